"""The wire constants of the behavior-record and trainer log-prob encodings, declared once.

Imported by the router's encoders and decoders (:mod:`router.records`,
:mod:`router.trainer_logprobs`) and by the trainer kit (:mod:`trainer.batch`,
:mod:`trainer.upload`), which imports nothing of the ``router`` package. The layouts are
documented in ``router/records.py`` and ``router/trainer_logprobs.py``.
"""

from __future__ import annotations

MAGIC_TURN = b"MFT"
"""First bytes of a turn block."""
MAGIC_BATCH = b"MFB"
"""First bytes of a trainer batch."""
RECORDS_FORMAT_VERSION = 2
"""Format byte of turn blocks and batches (2: a turn stores only the tokens it appends)."""
FLAG_F16 = 0x01
"""Turn flag bit 0: support log-probs are float16 (else float32)."""
FLAG_SECTIONS = 0x02
"""Turn flag bit 1: optional sections follow the support log-probs (see ``router/records.py``)."""
RECORDS_MEDIA_TYPE = "application/x-mixfleet-records"

MAGIC_LOGPROBS = b"MFL"
"""First bytes of a trainer log-prob upload."""
LOGPROBS_FORMAT_VERSION = 1
LOGPROBS_MEDIA_TYPE = "application/x-mixfleet-logprobs"

VERSION_MAX = 2**63 - 1
"""The largest weight or trainer version a batch carries: the trainer kit decodes versions and
version ages into int64 arrays (:mod:`trainer.batch`), so the router refuses a larger
``trainer_version`` and the kit's decoder a batch that names one."""

"""The trainer's log-prob upload (``POST /v1/batches/{lease_id}/trainer_logprobs``): its compact
binary encoding and the one decoder. The trainer's encoder is ``trainer.upload`` (the trainer
imports nothing of the router; both follow this layout).

Primitives
    u32   unsigned 32-bit little-endian integer (``struct`` format ``<I``)
    f32   IEEE-754 float32 little-endian (``<f``)

Upload (``MAGIC_LOGPROBS`` = b"MFL", then format byte ``FORMAT_VERSION``; media type
``MEDIA_TYPE``)::

    b"MFL" u8 format_version
    u32      n                 (number of log-probs)
    n f32    log p             (the trainer's log-prob of each sampled token)
    optional route section (routing replay):
    u32      n                 (the same count)
    n u8     route mismatch    (0: the trainer's own experts equal the recorded ones at the
                               position that predicted the token, in every MoE layer; 1: they
                               differ; 2: no routes were recorded for it)

The ``n`` log-probs follow the batch's token order: trajectory after trajectory in the order the
take handed them out, turn after turn, output token after output token (the order of
``trainer.batch.Batch``'s per-token arrays), so ``n`` equals the batch's output-token count.
Nothing may follow the last float, or the route section when there is one.
"""

from __future__ import annotations

import struct

import numpy as np

from core.wire import LOGPROBS_FORMAT_VERSION as FORMAT_VERSION
from core.wire import MAGIC_LOGPROBS

_HEAD = struct.Struct("<3sBI")


class LogprobsFormatError(ValueError):
    """The bytes are not a valid upload (wrong magic or version, truncated, trailing bytes)."""


def decode_trainer_logprobs(data: bytes | memoryview) -> np.ndarray:
    """The uploaded log-probs as a float32 array (a copy), in the batch's token order. Raises
    :class:`LogprobsFormatError` naming the problem."""
    return decode_upload(data)[0]


def decode_upload(data: bytes | memoryview) -> tuple[np.ndarray, np.ndarray | None]:
    """The uploaded log-probs (float32 copy) and the route-mismatch flags (uint8 copy; None
    without a route section). Raises :class:`LogprobsFormatError` naming the problem."""
    buf = memoryview(data)
    if len(buf) < _HEAD.size:
        raise LogprobsFormatError(f"upload of {len(buf)} bytes is shorter than its {_HEAD.size}-byte header")
    magic, version, n = _HEAD.unpack_from(buf)
    if magic != MAGIC_LOGPROBS:
        raise LogprobsFormatError(f"upload starts with {bytes(magic)!r}, not {MAGIC_LOGPROBS!r}")
    if version != FORMAT_VERSION:
        raise LogprobsFormatError(f"upload format version {version} (this router reads {FORMAT_VERSION})")
    want = _HEAD.size + 4 * n
    routes = None
    if len(buf) == want + 4 + n:
        (m,) = struct.unpack_from("<I", buf, want)
        if m != n:
            raise LogprobsFormatError(f"route section counts {m} tokens for {n} log-probs")
        routes = np.frombuffer(buf, dtype=np.uint8, count=n, offset=want + 4).copy()
        if routes.size and int(routes.max()) > 2:
            raise LogprobsFormatError(f"route flag {int(routes.max())} is not 0, 1 or 2")
    elif len(buf) != want:
        raise LogprobsFormatError(
            f"upload holds {len(buf)} bytes; {n} log-probs need {want} (with routes {want + 4 + n})"
        )
    return np.frombuffer(buf, dtype="<f4", count=n, offset=_HEAD.size).astype(np.float32), routes

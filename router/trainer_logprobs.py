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
Nothing may follow the last float, or the route section when there is one: an upload for a
batch of ``n`` tokens is exactly :func:`upload_size` bytes (``8 + 4n``; with routes
``12 + 5n``), which is what the route accepts, whatever the router's generic body limit.
"""

from __future__ import annotations

import struct

import numpy as np

from core.wire import LOGPROBS_FORMAT_VERSION as FORMAT_VERSION
from core.wire import MAGIC_LOGPROBS

_HEAD = struct.Struct("<3sBI")


def upload_size(n: int, *, routes: bool) -> int:
    """The bytes of the upload of ``n`` log-probs: the 8-byte header and 4 bytes a log-prob; with
    the route section, 4 more and 1 a token."""
    return _HEAD.size + 4 * n + (4 + n if routes else 0)


class LogprobsFormatError(ValueError):
    """The bytes are not a valid upload (wrong magic or version, truncated, trailing bytes)."""


def decode_trainer_logprobs(data: bytes | bytearray | memoryview) -> np.ndarray:
    """The uploaded log-probs as a float32 array (a view of ``data``), in the batch's token
    order. Raises :class:`LogprobsFormatError` naming the problem."""
    return decode_upload(data)[0]


def decode_upload(data: bytes | bytearray | memoryview) -> tuple[np.ndarray, np.ndarray | None]:
    """The uploaded log-probs (float32) and the route-mismatch flags (uint8; None without a route
    section), as views of ``data``: nothing is copied (they keep ``data`` alive, and are read-only
    when it is). Raises :class:`LogprobsFormatError` naming the problem."""
    buf = memoryview(data)
    if len(buf) < _HEAD.size:
        raise LogprobsFormatError(f"upload of {len(buf)} bytes is shorter than its {_HEAD.size}-byte header")
    magic, version, n = _HEAD.unpack_from(buf)
    if magic != MAGIC_LOGPROBS:
        raise LogprobsFormatError(f"upload starts with {bytes(magic)!r}, not {MAGIC_LOGPROBS!r}")
    if version != FORMAT_VERSION:
        raise LogprobsFormatError(f"upload format version {version} (this router reads {FORMAT_VERSION})")
    want = upload_size(n, routes=False)
    routes = None
    if len(buf) == upload_size(n, routes=True):
        (m,) = struct.unpack_from("<I", buf, want)
        if m != n:
            raise LogprobsFormatError(f"route section counts {m} tokens for {n} log-probs")
        routes = np.frombuffer(buf, dtype=np.uint8, count=n, offset=want + 4)
        if routes.size and int(routes.max()) > 2:
            raise LogprobsFormatError(f"route flag {int(routes.max())} is not 0, 1 or 2")
    elif len(buf) != want:
        raise LogprobsFormatError(
            f"upload holds {len(buf)} bytes; {n} log-probs need {want} (with routes "
            f"{upload_size(n, routes=True)})"
        )
    return np.frombuffer(buf, dtype="<f4", count=n, offset=_HEAD.size), routes

"""The trainer's log-prob upload encoding (``application/x-mixfleet-logprobs``; the layout is
documented in ``router/trainer_logprobs.py``): ``b"MFL"``, format byte 1, a u32 little-endian
count, then that many float32 little-endian log-probs in the batch's token order; optionally the
route section: a u32 count (the same) and one byte per token (0: the trainer's experts agree with
the recorded ones, 1: they differ, 2: no routes recorded)."""

from __future__ import annotations

import struct

import numpy as np

from core.wire import LOGPROBS_FORMAT_VERSION as FORMAT_VERSION
from core.wire import MAGIC_LOGPROBS


def encode_trainer_logprobs(logprobs: np.ndarray, route_mismatch: np.ndarray | None = None) -> bytes:
    """The upload of ``logprobs`` (any shape, flattened in C order; cast to float32) and, when
    given, the per-token ``route_mismatch`` (``trainer.policy.Policy.route_mismatch``: 0, 1 or 2).
    ValueError when there are more than 2**32 - 1 values, or the two differ in length or a flag
    is not 0, 1 or 2. The upload is one bytes object written once from the arrays (no
    intermediate copy beyond the float32 cast of ``logprobs`` when it is not float32 already):
    for ``n`` tokens ``8 + 4n`` bytes, with the flags ``12 + 5n``, which is what the router
    accepts for a batch of ``n`` tokens, however large."""
    flat = np.ascontiguousarray(np.asarray(logprobs).reshape(-1), dtype="<f4")
    if flat.size > 0xFFFFFFFF:
        raise ValueError(f"{flat.size} log-probs exceed the upload's u32 count")
    parts = [struct.pack("<3sBI", MAGIC_LOGPROBS, FORMAT_VERSION, flat.size), flat.view(np.uint8)]
    if route_mismatch is not None:
        flags = np.asarray(route_mismatch).reshape(-1)
        if flags.size != flat.size or (flags.size and not np.isin(flags, (0, 1, 2)).all()):
            raise ValueError(
                f"route_mismatch has {flags.size} flags for {flat.size} log-probs (each 0, 1 or 2)"
            )
        flags = np.ascontiguousarray(flags, dtype=np.uint8)
        parts += [struct.pack("<I", flags.size), flags]
    return b"".join(parts)

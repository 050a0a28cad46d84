"""The trainer's log-prob upload encoding (``application/x-mixfleet-logprobs``; the layout is
documented in ``router/trainer_logprobs.py``): ``b"MFL"``, format byte 1, a u32 little-endian
count, then that many float32 little-endian log-probs in the batch's token order."""

from __future__ import annotations

import struct

import numpy as np

from core.wire import LOGPROBS_FORMAT_VERSION as FORMAT_VERSION
from core.wire import MAGIC_LOGPROBS


def encode_trainer_logprobs(logprobs: np.ndarray) -> bytes:
    """The upload of ``logprobs`` (any shape, flattened in C order; cast to float32). ValueError
    when there are more than 2**32 - 1 values."""
    flat = np.ascontiguousarray(np.asarray(logprobs).reshape(-1), dtype="<f4")
    if flat.size > 0xFFFFFFFF:
        raise ValueError(f"{flat.size} log-probs exceed the upload's u32 count")
    return struct.pack("<3sBI", MAGIC_LOGPROBS, FORMAT_VERSION, flat.size) + flat.tobytes()

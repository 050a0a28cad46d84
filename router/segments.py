"""Append-only trajectories: how a turn's input relates to its session's stored context.

The state store keeps an open session's context (the token sequence of its current segment,
:mod:`router.state.base`) packed as uint32 little-endian (:func:`pack`). A turn's whole input
either extends it (the turn then stores only its new tail, :func:`place`) or does not: a fork,
which starts a new segment holding the whole input. Checking a full-context input costs one
comparison of packed bytes, no per-token Python work.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.turn_data import TurnData

_IDS = "I" if array("I").itemsize == 4 else "L"  # a 4-byte unsigned C type (token ids < 2**31)


def pack(ids: Sequence[int]) -> bytes:
    """``ids`` as uint32 little-endian bytes (each id in 0 .. 2**32 - 1, else OverflowError)."""
    packed = array(_IDS, ids)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes) -> list[int]:
    """The token ids of :func:`pack`'s bytes."""
    return np.frombuffer(data, dtype="<u4").tolist()


@dataclass(frozen=True)
class Placement:
    """Where a turn's input goes: ``context`` tokens of the stored segment it extends (0 on a
    fork or a first turn), the ``append`` that follows them, and ``fork`` (None, or the stored
    context's length and the prefix the input shared with it)."""

    context: int
    append: Sequence[int]
    fork: dict[str, int] | None = None


def locate(
    input_ids: Sequence[int] | None, append_ids: Sequence[int] | None, stored: bytes
) -> tuple[list[int], Placement]:
    """The engine's whole input and where it goes: ``input_ids`` placed on the ``stored``
    context (:func:`place`), or (``input_ids`` None) the stored context followed by
    ``append_ids``, which extend it by definition (no comparison). Raises ValueError for an
    empty whole input."""
    if input_ids is None:
        appended = list(append_ids or ())
        whole = unpack(stored) + appended if stored else appended
        at = Placement(len(stored) // 4, appended)
    else:
        whole = list(input_ids)
        at = place(whole, stored)
    if not whole:
        raise ValueError("the session has no stored context yet; give at least one token")
    return whole, at


def place(input_ids: Sequence[int], stored: bytes) -> Placement:
    """How the whole input ``input_ids`` relates to the ``stored`` context (packed): it extends
    it when the stored tokens are its prefix."""
    n = len(stored) // 4
    if n == 0:
        return Placement(0, input_ids)
    if len(input_ids) >= n and pack(input_ids[:n]) == stored:
        return Placement(n, input_ids[n:])
    have = np.frombuffer(stored, dtype="<u4")
    m = min(n, len(input_ids))
    differ = np.flatnonzero(have[:m] != np.asarray(input_ids[:m], dtype=np.int64))
    common = int(differ[0]) if differ.size else m
    return Placement(0, input_ids, {"stored": n, "common": common})


def engine_inputs(turns: Sequence[TurnData]) -> list[list[int]]:
    """Each turn's whole engine input, rebuilt from one trajectory's turns in order (a turn
    stores only what it appends): its segment's first ``context`` tokens, then its
    ``append_ids``; a segment starts at the first turn and at every fork. ValueError when a
    turn's ``context`` is not its segment's length before it."""
    out: list[list[int]] = []
    segment: list[int] = []
    for t in turns:
        if t.fork is not None:
            segment = []
        if t.context != len(segment):
            have = len(segment)
            raise ValueError(f"turn {t.turn}: context {t.context} but its segment holds {have} tokens")
        whole = segment + list(t.append_ids)
        out.append(whole)
        segment = whole + list(t.output_ids)
    return out

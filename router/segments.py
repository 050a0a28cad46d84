"""Append-only trajectories: how a turn's input relates to its session's stored context.

The state store keeps an open session's context (the token sequence of its current segment,
:mod:`router.state.base`) packed as uint32 little-endian (:func:`pack`). A turn's whole input
either extends it (the turn then stores only its new tail, :func:`place`) or does not: a fork,
which starts a new segment holding the whole input.

A turn's ids travel as one compact uint32 array (:func:`as_ids`: what a turn request's ids are
validated into, :mod:`router.schemas`) from the request to the engine's request body, which
:mod:`core.jsonio` encodes from the array in one go: the stored context is read as an array over
its bytes, a full-context input is checked against it by one comparison of arrays, and Python
lists are built only of what a turn appends. No per-token Python work grows with the context.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.turn_data import TurnData

_IDS = "I" if array("I").itemsize == 4 else "L"  # a 4-byte unsigned C type (token ids < 2**31)
_U32_MAX = 2**32 - 1

Ids = Sequence[int] | np.ndarray
"""Token ids: a sequence of ints, or an integer numpy array (:func:`as_ids`)."""


def pack(ids: Ids) -> bytes:
    """``ids`` as uint32 little-endian bytes (each id in 0 .. 2**32 - 1, else ValueError as
    :func:`as_ids`)."""
    return as_ids(ids).astype("<u4", copy=False).tobytes()


def unpack(data: bytes) -> list[int]:
    """The token ids of :func:`pack`'s bytes."""
    return np.frombuffer(data, dtype="<u4").tolist()


def as_ids(ids: Ids, limit: int = _U32_MAX) -> np.ndarray:
    """``ids`` as a one-dimensional uint32 array (native byte order; a uint32 array is returned as
    it is, not copied), checked in bulk. Raises ValueError naming the first entry (``[i] =
    value``, the value as JSON spells it) that is not an integer in 0 .. ``limit`` (at most
    2**32 - 1): a bool (JSON's ``true``), a string or a float is none, whatever it equals."""
    if isinstance(ids, np.ndarray):
        out = ids if ids.dtype == np.uint32 and ids.ndim == 1 else _from_array(ids, limit)
    else:
        try:
            out = np.frombuffer(array(_IDS, ids), dtype=np.uint32)
        except (TypeError, OverflowError):
            out = None
        if out is None or _holds_a_bool(ids, out):
            i = next(i for i, x in enumerate(ids) if not _is_id(x, limit))
            raise ValueError(_not_an_id(i, ids[i], limit))
    if limit < _U32_MAX and len(out) and out.max() > limit:
        i = int(np.argmax(out > limit))
        raise ValueError(_not_an_id(i, int(out[i]), limit))
    return out


def _holds_a_bool(ids: Sequence[object], out: np.ndarray) -> bool:
    """Whether ``ids``, which ``array`` took as ``out``, hold a bool (``array`` takes ``True`` and
    ``False`` as 1 and 0): only the entries that became 0 or 1 are looked at, found in one
    vectorized pass (ids 0 and 1 are rare special tokens), or, when they are most of ``ids``,
    every entry."""
    low = np.flatnonzero(out < 2)
    if len(low) * 3 < len(out):
        return bool in map(type, map(ids.__getitem__, low.tolist()))
    return bool in map(type, ids)


def _is_id(value: object, limit: int) -> bool:
    return type(value) is not bool and isinstance(value, int) and 0 <= value <= limit


def _not_an_id(i: int, value: object, limit: int) -> str:
    return f"[{i}] = {_spelled(value)} is not a token id (an integer in 0..{limit})"


def _spelled(value: object) -> str:
    """``value`` as JSON spells it (``true``, ``"1"``, ``2.5``; a long one cut), what the
    client sent; repr for what JSON cannot spell."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 64 else f"{text[:60]} ..."


def _from_array(a: np.ndarray, limit: int) -> np.ndarray:
    """An integer array of another dtype as uint32 (ValueError as :func:`as_ids`)."""
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise ValueError(f"a {a.ndim}-dimensional {a.dtype} array is not a list of token ids")
    bad = np.flatnonzero((a < 0) | (a > limit)) if a.size else ()
    if len(bad):
        i = int(bad[0])
        raise ValueError(_not_an_id(i, int(a[i]), limit))
    return a.astype(np.uint32)


@dataclass(frozen=True)
class Placement:
    """Where a turn's input goes: ``context`` tokens of the stored segment it extends (0 on a
    fork or a first turn), the ``append`` that follows them (a list: only what the turn adds is
    ever a Python list), and ``fork`` (None, or the stored context's length and the prefix the
    input shared with it)."""

    context: int
    append: list[int]
    fork: dict[str, int] | None = None


Stored = bytes | np.ndarray
"""A session's stored context: packed (:func:`pack`), or as a uint32 array."""


def stored_ids(stored: Stored) -> np.ndarray:
    """The stored context as a uint32 array (a view of packed bytes, not a copy)."""
    return stored if isinstance(stored, np.ndarray) else np.frombuffer(stored, dtype="<u4")


def locate(input_ids: Ids | None, append_ids: Ids | None, stored: Stored) -> tuple[np.ndarray, Placement]:
    """The engine's whole input (a uint32 array, :func:`as_ids`) and where it goes: ``input_ids``
    placed on the ``stored`` context (:func:`place`), or (``input_ids`` None) the stored context
    followed by ``append_ids``, which extend it by definition (no comparison). Raises ValueError
    for an empty whole input and as :func:`as_ids`."""
    if input_ids is None:
        appended = as_ids(() if append_ids is None else append_ids)
        have = stored_ids(stored)
        whole = np.concatenate((have, appended)) if len(have) else appended
        at = Placement(len(have), appended.tolist())
    else:
        whole = as_ids(input_ids)
        at = place(whole, stored)
    if not len(whole):
        raise ValueError("the session has no stored context yet; give at least one token")
    return whole, at


def place(input_ids: Ids, stored: Stored) -> Placement:
    """How the whole input ``input_ids`` relates to the ``stored`` context: it extends it when
    the stored tokens are its prefix (one comparison of arrays)."""
    ids = as_ids(input_ids)
    have = stored_ids(stored)
    n = len(have)
    if n == 0:
        return Placement(0, ids.tolist())
    if len(ids) >= n and np.array_equal(ids[:n], have):
        return Placement(n, ids[n:].tolist())
    m = min(n, len(ids))
    differ = np.flatnonzero(have[:m] != ids[:m])
    common = int(differ[0]) if differ.size else m
    return Placement(0, ids.tolist(), {"stored": n, "common": common})


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

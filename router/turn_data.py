"""One recorded turn as a pure value (:class:`TurnData`): what the router stores of it and the
one JSON view of it. The wire encoding is :mod:`router.records`; the parser of an engine answer
into a turn is :mod:`router.engine_answer`.

Append-only: a turn holds the input tokens it appends to its trajectory (``append_ids``, after
the ``context`` tokens of its segment that the previous turns stored: their appended and output
tokens), its generated tokens and their behavior records. A trajectory's tokens are therefore
stored once: segment by segment, turn after turn, ``append_ids`` then ``output_ids``. A turn whose
input did not extend the stored context is a fork (``fork`` set, ``context`` 0): it starts a new
segment holding its whole input, trained as its own sample.
"""

from __future__ import annotations

import array
import base64
import itertools
import math
import operator
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROUTES_SECTION = "routed_experts"
"""The turn block's section of a turn's routed experts (:class:`RoutedExperts`)."""
_ROUTE_CODES = {1: "B", 2: "H", 4: "i"}


@dataclass(frozen=True)
class RoutedExperts:
    """A turn's routed experts (SGLang's ``routed_experts``): ``rows`` positions from ``start`` of
    its segment's sequence, ``width`` ids each (layers x top-k, layer after layer, as SGLang lays
    them out; the router does not know the model), as ``data``: their int32 little-endian bytes.
    ValueError unless ``len(data) == 4 * rows * width``.

    Append-only: a turn stores the rows of the positions it adds to its segment, asked from
    ``context - 1`` (the previous turn's last output token was sampled, never fed forward in that
    turn; SGLang answers rows of ``[start, seqlen - 1)``, :mod:`core.sglang_release`), or 0 for a
    segment's first turn (:func:`router.turns.routes_start`); a segment's turns so hold the rows
    of its positions ``[0, len(segment) - 1)`` exactly once.

    Its section (:meth:`to_section`): varint start, varint rows, varint width, u8 bytes per id,
    then the ids as little-endian unsigned ints of that size (1 or 2 when every id fits, else 4:
    int32 as sent)."""

    start: int
    rows: int
    width: int
    data: bytes

    def __post_init__(self) -> None:
        if min(self.start, self.rows, self.width) < 0 or len(self.data) != 4 * self.rows * self.width:
            raise ValueError(
                f"routed experts: {len(self.data)} bytes for {self.rows} rows of {self.width} int32 ids"
            )

    def values(self) -> list[int]:
        """The ids, row after row."""
        return _ints(self.data, 4)

    def to_json(self) -> dict[str, Any]:
        """``start``, ``rows``, ``width`` and ``data``: base64 of the int32 bytes (SGLang's encoding)."""
        return {
            "start": self.start,
            "rows": self.rows,
            "width": self.width,
            "data": base64.b64encode(self.data).decode("ascii"),
        }

    def to_section(self) -> bytes:
        """The section's bytes (class docstring)."""
        values = self.values()
        lo, hi = (min(values), max(values)) if values else (0, 0)
        size = 4 if lo < 0 or hi >= 0x10000 else 2 if hi >= 0x100 else 1
        ids = self.data if size == 4 else _pack(values, size)
        return bytes(_head(self.start, self.rows, self.width)) + bytes([size]) + ids

    def tail(self, start: int) -> RoutedExperts:
        """The rows of the positions from ``start`` on (``start`` in ``[self.start, self.start +
        self.rows]``, else ValueError): what a turn stores when its segment already holds the
        rows before ``start``."""
        if not self.start <= start <= self.start + self.rows:
            end = self.start + self.rows
            raise ValueError(f"routed experts of positions [{self.start}, {end}) have no tail from {start}")
        skip = 4 * self.width * (start - self.start)
        return RoutedExperts(start, self.rows - (start - self.start), self.width, self.data[skip:])

    @classmethod
    def from_section(cls, data: bytes) -> RoutedExperts:
        """The routed experts of a section (ValueError naming what is wrong)."""
        pos, fields = 0, []
        for _ in range(3):
            value = shift = 0
            while True:
                if pos >= len(data):
                    raise ValueError("routed_experts section: truncated head")
                b = data[pos]
                pos += 1
                value |= (b & 0x7F) << shift
                shift += 7
                if b < 0x80:
                    break
            fields.append(value)
        start, rows, width = fields
        size = data[pos] if pos < len(data) else 0
        if size not in _ROUTE_CODES or len(data) - pos - 1 != rows * width * size:
            raise ValueError(f"routed_experts section: {len(data) - pos - 1} bytes for {rows} x {width} ids")
        raw = data[pos + 1 :]
        return cls(start, rows, width, raw if size == 4 else _pack(_ints(raw, size), 4))


def _head(*values: int) -> bytearray:
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append(v & 0x7F | 0x80)
            v >>= 7
        out.append(v)
    return out


def _ints(raw: bytes, size: int) -> list[int]:
    a = array.array(_ROUTE_CODES[size])
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def _pack(values: list[int], size: int) -> bytes:
    a = array.array(_ROUTE_CODES[size], values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


class Rows(Sequence):
    """A turn's rows of per-token values (support ids, or their log-probs), stored flat: row ``i``
    is ``values[offsets[i]:offsets[i + 1]]``, read as a list. ``values`` and ``offsets`` are
    lists; ``array``, when its producer has one, is ``values`` as a numpy array (int64 ids,
    float64 log-probs; equal value for value), which the encoder (:mod:`router.records`) takes
    instead of converting the list again. Built from the array alone (``values`` None), the list
    is ``array.tolist()``, made on its first read: a turn whose answer leaves its supports out
    never makes one. The parser (:mod:`router.engine_answer`) and the encoder so hand a turn's
    rows through as one list and one array each, no Python object per row, and the JSON view
    slices the list (its values are the very objects it holds). :meth:`of` flattens a sequence of
    rows. Immutable by contract (no method changes what it holds); equal to any sequence of the
    same rows."""

    __slots__ = ("_values", "array", "offsets")

    def __init__(self, values: list[Any] | None, offsets: list[int], array: Any = None) -> None:
        if values is None and array is None:
            raise ValueError("Rows needs its values as a list or as an array")
        self._values = values
        self.offsets = offsets
        self.array = array

    @property
    def values(self) -> list[Any]:
        """The rows' values, row after row, as one list."""
        if self._values is None:
            self._values = self.array.tolist()
        return self._values

    @classmethod
    def of(cls, rows: Sequence[Sequence[Any]]) -> Rows:
        """The rows of a sequence of sequences (a :class:`Rows` itself as it is)."""
        if type(rows) is cls:
            return rows
        return cls(list(itertools.chain.from_iterable(rows)), [0, *itertools.accumulate(map(len, rows))])

    def sizes(self) -> list[int]:
        """The length of every row."""
        bounds = self.offsets
        return list(map(operator.sub, bounds[1:], bounds))

    def same_shape(self, other: Rows) -> bool:
        """Whether ``other`` has rows of the same lengths."""
        return self.offsets is other.offsets or self.offsets == other.offsets

    def all_finite(self) -> bool:
        """Whether every value is a finite number (one sum: a finite sum has only finite terms)."""
        return math.isfinite(sum(self.values) if self.array is None else self.array.sum())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("row index out of range")
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self) -> Iterator[list[Any]]:
        bounds = self.offsets
        return map(self.values.__getitem__, map(slice, bounds, bounds[1:]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(map(operator.eq, self, map(list, other)))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({list(self)!r})"


@dataclass(frozen=True)
class TurnData:
    """One recorded turn. ``support_ids[i]`` sorted ascending, unique; empty = no filtering.
    Unknown log-probs are NaN (``raw_logprobs``: None or NaN). ``support_ids`` and
    ``support_logprobs`` are :class:`Rows` (any sequence of rows given is flattened into one on
    construction): row ``i`` reads as a list, and the encoder and the JSON view take the flat
    values at once.

    ``context``: tokens of the turn's segment before ``append_ids`` (0 for a segment's first
    turn). ``fork``: None, or on a turn that starts a new segment because its input did not
    extend the stored context, ``{"stored": n, "common": k}`` (the stored context's length and
    the length of the prefix the input shared with it). ``sections``: optional named sections
    of the turn block (raw bytes, :mod:`router.records`).

    ``timings``: where the turn's time went, in milliseconds (:func:`router.dispatch.run_turn`):
    ``engine_ms`` the engine request that answered (from sending ``/generate`` to its whole
    answer), ``failed_ms`` the engine requests that did not (timed out, refused, dropped, aborted,
    abandoned on a lost replica: the engine's or the network's time, not the router's),
    ``router_ms`` the rest of the dispatch (the router's own time: encoding, choosing replicas,
    moving the session), ``attempts`` the engine requests sent, and ``engine_e2e_ms`` the
    engine's own latency of the answer when it reports one.

    Invariant, checked on construction (ValueError): ``len(output_ids) == len(logprobs) ==
    len(raw_logprobs) == len(support_ids) == len(support_logprobs)``, ``len(support_ids[i])
    == len(support_logprobs[i])``, ``context >= 0`` and a fork has ``context`` 0. The order of
    support ids is checked by :func:`router.records.encode_turn`.
    """

    turn: int
    group: str
    replica: str
    append_ids: Sequence[int]
    output_ids: Sequence[int]
    logprobs: Sequence[float]
    raw_logprobs: Sequence[float | None]
    support_ids: Rows | Sequence[Sequence[int]]
    support_logprobs: Rows | Sequence[Sequence[float]]
    weight_versions: Sequence[dict[str, int]] = ()
    finish_reason: dict[str, Any] | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    moved_from: str | None = None
    sampling: dict[str, Any] | None = None
    context: int = 0
    fork: dict[str, int] | None = None
    sections: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids, lps = self.support_ids, self.support_logprobs
        if type(ids) is not Rows:
            object.__setattr__(self, "support_ids", ids := Rows.of(ids))
        if type(lps) is not Rows:
            object.__setattr__(self, "support_logprobs", lps := Rows.of(lps))
        n = len(self.output_ids)
        lens = (len(self.logprobs), len(self.raw_logprobs), len(ids), len(lps))
        if any(x != n for x in lens):
            raise ValueError(f"record lengths {lens} differ from {n} output tokens")
        if not ids.same_shape(lps):
            k_ids, k_lps = ids.sizes(), lps.sizes()
            i = next(i for i, (a, b) in enumerate(zip(k_ids, k_lps, strict=True)) if a != b)
            raise ValueError(f"token {i}: {k_ids[i]} support ids but {k_lps[i]} support log-probs")
        if self.context < 0 or (self.fork is not None and self.context):
            raise ValueError(f"context {self.context}: not a segment offset (a fork starts at 0)")

    @property
    def prompt_len(self) -> int:
        """The length of the input the engine was given: the segment's context and the append."""
        return self.context + len(self.append_ids)

    def versions(self) -> list[int | None]:
        """The weight version of every output token (None where no span covers it)."""
        return token_versions(self.weight_versions, len(self.output_ids))

    @property
    def routed_experts(self) -> RoutedExperts | None:
        """The turn's routed experts (its :data:`ROUTES_SECTION`), if recorded."""
        data = self.sections.get(ROUTES_SECTION)
        return None if data is None else RoutedExperts.from_section(data)

    def version_range(self) -> tuple[int | None, int | None]:
        """The lowest and highest weight version of the turn's spans; (None, None) without spans."""
        spans = self.weight_versions
        if len(spans) == 1:
            return spans[0]["version"], spans[0]["version"]
        versions = [s["version"] for s in spans]
        return (min(versions), max(versions)) if versions else (None, None)

    def to_json(
        self, session_id: str | None = None, *, with_input: bool = True, with_support: bool = True
    ) -> dict[str, Any]:
        """The turn's JSON object, the one JSON view of a turn (the turn answer without
        ``append_ids``, and without the records' ``support_ids`` and ``support_logprobs`` unless
        the turn asked ``return_support``; trajectory reads and JSON batches with them all, the
        input last): one record per output token with its weight version. Non-finite log-probs
        (unknown values) are None: JSON has no NaN. Sections are not part of the JSON view, but
        for the routed experts (``routed_experts``: :meth:`RoutedExperts.to_json`)."""
        out: dict[str, Any] = {}
        if session_id is not None:
            out["session_id"] = session_id
        out.update(
            turn=self.turn,
            group=self.group,
            replica=self.replica,
            context=self.context,
            fork=None if self.fork is None else dict(self.fork),
            output_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            records=self._records(with_support),
            weight_versions=[dict(s) for s in self.weight_versions],
            timings=dict(self.timings),
            moved_from=self.moved_from,
            sampling=None if self.sampling is None else dict(self.sampling),
        )
        routes = self.routed_experts
        if routes is not None:
            out["routed_experts"] = routes.to_json()
        if with_input:
            out["append_ids"] = list(self.append_ids)
        return out

    def _records(self, with_support: bool) -> list[dict[str, Any]]:
        """One JSON record per output token (non-finite log-probs as None), with its support rows
        sliced from the flat values if ``with_support``."""
        logprobs = self.logprobs
        if not math.isfinite(sum(logprobs)):  # a finite sum means every term is finite
            logprobs = [x if math.isfinite(x) else None for x in logprobs]
        raws = self.raw_logprobs
        if None in raws or not math.isfinite(sum(raws)):  # type: ignore[arg-type]
            raws = [None if x is None or not math.isfinite(x) else x for x in raws]
        versions = self.versions()
        if not with_support:
            return [
                {"token_id": tok, "logprob": lp, "raw_logprob": raw, "weight_version": version}
                for tok, lp, raw, version in zip(self.output_ids, logprobs, raws, versions, strict=True)
            ]
        support_ids, support_lps = self.support_ids, self.support_logprobs
        ids, lps = support_ids.values, support_lps.values  # type: ignore[union-attr]
        if not support_lps.all_finite():  # type: ignore[union-attr]
            lps = [x if math.isfinite(x) else None for x in lps]
        bounds = support_ids.offsets  # type: ignore[union-attr]
        return [
            {
                "token_id": tok,
                "logprob": lp,
                "raw_logprob": raw,
                "support_ids": ids[start:end],
                "support_logprobs": lps[start:end],
                "weight_version": version,
            }
            for tok, lp, raw, start, end, version in zip(
                self.output_ids,
                logprobs,
                raws,
                bounds[:-1],
                bounds[1:],
                versions,
                strict=True,
            )
        ]


def token_versions(spans: Sequence[Mapping[str, int]], n: int) -> list[int | None]:
    """The weight version of each of a turn's ``n`` output tokens from its ``weight_versions``
    spans (over output indices, end exclusive): the first span by start that covers it, None
    where none does."""
    if len(spans) == 1 and spans[0]["start"] <= 0 and spans[0]["end"] >= n:
        return [spans[0]["version"]] * n
    out: list[int | None] = [None] * n
    for span in sorted(spans, key=lambda s: s["start"]):
        for i in range(max(0, span["start"]), min(n, span["end"])):
            if out[i] is None:
                out[i] = span["version"]
    return out

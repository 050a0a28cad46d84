"""Compact binary encoding of turns (with their per-token behavior records) and trainer batches.

Behavior records are stored and served in this encoding, never as JSON lists of lists.
Decoding depends on the standard library only, so a trainer can decode batches without the
router; encoding uses numpy (long varint runs) and orjson (headers) when they are installed,
which changes neither the layout nor any decoded value (JSON headers may spell a float
differently, e.g. ``1e-5`` for ``1e-05``).

Primitives
    varint   unsigned LEB128 (7 bits per byte, low group first, high bit = more follows)
    f32/f16  IEEE-754 little-endian (``struct`` formats ``<f`` / ``<e``)
    json     varint byte length + UTF-8 JSON object

Turn block (``MAGIC_TURN`` = b"MFT", then format byte ``FORMAT_VERSION``)::

    b"MFT" u8 format_version u8 flags
    json     header: {"turn", "group", "replica", "finish_reason", "timings",
                      "weight_versions": [{"version", "start", "end"}], "moved_from"}
    varint   n_input,  then n_input varints (input token ids)
    varint   n_output, then n_output varints (output token ids)
    n_output f32     logprob       (log mu: renormalized over the support, the behavior log-prob)
    n_output f32     raw_logprob   (after temperature, before top-k/top-p; NaN when unknown)
    n_output varint  support size k_i (0 = no filtering: the whole vocabulary)
    per token with k_i > 0: first id as varint, then (id[j] - id[j-1] - 1) as varints
                            (ids strictly increasing, so the gaps are >= 0 and mostly tiny)
    sum(k_i) f16|f32 support log-probs, token after token, in support-id order

``flags`` bit 0 set = support log-probs are float16 (else float32). The token's own ``logprob``
and ``raw_logprob`` are always float32: they enter importance ratios directly. The per-token
``weight_version`` is not repeated per token: it is the version of the span in
``weight_versions`` covering the token's index (spans are over output indices, end exclusive).

Batch (``MAGIC_BATCH`` = b"MFB", then format byte)::

    b"MFB" u8 format_version
    json     header: {"lease_id", "held_back", "trajectories": [{"session_id", "group",
                      "reward", "metadata", "version_age", "n_turns"}]}
    then for each trajectory, for each of its n_turns turns: varint length + turn block

:func:`decode_batch` returns the same dict that the JSON form of ``POST /v1/batches/take``
serves, so a trainer may take either.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # optional speed-ups of the encoder (the decoder never needs them)
    import numpy as np
except ImportError:  # pragma: no cover
    np = None
try:
    import orjson
except ImportError:  # pragma: no cover
    orjson = None

MAGIC_TURN = b"MFT"
MAGIC_BATCH = b"MFB"
FORMAT_VERSION = 1
FLAG_F16 = 0x01
MEDIA_TYPE = "application/x-mixfleet-records"


class RecordFormatError(ValueError):
    """The bytes are not a valid block of this encoding (truncated, wrong magic, bad varint)."""


@dataclass(frozen=True)
class TurnData:
    """One recorded turn. ``support_ids[i]`` sorted ascending, unique; empty = no filtering.

    Invariant: ``len(output_ids) == len(logprobs) == len(raw_logprobs) == len(support_ids)
    == len(support_logprobs)`` and ``len(support_ids[i]) == len(support_logprobs[i])``.
    """

    turn: int
    group: str
    replica: str
    input_ids: Sequence[int]
    output_ids: Sequence[int]
    logprobs: Sequence[float]
    raw_logprobs: Sequence[float | None]
    support_ids: Sequence[Sequence[int]]
    support_logprobs: Sequence[Sequence[float]]
    weight_versions: Sequence[dict[str, int]] = ()
    finish_reason: dict[str, Any] | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    moved_from: str | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        lens = (len(self.logprobs), len(self.raw_logprobs), len(self.support_ids), len(self.support_logprobs))
        if any(x != n for x in lens):
            raise ValueError(f"record lengths {lens} differ from {n} output tokens")
        k_ids = list(map(len, self.support_ids))
        k_lps = list(map(len, self.support_logprobs))
        if k_ids != k_lps:
            i = next(i for i, (a, b) in enumerate(zip(k_ids, k_lps, strict=True)) if a != b)
            raise ValueError(f"token {i}: {k_ids[i]} support ids but {k_lps[i]} support log-probs")

    def versions(self) -> list[int | None]:
        """The weight version of every output token (None where no span covers it)."""
        n = len(self.output_ids)
        spans = self.weight_versions
        if len(spans) == 1 and spans[0]["start"] <= 0 and spans[0]["end"] >= n:
            return [spans[0]["version"]] * n
        out: list[int | None] = [None] * n
        for span in sorted(spans, key=lambda s: s["start"]):
            for i in range(max(0, span["start"]), min(n, span["end"])):
                if out[i] is None:
                    out[i] = span["version"]
        return out

    def to_json(self, session_id: str | None = None, *, with_input: bool = True) -> dict[str, Any]:
        """The API's JSON turn object (issue 4 shape) with one record per output token.
        Non-finite log-probs (unknown values) are None: JSON has no NaN."""
        logprobs = self.logprobs
        if not math.isfinite(sum(logprobs)):  # a finite sum means every term is finite
            logprobs = [x if math.isfinite(x) else None for x in logprobs]
        raws = self.raw_logprobs
        if None in raws or not math.isfinite(sum(raws)):  # type: ignore[arg-type]
            raws = [None if x is None or not math.isfinite(x) else x for x in raws]
        records = [
            {
                "token_id": tok,
                "logprob": lp,
                "raw_logprob": raw,
                "support_ids": list(ids),
                "support_logprobs": list(lps)
                if math.isfinite(sum(lps))
                else [x if math.isfinite(x) else None for x in lps],
                "weight_version": version,
            }
            for tok, lp, raw, ids, lps, version in zip(
                self.output_ids,
                logprobs,
                raws,
                self.support_ids,
                self.support_logprobs,
                self.versions(),
                strict=True,
            )
        ]
        out: dict[str, Any] = {}
        if session_id is not None:
            out["session_id"] = session_id
        out.update(
            turn=self.turn,
            group=self.group,
            replica=self.replica,
            output_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            records=records,
            weight_versions=[dict(s) for s in self.weight_versions],
            timings=dict(self.timings),
            moved_from=self.moved_from,
        )
        if with_input:
            out["input_ids"] = list(self.input_ids)
        return out


# ---------------------------------------------------------------- varints


def _varint(value: int, out: bytearray) -> None:
    if value < 0:
        raise ValueError(f"varint of negative value {value}")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


_MINUS_ONE = bytes([255, *range(255)])  # bytes.translate table: b -> b - 1
_NUMPY_MIN = 384  # below this many values a Python loop beats numpy's per-call overhead


def _varints(values: Sequence[int], out: bytearray) -> None:
    if not values:
        return
    if np is not None and len(values) >= _NUMPY_MIN:
        a = _int_array(values)
        if a is not None:
            low = int(a.min())
            if low < 0:
                raise ValueError(f"varint of negative value {low}")
            out += a.astype(np.uint8).tobytes() if a.max() < 0x80 else _np_varints(a)
            return
    coded = _single_bytes(values)
    if coded is not None and coded.isascii():  # all in 0..127: one byte each
        out += coded
        return
    low = min(values)
    if low < 0:
        raise ValueError(f"varint of negative value {low}")
    _append_varints(values, out)


def _single_bytes(values: Sequence[int]) -> bytes | None:
    """``bytes(values)`` when every value is in 0..255, else None."""
    try:
        return bytes(values)
    except (ValueError, TypeError):
        return None


def _append_varints(values: Sequence[int], out: bytearray, offset: int = 0) -> None:
    """LEB128 of each ``value + offset`` (all >= 0), without a call per value up to 3 bytes."""
    append = out.append
    for v in values:
        v += offset
        if v < 0x80:
            append(v)
        elif v < 0x4000:
            append(v & 0x7F | 0x80)
            append(v >> 7)
        elif v < 0x200000:
            append(v & 0x7F | 0x80)
            append((v >> 7) & 0x7F | 0x80)
            append(v >> 14)
        else:
            _varint(v, out)


def _int_array(values: Sequence[int]) -> Any:
    """``values`` as an int64 array, or None when they are not all integers that fit."""
    try:
        a = np.asarray(values)
    except (OverflowError, ValueError, TypeError):
        return None
    return a if a.dtype.kind == "i" and a.ndim == 1 else None


def _np_varints(v: Any) -> bytes:
    """LEB128 of a non-negative int64 array, vectorized: a (values x bytes) matrix of every
    value's 7-bit groups with continuation bits, read out row by row up to each value's length."""
    sizes = np.ones(len(v), dtype=np.int64)
    for j in range(1, 10):
        more = v >= (1 << (7 * j))
        if not more.any():
            break
        sizes += more
    width = int(sizes.max())
    groups = np.empty((len(v), width), dtype=np.uint8)
    for j in range(width):
        groups[:, j] = ((v >> (7 * j)) & 0x7F) | ((sizes > j + 1) << 7)
    return groups[np.arange(width) < sizes[:, None]].tobytes()


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise RecordFormatError(f"truncated: need {n} bytes at offset {self.pos}, have {len(self.buf)}")

    def byte(self) -> int:
        self.need(1)
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        result = shift = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7
            if shift > 63:
                raise RecordFormatError(f"varint longer than 9 bytes at offset {self.pos}")

    def varints(self, n: int) -> list[int]:
        if n == 0:
            return []
        end = self.pos + n
        if end <= len(self.buf):
            chunk = self.buf[self.pos : end]
            if max(chunk) < 0x80:
                self.pos = end
                return list(chunk)
        return [self.varint() for _ in range(n)]

    def raw(self, n: int) -> memoryview:
        self.need(n)
        chunk = self.buf[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def floats(self, n: int, fmt: str) -> tuple[float, ...]:
        size = struct.calcsize(fmt)
        return struct.unpack(f"<{n}{fmt}", self.raw(n * size))

    def json(self) -> Any:
        n = self.varint()
        try:
            return json.loads(bytes(self.raw(n)))
        except ValueError as exc:
            raise RecordFormatError(f"bad JSON header: {exc}") from None


def _json(obj: Any, out: bytearray) -> None:
    data = None
    if orjson is not None:
        try:
            data = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # e.g. an integer beyond 64 bits
            data = None
    if data is None:
        data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    _varint(len(data), out)
    out += data


# ---------------------------------------------------------------- turns


def _round(values: Sequence[float | None], fmt: str) -> list[float]:
    flat = [math.nan if v is None else v for v in values]
    return list(struct.unpack(f"<{len(flat)}{fmt}", struct.pack(f"<{len(flat)}{fmt}", *flat)))


def as_stored(turn: TurnData, *, f16: bool = False) -> TurnData:
    """``turn`` with its floats rounded exactly as :func:`encode_turn` stores them (so an API
    can answer with what it recorded without decoding it again)."""
    rows = turn.support_logprobs
    flat = _round([x for lps in rows for x in lps], "e" if f16 else "f")  # one pack for all rows
    supports: list[list[float]] = []
    pos = 0
    for lps in rows:
        end = pos + len(lps)
        supports.append(flat[pos:end])
        pos = end
    return replace(
        turn,
        logprobs=_round(turn.logprobs, "f"),
        raw_logprobs=[None if math.isnan(x) else x for x in _round(turn.raw_logprobs, "f")],
        support_logprobs=supports,
    )


def encode_turn(turn: TurnData, *, f16: bool = False) -> bytes:
    """Encode one turn. ``f16`` stores support log-probs as float16 (lossy, ~3 significant digits).

    After: ``decode_turn(encode_turn(t))`` equals ``t`` exactly for float32-representable
    values (float16-rounded support log-probs when ``f16``). Raises ValueError when the turn
    cannot be encoded (support ids not strictly increasing, negative ids, a log-prob beyond
    float32's range).
    """
    return _encode(turn, f16)


def encode_stored(turn: TurnData, *, f16: bool = False) -> tuple[bytes, TurnData]:
    """``(encode_turn(turn, f16=f16), as_stored(turn, f16=f16))`` from one pass: the stored
    values are read back from the encoded floats."""
    head, (body, logprobs, raws, flat) = _encode_parts(turn, f16)
    head += body
    return bytes(head), stored_turn(turn.__dict__, logprobs, raws, turn.support_ids, flat)


def stored_turn(
    fields: dict[str, Any],
    logprobs: tuple[float, ...],
    raws: tuple[float, ...],
    support_ids: Sequence[Sequence[int]],
    flat: tuple[float, ...],
) -> TurnData:
    """A :class:`TurnData` with the other ``fields`` (a ``TurnData.__dict__``-like mapping)
    and the stored floats that :func:`encode_body` returned (NaN raw log-probs become None;
    ``flat`` is cut into rows as long as ``support_ids``' rows). Its invariant is not checked
    again: ``encode_body`` packed as many values as the rows hold."""
    if not math.isfinite(sum(raws)):
        raws = tuple(None if math.isnan(x) else x for x in raws)
    supports = []
    pos = 0
    for ids in support_ids:
        end = pos + len(ids)
        supports.append(flat[pos:end])
        pos = end
    stored = TurnData.__new__(TurnData)
    values = stored.__dict__
    values.update(fields)
    values["support_ids"] = support_ids
    values["logprobs"] = logprobs
    values["raw_logprobs"] = raws
    values["support_logprobs"] = supports
    return stored


def _encode(turn: TurnData, f16: bool) -> bytes:
    head, (body, *_) = _encode_parts(turn, f16)
    head += body
    return bytes(head)


def _encode_parts(turn: TurnData, f16: bool):
    """``turn``'s header (a bytearray) and what :func:`encode_body` returns for it."""
    head = encode_head(turn, f16)
    rows = turn.support_ids
    raws = turn.raw_logprobs
    if None in raws:
        raws = [math.nan if x is None else x for x in raws]
    return head, encode_body(
        turn.input_ids,
        turn.output_ids,
        turn.logprobs,
        raws,
        list(map(len, rows)),
        list(itertools.chain.from_iterable(rows)),
        itertools.chain.from_iterable(turn.support_logprobs),
        f16,
    )


def encode_head(turn: TurnData, f16: bool) -> bytearray:
    """The start of a turn block: magic, format, flags and the JSON header of ``turn``."""
    out = bytearray(MAGIC_TURN)
    out.append(FORMAT_VERSION)
    out.append(FLAG_F16 if f16 else 0)
    _json(
        {
            "turn": turn.turn,
            "group": turn.group,
            "replica": turn.replica,
            "finish_reason": turn.finish_reason,
            "timings": turn.timings,
            "weight_versions": [dict(s) for s in turn.weight_versions],
            "moved_from": turn.moved_from,
        },
        out,
    )
    return out


def encode_body(
    input_ids: Sequence[int],
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    raws: Sequence[float],
    sizes: list[int],
    flat_ids: list[int],
    flat_logprobs: Iterable[float],
    f16: bool,
) -> tuple[bytearray, tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """The rest of a turn block after :func:`encode_head` (the part that does not depend on
    the turn's index): ids, log-probs, support sizes, gap-coded support ids and support
    log-probs (``sizes[i]`` ids of ``flat_ids`` / values of ``flat_logprobs`` per token, as
    many values as ids;
    ``raws``: NaN where unknown). Returns it with the stored values of ``logprobs``, ``raws``
    and ``flat_logprobs`` (rounded to float32 / float16 as stored). Raises ValueError when the
    values cannot be encoded."""
    out = bytearray()
    _varint(len(input_ids), out)
    _varints(input_ids, out)
    n = len(output_ids)
    _varint(n, out)
    _varints(output_ids, out)
    try:
        lp_bytes = struct.pack(f"<{n}f", *logprobs)
        raw_bytes = struct.pack(f"<{n}f", *raws)
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"log-probs: {exc}") from None
    out += lp_bytes
    out += raw_bytes
    _varints(sizes, out)
    total = len(flat_ids)
    if total:
        out += _gap_varints(flat_ids, sizes, total)
    fmt = f"<{total}e" if f16 else f"<{total}f"
    try:
        sup_bytes = struct.pack(fmt, *flat_logprobs)
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"support log-probs: {exc}") from None
    out += sup_bytes
    unpack = struct.unpack
    return out, unpack(f"<{n}f", lp_bytes), unpack(f"<{n}f", raw_bytes), unpack(fmt, sup_bytes)


def _gap_varints(flat: list[int], sizes: list[int], total: int) -> bytes:
    """The support ids of all tokens (``flat``, ``sizes[i]`` per token), gap coded: per row
    the first id, then ``id[j] - id[j-1] - 1``; as varints. Raises ValueError unless every row
    is strictly increasing and non-negative."""
    if np is not None and total >= _NUMPY_MIN:
        a = _int_array(flat)
        if a is not None:
            gaps = np.empty_like(a)
            gaps[0] = a[0]
            np.subtract(a[1:], a[:-1], out=gaps[1:])
            gaps[1:] -= 1
            starts = np.cumsum([0, *sizes[:-1]])[np.asarray(sizes) > 0]
            gaps[starts] = a[starts]
            if gaps.min() < 0:
                raise ValueError(_gap_error(int(np.argmax(gaps < 0))))
            if gaps.max() < 0x80:
                return gaps.astype(np.uint8).tobytes()
            return _np_varints(gaps)
    # d = id[j] - id[j-1], with id[-1] = -1 at row starts (so d is the id + 1 there); gap = d - 1
    prev = [-1, *flat[:-1]]
    pos = 0
    for k in sizes:
        if k:
            prev[pos] = -1
            pos += k
    try:
        coded = bytes(map(operator.sub, flat, prev))
    except (ValueError, TypeError):  # a d beyond 0..255 (or not an int: refused below)
        coded = None
    if coded is not None:
        coded = coded.translate(_MINUS_ONE)
        if coded.isascii():  # every gap in 0..127 (a d of 0, a repeated id, became 255)
            return coded
    d = list(map(operator.sub, flat, prev))
    if min(d) < 1:
        raise ValueError(_gap_error(next(i for i, x in enumerate(d) if x < 1)))
    out = bytearray()
    _append_varints(d, out, offset=-1)
    return bytes(out)


def _gap_error(at: int) -> str:
    return f"support ids must be non-negative and strictly increasing (flat position {at})"


def decode_turn(data: bytes | memoryview) -> TurnData:
    """Decode a turn block. Raises :class:`RecordFormatError` on malformed input."""
    r = _Reader(data)
    turn = _decode_turn(r)
    if r.pos != len(r.buf):
        raise RecordFormatError(f"{len(r.buf) - r.pos} trailing bytes after turn block")
    return turn


def decode_turn_header(data: bytes | memoryview) -> dict[str, Any]:
    """Only the JSON header of a turn block (cheap: no per-token work)."""
    r = _Reader(data)
    _check_magic(r, MAGIC_TURN)
    r.byte()
    return r.json()


def _check_magic(r: _Reader, magic: bytes) -> None:
    got = bytes(r.raw(len(magic))) if len(r.buf) >= len(magic) else bytes(r.buf)
    if got != magic:
        raise RecordFormatError(f"bad magic {got!r}, expected {magic!r}")
    version = r.byte()
    if version != FORMAT_VERSION:
        raise RecordFormatError(f"unsupported format version {version}")


def _decode_turn(r: _Reader) -> TurnData:
    _check_magic(r, MAGIC_TURN)
    flags = r.byte()
    header = r.json()
    if not isinstance(header, dict):
        raise RecordFormatError("turn header is not a JSON object")
    input_ids = r.varints(r.varint())
    n = r.varint()
    output_ids = r.varints(n)
    logprobs = list(r.floats(n, "f"))
    raw = [None if math.isnan(x) else x for x in r.floats(n, "f")]
    sizes = r.varints(n)
    support_ids: list[list[int]] = []
    for k in sizes:
        if k == 0:
            support_ids.append([])
            continue
        gaps = r.varints(k)
        ids = [gaps[0]]
        prev = gaps[0]
        for g in gaps[1:]:
            prev = prev + g + 1
            ids.append(prev)
        support_ids.append(ids)
    total = sum(sizes)
    flat = r.floats(total, "e" if flags & FLAG_F16 else "f")
    support_lps: list[list[float]] = []
    pos = 0
    for k in sizes:
        support_lps.append(list(flat[pos : pos + k]))
        pos += k
    try:
        return TurnData(
            turn=int(header["turn"]),
            group=str(header["group"]),
            replica=str(header["replica"]),
            input_ids=input_ids,
            output_ids=output_ids,
            logprobs=logprobs,
            raw_logprobs=raw,
            support_ids=support_ids,
            support_logprobs=support_lps,
            weight_versions=[
                {"version": int(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
                for s in header.get("weight_versions") or []
            ],
            finish_reason=header.get("finish_reason"),
            timings=header.get("timings") or {},
            moved_from=header.get("moved_from"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"bad turn header: {exc!r}") from None


# ---------------------------------------------------------------- batches


def encode_batch(
    lease_id: str, held_back: int, trajectories: Sequence[tuple[dict[str, Any], Sequence[bytes]]]
) -> bytes:
    """Encode a trainer batch from (trajectory header, stored turn blocks) pairs.

    The turn blocks are copied as stored (no re-encoding). Each header gets ``n_turns``.
    """
    out = bytearray(MAGIC_BATCH)
    out.append(FORMAT_VERSION)
    headers = [{**h, "n_turns": len(blobs)} for h, blobs in trajectories]
    _json({"lease_id": lease_id, "held_back": held_back, "trajectories": headers}, out)
    for _, blobs in trajectories:
        for blob in blobs:
            _varint(len(blob), out)
            out += blob
    return bytes(out)


def decode_batch(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a batch into the JSON shape of ``POST /v1/batches/take``."""
    r = _Reader(data)
    _check_magic(r, MAGIC_BATCH)
    header = r.json()
    trajectories = []
    for t in header.get("trajectories", []):
        t = dict(t)
        n_turns = int(t.pop("n_turns"))
        turns = []
        for _ in range(n_turns):
            size = r.varint()
            sub = _Reader(r.raw(size))
            turns.append(_decode_turn(sub).to_json(t["session_id"]))
        t["turns"] = turns
        trajectories.append(t)
    if r.pos != len(r.buf):
        raise RecordFormatError(f"{len(r.buf) - r.pos} trailing bytes after batch")
    return {"lease_id": header["lease_id"], "trajectories": trajectories, "held_back": header["held_back"]}

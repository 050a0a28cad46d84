"""Behavior records on the wire: the compact binary encoding of a turn (the turn block, stored
as is) and of a trainer batch (stored blocks copied), and their standard-library decoders.

* :func:`encode_turn` / :func:`encode_stored` - the turn block (and the turn as stored in it);
  :func:`encode_batch` - a trainer batch of stored blocks.
* :func:`decode_turn`, :func:`decode_turn_header`, :func:`decode_batch` - the decoders;
  :func:`decode_turn_outputs` - only the output log-probs and versions (the router's mismatch).

The turn itself is :class:`router.turn_data.TurnData`. Behavior records are stored and served in
this encoding, never as JSON lists of lists. The decoders use nothing but the standard library
(``json``, ``struct``), so a trainer can restate or copy them; the encoder uses numpy (a
project dependency: a turn's support rows are gap coded and packed as flat arrays,
:class:`router.turn_data.Rows`; long id runs are varint coded in one pass) and :mod:`core.jsonio`
for headers, which changes neither the layout nor any decoded value (JSON headers may spell a
float differently from :mod:`json`, e.g. ``1e-5`` for ``1e-05``). The constants are :mod:`core.wire`'s.

Primitives
    varint   unsigned LEB128 (7 bits per byte, low group first, high bit = more follows)
    f32/f16  IEEE-754 little-endian (``struct`` formats ``<f`` / ``<e``)
    u32      unsigned 32-bit little-endian integer (``<I``)
    json     varint byte length + UTF-8 JSON object

Turn block (``MAGIC_TURN`` = b"MFT", then format byte ``RECORDS_FORMAT_VERSION`` = 2)::

    b"MFT" u8 format_version u8 flags
    json     header: {"turn", "group", "replica", "finish_reason", "timings",
                      "weight_versions": [{"version", "start", "end"}], "moved_from",
                      "context": c (tokens of the turn's segment before its appended tokens),
                      "fork" (only on a fork: {"stored": n, "common": k}),
                      "sampling" (only when set: {"top_k_bound": n} or {"sampling_mask": false})}
    varint   n_append, then n_append varints (the input tokens the turn appends to its segment)
    varint   n_output, then n_output varints (output token ids)
    n_output f32     logprob       (log mu: renormalized over the support, the behavior log-prob)
    n_output f32     raw_logprob   (after temperature, before top-k/top-p; NaN when unknown)
    n_output varint  support size k_i (0 = no filtering: the whole vocabulary)
    per token with k_i > 0: first id as varint, then (id[j] - id[j-1] - 1) as varints
                            (ids strictly increasing, so the gaps are >= 0 and mostly tiny)
    sum(k_i) f16|f32 support log-probs, token after token, in support-id order
    only with flags bit 1 (``FLAG_SECTIONS``): optional sections, each
             varint name length, UTF-8 name, varint size, size bytes;
             then u32 the byte length of the sections (so the block's end locates them)

``flags`` bit 0 set = support log-probs are float16 (else float32). The token's own ``logprob``
and ``raw_logprob`` are always float32: they enter importance ratios directly. The per-token
``weight_version`` is not repeated per token: it is the version of the span in
``weight_versions`` covering the token's index (spans are over output indices, end exclusive).
A decoder keeps sections it does not know as bytes (:attr:`TurnData.sections`) and skips them;
a new kind of per-turn data is a new named section, which changes no existing byte.
Section ``routed_experts`` (only for a group or session with ``record_routes``): the turn's
routed experts, :class:`router.turn_data.RoutedExperts` (``to_section``: varint start, varint
rows, varint width, u8 bytes per id, then the ids, row ``j`` for position ``start + j`` of the
turn's segment); a turn stores the rows of the positions it adds, so a segment's turns hold its
positions ``[0, len(segment) - 1)`` once.

Append-only: a trajectory is one or more segments; a segment starts at the trajectory's first
turn and at every turn with ``fork`` (its input did not extend the stored context: the harness
edited or re-rendered history; such a turn has ``context`` 0 and appends its whole input). A
segment's token sequence is, turn after turn, ``append_ids`` then ``output_ids``: every token is
stored once, the engine's input of a turn is the segment's ``context`` tokens before it plus its
``append_ids``, and the loss mask (generated or not) is 1 exactly on the output tokens.

``sampling.top_k_bound`` = n says the turn asked for no finite ``top_k`` and was sampled with
``top_k = n`` (SGLang's ``--sampling-mask-max-tokens``; it returns sampling masks only for a finite
``top_k``): each support is the turn's top-p/min-p candidate set cut to its n most likely tokens.
``sampling.sampling_mask`` = false says the turn filtered nothing and was sent without a sampling
mask (:func:`core.sglang_release.sampling_request`): every support is empty (the whole
vocabulary) and ``logprob`` is the engine's ``output_token_logprobs`` value (per token ``[logprob,
token_id, text]``, SGLang's managers/tokenizer_manager.py 3098-3116), its log-prob after
temperature ``log softmax(logits / T)``, the distribution it drew from (layers/sampler.py
275-316). A block without the key is a turn sampled exactly as asked, its supports returned by
the engine.

Batch (``MAGIC_BATCH`` = b"MFB", then format byte)::

    b"MFB" u8 format_version
    json     header: {"lease_id", "held_back", "trainer_version" (when known),
                      "trajectories": [{"session_id", "group", "reward", "metadata",
                                        "version_age", "n_turns"}]}
    then for each trajectory, for each of its n_turns turns: varint length + turn block

:func:`decode_batch` returns the same dict that the JSON form of ``POST /v1/batches/take``
serves, so a trainer may take either.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from core.wire import FLAG_F16, FLAG_SECTIONS, MAGIC_BATCH, MAGIC_TURN, RECORDS_FORMAT_VERSION
from router.turn_data import ROUTES_SECTION, Rows, TurnData, token_versions

try:  # the encoder's (the decoder never needs numpy: it imports without it)
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


class RecordFormatError(ValueError):
    """The bytes are not a valid block of this encoding (truncated, wrong magic, bad varint)."""


# ---------------------------------------------------------------- varints


_VARINT_LIMIT = 1 << 63  # what the decoder reads (at most 9 bytes of 7 bits)


def _varint(value: int, out: bytearray) -> None:
    if value < 0:
        raise ValueError(f"varint of negative value {value}")
    if value >= _VARINT_LIMIT:
        raise ValueError(f"varint of {value}: beyond 63 bits")
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
    """``values`` as an int64 array, or None when they are not all integers that fit. Built
    through ``struct`` (one C conversion per value, refusing floats and ints beyond int64),
    which takes less time than ``array.array("q")`` (a format parse per value) or
    ``np.asarray`` of a list of Python ints; an array is taken as it is."""
    kind = values.dtype.kind if isinstance(values, np.ndarray) else ""
    if kind == "i" or (kind == "u" and values.itemsize < 8):  # type: ignore[attr-defined]
        return values.astype(np.int64, copy=False)  # type: ignore[attr-defined]
    try:
        return np.frombuffer(struct.pack(f"={len(values)}q", *values), dtype=np.int64)
    except (struct.error, TypeError):
        return None


def _np_varints(v: Any) -> bytes:
    """LEB128 of a non-negative int64 array, vectorized: a (values x groups) matrix of 7-bit
    groups filled one group column at a time, the continuation bit set where the next group is
    written; the written groups, value after value."""
    width = max(1, (int(v.max()).bit_length() + 6) // 7)
    groups = np.empty((len(v), width), dtype=np.uint8)
    written = np.empty((len(v), width), dtype=bool)
    written[:, 0] = True
    rest = v
    for k in range(width):
        groups[:, k] = rest & 0x7F
        if k + 1 < width:
            rest = rest >> 7
            more = rest != 0
            written[:, k + 1] = more
            groups[:, k] |= more.view(np.uint8) << 7
    return groups.ravel().take(np.flatnonzero(written.ravel())).tobytes()


class _Reader:
    """Reads ``buf`` from its start; ``base`` is where ``buf`` starts in the bytes the caller
    decodes (a turn block's offset in its batch), so every offset an error names is one there."""

    __slots__ = ("base", "buf", "pos")

    def __init__(self, buf: bytes | memoryview, base: int = 0) -> None:
        self.buf = memoryview(buf)
        self.pos = 0
        self.base = base

    def at(self) -> int:
        """The current position as an offset in the caller's bytes."""
        return self.base + self.pos

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise RecordFormatError(
                f"truncated: need {n} bytes at offset {self.at()}, have {len(self.buf) - self.pos}"
            )

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
                raise RecordFormatError(f"varint longer than 9 bytes at offset {self.at()}")

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

    def skip_varints(self, n: int) -> None:
        """Move past ``n`` varints without decoding them (with numpy: one scan for their ends)."""
        end = self.pos + n
        if n == 0 or (end <= len(self.buf) and max(self.buf[self.pos : end]) < 0x80):
            self.pos = end  # none, or all of one byte
            return
        if np is None:
            self.varints(n)
            return
        chunk = np.frombuffer(self.buf[self.pos : self.pos + 9 * n], dtype=np.uint8)
        ends = np.flatnonzero(chunk < 0x80)
        if ends.size < n:
            raise RecordFormatError(f"truncated: {n} varints at offset {self.at()} end past the block")
        self.pos += int(ends[n - 1]) + 1

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
        at = self.at()
        text = bytes(self.raw(n))
        try:
            return json.loads(text)
        except ValueError as exc:
            raise RecordFormatError(f"bad JSON header at offset {at}: {exc}") from None


def _json(obj: Any, out: bytearray) -> bytes:
    """``obj`` as a length-prefixed JSON object with sorted keys; its JSON bytes (the encoder's
    JSON module is imported here, so decoding needs the standard library only)."""
    from core.jsonio import dumps

    data = dumps(obj, sort_keys=True)
    _varint(len(data), out)
    out += data
    return data


# ---------------------------------------------------------------- turns


def encode_turn(turn: TurnData, *, f16: bool = False) -> bytes:
    """The turn block of ``turn``. ``f16`` stores support log-probs as float16 (lossy, ~3
    significant digits).

    After: ``decode_turn(encode_turn(t))`` equals ``t`` exactly for float32-representable
    values (float16-rounded support log-probs when ``f16``). Raises ValueError when the turn
    cannot be encoded (support ids not strictly increasing, negative ids, a log-prob beyond
    float32's range).
    """
    return bytes(_encode(turn, f16)[0])


def encode_stored(turn: TurnData, *, f16: bool = False) -> tuple[bytes, TurnData]:
    """``(encode_turn(turn, f16=f16), stored)``: ``stored`` is ``turn`` with the float values
    the block holds (float32 / float16-rounded; unknown raw log-probs None), so an API can
    answer with what it recorded. ``stored`` equals ``decode_turn`` of the block, the order of
    every header object's keys included (so its JSON view is the bytes a read of the block gives),
    and is built through :class:`TurnData`'s own checks. Raises ValueError as :func:`encode_turn`."""
    from core.jsonio import loads  # the encoder's JSON module, as in _json

    out, lp_bytes, raw_bytes, support_lps, header = _encode(turn, f16)
    unpack = struct.unpack
    n = len(turn.output_ids)
    raws: tuple[float | None, ...] = unpack(f"<{n}f", raw_bytes)
    if not math.isfinite(sum(raws)):  # type: ignore[arg-type]
        raws = tuple(None if math.isnan(x) else x for x in raws)  # type: ignore[arg-type]
    lps = unpack(f"<{n}f", lp_bytes)
    fields = _header_fields(loads(header))  # as a read of the block makes them
    return bytes(out), replace(turn, logprobs=lps, raw_logprobs=raws, support_logprobs=support_lps, **fields)


def _encode(turn: TurnData, f16: bool) -> tuple[bytearray, bytes, bytes, Rows, bytes]:
    """The block of ``turn`` and, as stored in it, the packed log-probs and raw log-probs, the
    support log-probs (:class:`Rows`) and the header's JSON. The support rows go through as flat
    arrays: their sizes, their ids gap coded and their log-probs packed, each in one vectorized
    pass."""
    out = bytearray(MAGIC_TURN)
    out.append(RECORDS_FORMAT_VERSION)
    out.append((FLAG_F16 if f16 else 0) | (FLAG_SECTIONS if turn.sections else 0))
    header = _json(_header(turn), out)
    _varint(len(turn.append_ids), out)
    _varints(turn.append_ids, out)
    n = len(turn.output_ids)
    _varint(n, out)
    _varints(turn.output_ids, out)
    raws = turn.raw_logprobs
    if None in raws:
        raws = [math.nan if x is None else x for x in raws]
    try:
        lp_bytes = struct.pack(f"<{n}f", *turn.logprobs)
        raw_bytes = struct.pack(f"<{n}f", *raws)
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"log-probs: {exc}") from None
    out += lp_bytes
    out += raw_bytes
    ids: Rows = turn.support_ids  # type: ignore[assignment]
    sizes = ids.sizes()
    _varints(sizes, out)
    if ids.offsets[-1]:
        out += _gap_varints(_id_array(ids, sizes), ids.offsets, sizes)
    packed, support_lps = _support_floats(turn.support_logprobs, f16)  # type: ignore[arg-type]
    out += packed
    if turn.sections:
        out += _sections(turn.sections)
    return out, lp_bytes, raw_bytes, support_lps, header


_F32_OVERFLOW = 2.0**128 - 2.0**103  # the least magnitude float32 rounds to infinity
_F16_OVERFLOW = 65520.0  # the same for float16


def _support_floats(rows: Rows, f16: bool) -> tuple[bytes, Rows]:
    """The support log-probs packed as float16 / float32 and, as stored, the rows of their
    values: ``rows`` itself where it has its array and packing changed none (float32 values, as
    engines send them: no new float objects), else the packed values read back (their list made
    when read). ValueError for a value beyond the format's range (as :mod:`struct` refuses it)."""
    values = rows.array
    if values is None:
        try:
            values = np.frombuffer(struct.pack(f"={len(rows.values)}d", *rows.values), dtype=np.float64)
        except (struct.error, OverflowError) as exc:
            raise ValueError(f"support log-probs: {exc}") from None
    magnitude, limit = np.abs(values), (_F16_OVERFLOW if f16 else _F32_OVERFLOW)
    if (  # fmax: a NaN (unknown) has no magnitude; an infinity is stored as one
        np.fmax.reduce(magnitude, initial=0.0) >= limit
        and np.fmax.reduce(magnitude[magnitude != math.inf], initial=0.0) >= limit
    ):
        raise ValueError(f"support log-probs: float too large to pack with {'e' if f16 else 'f'} format")
    packed = values.astype("<f2" if f16 else "<f4").tobytes()
    back = np.frombuffer(packed, dtype="<f2" if f16 else "<f4").astype(np.float64)
    if rows.array is not None and back.tobytes() == values.tobytes():  # the same bits: nothing rounded
        return packed, rows
    return packed, Rows(None, rows.offsets, back)


def _id_array(rows: Rows, sizes: list[int]) -> Any:
    """The support ids as an int64 array (ValueError naming one that is not an integer of 63 bits)."""
    if rows.array is not None:
        return rows.array
    ids = _int_array(rows.values)
    if ids is None:
        at, bad = next((j, x) for j, x in enumerate(rows.values) if type(x) is not int or x >= _VARINT_LIMIT)
        if type(bad) is not int:
            raise ValueError(f"support id {bad!r} of output token {_token_at(at, sizes)} is not an integer")
        raise ValueError(f"varint of {bad}: beyond 63 bits")
    return ids


def _header(turn: TurnData) -> dict[str, Any]:
    """The JSON header of ``turn``'s block (``fork`` and ``sampling`` only when set)."""
    header: dict[str, Any] = {
        "turn": turn.turn,
        "group": turn.group,
        "replica": turn.replica,
        "finish_reason": turn.finish_reason,
        "timings": turn.timings,
        "weight_versions": [dict(s) for s in turn.weight_versions],
        "moved_from": turn.moved_from,
        "context": turn.context,
    }
    if turn.fork is not None:
        header["fork"] = turn.fork
    if turn.sampling is not None:
        header["sampling"] = turn.sampling
    return header


def _sections(sections: Mapping[str, bytes]) -> bytes:
    """The optional sections (name, bytes) and their u32 byte length, as the block ends them."""
    out = bytearray()
    for name, data in sections.items():
        coded = name.encode()
        if not coded:
            raise ValueError("a section needs a name")
        _varint(len(coded), out)
        out += coded
        _varint(len(data), out)
        out += data
    if len(out) > 0xFFFFFFFF:
        raise ValueError(f"sections of {len(out)} bytes exceed the u32 length")
    return bytes(out) + struct.pack("<I", len(out))


def _gap_varints(ids: Any, offsets: list[int], sizes: list[int]) -> bytes:
    """The support ids of all tokens (``ids``, an int64 array; row ``i`` from ``offsets[i]``),
    gap coded: per row the first id, then ``id[j] - id[j-1] - 1``; as varints, in one vectorized
    pass. Raises ValueError unless every row is strictly increasing and non-negative."""
    gaps = np.empty_like(ids)
    gaps[0] = ids[0]
    np.subtract(ids[1:], ids[:-1], out=gaps[1:])
    gaps[1:] -= 1
    starts = np.asarray(offsets[:-1])[np.asarray(sizes) > 0]
    gaps[starts] = ids[starts]
    if gaps.min() < 0 or ids.min() < 0:  # a negative id is refused even where a gap wrapped
        raise ValueError(_gap_error(int(np.argmax((gaps < 0) | (ids < 0))), sizes))
    if gaps.max() < 0x80:
        return gaps.astype(np.uint8).tobytes()
    return _np_varints(gaps)


def _gap_error(at: int, sizes: list[int]) -> str:
    """The message for the support id at flat position ``at`` (rows of ``sizes``)."""
    return f"support ids of output token {_token_at(at, sizes)} must be non-negative and strictly increasing"


def _token_at(at: int, sizes: list[int]) -> int:
    """The output token whose support row holds flat position ``at``."""
    return bisect.bisect_right(list(itertools.accumulate(sizes)), at)


def decode_turn(data: bytes | memoryview, *, offset: int = 0) -> TurnData:
    """Decode a turn block. Raises :class:`RecordFormatError` on malformed input, naming offsets
    counted from ``offset`` (where the block lies in the bytes the caller holds, e.g. a batch)."""
    r = _Reader(data, offset)
    turn = _decode_turn(r)
    if r.pos != len(r.buf):
        left = len(r.buf) - r.pos
        raise RecordFormatError(f"{left} trailing bytes at offset {r.at()}, after the turn block's data")
    return turn


class TurnOutputs(NamedTuple):
    """What a turn block says of its output tokens, without their supports
    (:func:`decode_turn_outputs`): the turn's group, the length of its engine input
    (``context`` + appended tokens), the behavior log-prob of each output token (float32; a view
    of the block with numpy, else a tuple), their weight versions
    (:func:`router.turn_data.token_versions`) and whether the turn recorded routed experts."""

    group: str
    prompt_len: int
    logprobs: Any
    versions: list[int | None]
    routes: bool


def decode_turn_outputs(data: bytes | memoryview) -> TurnOutputs:
    """Only what the sampler-trainer mismatch needs of a turn block (:class:`TurnOutputs`): the
    header, its sections' names and the output log-probs; the token ids are skipped and the
    supports not read, so a turn costs no Python work per token (with numpy). Checks less than
    :func:`decode_turn` (nothing after the log-probs is read). Raises :class:`RecordFormatError`
    on malformed input."""
    r = _Reader(data)
    _check_magic(r, MAGIC_TURN)
    flags = r.byte()
    header = r.json()
    if not isinstance(header, dict):
        raise RecordFormatError("turn header is not a JSON object")
    sections = _read_sections(r) if flags & FLAG_SECTIONS else {}
    n_append = r.varint()
    r.skip_varints(n_append)
    n = r.varint()
    r.skip_varints(n)
    raw = r.raw(4 * n)
    logprobs = np.frombuffer(raw, dtype="<f4") if np is not None else struct.unpack(f"<{n}f", raw)
    try:
        versions = token_versions(_spans(header), n)
        prompt_len = int(header["context"]) + n_append
        return TurnOutputs(str(header["group"]), prompt_len, logprobs, versions, ROUTES_SECTION in sections)
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"bad turn header: {exc!r}") from None


def _spans(header: dict[str, Any]) -> list[dict[str, int]]:
    """A turn header's ``weight_versions`` spans, as integers (KeyError, TypeError or ValueError
    when malformed)."""
    return [
        {"version": int(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
        for s in header.get("weight_versions") or []
    ]


def decode_turn_header(data: bytes | memoryview) -> dict[str, Any]:
    """Only the JSON header of a turn block (cheap: no per-token work)."""
    r = _Reader(data)
    _check_magic(r, MAGIC_TURN)
    r.byte()
    return r.json()


def _check_magic(r: _Reader, magic: bytes) -> None:
    at = r.at()
    got = bytes(r.raw(len(magic))) if len(r.buf) >= len(magic) else bytes(r.buf)
    if got != magic:
        raise RecordFormatError(f"bad magic {got!r} at offset {at}, expected {magic!r}")
    version = r.byte()
    if version != RECORDS_FORMAT_VERSION:
        raise RecordFormatError(f"unsupported format version {version} at offset {at + len(magic)}")


def _decode_turn(r: _Reader) -> TurnData:
    """The turn block that fills ``r`` (its sections end the buffer)."""
    _check_magic(r, MAGIC_TURN)
    flags = r.byte()
    header = r.json()
    if not isinstance(header, dict):
        raise RecordFormatError("turn header is not a JSON object")
    sections: dict[str, bytes] = {}
    if flags & FLAG_SECTIONS:
        sections = _read_sections(r)
    append_ids = r.varints(r.varint())
    n = r.varint()
    output_ids = r.varints(n)
    logprobs = list(r.floats(n, "f"))
    raw = [None if math.isnan(x) else x for x in r.floats(n, "f")]
    sizes = r.varints(n)
    support_ids = [_ungap(r.varints(k)) if k else [] for k in sizes]
    flat = r.floats(sum(sizes), "e" if flags & FLAG_F16 else "f")
    support_lps: list[list[float]] = []
    pos = 0
    for k in sizes:
        support_lps.append(list(flat[pos : pos + k]))
        pos += k
    try:
        return TurnData(
            append_ids=append_ids,
            output_ids=output_ids,
            logprobs=logprobs,
            raw_logprobs=raw,
            support_ids=support_ids,
            support_logprobs=support_lps,
            sections=sections,
            **_header_fields(header),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"bad turn header: {exc!r}") from None


def _header_fields(header: dict[str, Any]) -> dict[str, Any]:
    """The :class:`TurnData` fields a turn block's JSON ``header`` gives, as a read of the block
    makes them (KeyError, TypeError or ValueError when malformed)."""
    fork = header.get("fork")
    return {
        "turn": int(header["turn"]),
        "group": str(header["group"]),
        "replica": str(header["replica"]),
        "weight_versions": _spans(header),
        "finish_reason": header.get("finish_reason"),
        "timings": header.get("timings") or {},
        "moved_from": header.get("moved_from"),
        "sampling": header.get("sampling"),
        "context": int(header["context"]),
        "fork": None if fork is None else {"stored": int(fork["stored"]), "common": int(fork["common"])},
    }


def _ungap(gaps: list[int]) -> list[int]:
    """A support row from its gap coding (first id, then ``id[j] - id[j-1] - 1``)."""
    ids = [gaps[0]]
    prev = gaps[0]
    for g in gaps[1:]:
        prev = prev + g + 1
        ids.append(prev)
    return ids


def _read_sections(r: _Reader) -> dict[str, bytes]:
    """The sections that end the block in ``r`` (their u32 length last); ``r`` then ends where
    they start."""
    end = len(r.buf)
    if end - r.pos < 4:
        raise RecordFormatError("truncated: a block with sections has no sections length")
    (size,) = struct.unpack("<I", r.buf[end - 4 :])
    start = end - 4 - size
    if start < r.pos:
        raise RecordFormatError(f"sections of {size} bytes do not fit the block")
    sub = _Reader(r.buf[start : end - 4], r.base + start)
    sections: dict[str, bytes] = {}
    while sub.pos < len(sub.buf):
        name = bytes(sub.raw(sub.varint()))
        try:
            sections[name.decode()] = bytes(sub.raw(sub.varint()))
        except UnicodeDecodeError:
            raise RecordFormatError(f"section name {name!r} is not UTF-8") from None
    r.buf = r.buf[:start]
    return sections


# ---------------------------------------------------------------- batches


def encode_batch(
    lease_id: str,
    held_back: int,
    trajectories: Sequence[tuple[dict[str, Any], Sequence[bytes]]],
    trainer_version: int | None = None,
) -> bytes:
    """Encode a trainer batch from (trajectory header, stored turn blocks) pairs.

    The turn blocks are copied as stored (no re-encoding). Each header gets ``n_turns``. The
    batch header names ``trainer_version`` (the version ages are measured against) when given.
    """
    out = bytearray(MAGIC_BATCH)
    out.append(RECORDS_FORMAT_VERSION)
    headers = [{**h, "n_turns": len(blobs)} for h, blobs in trajectories]
    head: dict[str, Any] = {"lease_id": lease_id, "held_back": held_back, "trajectories": headers}
    if trainer_version is not None:
        head["trainer_version"] = trainer_version
    _json(head, out)
    for _, blobs in trajectories:
        for blob in blobs:
            _varint(len(blob), out)
            out += blob
    return bytes(out)


def _check_segments(turns: list[TurnData], session_id: str) -> None:
    """Each turn's ``context`` is its segment's length before it (a segment starts at the first
    turn and at every fork); else :class:`RecordFormatError`."""
    length = 0
    for i, turn in enumerate(turns):
        if i == 0 or turn.fork is not None:
            length = 0
        if turn.context != length:
            raise RecordFormatError(
                f"session {session_id}, turn {i}: context {turn.context} but its segment holds "
                f"{length} tokens before it"
            )
        length += len(turn.append_ids) + len(turn.output_ids)


def decode_batch(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a batch into the JSON shape of ``POST /v1/batches/take``. Raises
    :class:`RecordFormatError` on malformed input: every turn block must be read to its end, the
    batch to its end, and each turn's ``context`` must be its segment's length before it."""
    r = _Reader(data)
    _check_magic(r, MAGIC_BATCH)
    header = r.json()
    try:
        heads = [(dict(t), int(t["n_turns"]), str(t["session_id"])) for t in header["trajectories"]]
        out = {"lease_id": header["lease_id"], "held_back": header["held_back"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"bad batch header: {exc!r}") from None
    trajectories = []
    for t, n_turns, session_id in heads:
        del t["n_turns"]
        turns, shapes = [], []
        for i in range(n_turns):
            size = r.varint()
            at = r.at()
            try:
                turn = decode_turn(r.raw(size), offset=at)
                shapes.append(turn.to_json(session_id))
            except ValueError as exc:  # a RecordFormatError, or a bad routed_experts section
                where = f"session {session_id}, turn {i} (block at offset {at})"
                raise RecordFormatError(f"{where}: {exc}") from None
            turns.append(turn)
        _check_segments(turns, session_id)
        t["turns"] = shapes
        trajectories.append(t)
    if r.pos != len(r.buf):
        raise RecordFormatError(f"{len(r.buf) - r.pos} trailing bytes at offset {r.pos}, after the batch")
    out = {"lease_id": out["lease_id"], "trajectories": trajectories, "held_back": out["held_back"]}
    if "trainer_version" in header:
        out["trainer_version"] = header["trainer_version"]
    return out

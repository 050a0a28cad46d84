"""Decode a trainer batch in the compact records encoding straight into flat arrays.

The encoding is the router's (``application/x-mixfleet-records``; the layout is documented in
``router/records.py``, whose standard-library decoder returns the JSON shape instead). This
module depends on numpy only: every per-token field of a turn is decoded by array operations
(varint runs, gap-coded support rows, float runs), never by a Python loop per token.

:func:`decode_batch` returns a :class:`Batch`: one row per sampled (output) token, in
trajectory, turn, token order, plus per-trajectory and per-turn tables. Routed experts (the
blocks' ``routed_experts`` sections): a turn's own rows (:meth:`Batch.routes`), a turn's whole
sequence (:meth:`Batch.sequence_routes`) and a segment's (:meth:`Batch.segment_routes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.wire import FLAG_F16, FLAG_SECTIONS, MAGIC_BATCH, MAGIC_TURN, VERSION_MAX
from core.wire import RECORDS_FORMAT_VERSION as FORMAT_VERSION


class BatchFormatError(ValueError):
    """The bytes are not a valid batch (truncated, wrong magic or version, bad varint, a value out
    of range)."""


def _version(value: Any, what: str) -> int:
    """``value`` when it is a weight or trainer version: an integer in ``[0, VERSION_MAX]`` (what
    the int64 versions and version ages hold); else :class:`BatchFormatError` naming ``what``."""
    if type(value) is not int or not 0 <= value <= VERSION_MAX:
        raise BatchFormatError(f"{what} {value!r} is not a version (an integer in [0, {VERSION_MAX}])")
    return value


@dataclass(frozen=True)
class Batch:
    """A decoded batch. Per sampled token (length ``T``, trajectory, turn, token order):
    ``token_ids``, ``logprobs`` (log mu, float32), ``raw_logprobs`` (float32, NaN when unknown),
    ``versions`` (int64, -1 when unknown), ``version_ages`` (``trainer_version - versions``,
    clipped at 0; -1 when unknown), ``group_index`` (into ``groups``), ``trajectory_index``,
    ``turn_index``, ``token_positions`` (its index in ``sequence_ids``); the support as CSR:
    ``support_offsets`` [T+1], ``support_ids`` and ``support_logprobs`` (float32).

    Sequences (append-only trajectories): every segment's tokens once, segment after segment
    (a trajectory has one segment, plus one per fork): ``sequence_ids`` (int64), ``loss_mask``
    (bool, True on sampled tokens), ``sequence_offsets`` [S+1] and ``segment_trajectory`` [S].
    A trainer computes each segment once; the sampled tokens' logits are at ``token_positions -
    1`` of their segment's sequence.

    Per trajectory: ``trajectories`` (the header's dicts: session_id, group, reward, metadata,
    version_age). Per turn: ``turns`` (header dicts with ``token_start`` / ``token_end`` into the
    token arrays, ``segment``, ``sequence_start`` (where its appended tokens start in
    ``sequence_ids``), ``append_ids`` and ``input_ids`` (the engine's whole input: its segment's
    first ``context + len(append_ids)`` tokens) as int64 views of ``sequence_ids``)."""

    lease_id: str | None
    held_back: int
    trainer_version: int | None
    groups: tuple[str, ...]
    trajectories: tuple[dict[str, Any], ...]
    turns: tuple[dict[str, Any], ...]
    token_ids: np.ndarray
    logprobs: np.ndarray
    raw_logprobs: np.ndarray
    versions: np.ndarray
    version_ages: np.ndarray
    group_index: np.ndarray
    trajectory_index: np.ndarray
    turn_index: np.ndarray
    support_offsets: np.ndarray
    support_ids: np.ndarray
    support_logprobs: np.ndarray
    token_positions: np.ndarray
    sequence_ids: np.ndarray
    loss_mask: np.ndarray
    sequence_offsets: np.ndarray
    segment_trajectory: np.ndarray

    def __len__(self) -> int:
        return int(self.token_ids.size)

    def routes(self, turn: int, top_k: int) -> np.ndarray | None:
        """Turn ``turn``'s routed experts (its ``routed_experts`` section) as int32 ``[rows,
        layers, top_k]`` (``top_k``: the model's experts per token; ValueError when a row's width
        is not a multiple), row ``j`` for position ``turns[turn]["routed_experts"]["start"] + j``
        of the turn's segment; None when the turn has none."""
        flat = self.turns[turn].get("routes")
        if flat is None:
            return None
        if top_k < 1 or flat.shape[1] % top_k:
            raise ValueError(
                f"routes of turn {turn} hold {flat.shape[1]} ids per position, not layers x {top_k}"
            )
        return flat.reshape(flat.shape[0], flat.shape[1] // top_k, top_k)

    def sequence_routes(self, turn: int, top_k: int) -> np.ndarray | None:
        """The recorded experts of every position of turn ``turn``'s sequence (its segment's
        tokens up to its input, then its output): int32 ``[len(input_ids) + outputs, layers,
        top_k]`` from the rows of this turn and the earlier turns of its segment (each placed
        from its ``start``), -1 where none were recorded (always the last position: nothing was
        computed there); None when the turn has none."""
        mine = self.routes(turn, top_k)
        if mine is None:
            return None
        t = self.turns[turn]
        length = len(t["input_ids"]) + int(t["token_end"]) - int(t["token_start"])
        out = np.full((length, *mine.shape[1:]), -1, dtype=np.int32)
        for j in range(turn + 1):
            other = self.turns[j]
            rows = self.routes(j, top_k) if other["segment"] == t["segment"] else None
            if rows is not None and rows.shape[1:] == mine.shape[1:]:
                start = int(other["routed_experts"]["start"])
                rows = rows[: max(0, length - start)]
                out[start : start + rows.shape[0]] = rows
        return out

    def segment_routes(self, segment: int, top_k: int) -> np.ndarray | None:
        """Segment ``segment``'s recorded experts aligned with its token sequence
        (``sequence_ids[sequence_offsets[segment]:sequence_offsets[segment + 1]]``, ``L`` tokens):
        int32 ``[L, layers, top_k]``, row ``p`` the experts of position ``p`` (the forward pass
        that predicted token ``p + 1``), from every turn of the segment (each placed from its
        ``start``; a segment's turns store each position once); -1 where none were recorded,
        always in the last row (nothing was computed there). None when no turn of the segment
        recorded routes."""
        lo, hi = int(self.sequence_offsets[segment]), int(self.sequence_offsets[segment + 1])
        owned = [i for i, t in enumerate(self.turns) if t["segment"] == segment and "routes" in t]
        if not owned:
            return None
        parts = [(int(self.turns[i]["routed_experts"]["start"]), self.routes(i, top_k)) for i in owned]
        out = np.full((hi - lo, *parts[0][1].shape[1:]), -1, dtype=np.int32)
        for start, rows in parts:
            if rows.shape[1:] != out.shape[1:] or start + rows.shape[0] > hi - lo:
                raise ValueError(f"routes of segment {segment} do not fit its {hi - lo} tokens")
            out[start : start + rows.shape[0]] = rows
        return out

    def rewards(self) -> np.ndarray:
        """Per-token reward of the token's trajectory (NaN when the trajectory has none)."""
        per = np.array(
            [np.nan if t.get("reward") is None else float(t["reward"]) for t in self.trajectories],
            dtype=np.float64,
        )
        return per[self.trajectory_index] if per.size else np.zeros(0)

    def to_torch(self) -> dict[str, Any]:
        """The per-token arrays as torch tensors (zero-copy where dtypes allow)."""
        import torch

        names = (
            "token_ids",
            "logprobs",
            "raw_logprobs",
            "versions",
            "version_ages",
            "group_index",
            "trajectory_index",
            "turn_index",
            "support_offsets",
            "support_ids",
            "support_logprobs",
            "token_positions",
            "sequence_ids",
            "loss_mask",
            "sequence_offsets",
            "segment_trajectory",
        )
        return {n: torch.from_numpy(np.ascontiguousarray(getattr(self, n))) for n in names}


_HIGH_BYTES = bytes(range(0x80, 0x100))
_TURN_KEYS = frozenset(("turn", "group", "replica", "context"))  # what every turn header holds
_TURN_PREFIX = MAGIC_TURN + bytes([FORMAT_VERSION])


def _varint_values(stream: np.ndarray, offset: int = 0) -> np.ndarray:
    """Every LEB128 value of ``stream`` (uint8; a concatenation of whole varints) plus
    ``offset``, as int64; raises :class:`BatchFormatError` when the stream ends inside a value
    or a value is longer than 9 bytes.

    Mostly one-byte values (support gaps): the work over every byte is one comparison, one
    compaction of the values' last bytes (a value below 128 is its last byte) and one widening
    add; the few continuation bytes are then folded into their values from a sparse index.
    Mostly multi-byte values (a large vocabulary's ids): :func:`_dense_varint_values`."""
    high = stream >= 0x80
    cont = high.nonzero()[0]
    if cont.size == 0:
        return np.add(stream, offset, dtype=np.int64)
    if cont[-1] == stream.size - 1:
        raise BatchFormatError("varint run ends inside a value")
    if 4 * cont.size > stream.size:  # mostly multi-byte values (a large vocabulary's ids)
        return _dense_varint_values(stream, high, offset)
    values = np.add(stream[~high], offset, dtype=np.int64)
    first = np.ones(cont.size, dtype=bool)
    first[1:] = cont[1:] != cont[:-1] + 1  # a continuation byte that starts a value
    group_start = first.nonzero()[0]
    n_cont = np.diff(np.append(group_start, cont.size))  # continuation bytes per multi-byte value
    if int(n_cont.max()) > 8:
        raise BatchFormatError("varint longer than 9 bytes (over 63 bits)")
    ends = cont[group_start] + n_cont  # the last byte of each multi-byte value
    owners = ends - (group_start + n_cont)  # its index among the values
    start = np.repeat(cont[group_start], n_cont)
    parts = (stream[cont].astype(np.int64) & 0x7F) << (7 * (cont - start))
    values[owners] = (
        ((values[owners] - offset) << (7 * n_cont)) | np.bitwise_or.reduceat(parts, group_start)
    ) + offset
    return values


_GROUP_MASKS = {
    dtype: np.array([(1 << (7 * k)) - 1 for k in range(width + 1)], dtype=dtype)
    for dtype, width in ((np.uint32, 4), (np.uint64, 9))
}


def _dense_varint_values(stream: np.ndarray, high: np.ndarray, offset: int) -> np.ndarray:
    """The values of ``stream`` (whole varints; ``high`` marks its continuation bytes) plus
    ``offset``, as int64, for a stream of mostly multi-byte values: per value its start, then
    for each byte position j up to the longest value one gather of the j-th bytes, or-ed in at
    bit 7j (in uint32 while values fit 28 bits), and a mask of each value's own length.
    Temporaries are few, small-typed and reused (every large one costs page faults on first
    touch)."""
    ends = np.logical_not(high).nonzero()[0]
    lengths = np.empty(ends.size, dtype=np.uint8)  # bytes per value (a wrapped one shows in the sum)
    lengths[0] = min(int(ends[0]) + 1, 255)
    np.subtract(ends[1:], ends[:-1], out=lengths[1:], casting="unsafe")
    width = int(lengths.max())
    if width > 9 or int(lengths.sum(dtype=np.int64)) != stream.size:
        raise BatchFormatError("varint longer than 9 bytes (over 63 bits)")
    dtype = np.uint32 if width <= 4 else np.uint64
    padded = np.zeros(stream.size + width, dtype=np.uint8)
    padded[: stream.size] = stream
    np.bitwise_and(padded, 0x7F, out=padded)
    starts = np.subtract(ends, lengths, out=ends)
    starts += 1
    values = padded[starts].astype(dtype)
    part = np.empty_like(values)
    for j in range(1, width):
        np.copyto(part, padded[j:][starts], casting="unsafe")
        np.left_shift(part, dtype(7 * j), out=part)
        np.bitwise_or(values, part, out=values)
    np.bitwise_and(values, _GROUP_MASKS[dtype][lengths], out=values)
    return np.add(values, offset, dtype=np.int64)


def _varint_at(raw: bytes, pos: int, base: int = 0) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it (``raw`` starts at offset ``base`` of the
    batch, which errors name)."""
    shift = value = 0
    while True:
        if pos >= len(raw):
            raise BatchFormatError(f"truncated varint at offset {base + pos}")
        b = raw[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise BatchFormatError(f"varint longer than 9 bytes at offset {base + pos}")


def _run_end(raw: bytes, buf: np.ndarray, start: int, count: int) -> int:
    """Where the run of ``count`` varints at ``start`` ends (``buf``: ``raw`` as uint8). A run
    spans ``count`` bytes plus its continuation bytes (high bit set). With few of those the
    span is extended by the continuation bytes found in its last extension until an extension
    has none; with many (each extension would find about as many again) the run ends after its
    ``count``-th byte below 0x80, found by one array pass."""
    end = start + count
    chunk = raw[start:end]
    if chunk.isascii():
        if len(chunk) < count:
            raise BatchFormatError(f"truncated varint run at offset {start}")
        return end
    more = len(chunk) - len(chunk.translate(None, _HIGH_BYTES))
    if 4 * more > count:
        guess = count * count // max(1, count - more) * 5 // 4 + 16  # the first bytes' ratio, +25%
        for window in (min(guess, 9 * count), 9 * count):
            last = (buf[start : start + window] < 0x80).nonzero()[0]
            if last.size >= count:
                return start + int(last[count - 1]) + 1
        raise BatchFormatError(f"truncated varint run at offset {start}")
    while more:
        chunk = raw[end : end + more]
        if len(chunk) < more:
            raise BatchFormatError(f"truncated varint run at offset {start}")
        end += more
        more = more - len(chunk.translate(None, _HIGH_BYTES))
    if end > len(raw) or raw[end - 1] >= 0x80:
        raise BatchFormatError(f"truncated varint run at offset {start}")
    return end


class _Layout:
    """Where every part of every turn block of a batch lies, in batch order: per turn its JSON
    header's byte range, its input and output token counts and whether its support log-probs
    are float16; per kind of run (input ids, output ids, log-probs, raw log-probs, support sizes,
    support gaps, support log-probs) the byte ranges."""

    def __init__(self, blocks: list[tuple[int, ...]]) -> None:
        """``blocks``: per turn (f16, header start, header end, n_input, input start, input end,
        n_output, output start, output end, sizes end, gaps end, support end, sections end), as
        :func:`_scan` finds them."""
        cols = tuple(zip(*blocks, strict=True)) or ((),) * 13
        f16, h_lo, h_hi, self.n_input, in_lo, in_hi, self.n_output, out_lo, out_hi = cols[:9]
        sz_hi, gap_hi, end, sec_hi = cols[9:]
        self.f16 = [bool(f) for f in f16]
        self.headers = list(zip(h_lo, h_hi, strict=True))
        self.inputs = list(zip(in_lo, in_hi, strict=True))
        self.outputs = list(zip(out_lo, out_hi, strict=True))
        lp_hi = [o + 4 * n for o, n in zip(out_hi, self.n_output, strict=True)]
        raw_hi = [o + 8 * n for o, n in zip(out_hi, self.n_output, strict=True)]
        self.logprobs = list(zip(out_hi, lp_hi, strict=True))
        self.raws = list(zip(lp_hi, raw_hi, strict=True))
        self.sizes = list(zip(raw_hi, sz_hi, strict=True))
        self.gaps = list(zip(sz_hi, gap_hi, strict=True))
        self.support = list(zip(gap_hi, end, strict=True))
        self.sections = list(zip(end, sec_hi, strict=True))  # empty where a turn has none


def _counted_run(raw: bytes, buf: np.ndarray, pos: int, end: int) -> tuple[int, int, int]:
    """A varint count at ``pos`` (inside a block ending at ``end``), then that many varints:
    (count, start of the run, end of the run)."""
    if pos >= end:
        raise BatchFormatError(f"truncated: a token count at offset {pos} lies past its block's end ({end})")
    count = raw[pos]
    pos += 1
    if count >= 0x80:
        count, pos = _varint_at(raw, pos - 1)
    run_end = _run_end(raw, buf, pos, count)
    if run_end > end:
        raise BatchFormatError(
            f"truncated: {count} token ids at offset {pos} run to offset {run_end}, past their turn "
            f"block's end ({end})"
        )
    return count, pos, run_end


def _scan(raw: bytes, buf: np.ndarray, pos: int, n_turns: int, blocks: list[tuple[int, ...]]) -> int:
    """Locate the parts of ``n_turns`` length-prefixed turn blocks from ``pos`` (one tuple per
    block appended to ``blocks``, see :class:`_Layout`); returns the position after them. Checks
    every length against the bytes."""
    size_of = len(raw)
    for _ in range(n_turns):
        if pos + 1 < size_of and raw[pos + 1] < 0x80 <= raw[pos]:  # a two-byte length
            size = (raw[pos] & 0x7F) | raw[pos + 1] << 7
            pos += 2
        else:
            size, pos = _varint_at(raw, pos)
        block_lo = pos
        end = pos + size
        if end > size_of:
            raise BatchFormatError(
                f"truncated: turn block of {size} bytes at offset {pos}, have {size_of - pos}"
            )
        if size < 7 or raw[pos : pos + 4] != _TURN_PREFIX:
            got = raw[pos : pos + 4]
            if got[:3] == MAGIC_TURN and len(got) == 4 and got[3] != FORMAT_VERSION:
                raise BatchFormatError(
                    f"unsupported format version {got[3]} (this decoder reads {FORMAT_VERSION})"
                )
            raise BatchFormatError(f"expected a turn block ({MAGIC_TURN!r}) at offset {pos}, got {got!r}")
        f16 = raw[pos + 4] & FLAG_F16
        sections_hi = end
        if raw[pos + 4] & FLAG_SECTIONS:  # optional sections end the block (their u32 length last)
            sections_hi = end - 4
            end -= 4 + int.from_bytes(raw[end - 4 : end], "little")
            if end < pos + 7:
                raise BatchFormatError(f"turn block at offset {pos}: its sections do not fit it")
        length = raw[pos + 5]
        pos += 6
        if length >= 0x80:
            length, pos = _varint_at(raw, pos - 1)
        h_lo = pos
        pos += length
        if pos > end:
            raise BatchFormatError(
                f"turn block at offset {block_lo}: its header of {length} bytes at offset {h_lo} does "
                f"not fit the block ({end - h_lo} bytes left)"
            )
        n_input, in_lo, in_hi = _counted_run(raw, buf, pos, end)
        n, out_lo, out_hi = _counted_run(raw, buf, in_hi, end)
        pos = out_hi + 8 * n
        sizes_hi = _run_end(raw, buf, pos, n)
        if sizes_hi > end:
            raise BatchFormatError(
                f"turn block at offset {block_lo}: the log-probs and support sizes of its {n} tokens "
                f"run to offset {sizes_hi}, past the block's end ({end})"
            )
        if sizes_hi - pos == n:
            total = sum(raw[pos:sizes_hi])
        else:
            total = int(_varint_values(buf[pos:sizes_hi]).sum())
        # the support log-probs end the block, so the gap run ends where they start
        gaps_hi = end - total * (2 if f16 else 4)
        if gaps_hi < sizes_hi + total:
            raise BatchFormatError(
                f"turn block at offset {block_lo}: its support sizes (ending at offset {sizes_hi}) "
                f"give {total} support ids, more than the {end - sizes_hi} bytes left before the "
                f"block's end ({end}) hold with their log-probs"
            )
        if (
            not sizes_hi + total <= gaps_hi <= sizes_hi + 9 * total
            or (total and raw[gaps_hi - 1] >= 0x80)
            or len(raw[sizes_hi:gaps_hi].translate(None, _HIGH_BYTES)) != total  # one last byte a value
        ):
            raise BatchFormatError(
                f"turn block at offset {block_lo}: {gaps_hi - sizes_hi} bytes between the support sizes "
                f"and the support log-probs do not hold {total} support ids"
            )
        pos = block_lo + size  # after the sections, if any
        blocks.append(
            (f16, h_lo, h_lo + length, n_input, in_lo, in_hi, n, out_lo, out_hi, sizes_hi, gaps_hi, end)
            + (sections_hi,)
        )
    return pos


def _joined(view: memoryview, ranges: list[tuple[int, int]]) -> np.ndarray:
    """The bytes of ``ranges`` one after another, as a new writable uint8 array."""
    return np.frombuffer(bytearray().join([view[lo:hi] for lo, hi in ranges]), dtype=np.uint8)


def _values(view: memoryview, ranges: list[tuple[int, int]], count: int, offset: int = 0) -> np.ndarray:
    """Every varint of the runs at ``ranges`` plus ``offset``, as int64 (one decode for all)."""
    values = _varint_values(_joined(view, ranges), offset)
    if values.size != count:
        raise BatchFormatError("varint runs do not hold the counts their headers give")
    return values


def _floats(view: memoryview, ranges: list[tuple[int, int]], dtype: str) -> np.ndarray:
    return _joined(view, ranges).view(dtype).astype(np.float32, copy=False)


def _support_ids(steps: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Gap-decoded support ids from ``steps`` (int64, every coded value + 1; used as the output):
    a row's first entry is its first id, every later one is ``id[j] - id[j-1] - 1``. With every
    step ``coded + 1``, a row's running sum is its ids + 1; one cumulative sum over the batch
    gives the ids once each row's first step also takes away the previous row's sum (and the
    first row's, 1)."""
    nonempty = sizes > 0
    if not nonempty.any():
        return steps
    starts = (np.cumsum(sizes) - sizes)[nonempty]
    row_sums = np.add.reduceat(steps, starts)
    steps[starts[0]] -= 1
    steps[starts[1:]] -= row_sums[:-1]
    return np.cumsum(steps, out=steps)


def _headers(raw: bytes, ranges: list[tuple[int, int]]) -> list[Any]:
    """The JSON turn headers at ``ranges``, parsed in one call (one by one to name a bad one)."""
    view = memoryview(raw)
    try:
        headers = json.loads(b"[" + b",".join([view[lo:hi] for lo, hi in ranges]) + b"]")
    except ValueError:
        for lo, hi in ranges:
            try:
                json.loads(raw[lo:hi])
            except ValueError as exc:
                raise BatchFormatError(f"bad JSON at offset {lo}: {exc}") from None
        raise BatchFormatError("bad JSON in the turn headers") from None
    if len(headers) != len(ranges):  # a header that is several values, e.g. "1,2"
        raise BatchFormatError("a turn header is not one JSON value")
    return headers


def _spans(turn: dict[str, Any], index: int, start: int, n: int) -> list[tuple[int, int, int]]:
    """The turn's weight-version spans as (first, end, version) in batch token indices, cut to
    the turn's ``n`` tokens and sorted by start (the router's decoder gives a token the first
    span by start that covers it)."""
    given = turn.get("weight_versions") or ()
    if len(given) == 1 and isinstance(given, list) and type(given[0]) is dict:  # the common case
        s = given[0]
        a, b, v = s.get("start"), s.get("end"), s.get("version")
        if type(a) is int and type(b) is int and type(v) is int:
            v = _version(v, f"turn {index}: weight version")
            return [(start + max(0, a), start + min(n, b), v)] if min(n, b) > max(0, a) else []
    try:
        spans = sorted(
            ((int(s["start"]), int(s["end"]), int(s["version"])) for s in given),
            key=lambda span: span[0],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BatchFormatError(f"turn {index}: bad weight_versions in its header: {exc!r}") from None
    for _, _, v in spans:
        _version(v, f"turn {index}: weight version")
    return [(start + max(0, a), start + min(n, b), v) for a, b, v in spans if min(n, b) > max(0, a)]


_ROUTE_DTYPES = {1: "u1", 2: "<u2", 4: "<i4"}


def _read_sections(data: bytes, turn: dict[str, Any], index: int, base: int) -> None:
    """The turn's optional sections (name, size, bytes; see ``router/records.py``; ``data``
    starts at offset ``base`` of the batch, which errors name): its ``routed_experts`` section
    becomes ``turn["routes"]`` (int32 ``[rows, layers x k]``) and ``turn["routed_experts"]``
    (``start``, ``rows``, ``width``); others are skipped."""
    pos = 0
    while pos < len(data):
        at = base + pos
        n, pos = _varint_at(data, pos, base)
        name = data[pos : pos + n]
        size, pos = _varint_at(data, pos + n, base)
        if pos + size > len(data):
            raise BatchFormatError(
                f"turn {index}: section {name!r} at offset {at} of {size} bytes does not fit"
            )
        try:
            name.decode()
        except UnicodeDecodeError:  # a corrupted name (an unknown one is skipped)
            raise BatchFormatError(
                f"turn {index}: section name {name!r} at offset {at} is not UTF-8"
            ) from None
        if name == b"routed_experts":
            _read_routes(data[pos : pos + size], turn, index, base + pos)
        pos += size


def _read_routes(data: bytes, turn: dict[str, Any], index: int, base: int) -> None:
    start, pos = _varint_at(data, 0, base)
    rows, pos = _varint_at(data, pos, base)
    width, pos = _varint_at(data, pos, base)
    size = data[pos] if pos < len(data) else 0
    if size not in _ROUTE_DTYPES or len(data) - pos - 1 != rows * width * size:
        raise BatchFormatError(
            f"turn {index}: bad routed_experts section at offset {base} ({rows} x {width} ids of "
            f"{size} bytes in {len(data) - pos - 1})"
        )
    ids = np.frombuffer(data, dtype=_ROUTE_DTYPES[size], offset=pos + 1, count=rows * width)
    turn["routes"] = ids.astype(np.int32).reshape(rows, width)
    turn["routed_experts"] = {"start": start, "rows": rows, "width": width}


def decode_batch(data: bytes | bytearray | memoryview) -> Batch:
    """Decode a whole batch (``POST /v1/batches/take`` with ``Accept:
    application/x-mixfleet-records``). Raises :class:`BatchFormatError` naming the problem."""
    raw = bytes(data)
    view = memoryview(raw)
    buf = np.frombuffer(raw, dtype=np.uint8)
    header, pos = _batch_header(raw)
    trainer_version = header.get("trainer_version")
    trajectories: list[dict[str, Any]] = []
    turn_owner: list[int] = []
    blocks: list[tuple[int, ...]] = []
    for ti, t in enumerate(header["trajectories"]):
        if not isinstance(t, dict) or not isinstance(t.get("n_turns"), int) or t["n_turns"] < 0:
            raise BatchFormatError(f"trajectory {ti} of the batch header has no count of turns (n_turns)")
        if "session_id" not in t:
            raise BatchFormatError(f"trajectory {ti} of the batch header has no session_id")
        t = dict(t)
        n_turns = t.pop("n_turns")
        trajectories.append(t)
        pos = _scan(raw, buf, pos, n_turns, blocks)
        turn_owner.extend([ti] * n_turns)
    if pos != len(raw):
        raise BatchFormatError(f"{len(raw) - pos} trailing bytes at offset {pos}, after the batch")
    layout = _Layout(blocks)
    turns = _headers(raw, layout.headers)
    count = sum(layout.n_output)
    token_ids = _values(view, layout.outputs, count)
    tables = _turn_tables(turns, layout, turn_owner, trajectories)
    appended = _values(view, layout.inputs, sum(layout.n_input))
    seq = _sequences(layout, appended, token_ids, tables.segment_start)
    for i, turn in enumerate(turns):
        lo = seq.turn_start[i]
        turn["sequence_start"] = lo
        turn["append_ids"] = seq.ids[lo : lo + layout.n_input[i]]
        turn["input_ids"] = seq.ids[seq.offsets[turn["segment"]] : lo + layout.n_input[i]]
        lo, hi = layout.sections[i]
        if hi > lo:
            _read_sections(raw[lo:hi], turn, i, lo)
    versions, ages = _versions(tables.spans, count, trainer_version)
    sizes = _values(view, layout.sizes, count)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    n_output = np.array(layout.n_output, dtype=np.int64)
    return Batch(
        lease_id=header["lease_id"],
        held_back=header["held_back"] or 0,
        trainer_version=trainer_version,
        groups=tuple(tables.groups),
        trajectories=tuple(trajectories),
        turns=tuple(turns),
        token_ids=token_ids,
        logprobs=_floats(view, layout.logprobs, "<f4"),
        raw_logprobs=_floats(view, layout.raws, "<f4"),
        versions=versions,
        version_ages=ages,
        group_index=np.repeat(np.array(tables.group_of, dtype=np.int64), n_output),
        trajectory_index=np.repeat(np.array(turn_owner, dtype=np.int64), n_output),
        turn_index=np.repeat(np.arange(len(turns), dtype=np.int64), n_output),
        support_offsets=offsets,
        support_ids=_support_ids(_values(view, layout.gaps, int(offsets[-1]), offset=1), sizes),
        support_logprobs=_support_logprobs(view, layout),
        token_positions=seq.positions,
        sequence_ids=seq.ids,
        loss_mask=seq.mask,
        sequence_offsets=seq.offsets,
        segment_trajectory=np.array(tables.segment_owner, dtype=np.int64),
    )


def _batch_header(raw: bytes) -> tuple[dict[str, Any], int]:
    """The batch's JSON header (checked: a trajectories list, integer counts) and the position
    after it."""
    if raw[:3] != MAGIC_BATCH or len(raw) < 4:
        raise BatchFormatError(f"expected magic {MAGIC_BATCH!r} at offset 0, got {raw[:3]!r}")
    if raw[3] != FORMAT_VERSION:
        raise BatchFormatError(f"unsupported format version {raw[3]} (this decoder reads {FORMAT_VERSION})")
    size, pos = _varint_at(raw, 4)
    if pos + size > len(raw):
        raise BatchFormatError(f"truncated: need {size} bytes at offset {pos}, have {len(raw) - pos}")
    try:
        header = json.loads(raw[pos : pos + size])
    except ValueError as exc:
        raise BatchFormatError(f"bad JSON at offset {pos}: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("trajectories"), list):
        raise BatchFormatError("batch header has no trajectories list")
    missing = sorted({"lease_id", "held_back"} - header.keys())
    if missing:  # a batch without them is not one a take answered (router.records refuses it too)
        raise BatchFormatError(f"batch header at offset {pos}: no {' or '.join(missing)}")
    trainer_version = header.get("trainer_version")
    held_back = header["held_back"] or 0
    if not isinstance(held_back, int):
        raise BatchFormatError("batch header: held_back must be an integer")
    if trainer_version is not None:
        _version(trainer_version, "batch header: trainer_version")
    return header, pos + size


@dataclass(frozen=True)
class _Tables:
    """Per turn: its group's index and whether it starts a segment; per segment its trajectory;
    the batch's weight-version spans (start, end, version) in batch token indices."""

    groups: dict[str, int]
    group_of: list[int]
    segment_start: list[bool]
    segment_owner: list[int]
    spans: list[tuple[int, int, int]]


def _turn_tables(
    turns: list[Any], layout: _Layout, owner: list[int], trajectories: list[dict[str, Any]]
) -> _Tables:
    """Check every turn header and annotate it (``token_start``, ``token_end``, ``session_id``,
    ``segment``): a segment starts at a trajectory's first turn and at every fork, and each
    turn's ``context`` must be its segment's length before it."""
    groups: dict[str, int] = {}
    group_of, starts, seg_owner = [], [], []
    spans: list[tuple[int, int, int]] = []
    start = seg_len = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not turn.keys() >= _TURN_KEYS:
            missing = sorted(_TURN_KEYS - turn.keys()) if isinstance(turn, dict) else "not an object"
            raise BatchFormatError(f"turn {i}: bad header: {missing}")
        group_of.append(groups.setdefault(str(turn.get("group")), len(groups)))
        fork = turn.get("fork")
        if fork is not None and not (isinstance(fork, dict) and fork.keys() >= {"stored", "common"}):
            raise BatchFormatError(f"turn {i}: bad fork in its header: {fork!r}")
        new = i == 0 or owner[i] != owner[i - 1] or fork is not None
        if new:
            seg_owner.append(owner[i])
            seg_len = 0
        if turn.get("context") != seg_len:
            raise BatchFormatError(
                f"turn {i}: context {turn.get('context')!r} but its segment holds {seg_len} tokens before it"
            )
        n = layout.n_output[i]
        seg_len += layout.n_input[i] + n
        starts.append(new)
        turn["token_start"], turn["token_end"] = start, start + n
        turn["session_id"] = trajectories[owner[i]].get("session_id")
        turn["segment"] = len(seg_owner) - 1
        spans.extend(_spans(turn, i, start, n))
        start += n
    return _Tables(groups, group_of, starts, seg_owner, spans)


@dataclass(frozen=True)
class _Sequences:
    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray
    turn_start: list[int]


def _sequences(layout: _Layout, appended: np.ndarray, outputs: np.ndarray, starts: list[bool]) -> _Sequences:
    """Every segment's tokens once (per turn its appended tokens, then its output tokens), the
    loss mask, segment offsets, each output token's position and each turn's start: placed by
    two scatters, no loop per token."""
    n_in = np.array(layout.n_input, dtype=np.int64)
    n_out = np.array(layout.n_output, dtype=np.int64)
    per_turn = n_in + n_out
    turn_start = np.cumsum(per_turn) - per_turn
    total = int(per_turn.sum())
    ids = np.empty(total, dtype=np.int64)
    mask = np.zeros(total, dtype=bool)
    in_pos = np.repeat(turn_start - (np.cumsum(n_in) - n_in), n_in) + np.arange(appended.size)
    out_pos = np.repeat(turn_start + n_in - (np.cumsum(n_out) - n_out), n_out) + np.arange(outputs.size)
    ids[in_pos] = appended
    ids[out_pos] = outputs
    mask[out_pos] = True
    offsets = np.append(turn_start[np.array(starts, dtype=bool)], total) if starts else np.zeros(1, np.int64)
    return _Sequences(ids, mask, offsets.astype(np.int64), out_pos, turn_start.tolist())


def _versions(spans: list[tuple[int, int, int]], count: int, trainer_version: int | None) -> tuple:
    """Per token its weight version (-1: none) and version age (-1: unknown)."""
    versions = np.full(count, -1, dtype=np.int64)
    for a, b, v in reversed(spans):  # where spans overlap, the earlier one (by start) wins
        versions[a:b] = v
    if trainer_version is None:
        return versions, np.full(count, -1, dtype=np.int64)
    return versions, np.where(versions >= 0, np.maximum(0, trainer_version - versions), -1)


def _support_logprobs(view: memoryview, layout: _Layout) -> np.ndarray:
    """Every turn's support log-probs as float32 (each turn in its own precision)."""
    if all(layout.f16) or not any(layout.f16):
        return _floats(view, layout.support, "<f2" if any(layout.f16) else "<f4")
    return np.concatenate(  # turns of both precisions: each turn's converted on its own
        [_floats(view, [r], "<f2" if f else "<f4") for r, f in zip(layout.support, layout.f16, strict=True)]
    )

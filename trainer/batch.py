"""Decode a trainer batch in the compact records encoding straight into flat arrays.

The encoding is the router's (``application/x-mixfleet-records``; the layout is documented in
``router/records.py``, whose standard-library decoder returns the JSON shape instead). This
module depends on numpy only: every per-token field of a turn is decoded by array operations
(varint runs, gap-coded support rows, float runs), never by a Python loop per token.

:func:`decode_batch` returns a :class:`Batch`: one row per sampled (output) token, in
trajectory, turn, token order, plus per-trajectory and per-turn tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC_TURN = b"MFT"
MAGIC_BATCH = b"MFB"
FORMAT_VERSION = 1
FLAG_F16 = 0x01


class BatchFormatError(ValueError):
    """The bytes are not a valid batch (truncated, wrong magic or version, bad varint)."""


@dataclass(frozen=True)
class Batch:
    """A decoded batch. Per token (length ``T``): ``token_ids``, ``logprobs`` (log mu, float32),
    ``raw_logprobs`` (float32, NaN when unknown), ``versions`` (int64, -1 when unknown),
    ``version_ages`` (``trainer_version - versions``, clipped at 0; -1 when unknown),
    ``group_index`` (into ``groups``), ``trajectory_index``, ``turn_index``; the support as CSR:
    ``support_offsets`` [T+1], ``support_ids`` and ``support_logprobs`` (float32). Per
    trajectory: ``trajectories`` (the header's dicts: session_id, group, reward, metadata,
    version_age). Per turn: ``turns`` (header dicts with ``input_ids`` as an int64 array and
    ``token_start`` / ``token_end`` into the token arrays)."""

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

    def __len__(self) -> int:
        return int(self.token_ids.size)

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
        )
        return {n: torch.from_numpy(np.ascontiguousarray(getattr(self, n))) for n in names}


_INPUT, _OUTPUT, _GAPS, _SIZES = 0, 1, 2, 3
_HIGH_BYTES = bytes(range(0x80, 0x100))


def _varint_values(stream: np.ndarray) -> np.ndarray:
    """Every LEB128 value of ``stream`` (uint8; a concatenation of whole varints) as int64.

    Work over every byte is one comparison and one gather of the last bytes; the (few)
    continuation bytes are then added into their values from a sparse index."""
    high = stream >= 0x80
    ends = np.flatnonzero(~high)
    values = stream[ends].astype(np.int64)
    cont = np.flatnonzero(high)
    if cont.size == 0:
        return values
    owner = np.searchsorted(ends, cont)  # the varint each continuation byte belongs to
    if owner[-1] >= ends.size:
        raise BatchFormatError("varint run ends inside a value")
    first = np.ones(owner.size, dtype=bool)
    first[1:] = owner[1:] != owner[:-1]
    group_start = np.flatnonzero(first)
    n_cont = np.diff(np.append(group_start, owner.size))  # continuation bytes per multi-byte value
    if int(n_cont.max()) > 8:
        raise BatchFormatError("varint longer than 9 bytes (over 63 bits)")
    owners = owner[group_start]
    values[owners] <<= 7 * n_cont
    start = ends[owner] - np.repeat(n_cont, n_cont)  # first byte of the byte's value
    parts = (stream[cont].astype(np.int64) & 0x7F) << (7 * (cont - start))
    values[owners] |= np.bitwise_or.reduceat(parts, group_start)
    return values


class _Cursor:
    """A position in the batch bytes; every read checks the length first. Varint runs are not
    decoded here: :meth:`skip_varints` only finds where a run ends, so that all runs of a batch
    are decoded together by :func:`_varint_values`."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.buf = np.frombuffer(raw, dtype=np.uint8)
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.raw):
            raise BatchFormatError(
                f"truncated: need {n} bytes at offset {self.pos}, have {len(self.raw) - self.pos}"
            )

    def byte(self) -> int:
        self.need(1)
        self.pos += 1
        return self.raw[self.pos - 1]

    def varint(self) -> int:
        raw, pos, shift, value = self.raw, self.pos, 0, 0
        while True:
            if pos >= len(raw):
                raise BatchFormatError(f"truncated varint at offset {self.pos}")
            b = raw[pos]
            value |= (b & 0x7F) << shift
            pos += 1
            if b < 0x80:
                break
            shift += 7
            if shift > 63:
                raise BatchFormatError(f"varint longer than 10 bytes at offset {self.pos}")
        self.pos = pos
        return value

    def skip_varints(self, count: int) -> tuple[int, int]:
        """The byte range of the next ``count`` varints (moves past them). A run of ``count``
        varints spans ``count`` bytes plus its continuation bytes (high bit set); the span is
        grown until it holds exactly that many."""
        raw, start = self.raw, self.pos
        size = count
        while True:
            chunk = raw[start : start + size]
            if len(chunk) < size:
                raise BatchFormatError(f"truncated varint run at offset {start}")
            grown = count + size - len(chunk.translate(None, _HIGH_BYTES))
            if grown == size:
                break
            size = grown
        if size and raw[start + size - 1] >= 0x80:
            raise BatchFormatError(f"truncated varint run at offset {start}")
        self.pos = start + size
        return start, self.pos

    def float_range(self, count: int, width: int) -> tuple[int, int]:
        """The byte range of the next ``count`` floats of ``width`` bytes (moves past them)."""
        self.need(count * width)
        self.pos += count * width
        return self.pos - count * width, self.pos

    def floats(self, count: int, dtype: str) -> np.ndarray:
        width = np.dtype(dtype).itemsize
        self.need(count * width)
        out = np.frombuffer(self.raw, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * width
        return out

    def json(self) -> Any:
        size = self.varint()
        self.need(size)
        try:
            value = json.loads(self.raw[self.pos : self.pos + size])
        except ValueError as exc:
            raise BatchFormatError(f"bad JSON at offset {self.pos}: {exc}") from None
        self.pos += size
        return value

    def magic(self, magic: bytes) -> None:
        self.need(len(magic) + 1)
        got = self.raw[self.pos : self.pos + len(magic)]
        if got != magic:
            raise BatchFormatError(f"expected magic {magic!r} at offset {self.pos}, got {got!r}")
        self.pos += len(magic)
        version = self.byte()
        if version != FORMAT_VERSION:
            raise BatchFormatError(
                f"unsupported format version {version} (this decoder reads {FORMAT_VERSION})"
            )


class _Runs:
    """The byte ranges of a batch's varint runs, per kind (input ids, output ids, support gaps),
    in batch order, with the count of values each holds."""

    def __init__(self) -> None:
        self.ranges: tuple[list[tuple[int, int]], ...] = ([], [], [], [])
        self.counts: tuple[list[int], ...] = ([], [], [], [])

    def add(self, kind: int, byte_range: tuple[int, int], count: int) -> None:
        self.ranges[kind].append(byte_range)
        self.counts[kind].append(count)

    def values(self, raw: bytes, kind: int) -> np.ndarray:
        """Every value of the kind's runs, in order (one decode for the whole batch)."""
        stream = b"".join([raw[lo:hi] for lo, hi in self.ranges[kind]])
        if stream.isascii():  # every value one byte: the bytes are the values
            values = np.frombuffer(stream, dtype=np.uint8)
        else:
            values = _varint_values(np.frombuffer(stream, dtype=np.uint8))
        if values.size != sum(self.counts[kind]):
            raise BatchFormatError("varint runs do not hold the counts their headers give")
        return values


def _turn(
    c: _Cursor, end: int, runs: _Runs, floats: list[list[tuple[int, int]]]
) -> tuple[dict[str, Any], int]:
    """Read one turn block's header and locate its runs; returns (header, n). The byte
    ranges of its float runs are appended to ``floats`` (log-probs, raw, float32 support,
    float16 support; the support range of the other precision is empty)."""
    c.magic(MAGIC_TURN)
    flags = c.byte()
    header = c.json()
    if not isinstance(header, dict):
        raise BatchFormatError("turn header is not a JSON object")
    n_input = c.varint()
    runs.add(_INPUT, c.skip_varints(n_input), n_input)
    n = c.varint()
    runs.add(_OUTPUT, c.skip_varints(n), n)
    floats[0].append(c.float_range(n, 4))
    floats[1].append(c.float_range(n, 4))
    lo, hi = c.skip_varints(n)
    runs.add(_SIZES, (lo, hi), n)
    total = sum(c.raw[lo:hi]) if hi - lo == n else int(_varint_values(c.buf[lo:hi]).sum())
    runs.add(_GAPS, c.skip_varints(total), total)
    if flags & FLAG_F16:
        floats[2].append((c.pos, c.pos))
        floats[3].append(c.float_range(total, 2))
    else:
        floats[2].append(c.float_range(total, 4))
        floats[3].append((c.pos, c.pos))
    if c.pos != end:
        raise BatchFormatError(f"turn block ends at offset {c.pos}, its length says {end}")
    return header, n


def _support_ids(coded: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Gap-decoded support ids (int64): a row's first entry is its first id, every later one is
    ``id[j] - id[j-1] - 1``. With every step ``coded + 1``, a row's running sum is its ids + 1;
    one cumulative sum over the batch gives the ids once each row's first step also takes away
    the previous row's sum (and the first row's, 1)."""
    steps = np.add(coded, 1, dtype=np.int64)
    nonempty = sizes > 0
    if not nonempty.any():
        return steps
    starts = (np.cumsum(sizes) - sizes)[nonempty]
    row_sums = np.add.reduceat(steps, starts)
    steps[starts[0]] -= 1
    steps[starts[1:]] -= row_sums[:-1]
    return np.cumsum(steps, out=steps)


def decode_batch(data: bytes | bytearray | memoryview) -> Batch:
    """Decode a whole batch (``POST /v1/batches/take`` with ``Accept:
    application/x-mixfleet-records``). Raises :class:`BatchFormatError` naming the problem."""
    c = _Cursor(bytes(data))
    c.magic(MAGIC_BATCH)
    header = c.json()
    if not isinstance(header, dict) or not isinstance(header.get("trajectories"), list):
        raise BatchFormatError("batch header has no trajectories list")
    trainer_version = header.get("trainer_version")
    groups: dict[str, int] = {}
    trajectories: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    runs = _Runs()
    float_ranges: list[list[tuple[int, int]]] = [[], [], [], []]
    owners: list[tuple[int, int, int, int]] = []  # (trajectory, turn, group, tokens) per turn
    spans: list[tuple[int, int, int]] = []  # (start, end, version) in batch token indices
    count = 0
    for ti, t in enumerate(header["trajectories"]):
        t = dict(t)
        n_turns = int(t.pop("n_turns"))
        trajectories.append(t)
        for _ in range(n_turns):
            size = c.varint()
            c.need(size)
            turn_header, n = _turn(c, c.pos + size, runs, float_ranges)
            g = groups.setdefault(str(turn_header.get("group")), len(groups))
            turn_header["token_start"], turn_header["token_end"] = count, count + n
            turn_header["session_id"] = t.get("session_id")
            for span in turn_header.get("weight_versions") or []:
                spans.append((count + int(span["start"]), count + int(span["end"]), int(span["version"])))
            turns.append(turn_header)
            owners.append((ti, len(turns) - 1, g, n))
            count += n
    if c.pos != len(c.raw):
        raise BatchFormatError(f"{len(c.raw) - c.pos} trailing bytes after the batch")

    inputs = runs.values(c.raw, _INPUT).astype(np.int64)
    lo = 0
    for turn_header, k in zip(turns, runs.counts[_INPUT], strict=True):
        turn_header["input_ids"] = inputs[lo : lo + k]
        lo += k
    sizes = runs.values(c.raw, _SIZES).astype(np.int64)
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    versions = np.full(count, -1, dtype=np.int64)
    for lo, hi, v in spans:
        versions[lo:hi] = v
    if trainer_version is None:
        ages = np.full(count, -1, dtype=np.int64)
    else:
        ages = np.where(versions >= 0, np.maximum(0, int(trainer_version) - versions), -1)
    per_turn = np.array(owners, dtype=np.int64).reshape(-1, 4)

    def gather(ranges: list[tuple[int, int]], dtype: str) -> np.ndarray:
        parts = [c.buf[lo:hi] for lo, hi in ranges if hi > lo]
        return (
            np.concatenate(parts).view(dtype).astype(np.float32, copy=False)
            if parts
            else np.zeros(0, np.float32)
        )

    if any(hi > lo for lo, hi in float_ranges[3]) and any(hi > lo for lo, hi in float_ranges[2]):
        # turns of both precisions: each turn's support log-probs converted on their own
        support_lps = np.concatenate(
            [
                gather([a], "<f4") if a[1] > a[0] else gather([b], "<f2")
                for a, b in zip(*float_ranges[2:], strict=True)
            ]
        )
    elif any(hi > lo for lo, hi in float_ranges[3]):
        support_lps = gather(float_ranges[3], "<f2")
    else:
        support_lps = gather(float_ranges[2], "<f4")

    return Batch(
        lease_id=header.get("lease_id"),
        held_back=int(header.get("held_back") or 0),
        trainer_version=None if trainer_version is None else int(trainer_version),
        groups=tuple(groups),
        trajectories=tuple(trajectories),
        turns=tuple(turns),
        token_ids=runs.values(c.raw, _OUTPUT).astype(np.int64),
        logprobs=gather(float_ranges[0], "<f4"),
        raw_logprobs=gather(float_ranges[1], "<f4"),
        versions=versions,
        version_ages=ages,
        group_index=np.repeat(per_turn[:, 2], per_turn[:, 3]),
        trajectory_index=np.repeat(per_turn[:, 0], per_turn[:, 3]),
        turn_index=np.repeat(per_turn[:, 1], per_turn[:, 3]),
        support_offsets=offsets,
        support_ids=_support_ids(runs.values(c.raw, _GAPS), sizes),
        support_logprobs=support_lps,
    )

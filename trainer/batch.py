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


class _Cursor:
    """A position in the batch bytes; every read checks the length first."""

    def __init__(self, buf: np.ndarray, raw: bytes) -> None:
        self.buf = buf
        self.raw = raw
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > self.buf.size:
            raise BatchFormatError(
                f"truncated: need {n} bytes at offset {self.pos}, have {self.buf.size - self.pos}"
            )

    def byte(self) -> int:
        self.need(1)
        self.pos += 1
        return int(self.buf[self.pos - 1])

    def varint(self) -> int:
        return int(self.varints(1)[0])

    def varints(self, count: int) -> np.ndarray:
        """``count`` unsigned LEB128 values as uint64, decoded as one array operation."""
        if count == 0:
            return np.zeros(0, dtype=np.uint64)
        window = self.buf[self.pos : self.pos + 10 * count]
        ends = np.flatnonzero(window < 0x80)
        if ends.size < count:
            raise BatchFormatError(f"truncated varint run at offset {self.pos}")
        ends = ends[:count]
        size = int(ends[-1]) + 1
        window = window[:size]
        starts = np.empty(count, dtype=np.int64)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if int(lengths.max()) > 10:
            raise BatchFormatError(f"varint longer than 10 bytes at offset {self.pos}")
        shift = (np.arange(size) - np.repeat(starts, lengths)).astype(np.uint64) * np.uint64(7)
        payload = (window & 0x7F).astype(np.uint64) << shift
        self.pos += size
        return np.bitwise_or.reduceat(payload, starts)

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


def _turn(c: _Cursor, end: int) -> tuple[dict[str, Any], tuple[np.ndarray, ...]]:
    c.magic(MAGIC_TURN)
    flags = c.byte()
    header = c.json()
    if not isinstance(header, dict):
        raise BatchFormatError("turn header is not a JSON object")
    input_ids = c.varints(c.varint()).astype(np.int64)
    n = c.varint()
    output_ids = c.varints(n).astype(np.int64)
    logprobs = c.floats(n, "<f4")
    raw = c.floats(n, "<f4")
    sizes = c.varints(n).astype(np.int64)
    total = int(sizes.sum())
    coded = c.varints(total).astype(np.int64)
    # row starts hold the first id; every later entry is (gap - 1) after its predecessor
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    steps = coded + 1
    row_start = offsets[:-1][sizes > 0]
    steps[row_start] = coded[row_start]
    running = np.cumsum(steps)
    base = np.repeat(running[row_start] - steps[row_start], sizes[sizes > 0])
    ids = running - base
    lps = c.floats(total, "<f2" if flags & FLAG_F16 else "<f4").astype(np.float32)
    if c.pos != end:
        raise BatchFormatError(f"turn block ends at offset {c.pos}, its length says {end}")
    versions = np.full(n, -1, dtype=np.int64)
    for span in header.get("weight_versions") or []:
        versions[int(span["start"]) : int(span["end"])] = int(span["version"])
    header["input_ids"] = input_ids
    return header, (output_ids, logprobs, raw, versions, sizes, ids, lps)


def decode_batch(data: bytes | bytearray | memoryview) -> Batch:
    """Decode a whole batch (``POST /v1/batches/take`` with ``Accept:
    application/x-mixfleet-records``). Raises :class:`BatchFormatError` naming the problem."""
    raw = bytes(data)
    c = _Cursor(np.frombuffer(raw, dtype=np.uint8), raw)
    c.magic(MAGIC_BATCH)
    header = c.json()
    if not isinstance(header, dict) or not isinstance(header.get("trajectories"), list):
        raise BatchFormatError("batch header has no trajectories list")
    trainer_version = header.get("trainer_version")
    groups: dict[str, int] = {}
    trajectories: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    parts: list[tuple[np.ndarray, ...]] = []
    owners: list[tuple[int, int, int, int]] = []  # (trajectory, turn, group, tokens) per turn
    count = 0
    for ti, t in enumerate(header["trajectories"]):
        t = dict(t)
        n_turns = int(t.pop("n_turns"))
        trajectories.append(t)
        for _ in range(n_turns):
            size = c.varint()
            c.need(size)
            turn_header, arrays = _turn(c, c.pos + size)
            g = groups.setdefault(str(turn_header.get("group")), len(groups))
            n = arrays[0].size
            turn_header["token_start"], turn_header["token_end"] = count, count + n
            turn_header["session_id"] = t.get("session_id")
            turns.append(turn_header)
            parts.append(arrays)
            owners.append((ti, len(turns) - 1, g, n))
            count += n
    if c.pos != c.buf.size:
        raise BatchFormatError(f"{c.buf.size - c.pos} trailing bytes after the batch")

    def cat(i: int, dtype: Any) -> np.ndarray:
        return (
            np.concatenate([p[i] for p in parts]).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
        )

    sizes = cat(4, np.int64)
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    versions = cat(3, np.int64)
    if trainer_version is None:
        ages = np.full(versions.size, -1, dtype=np.int64)
    else:
        ages = np.where(versions >= 0, np.maximum(0, int(trainer_version) - versions), -1)
    per_turn = np.array(owners, dtype=np.int64).reshape(-1, 4)
    return Batch(
        lease_id=header.get("lease_id"),
        held_back=int(header.get("held_back") or 0),
        trainer_version=None if trainer_version is None else int(trainer_version),
        groups=tuple(groups),
        trajectories=tuple(trajectories),
        turns=tuple(turns),
        token_ids=cat(0, np.int64),
        logprobs=cat(1, np.float32),
        raw_logprobs=cat(2, np.float32),
        versions=versions,
        version_ages=ages,
        group_index=np.repeat(per_turn[:, 2], per_turn[:, 3]),
        trajectory_index=np.repeat(per_turn[:, 0], per_turn[:, 3]),
        turn_index=np.repeat(per_turn[:, 1], per_turn[:, 3]),
        support_offsets=offsets,
        support_ids=cat(5, np.int64),
        support_logprobs=cat(6, np.float32),
    )

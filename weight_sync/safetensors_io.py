"""Streaming safetensors I/O with bounded memory: validated headers, ranged reads, sequential writes.

The safetensors format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping
tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
data section, which follows the header) plus optional ``"__metadata__"`` (str -> str), then the
data section. ``read_header`` accepts a file only when its tensors tile the data section exactly
(no gap, no overlap, nothing missing at the end), so a truncated or corrupt file is refused
before any tensor is used. ``TensorReader`` gives any row range of a tensor as a zero-copy view of
a private read-only mapping of its file (``view_rows``; pages it no longer needs are handed back
with ``release``) or as a copy read with ``pread`` (``read_rows``), and ``LayoutWriter`` writes a
file whose layout is fixed up front, accepting pieces of its tensors at known offsets from any
thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.errors import UserError

_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

if TYPE_CHECKING:
    import torch

# safetensors dtype string -> (torch dtype name, bytes per element). Header parsing needs no
# torch (so bad input is refused before torch is imported); tensor I/O does.
DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "I32": ("int32", 4),
    "I64": ("int64", 8),
    "BOOL": ("bool", 1),
}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string."""
    import torch

    return getattr(torch, DTYPES[dtype][0])


MAX_HEADER = 100 << 20


class SafetensorsError(UserError, ValueError):
    """A safetensors file is malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: ``file`` bytes ``[start, start + nbytes)`` (absolute offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse and validate the header of the safetensors file at ``path``.

    Returns ``(tensors by name, metadata)``. Raises ``SafetensorsError`` naming the file when it
    is not a well-formed safetensors file whose tensors exactly tile its data section.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: corrupt safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > MAX_HEADER or 8 + n > size:
                raise SafetensorsError(
                    f"{path}: corrupt safetensors file (header length {n}, file {size} bytes)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SafetensorsError(f"{path}: corrupt safetensors file (header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors file (__metadata__ is not an object)")
    data_start = 8 + n
    data_len = size - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(
                f"{path}: corrupt safetensors file (bad header entry for {name!r})"
            ) from None
        if dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise SafetensorsError(f"{path}: corrupt safetensors file (bad shape/offsets for {name!r})")
        if end - begin != math.prod(shape) * DTYPES[dtype][1]:
            raise SafetensorsError(
                f"{path}: corrupt safetensors file "
                f"({name!r}: {end - begin} bytes for shape {list(shape)} {dtype})"
            )
        entries[name] = TensorEntry(name, dtype, shape, path, data_start + begin, end - begin)
    pos = data_start
    for e in sorted(entries.values(), key=lambda e: (e.start, e.nbytes)):
        if e.start != pos:
            raise SafetensorsError(
                f"{path}: corrupt safetensors file (tensor {e.name!r} overlaps another or leaves a gap)"
            )
        pos += e.nbytes
    if pos - data_start != data_len:
        raise SafetensorsError(
            f"{path}: corrupt safetensors file (data section is {data_len} bytes, tensors need "
            f"{pos - data_start}; truncated or padded)"
        )
    return entries, {str(k): str(v) for k, v in meta.items()}


class TensorReader:
    """Reads row ranges of tensors; thread-safe; one descriptor and at most one mapping per file.

    ``view_rows`` (torch) and ``bits_rows`` (numpy) map each file once (privately: writing to a
    view never reaches the file) and return views into the mapping, valid until ``close``; the
    pages they touch count towards the process's resident memory until ``release`` hands them
    back (they stay in the page cache, and a view touched again just faults them back in).
    ``read_rows`` copies with ``pread``.
    """

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, tuple[mmap.mmap | None, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def file_array(self, path: Path) -> np.ndarray:
        """All of ``path`` as a uint8 array viewing its mapping."""
        fd = self._fd(path)
        with self._lock:
            got = self._maps.get(path)
            if got is None:
                size = os.fstat(fd).st_size
                m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
                data = np.frombuffer(m, dtype=np.uint8) if m is not None else np.empty(0, dtype=np.uint8)
                got = self._maps[path] = (m, data)
            return got[1]

    def bits_rows(self, entry: TensorEntry, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows ``[r0, r1)`` of ``entry``, flat, as unsigned integers of its item size (the bit
        patterns: ``uint16`` for BF16), viewing the mapping (a copy if the tensor is misaligned)."""
        offset, nbytes, _ = self._rows(entry, r0, r1)
        if offset % entry.itemsize:
            raw = self.read_bytes(entry.file, offset, nbytes).numpy()
        else:
            data = self.file_array(entry.file)
            if offset + nbytes > data.size:
                raise SafetensorsError(f"{entry.file}: unexpected end of file at byte {data.size}")
            raw = data[offset : offset + nbytes]
        return raw.view(_UINTS[entry.itemsize])

    def read_bytes(self, path: Path, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of ``path`` at ``offset`` as a fresh uint8 tensor."""
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes == 0:
            return buf
        view = memoryview(buf.numpy())
        fd = self._fd(path)
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise SafetensorsError(f"{path}: unexpected end of file at byte {offset + got}")
            got += n
        return buf

    def _rows(self, entry: TensorEntry, r0: int, r1: int | None) -> tuple[int, int, tuple[int, ...]]:
        """(byte offset in the file, byte count, shape) of rows ``[r0, r1)`` of ``entry``."""
        shape = entry.shape
        if not shape:
            return entry.start, entry.nbytes, ()
        r1 = shape[0] if r1 is None else r1
        row_bytes = math.prod(shape[1:]) * entry.itemsize
        return entry.start + r0 * row_bytes, (r1 - r0) * row_bytes, (r1 - r0, *shape[1:])

    def read_rows(self, entry: TensorEntry, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``entry`` (along its first dimension), copied, as a tensor of its dtype."""
        offset, nbytes, shape = self._rows(entry, r0, r1)
        return self.read_bytes(entry.file, offset, nbytes).view(torch_dtype(entry.dtype)).reshape(shape)

    def view_rows(self, entry: TensorEntry, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``entry`` as a tensor of its dtype viewing the file's mapping (no
        copy; a copy only when the file places the tensor at an offset that is not a multiple of
        its item size)."""
        import torch

        _, _, shape = self._rows(entry, r0, r1)
        bits = torch.from_numpy(self.bits_rows(entry, r0, r1))
        return bits.view(torch_dtype(entry.dtype)).reshape(shape)

    def release(self, path: Path, offset: int = 0, nbytes: int | None = None) -> None:
        """Hand back the mapped pages of ``path`` that lie wholly inside ``[offset, offset + nbytes)``
        (all of the file by default): views stay valid, they are read from the page cache again."""
        with self._lock:
            m = self._maps.get(path, (None,))[0]
        if m is None:
            return
        end = len(m) if nbytes is None else min(len(m), offset + nbytes)
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        end = end // page * page
        if end > start:
            m.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Close the files. A mapping is unmapped now unless views of it are still alive (then
        when the last one goes)."""
        with self._lock:
            fds, self._fds = self._fds, {}
            maps, self._maps = self._maps, {}
        for m, _ in maps.values():
            if m is not None:
                with contextlib.suppress(BufferError):
                    m.close()
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class OutTensor:
    """One tensor of a file to write: name, safetensors dtype string, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def encode_header(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header (space-padded to 8-byte alignment) for ``tensors``
    laid out in list order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


class LayoutWriter:
    """Writes one safetensors file whose tensors (and their order) are fixed at creation, piece by
    piece at known offsets, from any number of threads.

    Before: ``path`` does not exist (created exclusively at its final ``size``, space reserved
    where the filesystem can; ``header`` is written at once). ``write_at(i, offset, t)`` puts the
    raw bytes of ``t`` (straight from its memory) at byte ``offset`` of tensor ``i``'s data and
    returns them as a flat uint8 tensor; pieces may come in any order. ``close()`` checks that
    every tensor received exactly its size in bytes (pieces are not expected to overlap) and
    closes the file; ``abort()`` just closes it. Thread-safe.
    """

    def __init__(self, path: Path, tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.tensors = list(tensors)
        self.header = header = encode_header(self.tensors, metadata)
        self._starts = []
        pos = len(header)
        for t in self.tensors:
            self._starts.append(pos)
            pos += t.nbytes
        self.size = pos
        self._got = [0] * len(self.tensors)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        _preallocate(self._fd, self.size)
        _pwrite_all(self._fd, memoryview(header), 0)

    def write_at(self, index: int, offset: int, data: np.ndarray | torch.Tensor) -> np.ndarray:
        """Write the bytes of ``data`` at ``offset`` within tensor ``index``; returns them (flat
        uint8). A tensor must have the output's dtype; an array its item size (bit patterns)."""
        out = self.tensors[index]
        if isinstance(data, np.ndarray):
            if data.dtype.itemsize != out.itemsize:
                raise RuntimeError(f"{self.path}: got {data.dtype} for {out.name}, expected {out.dtype}")
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            import torch

            if data.dtype != torch_dtype(out.dtype):
                raise RuntimeError(f"{self.path}: got {data.dtype} for {out.name}, expected {out.dtype}")
            raw = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        n = raw.size
        if offset < 0 or offset + n > out.nbytes:
            raise RuntimeError(f"{self.path}: {n} bytes at {offset} overflow {out.name} ({out.nbytes} bytes)")
        if n:
            _pwrite_all(self._fd, memoryview(raw), self._starts[index] + offset)
        with self._lock:
            self._got[index] += n
        return raw

    def close(self, *, fsync: bool = False) -> None:
        """Close the file; ``RuntimeError`` naming a tensor that did not get exactly its bytes."""
        try:
            for t, got in zip(self.tensors, self._got, strict=True):
                if got != t.nbytes:
                    raise RuntimeError(f"{self.path}: {t.name} got {got} bytes, expected {t.nbytes}")
            if fsync:
                os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _fallocate_fn():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _fallocate_fn()


def _preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes for a new file where the filesystem supports it natively (Linux
    ``fallocate``), which makes the writes that fill it markedly cheaper (no per-page delayed
    allocation); otherwise nothing. Not ``os.posix_fallocate``: where the filesystem lacks
    support, that one falls back to writing the file once more."""
    if _FALLOCATE is not None and size > 0:
        _FALLOCATE(fd, 0, 0, size)  # failure (unsupported, no space) surfaces, if at all, on write


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    view = view.cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)

"""Streaming safetensors I/O with bounded memory: validated headers, ranged reads, sequential writes.

The safetensors format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping
tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
data section, which follows the header) plus optional ``"__metadata__"`` (str -> str), then the
data section. ``read_header`` accepts a file only when its tensors tile the data section exactly
(no gap, no overlap, nothing missing at the end), so a truncated or corrupt file is refused
before any tensor is used. ``read_rows`` reads any row range of a tensor with ``pread`` (nothing
else of the file is touched or mapped), and ``StreamingWriter`` writes a file whose layout is
fixed up front, accepting its data strictly in order while hashing it (sha256).
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weight_sync.checksum import HashingWriter
from weight_sync.errors import UserError

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


class SafetensorsError(UserError):
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
                f"{path}: corrupt safetensors file (tensor {e.name!r} overlaps or leaves a gap)"
            )
        pos += e.nbytes
    if pos - data_start != data_len:
        raise SafetensorsError(
            f"{path}: corrupt safetensors file (data section is {data_len} bytes, tensors need "
            f"{pos - data_start}; truncated or padded)"
        )
    return entries, {str(k): str(v) for k, v in meta.items()}


class TensorReader:
    """Reads row ranges of tensors with ``pread``; thread-safe; one descriptor per file."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

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

    def read_rows(self, entry: TensorEntry, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``entry`` (along its first dimension) as a tensor of its dtype."""
        shape = entry.shape
        if not shape:
            return (
                self.read_bytes(entry.file, entry.start, entry.nbytes)
                .view(torch_dtype(entry.dtype))
                .reshape(())
            )
        r1 = shape[0] if r1 is None else r1
        row_bytes = math.prod(shape[1:]) * entry.itemsize
        raw = self.read_bytes(entry.file, entry.start + r0 * row_bytes, (r1 - r0) * row_bytes)
        return raw.view(torch_dtype(entry.dtype)).reshape((r1 - r0, *shape[1:]))

    def close(self) -> None:
        fds, self._fds = self._fds, {}
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
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


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


class StreamingWriter:
    """Writes one safetensors file whose tensors (and their order) are fixed at creation.

    Before: ``path`` does not exist. ``write(t)`` appends the next bytes of the data section
    (tensors back to back in the given order); ``close()`` checks that exactly all bytes were
    written; ``digest()`` then returns the file's ``(sha256, size)``. With ``background_hash``
    the sha256 runs on its own thread (see ``HashingWriter``), so it overlaps the writing of this
    and the next files. Memory: what the caller passes in, plus at most 64 MiB awaiting the hash.
    """

    def __init__(
        self,
        path: Path,
        tensors: list[OutTensor],
        metadata: dict[str, str] | None = None,
        *,
        background_hash: bool = False,
    ) -> None:
        self.path = Path(path)
        self.tensors = list(tensors)
        self._expected = sum(t.nbytes for t in self.tensors)
        self._out = HashingWriter(self.path, background=background_hash)
        self._out.write(encode_header(self.tensors, metadata))
        self._header_len = self._out.bytes_written
        self._written = 0

    def write(self, t: torch.Tensor) -> None:
        """Append the raw bytes of ``t`` (any dtype; made contiguous)."""
        import torch

        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if self._written + raw.numel() > self._expected:
            raise RuntimeError(f"{self.path}: more data than the header declares")
        if raw.numel():
            self._out.write(raw.numpy())
        self._written += raw.numel()

    def close(self, *, fsync: bool = False) -> None:
        try:
            if self._written != self._expected:
                raise RuntimeError(
                    f"{self.path}: wrote {self._written} data bytes, header declares {self._expected}"
                )
        finally:
            self._out.close(fsync=fsync)

    def digest(self) -> tuple[str, int]:
        """``(sha256 hex, size)`` of the closed file (waits for a background hash)."""
        return self._out.hexdigest(), self._out.bytes_written

    def abort(self) -> None:
        self._out.close()
        self._out.hexdigest()

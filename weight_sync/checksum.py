"""Content digests for weight files: xxh3-128 (the default) or sha256, named by algorithm.

- ``ALGORITHMS``: the digests a manifest may name per file; ``DEFAULT_ALGORITHM`` is what new
  manifests use. xxh3-128 (non-cryptographic) hashes at memory bandwidth, far above sha256's
  rate, so checksumming a converted version costs little next to writing it. Either detects
  corruption (a flipped byte, a truncated or swapped file); neither is used as a signature
  against a deliberate forger (xxh3 is not cryptographic).
- ``new_hasher(algorithm)``: a streaming hasher (``update(buffer)``, ``hexdigest()``).
- ``file_digest(path, algorithm)``: the hex digest of a file's bytes; ``sha256_file`` and
  ``xxh3_file`` are the two spelled out.
- ``HashingWriter``: a binary file writer that hashes every byte it writes, so a file's digest
  is known the moment it is closed without reading it back.

File readers map the file in fixed-size windows and hash straight from the page cache (no copy
into a buffer; memory stays bounded whatever the file size).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections import deque
from pathlib import Path
from typing import Protocol

import xxhash

ALGORITHMS = ("xxh3_128", "sha256")
DEFAULT_ALGORITHM = "xxh3_128"
WINDOW = 64 << 20  # bytes of a file mapped at once while hashing it


class Hasher(Protocol):
    def update(self, data, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh streaming hasher for ``algorithm``; ``ValueError`` if it is not one of ``ALGORITHMS``."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def hash_mapped(fd: int, size: int, h: Hasher) -> None:
    """Feed bytes ``[0, size)`` of the open file ``fd`` to ``h``, mapped ``WINDOW`` bytes at a time."""
    for off in range(0, size, WINDOW):
        n = min(WINDOW, size - off)
        with mmap.mmap(fd, n, offset=off, access=mmap.ACCESS_READ) as m:
            m.madvise(mmap.MADV_SEQUENTIAL)
            h.update(m)


def file_digest(path: Path, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of the file at ``path`` with ``algorithm``."""
    h = new_hasher(algorithm)
    fd = os.open(path, os.O_RDONLY)
    try:
        hash_mapped(fd, os.fstat(fd).st_size, h)
    finally:
        os.close(fd)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    return file_digest(path, "sha256")


def xxh3_file(path: Path) -> str:
    """Hex xxh3-128 of the file at ``path``."""
    return file_digest(path, "xxh3_128")


class HashingWriter:
    """Writes bytes to a new file while computing their digest (``algorithm``, default xxh3-128).

    Before: ``path`` does not exist (the file is created exclusively). After ``close()``:
    the file holds exactly the bytes written, ``bytes_written`` is its size and ``hexdigest()``
    its digest. ``fsync=True`` on close makes the contents durable before returning.

    ``background=True`` hashes on a thread of its own, so writing and hashing proceed in
    parallel (worth it for sha256, not for xxh3): ``write`` hands each buffer to the hasher,
    blocking while more than ``max_pending`` bytes wait; ``hexdigest()`` waits for the hasher.
    Buffers passed to ``write`` must not be modified until ``hexdigest()`` returns (without a
    background hasher: until ``write`` returns).
    """

    def __init__(
        self,
        path: Path,
        *,
        algorithm: str = DEFAULT_ALGORITHM,
        background: bool = False,
        max_pending: int = 64 << 20,
    ) -> None:
        self.path = Path(path)
        self.algorithm = algorithm
        self._hash = new_hasher(algorithm)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.bytes_written = 0
        self._thread: threading.Thread | None = None
        if background:
            self._queue: deque[memoryview | None] = deque()
            self._cond = threading.Condition()
            self._pending = 0
            self._max_pending = max_pending
            self._error: BaseException | None = None
            self._thread = threading.Thread(
                target=self._hash_loop, name=f"{algorithm}:{self.path.name}", daemon=True
            )
            self._thread.start()

    def _hash_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                view = self._queue.popleft()
            if view is None:
                return
            try:
                self._hash.update(view)
            except BaseException as exc:  # pragma: no cover - the hashers do not fail on bytes
                self._error = exc
            with self._cond:
                self._pending -= len(view)
                self._cond.notify_all()

    def write(self, data) -> None:
        """Append ``data`` (any contiguous buffer) to the file and the digest."""
        view = memoryview(data).cast("B")
        total = len(view)
        if self._thread is None:
            self._hash.update(view)
        done = 0
        while done < total:
            done += os.write(self._fd, view[done:])
        self.bytes_written += total
        if self._thread is not None and total:
            with self._cond:
                while self._pending and self._pending + total > self._max_pending:
                    self._cond.wait()
                self._pending += total
                self._queue.append(view)
                self._cond.notify_all()

    def hexdigest(self) -> str:
        """The digest of everything written (waits for a background hasher to finish)."""
        if self._thread is not None:
            if self._thread.is_alive():
                with self._cond:
                    self._queue.append(None)
                    self._cond.notify_all()
                self._thread.join()
            if self._error is not None:
                raise self._error
        return self._hash.hexdigest()

    def close(self, *, fsync: bool = False) -> None:
        """Close the file (the background hasher, if any, may still be running)."""
        if self._fd < 0:
            return
        try:
            if fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._thread is not None:
            self.hexdigest()  # stop the hasher thread

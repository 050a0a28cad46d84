"""Content digests for weight files: sha256 for the files of a version, xxh3-128 for cheap identity.

- ``sha256_file(path)``: the hex sha256 of a file's bytes (what manifests record per file).
- ``HashingWriter``: a binary file writer that hashes every byte it writes (sha256), so a file's
  digest is known the moment it is closed without reading it back.
- ``xxh3_file(path)``: the hex xxh3-128 of a file's bytes (about 8x faster than sha256 here);
  used where a digest only identifies content (a converter's source checksum), never where it
  must resist tampering.

All readers stream in fixed-size buffers (memory stays bounded whatever the file size) and
release the GIL while hashing, so hashing overlaps with other threads' work.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from pathlib import Path

import xxhash

BUFSIZE = 1 << 20  # small enough to stay in cache between read and hash


def _stream(path: Path, update) -> int:
    size = 0
    buf = bytearray(BUFSIZE)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return size
            update(view[:n])
            size += n


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    h = hashlib.sha256()
    _stream(Path(path), h.update)
    return h.hexdigest()


def xxh3_file(path: Path) -> str:
    """Hex xxh3-128 of the file at ``path``."""
    h = xxhash.xxh3_128()
    _stream(Path(path), h.update)
    return h.hexdigest()


class HashingWriter:
    """Writes bytes to a new file while computing their sha256.

    Before: ``path`` does not exist (the file is created exclusively). After ``close()``:
    the file holds exactly the bytes written, ``bytes_written`` is its size and ``hexdigest()``
    its sha256. ``fsync=True`` on close makes the contents durable before returning.

    ``background=True`` hashes on a thread of its own, so writing and hashing proceed in
    parallel (and hashing of one file can overlap writing the next): ``write`` hands each buffer
    to the hasher, blocking while more than ``max_pending`` bytes wait; ``hexdigest()`` waits for
    the hasher. Buffers passed to ``write`` must not be modified afterwards.
    """

    def __init__(self, path: Path, *, background: bool = False, max_pending: int = 64 << 20) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._hash = hashlib.sha256()
        self.bytes_written = 0
        self._thread: threading.Thread | None = None
        if background:
            self._queue: deque[memoryview | None] = deque()
            self._cond = threading.Condition()
            self._pending = 0
            self._max_pending = max_pending
            self._error: BaseException | None = None
            self._thread = threading.Thread(
                target=self._hash_loop, name=f"sha256:{self.path.name}", daemon=True
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
            except BaseException as exc:  # pragma: no cover - hashlib does not fail on bytes
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
        """The sha256 of everything written (waits for a background hasher to finish)."""
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

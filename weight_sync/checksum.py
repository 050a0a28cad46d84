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
from pathlib import Path

import xxhash

BUFSIZE = 8 << 20


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
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._hash = hashlib.sha256()
        self.bytes_written = 0

    def write(self, data) -> None:
        """Append ``data`` (any contiguous buffer) to the file and the digest."""
        view = memoryview(data).cast("B")
        self._hash.update(view)
        total = len(view)
        done = 0
        while done < total:
            done += os.write(self._fd, view[done:])
        self.bytes_written += total

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def close(self, *, fsync: bool = False) -> None:
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

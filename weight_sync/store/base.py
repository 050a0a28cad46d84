"""The versioned weight store port: immutable numbered versions per (run, format) and a pointer.

Layout (every adapter presents it, whatever backs it)::

    <root>/<run_id>/<format>/v{N:06d}/   files + manifest.json   (immutable once committed)
    <root>/<run_id>/<format>/CURRENT      text: the integer N the format currently serves

Publication protocol (DESIGN.md "Weight versions"): write files into a private staging
directory -> ``commit`` (fsync files, write manifest, fsync, atomically make it ``v{N:06d}``)
-> ``advance`` the pointer by compare-and-swap. Guarantees every adapter keeps, even when the
publishing process is killed at any instruction:

- the pointer only ever names a committed, complete version;
- the pointer never moves backwards (a rollback publishes a new, higher number);
- a committed version never changes: committing the same number again with other bytes is
  refused (``VersionConflict``), with the same bytes it is a no-op;
- ``verify`` recomputes every file's digest (the algorithm its manifest entry names: xxh3-128 or
  sha256) and raises ``ChecksumError`` naming the bad file.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path

from weight_sync.errors import UserError
from weight_sync.manifest import Manifest

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreError(UserError):
    """A store operation was refused; the message says why."""


class VersionConflict(StoreError):
    """The version number is already committed with other content."""


class PointerError(StoreError):
    """A pointer move was refused (backwards, to an uncommitted version, or a lost CAS race)."""


def check_name(kind: str, value: str) -> str:
    """Validate a run id or format name (one path component; letters, digits, ``._-``)."""
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise StoreError(
            f"invalid {kind} {value!r}: use letters, digits, '.', '_' or '-' (one path component)"
        )
    return value


def check_version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise StoreError(f"version must be a non-negative integer, got {version!r}")
    return version


def version_name(version: int) -> str:
    return f"v{check_version(version):06d}"


class VersionStore(ABC):
    """Port for the versioned weight store (adapters: ``LocalStore``, Modal Volume)."""

    @abstractmethod
    def version_dir(self, run_id: str, fmt: str, version: int) -> Path:
        """Where version ``version`` of ``(run_id, fmt)`` lives (whether or not committed)."""

    @abstractmethod
    def staging_dir(self, run_id: str, fmt: str, version: int) -> Path:
        """A fresh, empty, private directory to write a version into before ``commit``."""

    @abstractmethod
    def commit(self, run_id: str, fmt: str, version: int, staged: Path) -> Manifest:
        """Make the files of ``staged`` the immutable version ``version``; return its manifest.

        Before: ``staged`` holds the files (and ideally their ``manifest.json``; without one
        the files are hashed). After: every file and the manifest (``version`` set) are durable
        and ``version_dir`` names them. A staging directory of this store is moved (consumed);
        any other directory is copied and left as it is. Raises ``VersionConflict`` when the
        version is already committed with other bytes; returns the existing manifest when it
        is committed with the same bytes.
        """

    @abstractmethod
    def advance(self, run_id: str, fmt: str, version: int, *, expected: int | None | object = ...) -> None:
        """Move ``(run_id, fmt)``'s pointer to ``version`` atomically.

        Refuses (``PointerError``) a version that is not committed, a move backwards, or (when
        ``expected`` is given) a pointer that no longer holds ``expected``. Moving to the
        version it already names is a no-op.
        """

    @abstractmethod
    def read_pointer(self, run_id: str, fmt: str) -> int | None:
        """The version the pointer names, or None when nothing was published."""

    @abstractmethod
    def read_manifest(self, run_id: str, fmt: str, version: int) -> Manifest:
        """The manifest of a committed version (``StoreError`` when it is not committed)."""

    @abstractmethod
    def verify(self, run_id: str, fmt: str, version: int) -> Manifest:
        """Recompute every file's checksum; raise ``ChecksumError`` naming the first bad file."""

    @abstractmethod
    def versions(self, run_id: str, fmt: str) -> list[int]:
        """Committed version numbers of ``(run_id, fmt)``, ascending."""

    def publish(self, run_id: str, fmt: str, version: int, src_dir: Path) -> Manifest:
        """``commit`` then ``advance``: after return the pointer names ``version``."""
        manifest = self.commit(run_id, fmt, version, src_dir)
        self.advance(run_id, fmt, version)
        return manifest

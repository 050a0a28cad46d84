"""The versioned weight store port: immutable numbered versions per (run, format) and a pointer.

A version is named by a ``VersionRef`` (run, format, number) and a pointer by a ``FormatRef``
(run, format); both are validated where they are built (``weight_sync.types``), so a store
never sees a name that is not one path component or a negative number.

Layout (every adapter presents it, whatever backs it)::

    <root>/<run_id>/<format>/v{N:06d}/   files + manifest.json   (immutable once committed)
    <root>/<run_id>/<format>/CURRENT      text: the integer N the format currently serves

Publication protocol (docs/architecture.md, "2. A weight version"): write files into a private staging
directory -> ``commit`` (fsync files, write manifest, fsync, atomically make it ``v{N:06d}``)
-> ``advance`` the pointer by compare-and-swap. Guarantees every adapter keeps, even when the
publishing process is killed at any instruction:

- the pointer only ever names a committed, complete version;
- the pointer never moves backwards (a rollback publishes a new, higher number);
- a committed version never changes: committing the same number again with other bytes is
  refused (``VersionConflict``), with the same bytes it is a no-op;
- ``verify`` recomputes every file's digest (the algorithm its manifest entry names: xxh3-128 or
  sha256) and raises ``ChecksumError`` naming the bad file;
- ``delete`` removes a committed version the pointer does not name, atomically as far as any
  reader can tell: ``versions``/``read_manifest`` report it committed and complete, or not at
  all, never half removed. Files a version shares with another (rollbacks hard-link theirs)
  stay intact for the other. Which versions may go is not the store's decision
  (:mod:`weight_sync.retention`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from core.errors import UserError
from weight_sync.manifest import Manifest
from weight_sync.types import FormatRef, VersionRef


class StoreError(UserError):
    """A store operation was refused; the message says why."""


class VersionConflict(StoreError):
    """The version number is already committed with other content."""


class PointerError(StoreError):
    """A pointer move was refused (backwards, to an uncommitted version, or a lost CAS race)."""


class VersionStore(ABC):
    """Port for the versioned weight store (adapters: ``LocalStore``, Modal Volume)."""

    @abstractmethod
    def version_dir(self, ref: VersionRef) -> Path:
        """Where version ``ref`` lives (whether or not committed)."""

    @abstractmethod
    def staging_dir(self, ref: VersionRef) -> Path:
        """A fresh, empty, private directory to write version ``ref`` into before ``commit``."""

    @abstractmethod
    def commit(self, ref: VersionRef, staged: Path) -> Manifest:
        """Make the files of ``staged`` the immutable version ``ref``; return its manifest.

        Before: ``staged`` holds the files (and ideally their ``manifest.json``; without one
        the files are hashed). After: every file and the manifest (``version`` set) are durable
        and ``version_dir(ref)`` names them. A staging directory of this store is moved
        (consumed); any other directory is copied and left as it is. Raises ``VersionConflict``
        when the version is already committed with other bytes; returns the existing manifest
        when it is committed with the same bytes.
        """

    @abstractmethod
    def advance(self, ref: VersionRef, *, expected: int | None | object = ...) -> None:
        """Move the pointer of ``ref.stream`` to ``ref.version`` atomically.

        Refuses (``PointerError``) a version that is not committed, a move backwards, or (when
        ``expected`` is given) a pointer that no longer holds ``expected``. Moving to the
        version it already names is a no-op.
        """

    @abstractmethod
    def read_pointer(self, stream: FormatRef) -> int | None:
        """The version ``stream``'s pointer names, or None when nothing was published."""

    @abstractmethod
    def read_manifest(self, ref: VersionRef) -> Manifest:
        """The manifest of a committed version (``StoreError`` when it is not committed)."""

    @abstractmethod
    def verify(self, ref: VersionRef) -> Manifest:
        """Recompute every file's checksum; raise ``ChecksumError`` naming the first bad file."""

    @abstractmethod
    def versions(self, stream: FormatRef) -> list[int]:
        """Committed version numbers of ``stream``, ascending."""

    @abstractmethod
    def delete(self, ref: VersionRef) -> None:
        """Remove the committed version ``ref``.

        Refuses (``StoreError`` naming it) the version its stream's pointer names, and a version
        that is not committed. After return ``ref`` is not among ``versions`` and its bytes are
        gone, except files hard-linked into another version, which keep their content there.
        Killed at any instruction, it leaves ``ref`` either committed and complete or absent:
        the version leaves its ``v{N:06d}`` name in one atomic step before any file is removed,
        and what a killed delete left under the hidden trash directory is removed by the next
        ``delete`` of the stream (or the adapter's ``clean_trash``). Does not check whether another version's
        delta chain needs ``ref`` (:mod:`weight_sync.retention` decides what may go).
        """

    @abstractmethod
    def clean_staging(self, stream: FormatRef, *, older_than_s: float = 3600.0) -> list[Path]:
        """Remove ``stream``'s staging directories untouched for ``older_than_s`` (left by killed
        publishers; a publisher's own failure removes its own). Never touches committed versions
        or the pointer. Returns what was removed."""

    def publish(self, ref: VersionRef, src_dir: Path) -> Manifest:
        """``commit`` then ``advance``: after return the pointer of ``ref.stream`` names ``ref``."""
        manifest = self.commit(ref, src_dir)
        self.advance(ref)
        return manifest

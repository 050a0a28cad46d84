"""``LocalStore``: the versioned weight store on a local (POSIX) directory.

Mechanics behind the port's guarantees (see ``weight_sync.store.base``):

- Staging directories live in ``<root>/<run>/<format>/.staging/`` (same filesystem as the
  versions, so ``rename`` is atomic; hidden, so never taken for a version).
- ``commit``: fsync every file -> write ``manifest.json`` (tmp + fsync + ``os.replace``) -> fsync
  the staging directory -> ``rename`` it to ``v{N:06d}`` (atomic; fails if the name exists) ->
  fsync the format directory. A version directory therefore exists only complete, with its
  manifest, and durable.
- ``advance``: under an exclusive ``flock`` of ``<format>/.lock`` (so concurrent advancers
  serialize and the compare-and-swap is real), check the move, write ``CURRENT`` as a tmp file,
  fsync, ``os.replace`` it over ``CURRENT``, fsync the directory. Readers never take the lock:
  they see the old or the new pointer, never a partial one.

- ``delete``: under the same ``flock`` (so the pointer cannot move to the version meanwhile),
  refuse the pointer's version, then ``rename`` ``v{N:06d}`` into the hidden
  ``<format>/.trash/`` (atomic: from then on no reader finds the version, and before it every
  reader finds it whole) and fsync the format directory; then, without the lock, remove the
  trashed tree and whatever a killed delete left in ``.trash/``. Removing a directory entry
  never touches an inode another version links: a rollback's hard-linked files stay whole there.

``on_step(name)`` (optional) is called after each step -- ``copied``, ``files_synced``,
``manifest_written``, ``committed``, ``pointer_tmp_written``, ``pointer_replaced``,
``advanced``; ``trashed``, ``deleted`` -- so fault tests can stop a real process at each one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from weight_sync.checksum import HashingWriter
from weight_sync.manifest import (
    MANIFEST_NAME,
    ChecksumError,
    Manifest,
    ManifestError,
    build_manifest,
    check_file_set,
    fsync_dir,
    list_files,
    verify_dir,
)
from weight_sync.store.base import PointerError, StoreError, VersionConflict, VersionStore
from weight_sync.types import FormatRef, InvalidVersion, VersionRef, parse_version

POINTER_NAME = "CURRENT"
STAGING = ".staging"
TRASH = ".trash"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(VersionStore):
    """A ``VersionStore`` rooted at a local directory (created on first write)."""

    def __init__(self, root: Path, *, on_step: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self._on_step = on_step or (lambda _step: None)

    # --- layout -------------------------------------------------------------------------------

    def format_dir(self, stream: FormatRef) -> Path:
        return self.root / stream.run_id / stream.format

    def version_dir(self, ref: VersionRef) -> Path:
        return self.format_dir(ref.stream) / ref.name

    def pointer_path(self, stream: FormatRef) -> Path:
        return self.format_dir(stream) / POINTER_NAME

    def staging_dir(self, ref: VersionRef) -> Path:
        base = self.format_dir(ref.stream) / STAGING
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{ref.name}-{os.getpid()}-{secrets.token_hex(6)}"
        path.mkdir(mode=0o700)
        return path

    def _is_staging(self, stream: FormatRef, path: Path) -> bool:
        base = (self.format_dir(stream) / STAGING).resolve()
        return path.resolve().parent == base

    # --- commit -------------------------------------------------------------------------------

    def commit(self, ref: VersionRef, staged: Path) -> Manifest:
        staged = Path(staged)
        if not staged.is_dir():
            raise StoreError(f"cannot commit {staged}: not a directory")
        target = self.version_dir(ref)

        manifest = self._staged_manifest(staged, ref.format).with_version(ref.version)
        if target.exists():
            return self._same_or_conflict(ref, manifest, staged)

        if not self._is_staging(ref.stream, staged):
            staged = self._copy_in(ref, staged, manifest)
            self._on_step("copied")

        for rel in manifest.files:
            _fsync_file(staged / rel)
        self._on_step("files_synced")
        manifest.write(staged, fsync=True)  # also fsyncs the staging directory
        self._on_step("manifest_written")
        try:
            os.rename(staged, target)
        except OSError:
            if target.exists():  # a concurrent committer won the race
                return self._same_or_conflict(ref, manifest, staged)
            raise
        fsync_dir(target.parent)
        self._on_step("committed")
        return manifest

    def _staged_manifest(self, staged: Path, fmt: str) -> Manifest:
        if (staged / MANIFEST_NAME).exists():
            manifest = Manifest.read(staged)
            if manifest.format != fmt:
                raise StoreError(f"{staged} holds format {manifest.format!r}, not {fmt!r}")
            check_file_set(staged, manifest)
            return manifest
        return build_manifest(staged, format=fmt)

    def _same_or_conflict(self, ref: VersionRef, manifest: Manifest, staged: Path) -> Manifest:
        try:
            existing = Manifest.read(self.version_dir(ref))
        except ManifestError as exc:
            raise VersionConflict(f"{ref} exists but is unreadable: {exc}") from None
        if not existing.same_content(manifest):
            raise VersionConflict(
                f"{ref} is already committed with other content "
                "(versions are immutable; publish a new number)"
            )
        if self._is_staging(ref.stream, staged):
            shutil.rmtree(staged, ignore_errors=True)
        return existing

    def _copy_in(self, ref: VersionRef, src: Path, manifest: Manifest) -> Path:
        """Copy ``src``'s listed files into a fresh staging directory, checking each digest."""
        dst = self.staging_dir(ref)
        try:
            for rel, entry in manifest.files.items():
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                with open(src / rel, "rb") as f, HashingWriter(dst / rel, algorithm=entry.algorithm) as out:
                    while chunk := f.read(8 << 20):
                        out.write(chunk)
                if out.hexdigest() != entry.digest or out.bytes_written != entry.bytes:
                    raise ChecksumError(src / rel, "content does not match its manifest")
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)
            raise
        return dst

    # --- pointer ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, stream: FormatRef) -> Iterator[None]:
        d = self.format_dir(stream)
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def advance(self, ref: VersionRef, *, expected: int | None | object = ...) -> None:
        stream, version = ref.stream, ref.version
        with self._locked(stream):
            current = self.read_pointer(stream)
            if expected is not ... and current != expected:
                raise PointerError(f"{stream} pointer is {current}, not the expected {expected}")
            if current == version:
                return
            if current is not None and version < current:
                raise PointerError(
                    f"{stream} pointer is at {current}; it never moves backwards to {version} "
                    "(roll back by publishing a new number)"
                )
            target = self.version_dir(ref)
            try:
                check_file_set(target, Manifest.read(target))
            except (ManifestError, ChecksumError) as exc:
                raise PointerError(f"{ref} is not committed: {exc}") from None
            d = self.format_dir(stream)
            tmp = d / f".{POINTER_NAME}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, f"{version}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self._on_step("pointer_tmp_written")
            os.replace(tmp, d / POINTER_NAME)
            self._on_step("pointer_replaced")
            fsync_dir(d)
        self._on_step("advanced")

    def read_pointer(self, stream: FormatRef) -> int | None:
        path = self.pointer_path(stream)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            return parse_version(text)
        except InvalidVersion:
            raise StoreError(f"{path} is corrupt (holds {text[:40]!r}, not a version number)") from None

    # --- reading ------------------------------------------------------------------------------

    def _committed_dir(self, ref: VersionRef) -> Path:
        """The directory of committed ``ref`` (its manifest there, as ``versions`` counts it: a
        volume's view may keep a deleted version's emptied directory), else ``StoreError``."""
        d = self.version_dir(ref)
        if not (d / MANIFEST_NAME).is_file():
            raise StoreError(f"{ref.stream} has no committed {ref.name}")
        return d

    def read_manifest(self, ref: VersionRef) -> Manifest:
        return Manifest.read(self._committed_dir(ref))

    def verify(self, ref: VersionRef) -> Manifest:
        return verify_dir(self._committed_dir(ref))

    def versions(self, stream: FormatRef) -> list[int]:
        d = self.format_dir(stream)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            m = _VERSION_DIR.match(name)
            if m and (d / name / MANIFEST_NAME).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def runs(self) -> list[str]:
        """The run ids the store has a directory for (``ROOT/RUN/FORMAT/...``), sorted; none
        when the root does not exist."""
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:
            return []

    # --- housekeeping -------------------------------------------------------------------------

    def clean_staging(self, stream: FormatRef, *, older_than_s: float = 3600.0) -> list[Path]:
        """Remove staging directories (left by killed publishers) untouched for ``older_than_s``.

        Never touches committed versions or the pointer. Returns what was removed.
        """
        base = self.format_dir(stream) / STAGING
        removed = []
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            for p in base.iterdir():
                if now - p.stat().st_mtime >= older_than_s:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
        return removed

    def clean_trash(self, stream: FormatRef) -> list[Path]:
        """Remove what deletes left in ``<format>/.trash/`` (a delete killed after its rename, or
        one running now: removing a tree twice at once is harmless). Returns what was there."""
        base = self.format_dir(stream) / TRASH
        try:
            left = sorted(base.iterdir())
        except FileNotFoundError:
            return []
        for p in left:
            shutil.rmtree(p, ignore_errors=True)
        return left

    # --- deleting -----------------------------------------------------------------------------

    def delete(self, ref: VersionRef) -> None:
        trashed = self.trash(ref)
        self.clean_trash(ref.stream)
        if trashed.exists():
            raise StoreError(f"{ref} left its name but {trashed} could not be removed")
        self._on_step("deleted")

    def trash(self, ref: VersionRef) -> Path:
        """``delete``'s first half: under the format's lock, refuse the pointer's version or one not
        committed, then atomically rename ``v{N:06d}`` into ``.trash/`` (durable); returns where it
        went. ``ref`` is no longer committed after return; its files are still there."""
        stream = ref.stream
        with self._locked(stream):
            if self.read_pointer(stream) == ref.version:
                raise StoreError(f"{ref} is the version the {stream} pointer names; it cannot be deleted")
            target = self.version_dir(ref)
            if not (target / MANIFEST_NAME).is_file():
                raise StoreError(f"{stream} has no committed {ref.name} to delete")
            base = self.format_dir(stream) / TRASH
            base.mkdir(exist_ok=True)
            dest = base / f"{ref.name}-{os.getpid()}-{secrets.token_hex(6)}"
            os.rename(target, dest)
            fsync_dir(target.parent)
        self._on_step("trashed")
        return dest

    def files(self, ref: VersionRef) -> list[str]:
        """Relative paths of a version's files (manifest excluded)."""
        return list_files(self.version_dir(ref))

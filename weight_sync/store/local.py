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

``on_step(name)`` (optional) is called after each step -- ``copied``, ``files_synced``,
``manifest_written``, ``committed``, ``pointer_tmp_written``, ``pointer_replaced``,
``advanced`` -- so fault tests can stop a real publisher process at each one.
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
from weight_sync.store.base import (
    PointerError,
    StoreError,
    VersionConflict,
    VersionStore,
    check_name,
    check_version,
    version_name,
)

POINTER_NAME = "CURRENT"
STAGING = ".staging"
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

    def format_dir(self, run_id: str, fmt: str) -> Path:
        return self.root / check_name("run id", run_id) / check_name("format", fmt)

    def version_dir(self, run_id: str, fmt: str, version: int) -> Path:
        return self.format_dir(run_id, fmt) / version_name(version)

    def pointer_path(self, run_id: str, fmt: str) -> Path:
        return self.format_dir(run_id, fmt) / POINTER_NAME

    def staging_dir(self, run_id: str, fmt: str, version: int) -> Path:
        base = self.format_dir(run_id, fmt) / STAGING
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{version_name(version)}-{os.getpid()}-{secrets.token_hex(6)}"
        path.mkdir(mode=0o700)
        return path

    def _is_staging(self, run_id: str, fmt: str, path: Path) -> bool:
        base = (self.format_dir(run_id, fmt) / STAGING).resolve()
        return path.resolve().parent == base

    # --- commit -------------------------------------------------------------------------------

    def commit(self, run_id: str, fmt: str, version: int, staged: Path) -> Manifest:
        check_version(version)
        staged = Path(staged)
        if not staged.is_dir():
            raise StoreError(f"cannot commit {staged}: not a directory")
        target = self.version_dir(run_id, fmt, version)

        manifest = self._staged_manifest(staged, fmt).with_version(version)
        if target.exists():
            return self._same_or_conflict(run_id, fmt, version, manifest, staged)

        if not self._is_staging(run_id, fmt, staged):
            staged = self._copy_in(run_id, fmt, version, staged, manifest)
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
                return self._same_or_conflict(run_id, fmt, version, manifest, staged)
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

    def _same_or_conflict(
        self, run_id: str, fmt: str, version: int, manifest: Manifest, staged: Path
    ) -> Manifest:
        try:
            existing = Manifest.read(self.version_dir(run_id, fmt, version))
        except ManifestError as exc:
            raise VersionConflict(
                f"{run_id}/{fmt} {version_name(version)} exists but is unreadable: {exc}"
            ) from None
        if not existing.same_content(manifest):
            raise VersionConflict(
                f"{run_id}/{fmt} {version_name(version)} is already committed with other content "
                "(versions are immutable; publish a new number)"
            )
        if self._is_staging(run_id, fmt, staged):
            shutil.rmtree(staged, ignore_errors=True)
        return existing

    def _copy_in(self, run_id: str, fmt: str, version: int, src: Path, manifest: Manifest) -> Path:
        """Copy ``src``'s listed files into a fresh staging directory, checking each digest."""
        dst = self.staging_dir(run_id, fmt, version)
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
    def _locked(self, run_id: str, fmt: str) -> Iterator[None]:
        d = self.format_dir(run_id, fmt)
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def advance(self, run_id: str, fmt: str, version: int, *, expected: int | None | object = ...) -> None:
        check_version(version)
        with self._locked(run_id, fmt):
            current = self.read_pointer(run_id, fmt)
            if expected is not ... and current != expected:
                raise PointerError(f"{run_id}/{fmt} pointer is {current}, not the expected {expected}")
            if current == version:
                return
            if current is not None and version < current:
                raise PointerError(
                    f"{run_id}/{fmt} pointer is at {current}; it never moves backwards to {version} "
                    "(roll back by publishing a new number)"
                )
            target = self.version_dir(run_id, fmt, version)
            try:
                check_file_set(target, Manifest.read(target))
            except (ManifestError, ChecksumError) as exc:
                raise PointerError(
                    f"{run_id}/{fmt} {version_name(version)} is not committed: {exc}"
                ) from None
            d = self.format_dir(run_id, fmt)
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

    def read_pointer(self, run_id: str, fmt: str) -> int | None:
        path = self.pointer_path(run_id, fmt)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            return check_version(int(text.strip()))
        except (ValueError, StoreError):
            raise StoreError(f"{path} is corrupt (holds {text[:40]!r}, not a version number)") from None

    # --- reading ------------------------------------------------------------------------------

    def read_manifest(self, run_id: str, fmt: str, version: int) -> Manifest:
        d = self.version_dir(run_id, fmt, version)
        if not d.is_dir():
            raise StoreError(f"{run_id}/{fmt} has no committed {version_name(version)}")
        return Manifest.read(d)

    def verify(self, run_id: str, fmt: str, version: int) -> Manifest:
        d = self.version_dir(run_id, fmt, version)
        if not d.is_dir():
            raise StoreError(f"{run_id}/{fmt} has no committed {version_name(version)}")
        return verify_dir(d)

    def versions(self, run_id: str, fmt: str) -> list[int]:
        d = self.format_dir(run_id, fmt)
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

    # --- housekeeping -------------------------------------------------------------------------

    def clean_staging(self, run_id: str, fmt: str, *, older_than_s: float = 3600.0) -> list[Path]:
        """Remove staging directories (left by killed publishers) untouched for ``older_than_s``.

        Never touches committed versions or the pointer. Returns what was removed.
        """
        base = self.format_dir(run_id, fmt) / STAGING
        removed = []
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            for p in base.iterdir():
                if now - p.stat().st_mtime >= older_than_s:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
        return removed

    def files(self, run_id: str, fmt: str, version: int) -> list[str]:
        """Relative paths of a version's files (manifest excluded)."""
        return list_files(self.version_dir(run_id, fmt, version))

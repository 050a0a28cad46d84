"""Stage a committed version for a replica: bring it next to the engine and prove its bytes.

docs/architecture.md, "2. A weight version": a replica stages (reads and verifies checksums) while it keeps
serving, and only then activates. Two modes:

- ``copy``: every file is copied from the store into ``<staging_root>/v{N:06d}`` and hashed in
  the same pass (one read of the store); a file whose digest or size differs from the
  manifest raises :class:`~weight_sync.manifest.ChecksumError` naming the file in the store.
  The copy is written under ``v{N:06d}.partial`` and renamed only when every file verified,
  so a directory without the suffix is always complete (a staging interrupted by a kill leaves
  only a ``.partial`` that :func:`clean_staging` removes).
- ``inplace``: the store's own directory is verified where it lies and handed to the engine
  (no copy; for a store on local disk). A delta version is always materialized (hard links)
  into the staging root first, since the engine needs one full directory.

Staging can be interrupted between chunks by ``should_abort`` (a newer version appeared):
it then raises :class:`StageAborted` and leaves nothing but a ``.partial`` directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from weight_sync.checksum import new_hasher
from weight_sync.delta import version_files
from weight_sync.manifest import MANIFEST_NAME, ChecksumError, FileEntry, Manifest, check_digest
from weight_sync.store.base import VersionStore
from weight_sync.types import VersionRef, version_name

StageMode = Literal["copy", "inplace"]
STAGE_MODES: tuple[str, ...] = ("copy", "inplace")
_CHUNK = 8 << 20
_MANIFEST = MANIFEST_NAME


class StageAborted(Exception):
    """Staging stopped early because ``should_abort`` said so (nothing usable was left)."""


@dataclass(frozen=True)
class StagedVersion:
    """A version whose every file verified against its manifest, at ``path``."""

    version: int
    path: Path
    manifest: Manifest
    seconds: float
    bytes: int
    copied: bool


def stage_version(
    store: VersionStore,
    ref: VersionRef,
    staging_root: Path,
    *,
    mode: StageMode = "copy",
    should_abort: Callable[[], bool] = lambda: False,
    rate_bytes_per_s: float | None = None,
    progress: Callable[[int], None] = lambda _n: None,
) -> StagedVersion:
    """Stage version ``ref`` and verify every file.

    Before: ``ref`` is committed in ``store``. After: the returned ``path`` holds the full
    version and every file matched the manifest's size and digest. Raises ``ChecksumError``
    naming the bad file (nothing staged is left behind for that version), ``StageAborted``
    when ``should_abort()`` turned true. ``rate_bytes_per_s`` caps the copy rate (to leave
    the disk or network to serving); ``progress(bytes_so_far)`` is called per chunk.
    """
    t0 = time.perf_counter()
    version = ref.version
    manifest = store.read_manifest(ref)
    if mode == "inplace" and manifest.kind != "delta":
        src = Path(store.version_dir(ref))
        total = 0
        for rel, entry in sorted(manifest.files.items()):
            if should_abort():
                raise StageAborted(f"version {version} superseded while staging")
            _hash_file(src / rel, entry, progress_base=total, progress=progress, rate=rate_bytes_per_s)
            total += entry.bytes
        return StagedVersion(version, src, manifest, time.perf_counter() - t0, total, copied=False)

    staging_root.mkdir(parents=True, exist_ok=True)
    final = staging_root / ref.name
    if final.is_dir():
        # Staged before (e.g. by a previous run of this sidecar): verify again, cheaply in place.
        try:
            total = 0
            for rel, entry in sorted(manifest.files.items()):
                if should_abort():
                    raise StageAborted(f"version {version} superseded while staging")
                _hash_file(final / rel, entry, progress_base=total, progress=progress, rate=None)
                total += entry.bytes
            return StagedVersion(version, final, manifest, time.perf_counter() - t0, total, copied=True)
        except ChecksumError:
            shutil.rmtree(final, ignore_errors=True)
    partial = staging_root / f"{ref.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    total = 0
    try:
        for rel, src_dir, entry in _layers(store, ref):
            if should_abort():
                raise StageAborted(f"version {version} superseded while staging")
            dst = partial / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                dst.unlink()
            if mode == "inplace":
                # Delta in place: hard links of the store's files, verified where they lie.
                _link_or_copy(src_dir / rel, dst)
                _hash_file(
                    dst,
                    entry,
                    progress_base=total,
                    progress=progress,
                    rate=rate_bytes_per_s,
                    name=src_dir / rel,
                )
            else:
                _copy_hash(src_dir / rel, dst, entry, total, progress, rate_bytes_per_s, should_abort)
            total += entry.bytes
        # The version's own manifest goes last, so the staged dir is self-describing.
        shutil.copyfile(Path(store.version_dir(ref)) / _MANIFEST, partial / _MANIFEST)
        _fsync_dir(partial)
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return StagedVersion(version, final, manifest, time.perf_counter() - t0, total, copied=True)


def loadable_dir(store: VersionStore, ref: VersionRef, staging_root: Path) -> Path:
    """A directory an engine (or a reader of its config and shards) loads version ``ref`` from:
    the version's own directory for a full version, read where it is; for a delta version, whose
    directory holds only what changed, its whole content staged under ``staging_root`` (hard links,
    every file checked: :func:`stage_version` in place)."""
    if store.read_manifest(ref).kind != "delta":
        return Path(store.version_dir(ref))
    return stage_version(store, ref, staging_root, mode="inplace").path


def clean_staging(staging_root: Path, keep: set[int]) -> list[Path]:
    """Remove every staged or partial version under ``staging_root`` except those in ``keep``."""
    removed = []
    if not staging_root.is_dir():
        return removed
    keep_names = {version_name(v) for v in keep}
    for p in staging_root.iterdir():
        if p.name in keep_names:
            continue
        if p.name.startswith("v") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _layers(store: VersionStore, ref: VersionRef):
    """(relpath, source dir, entry) for every file of the full version, newest layer winning."""
    files = version_files(store, ref)
    for rel in sorted(files):
        if rel != _MANIFEST:
            src, entry = files[rel]
            yield rel, src, entry


def _check(path: Path, n: int, digest: str, entry: FileEntry) -> None:
    if n != entry.bytes:
        raise ChecksumError(path, f"size {n} != manifest's {entry.bytes}")
    check_digest(path, digest, entry)


def _chunk(rate: float | None) -> int:
    """Read size: large, or about a tenth of a second's worth when the rate is capped."""
    return _CHUNK if not rate else max(64 << 10, min(_CHUNK, int(rate / 10)))


def _throttle(done: int, t0: float, rate: float | None) -> None:
    if rate:
        ahead = done / rate - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)


def _hash_file(
    path: Path, entry: FileEntry, *, progress_base: int, progress, rate, name: Path | None = None
) -> None:
    hasher = new_hasher(entry.algorithm)
    n = 0
    t0 = time.perf_counter()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_chunk(rate)):
                hasher.update(chunk)
                n += len(chunk)
                progress(progress_base + n)
                _throttle(n, t0, rate)
    except FileNotFoundError:
        raise ChecksumError(name or path, "missing (listed in the manifest)") from None
    _check(name or path, n, hasher.hexdigest(), entry)


def _copy_hash(src: Path, dst: Path, entry: FileEntry, base: int, progress, rate, should_abort) -> None:
    hasher = new_hasher(entry.algorithm)
    n = 0
    t0 = time.perf_counter()
    try:
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(_chunk(rate)):
                hasher.update(chunk)
                fo.write(chunk)
                n += len(chunk)
                progress(base + n)
                _throttle(n, t0, rate)
                if should_abort():
                    raise StageAborted("superseded while staging")
            fo.flush()
            os.fsync(fo.fileno())
    except FileNotFoundError:
        raise ChecksumError(src, "missing (listed in the manifest)") from None
    _check(src, n, hasher.hexdigest(), entry)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

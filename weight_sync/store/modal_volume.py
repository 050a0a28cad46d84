"""``ModalVolumeStore``: the versioned weight store on a Modal Volume mounted at a path.

The layout and the file mechanics are :class:`~weight_sync.store.local.LocalStore`'s, on the
mount; what a Volume adds are its visibility rules, read from the installed client
(``modal/volume.py``, modal 1.6.4, class ``_Volume``):

- ``commit()``: "Commit changes to a mounted volume ... the changes made are now persisted in
  durable storage and available to other containers accessing the volume". Nothing another
  container sees changes before it; after the commit RPC the client reloads the volume
  (``if not resp.skip_reload: await self._do_reload(...)``), so a commit is refused like a
  reload while a file of the volume is open.
- ``reload()``: "Make latest committed state of volume available in the running container ...
  Reloading will fail if there are open files for the volume" (a ``RuntimeError``; the
  container's working directory inside the volume counts as open, ``_open_files_error_annotation``).
  "Any uncommitted changes ... may implicitly be committed when reloading": this adapter never
  relies on either outcome, it commits every change it makes before the next reload.
- There is no lock across containers ("last write wins"; "distributed file locking [is not]
  supported").

How the port's guarantees (:mod:`weight_sync.store.base`) hold on that:

- ``staging_dir`` is on the container's own disk (``scratch``), never on the volume, so
  conversions writing their files leave no file of the volume open while another format
  commits, and nothing half-written is ever part of a commit.
- ``commit``: reload (to compare with what other containers committed) -> copy the staged files
  into the volume, checking each digest, fsync, manifest, rename to ``v{N:06d}`` (LocalStore's
  steps) -> ``volume.commit()`` (step ``volume_committed``). The version's files are durable
  and visible to every container that reloads before the pointer can name them.
- ``advance``: reload -> LocalStore's compare-and-swap of ``CURRENT`` in this container's view
  -> ``volume.commit()`` (step ``pointer_committed``). So the pointer is written and committed
  after the version's files were committed, and a reader that sees the pointer after a reload
  sees the version complete.
- ``delete``: reload -> LocalStore's check and atomic rename of ``v{N:06d}`` into the hidden
  ``.trash/`` (step ``trashed``) -> ``volume.commit()`` (step ``trash_committed``): other
  containers see the version whole until this commit and absent after it -> remove the
  trashed tree and any a killed delete left -> ``volume.commit()`` (step ``volume_committed``).
  A mounted volume is changed with ordinary file operations and then committed (modal 1.6.4
  ``modal/volume.py`` line 1192, ``_Volume.copy_files``: "if the volume is already mounted on
  the Modal function, you should use normal filesystem operations like ``os.rename()`` and then
  ``commit()`` the volume"; line 894, ``commit``: "the changes made are now persisted in durable
  storage"); mounts allow background commits (line 480, ``_volume_to_mount_proto``:
  ``allow_background_commits=True``), so a container killed between the steps may have
  committed any prefix of them, each of which leaves the version whole or absent.
  A container still reading the version (its view is the one of its last reload, and it cannot
  reload with a file open) keeps its files until it reloads.
- ``read_pointer``: reloads first, unless this process holds a file of the volume open or
  mapped (a staging copy in progress, when Modal would refuse the reload): then it reads the view of the
  last reload, which names a committed version (maybe not the newest); the next read after the
  files are closed sees the newest. A reload refused for any other reason is a ``StoreError``.
- ``read_manifest``, ``verify``, ``versions`` and ``version_dir`` read this container's current
  view (a caller that needs the newest calls ``read_pointer`` first).

A file of the volume held open by another process of the container makes ``commit`` and
``advance`` fail with ``StoreError`` (Modal refuses the reload): a publisher converting a
checkpoint that lies on the volume in worker processes while it commits another format must
convert from a copy on its own disk.

Every reload-commit sequence of this adapter, and every read of the volume's small files
(``read_pointer`` with its reload, ``read_manifest``, ``versions``), holds one lock per container:
a thread lock and an ``flock`` on ``<scratch>/.volume.lock`` (the container's processes share
``scratch``), so one process's reload never meets another's pointer, manifest or directory held
open by the store itself. ``verify`` and the readers of a version's weight files (a replica's
staging copy, an engine's mappings) run without it: they take long, and what they hold open
makes another process's reload fail, as above. Across containers
there is no such lock: pointer moves and commits of the same version must come from one writer
at a time (the router runs one publish at a time); readers may be anywhere.

``on_step(name)`` receives LocalStore's steps and ``volume_committed`` / ``pointer_committed`` /
``trash_committed``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from weight_sync.manifest import Manifest
from weight_sync.store.base import StoreError, VersionStore
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef, VersionRef

LOCK_NAME = ".volume.lock"
# ``modal.Volume.from_name(name, version=VOLUME_FS_VERSION)``: the VolumeFS backend the fleet's
# volume is created with (``_Volume._get_version_proto`` takes 1 or 2; set, it "must match an
# existing Volume").
VOLUME_FS_VERSION = 2


@runtime_checkable
class VolumeHandle(Protocol):
    """What the store needs of a mounted volume: ``modal.Volume``'s ``commit`` and ``reload``."""

    def commit(self) -> None: ...

    def reload(self) -> None: ...


def open_path_under(mount: Path) -> str | None:
    """A path under ``mount`` this process holds open, has memory-mapped or has as its working
    directory, or None (also None where there is no ``/proc``)."""
    top = os.path.realpath(mount)
    prefix = top + "/"
    candidates = ["/proc/self/cwd"]
    with contextlib.suppress(OSError):
        candidates += [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    for link in candidates:
        try:
            target = os.readlink(link)
        except OSError:
            continue
        if target == top or target.startswith(prefix):
            return target
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read()
    except OSError:
        return None
    at = maps.find(b" " + prefix.encode())
    if at < 0:
        return None
    end = maps.find(b"\n", at)
    return maps[at + 1 : end if end >= 0 else None].decode(errors="replace").removesuffix(" (deleted)")


class ModalVolumeStore(VersionStore):
    """A ``VersionStore`` on ``volume`` mounted at ``mount`` (see the module docstring).

    ``scratch`` is a directory on the container's own disk for staging directories and the
    container's lock; it must not lie under ``mount`` (``StoreError`` otherwise).
    """

    def __init__(
        self,
        volume: VolumeHandle,
        mount: Path,
        *,
        scratch: Path,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.volume = volume
        self.mount = Path(mount)
        self.scratch = Path(scratch)
        real_mount, real_scratch = Path(os.path.realpath(self.mount)), Path(os.path.realpath(self.scratch))
        if real_scratch == real_mount or real_mount in real_scratch.parents:
            raise StoreError(f"scratch {self.scratch} lies on the volume mounted at {self.mount}")
        self._on_step = on_step or (lambda _step: None)
        self._files = LocalStore(self.mount, on_step=self._on_step)
        self._staging = LocalStore(self.scratch / "staging")
        self._thread_lock = threading.RLock()

    # --- the container's lock and the volume's two operations ----------------------------------

    @contextlib.contextmanager
    def _container_lock(self) -> Iterator[None]:
        with self._thread_lock:
            self.scratch.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.scratch / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _reload(self) -> None:
        try:
            self.volume.reload()
        except RuntimeError as exc:
            raise StoreError(f"reloading the volume at {self.mount} failed: {exc}") from None

    def _commit(self, step: str | None) -> None:
        try:
            self.volume.commit()
        except RuntimeError as exc:
            raise StoreError(f"committing the volume at {self.mount} failed: {exc}") from None
        if step is not None:
            self._on_step(step)

    def refresh(self) -> bool:
        """Reload the volume unless a file of it is open in this process; whether it reloaded.

        After a True: this container sees every commit made before the call. ``StoreError``
        when the volume refused the reload for another reason.
        """
        with self._container_lock():
            return self._refresh()

    def _refresh(self) -> bool:
        """:meth:`refresh`, the container's lock held."""
        if open_path_under(self.mount) is not None:
            return False
        try:
            self.volume.reload()
        except RuntimeError as exc:
            if open_path_under(self.mount) is not None:  # a file was opened meanwhile
                return False
            raise StoreError(f"reloading the volume at {self.mount} failed: {exc}") from None
        return True

    # --- layout -------------------------------------------------------------------------------

    def version_dir(self, ref: VersionRef) -> Path:
        return self._files.version_dir(ref)

    def staging_dir(self, ref: VersionRef) -> Path:
        return self._staging.staging_dir(ref)

    # --- writing ------------------------------------------------------------------------------

    def commit(self, ref: VersionRef, staged: Path) -> Manifest:
        staged = Path(staged)
        own = staged.is_dir() and staged.resolve().is_relative_to((self.scratch / "staging").resolve())
        with self._container_lock():
            self._reload()
            manifest = self._files.commit(ref, staged)
            self._commit("volume_committed")
        if own:
            shutil.rmtree(staged, ignore_errors=True)
        return manifest

    def advance(self, ref: VersionRef, *, expected: int | None | object = ...) -> None:
        with self._container_lock():
            self._reload()
            moved = False
            try:
                before = self._files.read_pointer(ref.stream)
                self._files.advance(ref, expected=expected)
                moved = before != ref.version
            finally:
                # Also after a refused move: the lock file LocalStore created is committed, so
                # this container never holds uncommitted changes.
                self._commit("pointer_committed" if moved else None)

    def delete(self, ref: VersionRef) -> None:
        with self._container_lock():
            self._reload()
            trashed = None
            try:
                trashed = self._files.trash(ref)
            finally:
                # Also after a refusal: the lock file LocalStore may have created is committed.
                self._commit(None if trashed is None else "trash_committed")
            try:
                self._files.clean_trash(ref.stream)
            finally:
                self._commit("volume_committed")
            if trashed.exists():
                raise StoreError(f"{ref} left its name but {trashed} could not be removed")

    def clean_trash(self, stream: FormatRef) -> list[Path]:
        """Remove what deletes left in the stream's ``.trash/`` and commit the volume."""
        with self._container_lock():
            self._reload()
            try:
                return self._files.clean_trash(stream)
            finally:
                self._commit(None)

    # --- reading ------------------------------------------------------------------------------

    # The store's own reads of the volume's small files hold the container's lock, so no reload
    # of another process of the container meets one of them open (Modal would refuse it).

    def read_pointer(self, stream: FormatRef) -> int | None:
        with self._container_lock():
            self._refresh()
            return self._files.read_pointer(stream)

    def read_manifest(self, ref: VersionRef) -> Manifest:
        with self._container_lock():
            return self._files.read_manifest(ref)

    def verify(self, ref: VersionRef) -> Manifest:
        return self._files.verify(ref)

    def versions(self, stream: FormatRef) -> list[int]:
        with self._container_lock():
            return self._files.versions(stream)

    def clean_staging(self, stream: FormatRef, *, older_than_s: float = 3600.0) -> list[Path]:
        """Remove this container's staging directories untouched for ``older_than_s``."""
        return self._staging.clean_staging(stream, older_than_s=older_than_s)

"""The versioned weight store: the port (:mod:`weight_sync.store.base`), its adapters, and the
factory that picks one."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from weight_sync.store.base import VersionStore
from weight_sync.store.local import LocalStore
from weight_sync.store.modal_volume import VOLUME_FS_VERSION, ModalVolumeStore


def open_store(root: Path, *, volume: str | None = None, scratch: Path | None = None) -> VersionStore:
    """The store at ``root``: a :class:`LocalStore` when ``volume`` is None, else a
    :class:`ModalVolumeStore` on the Modal Volume named ``volume``, mounted at ``root`` in this
    container (``scratch`` on the container's own disk, default ``<tmp>/mixfleet-volume-<name>``,
    shared by the container's processes). Looking the volume up contacts nothing until its first
    ``reload``/``commit`` (``modal.Volume.from_name`` hydrates lazily)."""
    if volume is None:
        return LocalStore(Path(root))
    import modal

    handle = modal.Volume.from_name(volume, version=VOLUME_FS_VERSION)
    scratch = (
        Path(scratch) if scratch is not None else Path(tempfile.gettempdir()) / f"mixfleet-volume-{volume}"
    )
    return ModalVolumeStore(handle, Path(root), scratch=scratch)


@dataclass(frozen=True)
class StoreLocation:
    """Where a store is, so that each process that needs it opens its own handle: a directory
    (``volume`` None), or the Modal Volume named ``volume`` mounted at ``root`` (``scratch``: see
    :func:`open_store`)."""

    root: Path
    volume: str | None = None
    scratch: Path | None = None

    def open(self) -> VersionStore:
        return open_store(self.root, volume=self.volume, scratch=self.scratch)

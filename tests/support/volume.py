"""A stand-in for a Modal Volume that enforces Modal's rules, for the Volume store's tests.

One :class:`StandInVolume` is one container's handle on one volume. Its state is all on disk,
so several processes can be one container (they pass the same directories) and a fresh handle
on a new ``container`` directory is a new container:

- ``durable/``: the volume's committed state, what ``commit`` publishes and ``reload`` reads.
- ``<container>/mount/``: the container's view, where the store reads and writes. Writes stay
  private to it until ``commit``; other containers see nothing of them before their own
  ``reload`` after that commit.
- ``<container>/base.json``: the view's state at its last reload (digest per file), so
  ``commit`` knows what this container changed (files written or removed since) and publishes
  exactly that, file by file, last writer winning, as Modal does.

Rules enforced, as the installed modal client states them (``modal/volume.py``):
``reload`` raises ``RuntimeError`` while any process of the machine holds a file under the
mount open or has its working directory there (the client's ``_open_files_error_annotation``
scans every process's descriptors and working directory the same way) -- or keeps one
memory-mapped, which holds the file open just the same; ``commit`` publishes, then reloads
like the client does, so it raises the same error after publishing. Stricter than Modal where
Modal leaves the outcome open: ``reload`` with uncommitted changes raises (Modal "may
implicitly" commit them; a store that relies on either outcome is wrong).

``events`` (per handle, in memory) lists ``"commit"`` / ``"reload"`` in the order they succeeded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

OPEN_FILES = "there are open files preventing the operation"
_PID = re.compile(r"^[1-9][0-9]*$")


def _digests(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            out[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def open_file_under(mount: Path) -> str | None:
    """A file under ``mount`` some process holds open (or its cwd inside), described, or None."""
    mount = Path(os.path.realpath(mount))
    top, prefix = str(mount), f"{mount}/"

    def inside(link: str) -> Path | None:
        try:
            target = os.readlink(link)
        except OSError:
            return None
        return Path(target) if target == top or target.startswith(prefix) else None

    for pid in os.listdir("/proc"):
        if not _PID.match(pid):
            continue
        hit = inside(f"/proc/{pid}/cwd")
        if hit is not None:
            return f"cwd of process {pid} is inside volume"
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            hit = inside(f"/proc/{pid}/fd/{fd}")
            if hit is not None:
                return f"path {hit.relative_to(mount)} is open from process {pid}"
        hit = _mapped_under(pid, mount)
        if hit is not None:
            return f"path {hit.relative_to(mount)} is mapped by process {pid}"
    return None


def _mapped_under(pid: str, mount: Path) -> Path | None:
    """A file under ``mount`` that process ``pid`` has memory-mapped (a mapping keeps the file
    open after its descriptor is closed, as SGLang's safetensors mappings do)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read()
    except OSError:
        return None
    prefix = f" {mount}/".encode()
    at = maps.find(prefix)
    if at < 0:
        return None
    end = maps.find(b"\n", at)
    return Path(maps[at + 1 : end if end >= 0 else None].decode().removesuffix(" (deleted)"))


class StandInVolume:
    """One container's handle on a stand-in volume (see the module docstring)."""

    def __init__(self, durable: Path, container: Path) -> None:
        self.durable = Path(durable)
        self.container = Path(container)
        self.mount = self.container / "mount"
        self.events: list[str] = []
        self.durable.mkdir(parents=True, exist_ok=True)
        self.container.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if not (self.container / "base.json").exists():
                self._refresh_view()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The container's and the volume's locks (commit and reload are atomic, as on Modal)."""
        fds = []
        try:
            for path in (self.container / ".lock", self.durable.parent / f".{self.durable.name}.lock"):
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            for fd in reversed(fds):
                os.close(fd)

    def _base(self) -> dict[str, str]:
        return json.loads((self.container / "base.json").read_text())

    def _refresh_view(self) -> None:
        """Make the view the durable state, file by file (what differs is copied or removed)."""
        self.mount.mkdir(exist_ok=True)
        durable, view = _digests(self.durable), _digests(self.mount)
        for rel in view.keys() - durable.keys():
            (self.mount / rel).unlink()
        for rel, digest in durable.items():
            if view.get(rel) != digest:
                (self.mount / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.durable / rel, self.mount / rel)
        (self.container / "base.json").write_text(json.dumps(durable))

    def uncommitted(self) -> list[str]:
        """Paths this container changed (written or removed) since its last reload."""
        base, now = self._base(), _digests(self.mount)
        return sorted({p for p in base.keys() | now.keys() if base.get(p) != now.get(p)})

    def _refuse_if_open(self) -> None:
        hit = open_file_under(self.mount)
        if hit is not None:
            raise RuntimeError(f"{OPEN_FILES}: {hit}")

    def commit(self) -> None:
        with self._locked():
            base, now = self._base(), _digests(self.mount)
            for rel in sorted(base.keys() | now.keys()):
                if base.get(rel) == now.get(rel):
                    continue
                dst = self.durable / rel
                if rel in now:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    tmp = dst.parent / f".standin-{os.getpid()}-{dst.name}"
                    shutil.copyfile(self.mount / rel, tmp)
                    os.replace(tmp, dst)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        dst.unlink()
            (self.container / "base.json").write_text(json.dumps(now))  # all of it is committed now
            # What the client does after a successful commit RPC: reload.
            self._refuse_if_open()
            self._refresh_view()
        self.events.append("commit")

    def reload(self) -> None:
        with self._locked():
            self._refuse_if_open()
            changed = self.uncommitted()
            if changed:
                raise RuntimeError(
                    f"stand-in volume: reload with uncommitted changes ({', '.join(changed[:3])}); "
                    "Modal may or may not commit them"
                )
            self._refresh_view()
        self.events.append("reload")


def volume_store(root: Path, container: str = "c0", **kw):
    """A ``ModalVolumeStore`` on a stand-in volume under ``root`` (``root/durable``), in container
    ``container`` (its view ``root/<container>/mount``, its scratch ``root/<container>/scratch``)."""
    from weight_sync.store.modal_volume import ModalVolumeStore

    volume = StandInVolume(Path(root) / "durable", Path(root) / container)
    return ModalVolumeStore(volume, volume.mount, scratch=Path(root) / container / "scratch", **kw)

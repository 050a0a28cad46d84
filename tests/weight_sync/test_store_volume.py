"""ModalVolumeStore's commit/reload order, against the stand-in volume that enforces Modal's rules.

The stand-in (``tests/support/volume.py``) is checked first: it must refuse what Modal refuses,
or the order tests below could not fail. Then: at every step of a publish in one container, a
reader in another container (reloading) sees the pointer name a complete version, the new
version only after the version's volume commit, the pointer only after the pointer's commit;
reading the pointer while a file of the volume is open here (a staging copy) reads the last view
instead of failing; staging to local disk leaves no file of the volume open; a barrier publish
of two formats (converted in worker processes) and a rollback keep a reader's pointers on
complete versions throughout.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import modal
import pytest
import torch

from tests.support.models import make_model_dir
from tests.support.volume import OPEN_FILES, StandInVolume, volume_store
from weight_sync.manifest import build_manifest
from weight_sync.publish import publish_checkpoint, rollback
from weight_sync.stage import stage_version
from weight_sync.store import open_store
from weight_sync.store.base import StoreError
from weight_sync.store.modal_volume import LOCK_NAME, ModalVolumeStore, VolumeHandle, open_path_under
from weight_sync.types import FormatRef

STREAM = FormatRef("run", "bf16")


@contextlib.contextmanager
def _held_open(path: Path) -> Iterator[int]:
    """Another process holds ``path`` open while the block runs; yields its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


_HOLDER = "import sys; f = open(sys.argv[1]); print('open', flush=True); sys.stdin.read()"


def _staged(store, version: int, payload: bytes):
    d = store.staging_dir(STREAM.at(version))
    (d / "weights.bin").write_bytes(payload)
    (d / "config.json").write_text("{}")
    build_manifest(d, format=STREAM.format).write(d, fsync=False)
    return d


# --- the stand-in enforces the rules ---------------------------------------------------------


def test_stand_in_shows_nothing_before_commit(tmp_path) -> None:
    writer = StandInVolume(tmp_path / "durable", tmp_path / "w")
    reader = StandInVolume(tmp_path / "durable", tmp_path / "r")
    (writer.mount / "a.txt").write_text("one")
    reader.reload()
    assert not (reader.mount / "a.txt").exists(), "a reader sees nothing before the writer commits"
    writer.commit()
    assert not (reader.mount / "a.txt").exists(), "nor before its own reload"
    reader.reload()
    assert (reader.mount / "a.txt").read_text() == "one"
    (writer.mount / "a.txt").unlink()
    writer.commit()
    reader.reload()
    assert not (reader.mount / "a.txt").exists(), "a removal is committed like a write"


def test_stand_in_refuses_reload_and_commit_while_a_file_is_open(tmp_path) -> None:
    vol = StandInVolume(tmp_path / "durable", tmp_path / "c")
    (vol.mount / "f.bin").write_bytes(b"x")
    vol.commit()
    with open(vol.mount / "f.bin", "rb"), pytest.raises(RuntimeError, match=f"{OPEN_FILES}: path f.bin"):
        vol.reload()
    vol.reload()  # closed: fine again
    (vol.mount / "g.bin").write_bytes(b"y")
    with open(vol.mount / "f.bin", "rb"), pytest.raises(RuntimeError, match=OPEN_FILES):
        vol.commit()  # published, then the client's reload is refused
    assert (tmp_path / "durable" / "g.bin").read_bytes() == b"y"
    # Another process of the container holding a file open counts too, as on Modal.
    with (
        _held_open(vol.mount / "f.bin") as pid,
        pytest.raises(RuntimeError, match=f"path f.bin is open from process {pid}"),
    ):
        vol.reload()
    vol.reload()


def test_stand_in_refuses_reload_with_uncommitted_changes(tmp_path) -> None:
    vol = StandInVolume(tmp_path / "durable", tmp_path / "c")
    (vol.mount / "f.bin").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="uncommitted changes"):
        vol.reload()


# --- the adapter's order ---------------------------------------------------------------------


def test_every_publish_step_leaves_other_containers_a_complete_version(tmp_path) -> None:
    """At each step of publishing v2 in container ``w``, container ``r`` reloads and checks."""
    setup = volume_store(tmp_path, "setup")
    setup.publish(STREAM.at(1), _staged(setup, 1, b"one"))
    reader = volume_store(tmp_path, "r")
    seen: list[tuple[str, int | None, list[int]]] = []

    def check(step: str) -> None:
        pointer = reader.read_pointer(STREAM)  # reloads: nothing of the reader's is open
        reader.verify(STREAM.at(pointer))  # the pointer always names a complete version
        seen.append((step, pointer, reader.versions(STREAM)))

    writer = volume_store(tmp_path, "w", on_step=check)
    writer.publish(STREAM.at(2), _staged(writer, 2, b"two"))
    assert seen == [
        ("copied", 1, [1]),
        ("files_synced", 1, [1]),
        ("manifest_written", 1, [1]),
        ("committed", 1, [1]),  # complete in the writer's view, not yet committed to the volume
        ("volume_committed", 1, [1, 2]),  # the version's files, before any pointer names them
        ("pointer_tmp_written", 1, [1, 2]),
        ("pointer_replaced", 1, [1, 2]),  # the writer's view only
        ("advanced", 1, [1, 2]),
        ("pointer_committed", 2, [1, 2]),
    ]
    # commit: reload (compare with what others committed) then commit; advance: the same.
    assert writer.volume.events == ["reload", "commit", "reload", "commit"]
    assert reader.read_pointer(STREAM) == 2 and reader.verify(STREAM.at(2)).version == 2


def test_reading_the_pointer_while_staging_reads_the_last_view(tmp_path) -> None:
    writer = volume_store(tmp_path, "w")
    writer.publish(STREAM.at(1), _staged(writer, 1, b"one"))
    reader = volume_store(tmp_path, "r")
    assert reader.read_pointer(STREAM) == 1
    writer.publish(STREAM.at(2), _staged(writer, 2, b"two"))
    shard = reader.version_dir(STREAM.at(1)) / "weights.bin"
    with open(shard, "rb"):  # what a staging copy holds open
        assert open_path_under(reader.mount) == str(shard)
        assert reader.read_pointer(STREAM) == 1, "no reload while a file of the volume is open"
        assert reader.volume.events == ["reload"]
    # A mapping without a descriptor (how torch maps a file) holds the file open just the same.
    mapped = torch.from_file(str(shard), shared=False, size=shard.stat().st_size, dtype=torch.uint8)
    assert open_path_under(reader.mount) == str(shard)
    assert reader.read_pointer(STREAM) == 1 and reader.volume.events == ["reload"]
    del mapped
    assert reader.read_pointer(STREAM) == 2


def test_a_reload_refused_for_another_reason_is_a_store_error(tmp_path) -> None:
    """Another process of the container holds a file of the volume: Modal refuses the reload and
    this process cannot wait it out, so the reader says so."""
    writer = volume_store(tmp_path, "w")
    writer.publish(STREAM.at(1), _staged(writer, 1, b"one"))
    reader = volume_store(tmp_path, "r")
    reader.read_pointer(STREAM)
    with (
        _held_open(reader.version_dir(STREAM.at(1)) / "config.json"),
        pytest.raises(StoreError, match=f"reloading the volume at .* failed: {OPEN_FILES}"),
    ):
        reader.read_pointer(STREAM)


def test_the_stores_reads_of_its_small_files_wait_for_the_container_lock(tmp_path) -> None:
    """``read_pointer``, ``read_manifest`` and ``versions`` read the volume only under the
    container's lock, held here as another process of the container holds it through a
    reload-commit sequence (an ``advance``): they wait for it, so that process's reload never
    meets their files open (it would fail, as it failed in a run of two advancers)."""
    store = volume_store(tmp_path)
    store.publish(STREAM.at(1), _staged(store, 1, b"one"))
    reads = {
        "read_pointer": lambda: store.read_pointer(STREAM),
        "read_manifest": lambda: store.read_manifest(STREAM.at(1)),
        "versions": lambda: store.versions(STREAM),
    }
    for name, read in reads.items():
        fd = os.open(store.scratch / LOCK_NAME, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a descriptor of its own: the store's flock waits for it
        done = threading.Event()
        reader = threading.Thread(target=lambda read=read, done=done: (read(), done.set()))
        reader.start()
        try:
            assert not done.wait(0.5), f"{name} read the volume while another process held the lock"
        finally:
            os.close(fd)
        assert done.wait(30), name
        reader.join()


def test_staging_to_local_disk_leaves_no_file_of_the_volume_open(tmp_path) -> None:
    writer = volume_store(tmp_path, "w")
    writer.publish(STREAM.at(1), _staged(writer, 1, b"one" * 1000))
    reader = volume_store(tmp_path, "replica")
    ref = STREAM.at(reader.read_pointer(STREAM))
    staged = stage_version(reader, ref, tmp_path / "local-disk", mode="copy")
    assert staged.copied and reader.mount not in staged.path.parents
    assert (staged.path / "weights.bin").read_bytes() == b"one" * 1000
    assert open_path_under(reader.mount) is None
    reader.volume.reload()  # Modal would refuse this if staging had left a file open


def test_scratch_on_the_volume_is_refused(tmp_path) -> None:
    vol = StandInVolume(tmp_path / "durable", tmp_path / "c")
    with pytest.raises(StoreError, match="lies on the volume"):
        ModalVolumeStore(vol, vol.mount, scratch=vol.mount / "scratch")


def test_factory_takes_a_modal_volume_offline(tmp_path) -> None:
    """``open_store`` with a volume name builds the adapter on a real ``modal.Volume`` handle
    without contacting Modal (``from_name`` is lazy); the handle satisfies the protocol."""
    store = open_store(tmp_path / "mnt", volume="mixfleet-weights", scratch=tmp_path / "scratch")
    assert isinstance(store, ModalVolumeStore) and isinstance(store.volume, modal.Volume)
    assert isinstance(store.volume, VolumeHandle) and store.mount == tmp_path / "mnt"
    assert type(open_store(tmp_path / "local")).__name__ == "LocalStore"


def test_barrier_publish_and_rollback_on_the_volume(tmp_path) -> None:
    """``publish_checkpoint`` in barrier mode, two formats converted in worker processes (writing
    to the publisher's own disk while it commits the other format to the volume), then a
    rollback: after every commit and pointer move, a reader in another container sees no pointer
    name the new version before both formats of it are committed, and every pointer verify."""
    base = make_model_dir(tmp_path / "models", "tiny", "bf16")
    formats = ["bf16", "fp8"]
    reader = volume_store(tmp_path, "reader")
    checks: list[dict[str, int | None]] = []

    def check(kind: str, info: dict) -> None:
        if kind not in ("committed", "advanced"):
            return
        pointers = {f: reader.read_pointer(FormatRef("run", f)) for f in formats}
        for f, v in pointers.items():
            if v is not None:
                reader.verify(FormatRef("run", f).at(v))
        newest = max((v for v in pointers.values() if v is not None), default=None)
        if newest is not None:
            assert all(newest in reader.versions(FormatRef("run", f)) for f in formats), (kind, pointers)
        checks.append(pointers)

    publisher = volume_store(tmp_path, "publisher")
    publish_checkpoint(publisher, "run", 0, base, formats, workers=2, on_event=check)
    assert checks[-1] == {"bf16": 0, "fp8": 0} and {"bf16": None, "fp8": None} in checks
    rollback(publisher, "run", 0, formats, version=1, on_event=check)
    assert checks[-1] == {"bf16": 1, "fp8": 1}
    for f in formats:
        one, zero = (
            reader.read_manifest(FormatRef("run", f).at(1)),
            reader.read_manifest(FormatRef("run", f).at(0)),
        )
        assert one.files == zero.files and one.version == 1
    assert "commit" not in reader.volume.events

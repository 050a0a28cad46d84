"""``VersionStore.delete`` on both adapters: ``LocalStore`` on a directory and ``ModalVolumeStore``
on the stand-in volume (``tests/support/volume.py``, Modal's commit/reload rules).

The contract (``weight_sync/store/base.py``): the pointer's version and an uncommitted one are
refused with a ``StoreError`` naming them; a deleted version is gone from ``versions`` and
``read_manifest``; a rollback's hard-linked files stay whole in the version that shares them;
and a deleter killed (SIGKILL, a real process) or failing at any step leaves every reader the
version complete or absent, never half deleted, with what it left removed by the next delete.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.procs import REPO
from tests.weight_sync.publisher import FMT, RUN, STREAM, open_store, publish, step_through
from weight_sync.publish import rollback
from weight_sync.store.base import StoreError

LOCAL_STEPS = ["trashed", "deleted"]
VOLUME_STEPS = ["trashed", "trash_committed", "volume_committed"]
# The first step after which a reader no longer finds the version.
GONE = {"local": "trashed", "volume": "trash_committed"}


def _layout_root(tmp_path, adapter: str):
    """Where a reader outside the deleter sees files: the directory, or the volume's durable state."""
    return tmp_path if adapter == "local" else tmp_path / "durable"


def _three(tmp_path, adapter: str):
    for v, payload in ((1, "a"), (2, "b"), (3, "c")):
        publish(tmp_path, v, payload, adapter=adapter, container="setup")
    return open_store(tmp_path, adapter, "reader")


@pytest.mark.parametrize("adapter", ["local", "volume"])
def test_delete_removes_a_version_and_keeps_the_others(tmp_path, adapter) -> None:
    store = _three(tmp_path, adapter)
    writer = open_store(tmp_path, adapter, "w")
    writer.delete(STREAM.at(1))
    store.read_pointer(STREAM)  # a volume reader reloads here
    assert store.versions(STREAM) == [2, 3]
    with pytest.raises(StoreError, match="no committed v000001"):
        store.read_manifest(STREAM.at(1))
    for v in (2, 3):
        store.verify(STREAM.at(v))
    fmt_dir = _layout_root(tmp_path, adapter) / RUN / FMT  # the stand-in keeps emptied directories
    assert not [p for d in ("v000001", ".trash") for p in (fmt_dir / d).rglob("*") if p.is_file()]


@pytest.mark.parametrize("adapter", ["local", "volume"])
def test_delete_refuses_the_pointer_and_an_uncommitted_version(tmp_path, adapter) -> None:
    store = _three(tmp_path, adapter)
    with pytest.raises(StoreError, match=r"v000003.*pointer names"):
        store.delete(STREAM.at(3))
    with pytest.raises(StoreError, match="no committed v000007"):
        store.delete(STREAM.at(7))
    assert store.versions(STREAM) == [1, 2, 3] and store.read_pointer(STREAM) == 3
    store.verify(STREAM.at(3))
    if adapter == "volume":  # a refusal leaves nothing uncommitted in the container's view
        assert store.volume.uncommitted() == []


@pytest.mark.parametrize("adapter", ["local", "volume"])
def test_hard_linked_files_stay_whole_in_the_rollback_sharing_them(tmp_path, adapter) -> None:
    store = _three(tmp_path, adapter)
    rollback(store, RUN, 1, [FMT])  # version 4: version 1's files, hard-linked where possible
    shard = "model-00001-of-00002.safetensors"
    if adapter == "local":
        assert os.stat(store.version_dir(STREAM.at(4)) / shard).st_nlink == 2
    store.delete(STREAM.at(1))
    assert store.versions(STREAM) == [2, 3, 4]
    assert store.verify(STREAM.at(4)).source_checksum == "xxh3_128:a"
    if adapter == "local":
        assert os.stat(store.version_dir(STREAM.at(4)) / shard).st_nlink == 1
    other = open_store(tmp_path, adapter, "fresh")
    assert other.read_pointer(STREAM) == 4 and other.verify(STREAM.at(4)).source_checksum == "xxh3_128:a"


def test_volume_readers_see_the_version_whole_until_the_trash_commit(tmp_path) -> None:
    _three(tmp_path, "volume")
    reader = open_store(tmp_path, "volume", "r")
    seen = []

    def check(step: str) -> None:
        reader.read_pointer(STREAM)  # reloads
        versions = reader.versions(STREAM)
        if 1 in versions:
            reader.verify(STREAM.at(1))
        seen.append((step, versions))

    writer = open_store(tmp_path, "volume", "w", check)
    writer.delete(STREAM.at(1))
    assert seen == [("trashed", [1, 2, 3]), ("trash_committed", [2, 3]), ("volume_committed", [2, 3])]
    assert writer.volume.events == ["reload", "commit", "commit"]


def _deleter(root, version: int, adapter: str, container: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.weight_sync.deleter", str(root), str(version), adapter, container],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
        start_new_session=True,
    )


def _delete_through(root, version: int, adapter: str, kill_at: str | None) -> list[str]:
    return step_through(_deleter(root, version, adapter, "killed"), kill_at)


@pytest.mark.parametrize(("adapter", "steps"), [("local", LOCAL_STEPS), ("volume", VOLUME_STEPS)])
def test_deleter_reports_every_step(tmp_path, adapter, steps) -> None:
    _three(tmp_path, adapter)
    assert _delete_through(tmp_path, 1, adapter, None) == [*steps, "done"]


@pytest.mark.parametrize(
    ("adapter", "kill_at"), [("local", s) for s in LOCAL_STEPS] + [("volume", s) for s in VOLUME_STEPS]
)
def test_kill_at_each_step_leaves_the_version_whole_or_gone(tmp_path, adapter, kill_at) -> None:
    _three(tmp_path, adapter)
    _delete_through(tmp_path, 1, adapter, kill_at)
    steps = LOCAL_STEPS if adapter == "local" else VOLUME_STEPS
    gone = steps.index(kill_at) >= steps.index(GONE[adapter])

    reader = open_store(tmp_path, adapter, "reader")
    assert reader.read_pointer(STREAM) == 3
    assert reader.versions(STREAM) == ([2, 3] if gone else [1, 2, 3])
    for v in reader.versions(STREAM):
        reader.verify(STREAM.at(v))  # never a half-deleted version among the committed ones

    # The next delete (in any container) removes what the killed one left in the trash.
    reader.delete(STREAM.at(2))
    again = open_store(tmp_path, adapter, "after")
    again.read_pointer(STREAM)
    assert again.versions(STREAM) == ([3] if gone else [1, 3])
    trash = _layout_root(tmp_path, adapter) / RUN / FMT / ".trash"
    assert not [p for p in trash.rglob("*") if p.is_file()]


@pytest.mark.parametrize("adapter", ["local", "volume"])
def test_an_exception_between_the_rename_and_the_removal_leaves_the_version_gone(tmp_path, adapter) -> None:
    _three(tmp_path, adapter)

    def fail(step: str) -> None:
        if step == "trashed":
            raise OSError("disk went away")

    store = open_store(tmp_path, adapter, "w", fail)
    with pytest.raises(OSError, match="disk went away"):
        store.delete(STREAM.at(1))
    reader = open_store(tmp_path, adapter, "reader")
    reader.read_pointer(STREAM)
    assert reader.versions(STREAM) == [2, 3]
    for v in (2, 3):
        reader.verify(STREAM.at(v))
    assert FMT in str(reader.version_dir(STREAM.at(2)))

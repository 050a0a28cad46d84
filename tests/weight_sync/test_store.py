"""The store contract: commit / advance / publish semantics, immutability, monotonic pointer, verify.

Every test runs against each adapter: ``LocalStore`` on a directory, and ``ModalVolumeStore`` on
the stand-in volume of ``tests/support/volume.py`` (which enforces Modal's commit/reload rules).
``root`` is where the adapter's layout is seen (the directory; the container's mount).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from tests.support.procs import REPO
from tests.support.volume import volume_store
from weight_sync.manifest import MANIFEST_NAME, ChecksumError, Manifest, build_manifest
from weight_sync.store.base import PointerError, StoreError, VersionConflict
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef, InvalidName, InvalidVersion, VersionRef

RUN, FMT = "run-1", "fp8"
STREAM = FormatRef(RUN, FMT)
ADAPTERS = ("local", "volume")


def open_store(kind: str, where):
    """The ``kind`` adapter on a fresh ``where``: (store, the root its layout is seen under)."""
    if kind == "local":
        return LocalStore(where), where
    store = volume_store(where)
    return store, store.mount


@pytest.fixture(params=ADAPTERS)
def adapter(request) -> str:
    return request.param


def _stage(store, version: int, payload: bytes, *, manifest: bool = True):
    d = store.staging_dir(STREAM.at(version))
    (d / "weights.bin").write_bytes(payload)
    (d / "config.json").write_text(f'{{"v": {len(payload)}}}')
    if manifest:
        build_manifest(d, format=FMT, source_checksum="xxh3_128:src").write(d, fsync=False)
    return d


def test_layout_and_publish(tmp_path, adapter) -> None:
    store, root = open_store(adapter, tmp_path)
    assert store.read_pointer(STREAM) is None and store.versions(STREAM) == []
    staged = _stage(store, 1, b"one")
    if adapter == "local":
        assert staged.parent.name == ".staging" and staged.parent.parent == tmp_path / RUN / FMT
    else:  # staged on the container's own disk, never on the volume
        assert root not in staged.parents and store.scratch in staged.parents
    m = store.publish(STREAM.at(1), staged)
    assert not staged.exists(), "a staging directory is consumed by commit"
    assert store.version_dir(STREAM.at(1)) == root / RUN / FMT / "v000001"
    assert (root / RUN / FMT / "CURRENT").read_text().strip() == "1"
    assert store.read_pointer(STREAM) == 1 and store.versions(STREAM) == [1]
    assert m.version == 1 and store.read_manifest(STREAM.at(1)) == m
    assert store.verify(STREAM.at(1)) == m
    assert sorted(os.listdir(store.version_dir(STREAM.at(1)))) == [
        "config.json",
        MANIFEST_NAME,
        "weights.bin",
    ]


def test_commit_without_manifest_hashes_the_files(tmp_path, adapter) -> None:
    store, _ = open_store(adapter, tmp_path)
    m = store.commit(STREAM.at(3), _stage(store, 3, b"three", manifest=False))
    assert set(m.files) == {"config.json", "weights.bin"} and m.version == 3
    store.verify(STREAM.at(3))


def test_commit_from_outside_copies_and_leaves_source(tmp_path, adapter) -> None:
    store, _ = open_store(adapter, tmp_path / "store")
    src = tmp_path / "converted"
    src.mkdir()
    save_file({"w": torch.zeros(250)}, str(src / "w.safetensors"))
    build_manifest(src, format=FMT).write(src)
    m = store.publish(STREAM.at(5), src)
    assert (src / "w.safetensors").exists() and store.read_pointer(STREAM) == 5
    assert Manifest.read(src).version is None and m.version == 5
    store.verify(STREAM.at(5))


def test_immutable_versions(tmp_path, adapter) -> None:
    store, _ = open_store(adapter, tmp_path)
    first = store.commit(STREAM.at(1), _stage(store, 1, b"one"))
    # Same bytes again: idempotent, returns the committed manifest, discards the staging dir.
    again = _stage(store, 1, b"one")
    assert store.commit(STREAM.at(1), again) == first and not again.exists()
    # Other bytes under the same number: refused, and the committed version is untouched.
    with pytest.raises(VersionConflict, match="already committed with other content"):
        store.commit(STREAM.at(1), _stage(store, 1, b"ONE"))
    assert store.verify(STREAM.at(1)) == first
    assert (store.version_dir(STREAM.at(1)) / "weights.bin").read_bytes() == b"one"


def test_pointer_moves_forward_only_and_only_to_committed(tmp_path, adapter) -> None:
    store, _ = open_store(adapter, tmp_path)
    with pytest.raises(PointerError, match="not committed"):
        store.advance(STREAM.at(1))
    assert store.read_pointer(STREAM) is None
    for v in (1, 2, 3):
        store.commit(STREAM.at(v), _stage(store, v, b"x" * v))
    store.advance(STREAM.at(2))
    store.advance(STREAM.at(2))  # no-op
    with pytest.raises(PointerError, match="never moves backwards"):
        store.advance(STREAM.at(1))
    with pytest.raises(PointerError, match="expected"):
        store.advance(STREAM.at(3), expected=1)
    store.advance(STREAM.at(3), expected=2)
    assert store.read_pointer(STREAM) == 3
    with pytest.raises(PointerError, match="not committed"):
        store.advance(STREAM.at(9))
    assert store.read_pointer(STREAM) == 3


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("outside", [False, True])
def test_verify_names_the_flipped_shard(tmp_path, adapter, algorithm, outside) -> None:
    """Manifests naming either checksum publish (a copy from outside checks each file on the
    way in) and verify; a flipped byte is found and the file named."""
    store, _ = open_store(adapter, tmp_path / "store")
    d = tmp_path / "converted" if outside else store.staging_dir(STREAM.at(1))
    d.mkdir(parents=True, exist_ok=True)
    for i in (1, 2):
        tensors = {f"w{i}": torch.arange(4096, dtype=torch.float32).reshape(64, 64) * i}
        save_file(tensors, str(d / f"model-0000{i}-of-00002.safetensors"))
    build_manifest(d, format=FMT, algorithm=algorithm).write(d)
    m = store.publish(STREAM.at(1), d)
    assert m.tensor_count == 2 and {e.algorithm for e in m.files.values()} == {algorithm}
    assert store.verify(STREAM.at(1)) == m
    shard = store.version_dir(STREAM.at(1)) / "model-00002-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[5000] ^= 0x80
    shard.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError) as exc:
        store.verify(STREAM.at(1))
    assert exc.value.path == shard and "model-00002-of-00002.safetensors" in str(exc.value)


def test_bad_names_and_missing_versions(tmp_path, adapter) -> None:
    store, root = open_store(adapter, tmp_path)
    for bad in ("../x", "a/b", "", ".."):
        with pytest.raises(InvalidName, match="invalid run id"):
            store.version_dir(VersionRef(bad, FMT, 1))
    with pytest.raises(InvalidVersion, match="non-negative"):
        store.version_dir(STREAM.at(-1))
    with pytest.raises(StoreError, match="no committed"):
        store.read_manifest(STREAM.at(4))
    (root / RUN / FMT).mkdir(parents=True)
    (root / RUN / FMT / "CURRENT").write_text("garbage")
    if adapter == "volume":
        store.volume.commit()  # another container's corrupt pointer, as a reader reloads it
    with pytest.raises(StoreError, match="corrupt"):
        store.read_pointer(STREAM)


_ADVANCER = """
import sys
from pathlib import Path
from weight_sync.store.base import PointerError
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef, VersionRef
from tests.support.volume import volume_store
store = LocalStore(sys.argv[1]) if sys.argv[5] == "local" else volume_store(Path(sys.argv[1]))
violations = 0
for v in range(int(sys.argv[2]), 41, 2):
    try:
        store.advance(VersionRef(sys.argv[3], sys.argv[4], v))
    except PointerError:
        pass
    # Whether this move won or lost, the pointer is never below a version it accepted.
    violations += store.read_pointer(FormatRef(sys.argv[3], sys.argv[4])) < v
print(violations)
"""


def test_concurrent_advancers_never_move_backwards(tmp_path, adapter) -> None:
    """Two processes (of one container, for the volume) race to advance through interleaved
    versions; the lock makes the CAS real: the pointer ends at the maximum and never drops below
    a version once it held it."""
    store, _ = open_store(adapter, tmp_path)
    for v in range(1, 41):
        store.commit(STREAM.at(v), _stage(store, v, b"v%d" % v))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ADVANCER, str(tmp_path), start, RUN, FMT, adapter],
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        for start in ("1", "2")
    ]
    results = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert results == ["0", "0"]
    assert store.read_pointer(STREAM) == 40

"""Staging a committed version next to an engine: copy + verify in one pass, in place, deltas,
corruption named by file, interrupted stagings leaving nothing usable behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weight_sync.manifest import ChecksumError, build_manifest
from weight_sync.publish import publish_checkpoint
from weight_sync.stage import StageAborted, clean_staging, stage_version
from weight_sync.store.local import LocalStore
from weight_sync.types import VersionRef

RUN = "r"
V1 = VersionRef(RUN, "bf16", 1)


@pytest.fixture()
def store(tmp_path, tiny_base) -> LocalStore:
    s = LocalStore(tmp_path / "store")
    publish_checkpoint(s, RUN, 1, tiny_base, ["bf16"], workers=0)
    return s


def _same_tree(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_copy_stages_a_verified_complete_directory(store, tmp_path) -> None:
    seen: list[int] = []
    staged = stage_version(store, V1, tmp_path / "staging", progress=seen.append)
    assert staged.copied and staged.path == tmp_path / "staging" / "v000001"
    assert staged.bytes == store.read_manifest(V1).total_bytes == seen[-1]
    _same_tree(staged.path, store.version_dir(V1))
    again = stage_version(store, V1, tmp_path / "staging")  # already staged: re-verified
    assert again.path == staged.path


def test_inplace_verifies_the_store_copy(store, tmp_path) -> None:
    staged = stage_version(store, V1, tmp_path / "staging", mode="inplace")
    assert not staged.copied and staged.path == store.version_dir(V1)
    assert not (tmp_path / "staging").exists()


@pytest.mark.parametrize("mode", ["copy", "inplace"])
def test_corrupt_shard_is_named_and_nothing_is_staged(store, tmp_path, mode) -> None:
    shard = store.version_dir(V1) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError) as err:
        stage_version(store, V1, tmp_path / "staging", mode=mode)
    assert err.value.path == shard and "content differs" in err.value.reason
    assert not list((tmp_path / "staging").glob("v*")) if (tmp_path / "staging").exists() else True


def test_abort_leaves_no_usable_directory(store, tmp_path) -> None:
    calls = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(StageAborted):
        stage_version(store, V1, tmp_path / "staging", should_abort=abort)
    assert list((tmp_path / "staging").iterdir()) == []


def test_delta_version_is_materialized_over_its_base(store, tmp_path, tiny_base) -> None:
    """A delta (kind="delta", base_version=1) holding only the changed shard stages to the full
    directory: the base's files plus the delta's replacement."""
    delta_src = tmp_path / "delta-src"
    delta_src.mkdir()
    tensors = load_file(str(tiny_base / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 2
    save_file(tensors, str(delta_src / "model.safetensors"), metadata={"format": "pt"})
    m = build_manifest(delta_src, format="bf16", kind="delta", base_version=1)
    m.write(delta_src)
    store.publish(VersionRef(RUN, "bf16", 2), delta_src)
    assert store.read_manifest(VersionRef(RUN, "bf16", 2)).kind == "delta"
    staged = stage_version(store, VersionRef(RUN, "bf16", 2), tmp_path / "staging")
    base_dir = store.version_dir(V1)
    for p in base_dir.iterdir():
        if p.name in ("manifest.json", "model.safetensors"):
            continue
        assert (staged.path / p.name).read_bytes() == p.read_bytes()
    got = load_file(str(staged.path / "model.safetensors"))
    assert torch.equal(got["lm_head.weight"], tensors["lm_head.weight"])
    assert json.loads((staged.path / "manifest.json").read_text())["kind"] == "delta"


def test_clean_staging_keeps_only_what_is_asked(tmp_path) -> None:
    root = tmp_path / "staging"
    for name in ("v000001", "v000002", "v000003.partial"):
        (root / name).mkdir(parents=True)
    removed = clean_staging(root, {2})
    assert sorted(p.name for p in removed) == ["v000001", "v000003.partial"]
    assert [p.name for p in root.iterdir()] == ["v000002"]
    shutil.rmtree(root)
    assert clean_staging(root, set()) == []

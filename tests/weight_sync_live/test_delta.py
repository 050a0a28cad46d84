"""Delta publish: a trainer hands over only the changed tensors; each format's version is a delta
over the base (only the files that differ), and a replica staging it gets, byte for byte, what a
full publish of the merged checkpoint gives. Real checkpoints, conversions, store, router."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.errors import UserError
from launcher.children import Launcher, ReplicaSpec
from tests.support.procs import REPO, mixfleet_argv
from tests.support.router import router_process, write_preset
from weight_sync.convert import convert_checkpoint
from weight_sync.delta import reduce_to_delta
from weight_sync.manifest import ChecksumError, Manifest, build_manifest
from weight_sync.publish import bootstrap, publish_checkpoint, publish_delta
from weight_sync.stage import stage_version
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef, VersionRef

RUN = "r"
FORMATS = ["bf16", "fp8", "nvfp4"]
LM_HEAD = "lm_head.weight"


def _changed(base: Path) -> dict[str, torch.Tensor]:
    """New values for two tensors of one shard: the LM head and an expert's up projection (NVFP4
    fuses it with its gate_proj, so that tensor's encoding changes too)."""
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index[LM_HEAD]
    ups = [n for n, f in sorted(index.items()) if f == shard and n.endswith("experts.1.up_proj.weight")]
    expert = ups[0]
    tensors = load_file(base / shard)
    return {n: (tensors[n].float() * 1.5 + 0.01).to(tensors[n].dtype) for n in (LM_HEAD, expert)}


def _merged(base: Path, changed: dict[str, torch.Tensor], out: Path) -> Path:
    """The full checkpoint with ``changed`` applied, written independently of weight_sync.delta."""
    shutil.copytree(base, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        if any(n in tensors for n in changed):
            tensors.update({n: t for n, t in changed.items() if n in tensors})
            save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


@pytest.fixture()
def store(tmp_path: Path, tiny_2shards: Path) -> LocalStore:
    s = LocalStore(tmp_path / "store")
    publish_checkpoint(s, RUN, 1, tiny_2shards, FORMATS, workers=0)
    return s


def _write_delta(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    d = tmp_path / "delta"
    d.mkdir(parents=True)
    save_file(tensors, str(d / "delta.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.timeout(300)
def test_delta_stages_to_exactly_the_full_conversion(
    store: LocalStore, tmp_path: Path, tiny_2shards: Path
) -> None:
    changed = _changed(tiny_2shards)
    result = publish_delta(store, RUN, 2, _write_delta(tmp_path, changed), 1, FORMATS, workers=0)
    assert {f.format: f.kind for f in result.formats} == dict.fromkeys(FORMATS, "delta")
    # The reference: the merged checkpoint (built here), converted in full per format. The bf16
    # version of 1 is the base the delta applies to, so the reference starts from it too.
    ref_src = _merged(store.version_dir(VersionRef(RUN, "bf16", 1)), changed, tmp_path / "ref-src")
    (ref_src / "manifest.json").unlink()
    for fmt in FORMATS:
        assert store.read_pointer(FormatRef(RUN, fmt)) == 2
        m = store.read_manifest(VersionRef(RUN, fmt, 2))
        full = store.read_manifest(VersionRef(RUN, fmt, 1))
        assert m.kind == "delta" and m.base_version == 1
        # Only the shard(s) holding a changed tensor are new; the other shard, config and
        # tokenizer files come from the base.
        shards = [rel for rel in m.files if rel.endswith(".safetensors")]
        assert 1 <= len(shards) < len([r for r in full.files if r.endswith(".safetensors")]), m.files
        assert m.total_bytes < full.total_bytes
        ref = convert_checkpoint(ref_src, tmp_path / f"ref-{fmt}", fmt)
        for mode in ("copy", "inplace"):
            staged = stage_version(
                store, VersionRef(RUN, fmt, 2), tmp_path / f"staging-{fmt}-{mode}", mode=mode
            )
            names = sorted(p.name for p in staged.path.iterdir() if p.name != "manifest.json")
            assert names == sorted(ref.files), (fmt, mode)
            for name in names:
                assert (staged.path / name).read_bytes() == (tmp_path / f"ref-{fmt}" / name).read_bytes(), (
                    fmt,
                    mode,
                    name,
                )
    # Publishing the same delta again is a no-op; a delta over a delta chains.
    again = publish_delta(store, RUN, 2, _write_delta(tmp_path / "again", changed), 1, FORMATS, workers=0)
    assert all(f.reused for f in again.formats)
    more = {LM_HEAD: (changed[LM_HEAD].float() * -1).to(changed[LM_HEAD].dtype)}
    publish_delta(store, RUN, 3, _write_delta(tmp_path / "third", more), 2, FORMATS, workers=0)
    staged = stage_version(store, VersionRef(RUN, "bf16", 3), tmp_path / "staging-3")
    got: dict[str, torch.Tensor] = {}
    for shard in staged.path.glob("*.safetensors"):
        got.update(load_file(shard))
    expert = next(n for n in changed if n != LM_HEAD)
    assert torch.equal(got[LM_HEAD], more[LM_HEAD]) and torch.equal(got[expert], changed[expert])


@pytest.mark.timeout(300)
def test_a_delta_version_starts_engines_and_is_converted_for_a_new_format(
    store: LocalStore, tmp_path: Path, tiny_2shards: Path
) -> None:
    """Once the pointers name a delta version (its directories hold only what changed), the
    launcher starts an engine on it (its whole content staged, as its sidecar stages it) and a
    format added then (``mixfleet up`` with a new group: :func:`bootstrap`) gets its content
    converted whole: the engine exited for want of a config.json, the bootstrap refused the same."""
    changed = _changed(tiny_2shards)
    publish_delta(store, RUN, 2, _write_delta(tmp_path, changed), 1, FORMATS, workers=0)
    assert bootstrap(store, RUN, tiny_2shards, [*FORMATS, "mxfp4"], workers=0)["mxfp4"] == 2
    ref_src = _merged(store.version_dir(VersionRef(RUN, "bf16", 1)), changed, tmp_path / "ref-src")
    (ref_src / "manifest.json").unlink()
    ref = convert_checkpoint(ref_src, tmp_path / "ref-mxfp4", "mxfp4")
    got = store.version_dir(VersionRef(RUN, "mxfp4", 2))
    assert store.read_manifest(VersionRef(RUN, "mxfp4", 2)).kind == "full"
    assert {n: (got / n).read_bytes() for n in ref.files} == {
        n: (tmp_path / "ref-mxfp4" / n).read_bytes() for n in ref.files
    }
    assert not list(store.root.glob(".checkpoint-*"))  # the linked content is gone
    with Launcher(store.root, RUN, engine_threads=1) as launcher:
        replica = launcher.replica(
            ReplicaSpec("cpu-0", "cpu", "bf16"),
            staging_dir=tmp_path / "staging",
            engine_log=tmp_path / "engine.log",
            sidecar_log=tmp_path / "sidecar.log",
        )
        engine = launcher.start_engine(replica, 2)
        deadline = time.monotonic() + 120
        while True:
            assert engine.returncode() is None, (tmp_path / "engine.log").read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                info = httpx.get(f"{replica.engine_url}/model_info", timeout=5).json()
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert info["weight_version"] == "2" and info["model_path"] == str(tmp_path / "staging" / "v000002")


def test_validate_reads_a_delta_versions_whole_content(
    store: LocalStore, tmp_path: Path, tiny_2shards: Path
) -> None:
    """``mixfleet validate`` checks a group's version with its config and manifest: for a delta
    version it reads the version's whole content, staged for the run (its directory lacks the
    config and the unchanged shards, so level 1 failed reading ``config.json``)."""
    from validate.target import version_content
    from weight_sync.delta import version_files

    publish_delta(store, RUN, 2, _write_delta(tmp_path, _changed(tiny_2shards)), 1, FORMATS, workers=0)
    assert version_content(store, RUN, "fp8", 1, tmp_path / "scratch") == store.version_dir(
        VersionRef(RUN, "fp8", 1)
    )
    assert version_content(store, RUN, "fp8", 2, None) is None
    got = version_content(store, RUN, "fp8", 2, tmp_path / "scratch")
    manifest = Manifest.read(got)
    assert (manifest.kind, manifest.version, manifest.format) == ("delta", 2, "fp8")
    whole = version_files(store, VersionRef(RUN, "fp8", 2))
    assert sorted(p.name for p in got.iterdir() if p.name != "manifest.json") == sorted(whole)
    assert all((got / rel).read_bytes() == (d / rel).read_bytes() for rel, (d, _) in whole.items())
    assert json.loads((got / "config.json").read_text())["quantization_config"]


@pytest.mark.timeout(300)
def test_bad_deltas_are_refused_before_anything_moves(
    store: LocalStore, tmp_path: Path, tiny_2shards: Path
) -> None:
    good = _changed(tiny_2shards)[LM_HEAD]
    cases = [
        ({"model.layers.9.nope.weight": good}, "not in version 1: model.layers.9.nope.weight"),
        ({LM_HEAD: good[:-1]}, "lm_head.weight.*version 1 has BF16"),
        ({LM_HEAD: good.float()}, "is F32"),
    ]
    nan, inf = good.clone(), good.clone()
    nan[1, 2] = float("nan")
    inf.view(-1)[-1] = float("-inf")
    for tensors in ({LM_HEAD: nan}, {LM_HEAD: inf}):  # named in the user's file, not the merged copy
        i = len(cases)
        named = rf"bad{i}/d\.safetensors: tensor 'lm_head\.weight' of shape .* contains NaN or Inf"
        cases.append((tensors, named))
    for i, (tensors, message) in enumerate(cases):
        d = tmp_path / f"bad{i}"
        d.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "d.safetensors"))
        with pytest.raises(UserError, match=message):
            publish_delta(store, RUN, 2, d, 1, FORMATS, workers=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no tensors"):
        publish_delta(store, RUN, 2, empty, 1, FORMATS, workers=0)
    ok = _write_delta(tmp_path / "ok", {LM_HEAD: good})
    with pytest.raises(UserError, match="has no bf16, fp8, nvfp4 version 7"):
        publish_delta(store, RUN, 8, ok, 7, FORMATS, workers=0)
    with pytest.raises(UserError, match="must be an older version"):
        publish_delta(store, RUN, 1, ok, 1, FORMATS, workers=0)
    no_bf16 = LocalStore(tmp_path / "store2")
    publish_checkpoint(no_bf16, RUN, 1, tiny_2shards, ["fp8"], workers=0)
    with pytest.raises(UserError, match="no bf16 version 1 .a delta applies to the base's bf16 copy"):
        publish_delta(no_bf16, RUN, 2, ok, 1, ["fp8"], workers=0)
    for fmt in FORMATS:
        assert store.read_pointer(FormatRef(RUN, fmt)) == 1 and store.versions(FormatRef(RUN, fmt)) == [1]


def test_a_base_file_the_new_version_lacks_keeps_that_format_full(store: LocalStore, tmp_path: Path) -> None:
    """A delta cannot delete a file: reduce_to_delta leaves such a version full."""
    staged = Path(store.staging_dir(VersionRef(RUN, "bf16", 2)))
    shutil.copytree(store.version_dir(VersionRef(RUN, "bf16", 1)), staged, dirs_exist_ok=True)
    m = Manifest.read(staged)
    dropped = next(rel for rel in m.files if rel.startswith("tokenizer"))
    (staged / dropped).unlink()
    files = {k: v for k, v in m.files.items() if k != dropped}
    Manifest(None, "bf16", "full", None, m.source_checksum, files, m.tensor_count,
             sum(e.bytes for e in files.values())).write(staged, fsync=False)  # fmt: skip
    assert reduce_to_delta(store, VersionRef(RUN, "bf16", 1), staged) is None
    assert Manifest.read(staged).kind == "full" and (staged / next(iter(files))).exists()


@pytest.mark.timeout(300)
def test_router_publishes_a_delta(tmp_path: Path, tiny_2shards: Path) -> None:
    store = LocalStore(tmp_path / "store")
    publish_checkpoint(store, RUN, 1, tiny_2shards, FORMATS, workers=0)
    preset = write_preset(
        tmp_path / "p.toml", [{"name": f"cpu-{f}", "weight_format": f, "min_replicas": 0} for f in FORMATS]
    )
    env = {"MIXFLEET_STORE": str(store.root), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    delta = _write_delta(tmp_path, {LM_HEAD: _changed(tiny_2shards)[LM_HEAD]})
    with router_process(preset, env=env) as router:
        h, url = router.headers, router.url + "/v1/weights"
        body = {"checkpoint": str(delta), "version": 6, "delta_of": 5}
        bad = httpx.post(url, headers=h, json=body)
        assert bad.status_code == 400 and "no bf16, fp8, nvfp4 version 5" in bad.json()["detail"], bad.text
        bad = httpx.post(url, headers=h, json={**body, "delta_of": 6})
        assert bad.status_code == 400 and "must be an older version" in bad.json()["detail"], bad.text
        job = httpx.post(url, headers=h, json={"checkpoint": str(delta), "delta_of": 1})
        assert job.status_code == 202, job.text
        job = job.json()
        deadline = time.monotonic() + 240
        while job["state"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
            job = httpx.get(router.url + f"/v1/weights/jobs/{job['job_id']}", headers=h).json()
        assert job["state"] == "done", job
        status = httpx.get(router.url + "/v1/weights", headers=h).json()
        for fmt in FORMATS:
            man = status["formats"][fmt]["manifest"]
            assert status["formats"][fmt]["pointer"] == 2
            assert man["kind"] == "delta" and man["base_version"] == 1


@pytest.mark.timeout(300)
def test_cli_publishes_a_delta_into_a_store(store: LocalStore, tmp_path: Path, tiny_2shards: Path) -> None:
    delta = _write_delta(tmp_path, {LM_HEAD: _changed(tiny_2shards)[LM_HEAD]})
    args = ["weights", "publish", "--store", str(store.root), "--run", RUN, "--formats", "bf16,fp8,nvfp4"]

    def cli(base: str, delta: Path = delta) -> subprocess.CompletedProcess:
        argv = mixfleet_argv(*args, "--delta-of", base, str(delta))
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240)

    out = cli("1")
    assert out.returncode == 0, out.stderr
    assert "version 2" in out.stdout and out.stdout.count("(delta: changed files only)") == 3, out.stdout
    bad = cli("9")
    assert bad.returncode != 0 and "must be an older version: base 9, version 3" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    nan = _changed(tiny_2shards)[LM_HEAD]
    nan[0, 0] = float("nan")
    bad = cli("2", _write_delta(tmp_path / "nan", {LM_HEAD: nan}))
    want = f"{tmp_path / 'nan' / 'delta' / 'delta.safetensors'}: tensor 'lm_head.weight' of shape"
    assert bad.returncode != 0 and want in bad.stderr and "NaN or Inf" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_a_broken_delta_chain_is_refused_naming_its_manifest(store: LocalStore, tmp_path: Path) -> None:
    """Deltas whose bases form a cycle (committed by hand: the store does not follow bases)."""
    for version, base in ((2, 3), (3, 2)):
        d = tmp_path / f"d{version}"
        d.mkdir()
        (d / "config.json").write_text("{}")
        build_manifest(d, format="bf16", kind="delta", base_version=base).write(d, fsync=False)
        store.commit(VersionRef(RUN, "bf16", version), d)
    with pytest.raises(ChecksumError, match="cyclic") as err:
        stage_version(store, VersionRef(RUN, "bf16", 2), tmp_path / "staging")
    assert err.value.path.name == "manifest.json"

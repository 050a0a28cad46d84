"""The validation ladder on a live local fleet: a clean fleet passes every level, and each injected
fault is caught at its own level and no earlier.

The tests run in order on one fleet; each leaves it serving clean weights."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest
from safetensors.torch import load_file, save_file

from tests.support.procs import mixfleet_argv
from tests.validate.conftest import RUN, Fleet
from weight_sync.convert import convert_checkpoint
from weight_sync.manifest import MANIFEST_NAME, Manifest, build_manifest
from weight_sync.types import FormatRef, VersionRef

SCALE = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"


def _validate(fleet: Fleet, *args: str) -> tuple[int, dict]:
    out = fleet.cli("validate", "--json", *args)
    assert out.returncode in (0, 1), out.stdout + out.stderr
    return out.returncode, json.loads(out.stdout)


def _levels(report: dict, group: str) -> dict[int, dict]:
    g = next(x for x in report["groups"] if x["group"] == group)
    return {lv["level"]: lv for lv in g["levels"]}


@pytest.mark.timeout(600)
def test_clean_fleet_passes_every_level(fleet: Fleet, tmp_path) -> None:
    before = fleet.latest()
    code, report = _validate(fleet, "--out", str(tmp_path / "out"))
    assert code == 0 and report["ok"], json.dumps(report, indent=1)[:6000]
    for g in report["groups"]:
        assert [lv["level"] for lv in g["levels"]] == [1, 2, 3, 4, 5, 6], g["group"]
        levels = {lv["level"]: lv for lv in g["levels"]}
        assert levels[3]["details"]["linears"][0].get("engine_vs_qdq"), "the local engine ran the operator"
        assert levels[5]["details"]["agreement"], "the engine returned routed experts"
    assert (
        report["live_update"]["perturbed"] == before + 1
        and report["live_update"]["rolled_back"] == before + 2
    )
    page = (tmp_path / "out" / "validate.html").read_text()
    assert page.count("data:image/png;base64,") == 6
    assert json.loads((tmp_path / "out" / "validate.json").read_text())["ok"]


def _publish_with_corrupt_scale(fleet: Fleet, tiny_base, version: int) -> None:
    """Publish ``version`` of every format; fp8's ``SCALE`` tensor is four times what the converter
    wrote (committed with a manifest of the corrupted bytes: the store and the engine accept it)."""
    for fmt in ("bf16", "fp8", "nvfp4"):
        ref = VersionRef(RUN, fmt, version)
        staged = fleet.store.staging_dir(ref)
        convert_checkpoint(tiny_base, staged, fmt, workers=1)
        if fmt == "fp8":
            shard = staged / "model.safetensors"
            tensors = load_file(str(shard))
            tensors[SCALE] = tensors[SCALE] * 4
            save_file(tensors, str(shard), metadata={"format": "pt"})
            old = Manifest.read(staged)
            (staged / MANIFEST_NAME).unlink()
            new = build_manifest(staged, format=fmt, source_checksum=old.source_checksum)
            dataclasses.replace(new, unquantized=old.unquantized).write(staged)
        fleet.store.commit(ref, staged)
    for fmt in ("bf16", "fp8", "nvfp4"):
        fleet.store.advance(VersionRef(RUN, fmt, version))
    fleet.weights()  # the router adopts the store's latest version
    fleet.wait_active(version)


@pytest.mark.timeout(600)
def test_corrupt_scale_is_caught_at_level_2(fleet: Fleet, tiny_base, tmp_path) -> None:
    v = fleet.latest() + 1
    _publish_with_corrupt_scale(fleet, tiny_base, v)
    code, report = _validate(fleet, "--no-live-update", "--out", str(tmp_path / "out"))
    assert code == 1
    fp8 = _levels(report, "cpu-fp8")
    assert fp8[1]["ok"] and not fp8[2]["ok"] and sorted(fp8) == [1, 2], fp8
    assert any(SCALE in f and "scales" in f for f in fp8[2]["failures"]), fp8[2]["failures"]
    layer = SCALE.removesuffix(".weight_scale_inv")
    assert any(f.startswith(layer + ":") and "relative error" in f for f in fp8[2]["failures"])
    for group in ("cpu-bf16", "cpu-nvfp4"):  # the other groups' versions are clean
        assert all(lv["ok"] for lv in _levels(report, group).values()), group
    clean = v + 1
    for fmt in ("bf16", "fp8", "nvfp4"):
        staged = fleet.store.staging_dir(VersionRef(RUN, fmt, clean))
        convert_checkpoint(tiny_base, staged, fmt, workers=1)
        fleet.store.commit(VersionRef(RUN, fmt, clean), staged)
        fleet.store.advance(VersionRef(RUN, fmt, clean))
    fleet.weights()
    fleet.wait_active(clean)
    assert fleet.store.read_pointer(FormatRef(RUN, "fp8")) == clean


@pytest.mark.timeout(600)
def test_swapped_experts_are_localized_at_level_5(fleet: Fleet, tmp_path) -> None:
    fleet.fault("cpu-bf16", {"swap_experts": [0, 1, 2]})
    try:
        fleet.republish()  # the engine loads the version again, with experts 1 and 2 of layer 0 swapped
        code, report = _validate(
            fleet, "--group", "cpu-bf16", "--no-live-update", "--out", str(tmp_path / "out")
        )
    finally:
        fleet.fault("cpu-bf16", {})
        fleet.republish()
    assert code == 1
    lv = _levels(report, "cpu-bf16")
    assert [lv[n]["ok"] for n in (1, 2, 3)] == [True, True, True], {n: lv[n]["summary"] for n in lv}
    assert not lv[4]["ok"] and any("k3 KL" in f for f in lv[4]["failures"]), lv[4]
    assert not lv[5]["ok"] and 6 not in lv, lv[5]
    first = lv[5]["details"]["first_divergence"]["cpu-bf16-0"]
    assert first == {"layer": 1, "last_agreeing": 0}, lv[5]
    agree = lv[5]["details"]["agreement"]["cpu-bf16-0"]
    assert agree["0"] == 1.0 and agree["1"] < 0.97, agree
    assert "layer 0's routing" in lv[5]["failures"][0]


@pytest.mark.timeout(600)
def test_activation_never_installed_is_caught_at_level_6(fleet: Fleet, tmp_path) -> None:
    fleet.fault("cpu-nvfp4", {"skip_install": True})
    try:
        code, report = _validate(fleet, "--group", "cpu-nvfp4", "--out", str(tmp_path / "out"))
    finally:
        fleet.fault("cpu-nvfp4", {})
        fleet.republish()
    assert code == 1
    lv = _levels(report, "cpu-nvfp4")
    assert [lv[n]["ok"] for n in range(1, 6)] == [True] * 5, {n: lv[n]["summary"] for n in lv}
    assert not lv[6]["ok"], lv[6]
    assert any("after the swap" in f for f in lv[6]["failures"]), lv[6]["failures"]


def test_bad_arguments_are_one_line_errors(fleet: Fleet, tmp_path) -> None:
    out = fleet.cli("validate", "--group", "no-such-group", "--no-live-update")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == (
        "mixfleet validate: error: unknown group(s) no-such-group "
        "(the fleet has cpu-bf16, cpu-fp8, cpu-nvfp4)"
    )
    bad = tmp_path / "p.jsonl"
    bad.write_text("[1, 2, 3]\nnot json\n")
    out = fleet.cli("validate", "--prompts", str(bad))
    assert out.returncode == 2 and "line 2: not JSON" in out.stderr, out.stderr
    before = fleet.latest()
    outside = tmp_path / "outside.jsonl"
    outside.write_text("[1, 2]\n[1, 99999]\n")
    out = fleet.cli("validate", "--prompts", str(outside))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == (
        "mixfleet validate: error: prompt 2: token id 99999 is outside the model's vocabulary [0, 267)"
    )
    out = fleet.cli("validate", "--max-new-tokens", "5000", "--no-live-update")
    assert out.returncode == 2 and "exceed the model's context of 2048" in out.stderr, out.stderr
    out = fleet.cli("validate", "--store", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stdout + out.stderr
    assert f"--store {tmp_path / 'nowhere'}: not a directory" in out.stderr, out.stderr
    assert fleet.latest() == before  # bad input published nothing
    env = {k: v for k, v in {**os.environ, **fleet.env}.items() if k != "MIXFLEET_STORE"}
    out = subprocess.run(
        mixfleet_argv("validate", "--no-live-update"), capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.startswith("mixfleet validate: error: no version store: pass --store ROOT"), out.stderr

"""The GPU check, run the way the suite can: the local CPU engine in SGLang's place, every other
process the production one (router, replicas with staging, sidecar and reconciler). Its record and
span checks are also fed broken turns, which they must name."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.gpu_check import check_records, check_spans, engine_command, preset_toml
from fleet.specs import FleetSpec


def _turn(spans, n, versions=None, records=None):
    versions = (
        versions
        if versions is not None
        else [s["version"] for s in spans for _ in range(s["start"], s["end"])]
    )
    recs = records or [{"weight_version": v} for v in versions]
    return {"group": "g", "turn": 0, "output_ids": list(range(n)), "weight_versions": spans, "records": recs}


def test_spans_accepted_and_every_break_named() -> None:
    ok = _turn([{"version": 3, "start": 0, "end": 4}, {"version": 4, "start": 4, "end": 6}], 6)
    assert check_spans(ok, {3, 4}) == []
    gap = _turn([{"version": 3, "start": 0, "end": 3}, {"version": 4, "start": 4, "end": 6}], 6, [3] * 6)
    assert "does not continue at 3" in check_spans(gap, {3, 4})[0]
    backwards = _turn([{"version": 4, "start": 0, "end": 3}, {"version": 3, "start": 3, "end": 6}], 6)
    assert "span version 3 after 4" in check_spans(backwards, {3, 4})[0]
    unknown = _turn([{"version": 9, "start": 0, "end": 6}], 6)
    assert "span version 9" in check_spans(unknown, {3, 4})[0]
    short = _turn([{"version": 3, "start": 0, "end": 5}], 6, [3] * 6)
    assert "spans end at 5" in check_spans(short, {3})[0]
    wrong_record = _turn([{"version": 3, "start": 0, "end": 2}], 2, [3, 4])
    assert "record versions" in check_spans(wrong_record, {3, 4})[0]
    assert "no weight-version spans" in check_spans(_turn([], 2, [3, 3]), {3})[0]


def test_records_accepted_and_every_break_named() -> None:
    good = {
        "token_id": 5,
        "logprob": -0.5,
        "support_ids": [5, 7],
        "support_logprobs": [-0.5, -0.9327521295671886],
    }
    turn = {"group": "g", "turn": 0, "records": [good]}
    assert check_records(turn) == []
    cases = {
        "empty support": {**good, "support_ids": [], "support_logprobs": []},
        "is not in its support": {**good, "token_id": 6},
        "sum to": {**good, "support_logprobs": [-0.5, -0.5]},
        "is not its support log-prob": {**good, "logprob": -0.4},
    }
    for words, rec in cases.items():
        found = check_records({"group": "g", "turn": 0, "records": [rec]})
        assert len(found) == 1 and words in found[0], (words, found)


def test_sglang_command_is_the_modal_servers_argv_with_the_replicas_placeholders() -> None:
    from images.sglang import server_argv

    command = engine_command("sglang", "fp8", "fp8_e4m3", 31000)
    filled = [part.format(model="/stage/v7", port=31000, version="7") for part in shlex.split(command)]
    expected = server_argv(model_path="/stage/v7", port=31000, weight_format="fp8", kv_cache_dtype="fp8_e4m3",
                           tp_size=1, weight_version="7", python=sys.executable,
                           engine_args=["--enable-return-routed-experts"])  # fmt: skip
    assert filled == expected
    assert engine_command("local", "fp8", "auto", 31000) == ""


def test_preset_is_valid_with_one_group_per_format() -> None:
    import tomllib

    spec = FleetSpec.model_validate(tomllib.loads(preset_toml(("bf16", "nvfp4"), "sglang", "B200")))
    assert all(g.returns_routes for g in spec.groups)  # what level 5 of the ladder needs
    assert [(g.name, g.weight_format, g.accelerator) for g in spec.groups] == [
        ("check-bf16", "bf16", "B200"),
        ("check-nvfp4", "nvfp4", "B200"),
    ]


@pytest.mark.slow
def test_check_passes_on_the_local_engine_for_every_format(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "deploy.gpu_check", "--out", str(out), "--model", str(tiny_dir)]
    argv += ["--engine", "local", "--formats", "bf16,fp8,nvfp4", "--sessions", "2", "--turn-tokens", "64"]
    argv += ["--timeout", "300"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["failures"] == []
    activation = report["steps"]["activation"]
    verify = activation["verify"]
    assert (verify["latest"], verify["perturbed"], verify["rolled_back"]) == (0, 1, 2)
    assert set(verify["groups"]) == {"check-bf16", "check-fp8", "check-nvfp4"}
    assert activation["load_errors"] == [] and activation["turns"] > 0
    # Load ran through both activations: some turn of every group crossed one.
    assert all(n > 0 for n in activation["turns_across_an_activation"].values()), activation
    assert all(m["tokens"] > 0 and m["mean_support"] >= 1 for m in report["steps"]["masks"].values())
    # The ladder's levels 1-5 ran on every group and passed; level 5 compared the engines' routes.
    ladder = report["steps"]["ladder"]
    assert ladder["ok"] and {g["group"] for g in ladder["groups"]} == set(verify["groups"])
    for g in ladder["groups"]:
        assert [lv["level"] for lv in g["levels"]] == [1, 2, 3, 4, 5] and all(lv["ok"] for lv in g["levels"])
        assert g["levels"][4]["details"]["agreement"], g["group"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="needs a Python without SGLang")
def test_a_replica_that_exits_stops_the_check_at_once_naming_its_log(tiny_dir: Path, tmp_path: Path) -> None:
    # Without SGLang the engine exits at once and its replica with it: the check must say so now,
    # not wait out --timeout (here 600 s) for a group that cannot become ready.
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "deploy.gpu_check", "--out", str(out), "--model", str(tiny_dir)]
    argv += ["--engine", "sglang", "--formats", "bf16", "--timeout", "600"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    log = out / "logs" / "replica-bf16.log"
    assert proc.stderr.splitlines() == [
        f"gpu check: replica-bf16 exited with 2 before its group was ready; see {log}"
    ]

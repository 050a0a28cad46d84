"""The router prunes its version store (``--keep-store-versions``), through a real router process
over a real local store, driven over HTTP and through the ``mixfleet weights`` CLI.

- every job first prunes the run to its newest N versions, never a version from the lowest one a
  live replica serves upward (a replica heartbeating an old version holds every newer one), never
  what the job reads (a rollback's target); the job's events say what went and the bytes freed;
- a rollback to a pruned version is a 404 naming it; the store's files of the versions kept
  verify, the rollback's hard-linked files included;
- ``GET /v1/weights/prune?keep=N`` plans, ``POST`` prunes as a job, ``mixfleet weights prune``
  does both (dry run by default); a ``--keep`` below 1 is one line and exit 2, a 422 over HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx

from tests.support.procs import mixfleet_argv
from tests.support.router import router_process, write_preset
from trainer.client import RolloutClient
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

RUN = "r"
STREAM = FormatRef(RUN, "bf16")


def _heartbeat(router, client: httpx.Client, active: int) -> None:
    body = {"replica_id": "rep-0", "group": "cpu-bf16", "url": "http://127.0.0.1:9/", "ready": True,
            "active_version": active}  # fmt: skip
    r = client.post(f"{router.url}/v1/replicas/heartbeat", json=body)
    assert r.status_code == 200, r.text


def _pruned(job: dict) -> list[dict]:
    return [e for e in job["events"] if e["kind"] == "pruned"]


def test_the_router_prunes_at_every_job_and_never_what_replicas_or_the_job_need(tmp_path, tiny_dir) -> None:
    preset = write_preset(tmp_path / "preset.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    env = {"MIXFLEET_STORE": str(tmp_path / "store"), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    store = LocalStore(tmp_path / "store")
    with (
        router_process(preset, env=env, extra_args=("--keep-store-versions", "2")) as router,
        httpx.Client(headers=router.headers, timeout=60) as http,
        RolloutClient(router.url, router.key) as client,
    ):
        _heartbeat(router, http, 1)  # a replica still serves version 1 ...
        for v in range(1, 6):
            job = client.wait_job(client.publish(str(tiny_dir), version=v)["job_id"])
            _heartbeat(router, http, 1)
        assert store.versions(STREAM) == [1, 2, 3, 4, 5]  # ... so every version from 1 up stays
        assert _pruned(job) == []

        _heartbeat(router, http, 2)  # it moved on: 1 may go (beyond the newest 2, below 2)
        job = client.wait_job(client.publish(str(tiny_dir), version=6)["job_id"])
        assert [(e["deleted"], e["bytes_freed"] > 0) for e in _pruned(job)] == [({"bf16": [1]}, True)]
        assert store.versions(STREAM) == [2, 3, 4, 5, 6]

        _heartbeat(router, http, 6)  # every replica serves the newest: a rollback to 3 keeps 3
        r = http.post(f"{router.url}/v1/weights/rollback", json={"to": 3})
        assert r.status_code == 202, r.text
        job = client.wait_job(r.json()["job_id"])
        assert [e["deleted"] for e in _pruned(job)] == [{"bf16": [2, 4]}]
        assert job["result"]["version"] == 7 and store.versions(STREAM) == [3, 5, 6, 7]

        r = http.post(f"{router.url}/v1/weights/rollback", json={"to": 2})
        assert r.status_code == 404, r.text
        assert r.json()["detail"] == (
            f"cannot roll back run {RUN!r} to version 2: no bf16 version 2 (never published, or pruned "
            "from the store)"
        )

        # the plan, then the prune job, over HTTP (the replica now serves 7)
        _heartbeat(router, http, 7)
        r = http.get(f"{router.url}/v1/weights/prune", params={"keep": 1})
        assert r.status_code == 200 and r.json()["deleted"] == {"bf16": [3, 5, 6]}, r.text
        assert r.json()["dry_run"] is True and store.versions(STREAM) == [3, 5, 6, 7]
        assert http.get(f"{router.url}/v1/weights/prune", params={"keep": 0}).status_code == 422
        assert http.post(f"{router.url}/v1/weights/prune", json={"keep": 0}).status_code == 422

        # the CLI: a dry run by default, then --apply
        cli_env = {**os.environ, "MIXFLEET_URL": router.url, "MIXFLEET_API_KEY": router.key}

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                mixfleet_argv("weights", "prune", *args),
                capture_output=True,
                text=True,
                timeout=300,
                env=cli_env,
            )

        done = cli("--keep", "1")
        assert done.returncode == 0, done.stderr
        assert "bf16   would delete v3, v5, v6; keeps v7" in done.stdout, done.stdout
        assert "(dry run: pass --apply to delete)" in done.stdout and store.versions(STREAM) == [3, 5, 6, 7]
        bad = cli("--keep", "0")
        assert bad.returncode == 2 and bad.stdout == "", bad
        assert (
            bad.stderr
            == "mixfleet weights: error: keep must be a whole number of versions, at least 1 (got 0)\n"
        )
        done = cli("--keep", "1", "--apply", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["deleted"] == {"bf16": [3, 5, 6]}
        assert store.versions(STREAM) == [7] and store.read_pointer(STREAM) == 7
        assert store.verify(STREAM.at(7)).version == 7  # version 3's hard-linked files, intact


def test_prune_store_directly_keeps_delta_bases(tmp_path: Path, tiny_dir: Path) -> None:
    """``mixfleet weights prune --store``: no router; a kept delta's base stays."""
    import torch
    from safetensors.torch import load_file, save_file

    from weight_sync.publish import publish_checkpoint, publish_delta

    store = LocalStore(tmp_path / "store")
    for v in (1, 2):
        publish_checkpoint(store, RUN, v, tiny_dir, ["bf16"], workers=0)
    delta = tmp_path / "delta"
    delta.mkdir()
    norm = load_file(str(tiny_dir / "model.safetensors"))["model.norm.weight"]
    save_file({"model.norm.weight": norm + torch.ones_like(norm)}, str(delta / "model.safetensors"))
    publish_delta(store, RUN, 3, delta, 1, ["bf16"], workers=0)  # 3 = 1 + the changed norm
    argv = mixfleet_argv("weights", "prune", "--store", str(tmp_path / "store"), "--run", RUN, "--keep", "1")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "bf16   would delete v2; keeps v1, v3" in done.stdout, done.stdout
    assert "MB freed" in done.stdout and store.versions(STREAM) == [1, 2, 3]
    done = subprocess.run([*argv, "--apply"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert store.versions(STREAM) == [1, 3]
    store.verify(STREAM.at(1))
    missing = subprocess.run(
        mixfleet_argv("weights", "prune", "--store", str(tmp_path / "nowhere"), "--keep", "1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "not a directory" in missing.stderr


def test_prune_store_directly_names_an_unknown_run_and_the_stores_runs(tmp_path: Path) -> None:
    """``weights prune --store ROOT --run NAME`` for a run the store does not have printed an
    empty plan ("keeping the newest 1 versions: ... would delete 0 versions") and exited 0: a
    misspelt run looked like nothing to prune. One line naming it and the runs the store has, exit 2."""
    from tests.weight_sync.publisher import FMT, publish
    from tests.weight_sync.publisher import RUN as STORED

    publish(tmp_path / "store", 1, "a")
    for run in (["--run", "nope"], []):  # without --run: the run "default"
        argv = mixfleet_argv("weights", "prune", "--store", str(tmp_path / "store"), *run, "--keep", "1")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        (line,) = done.stderr.strip().splitlines()
        name = run[1] if run else "default"
        assert f"has no run {name!r}" in line and f"the store's runs: {STORED})" in line, line
    argv = mixfleet_argv(
        "weights", "prune", "--store", str(tmp_path / "store"), "--run", STORED, "--keep", "1"
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"{FMT:6s} would delete nothing; keeps v1" in done.stdout, done.stdout

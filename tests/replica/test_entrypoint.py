"""The replica entrypoint (``replica.entrypoint.run_replica`` as ``mixfleet replica``) on real processes.

A store holds version 0 of the ``tiny`` base policy (bf16); a real router knows the group and
publishes into that store; the entrypoint runs as its own process with the local CPU engine in
SGLang's place. It stages version 0 to its own directory (the engine loads that copy, not the
store's), starts the engine on a private port and the sidecar on the public one, reports ready
to the router, serves a turn through the router, then activates version 1 published through the
router's ``/v1/weights`` and serves it. SIGTERM stops the replica and both its processes.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from router.config import SCOPES
from tests.support.models import make_model_dir
from tests.support.procs import REPO, free_port, mixfleet_argv, process
from tests.support.router import ALL_SCOPES, RouterHandle, router_process, write_preset
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

RUN, GROUP, FMT = "run", "cpu-bf16", "bf16"
# The scope a sidecar's heartbeat key needs on this router.
REPLICA_SCOPE = "replica" if "replica" in SCOPES else "admin"


def _wait(pred, what: str, timeout: float, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            tail = "\n".join(
                f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in log.glob("*.log")
            )
            raise AssertionError(f"{what} within {timeout}s\n{tail}")
        time.sleep(0.2)


def _group(router, headers) -> dict:
    r = httpx.get(router.url + "/v1/groups", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return next(g for g in r.json()["groups"] if g["name"] == GROUP)


def _turn(router, headers) -> dict:
    sid = httpx.post(router.url + "/v1/sessions", headers=headers, json={"group": GROUP}, timeout=30)
    assert sid.status_code == 200, sid.text
    turn = httpx.post(
        router.url + f"/v1/sessions/{sid.json()['session_id']}/turns",
        headers=headers,
        json={
            "input_ids": [72, 101, 108, 108, 111],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
        },
        timeout=120,
    )
    assert turn.status_code == 200, turn.text
    return turn.json()


def _publish_version_1(
    router: RouterHandle, h: dict[str, str], trained: Path, store_root: Path, logs: Path
) -> None:
    """Publish ``trained`` as version 1 through the router, wait for the job, check the store's
    pointer moved, and wait until the router sees the group active at version 1."""
    job = httpx.post(
        router.url + "/v1/weights",
        headers=h,
        json={"checkpoint": str(trained), "version": 1},
        timeout=60,
    )
    assert job.status_code == 202, job.text
    job_id = job.json()["job_id"]

    def done():
        j = httpx.get(router.url + f"/v1/weights/jobs/{job_id}", headers=h, timeout=10).json()
        assert j["state"] in ("running", "done"), j
        return j if j["state"] == "done" else None

    _wait(done, "the publish job never finished", 300, logs)
    assert LocalStore(store_root).read_pointer(FormatRef(RUN, FMT)) == 1
    _wait(
        lambda: _group(router, h)["active_version"] == 1,
        "the replica never activated version 1",
        300,
        logs,
    )


@pytest.mark.timeout(600)
def test_replica_entrypoint_stages_serves_and_activates_a_publish(tmp_path) -> None:
    models = tmp_path / "models"
    base, trained = make_model_dir(models, "tiny", FMT), make_model_dir(models, "tiny", FMT, seed=2)
    store_root, stage, logs = tmp_path / "store", tmp_path / "stage", tmp_path / "logs"
    logs.mkdir()
    publish_checkpoint(LocalStore(store_root), RUN, 0, base, [FMT], workers=0)

    admin, replica_key = secrets.token_hex(16), secrets.token_hex(16)
    keys = {admin: ALL_SCOPES, replica_key: [REPLICA_SCOPE]}
    preset = write_preset(
        tmp_path / "preset.toml",
        [{"name": GROUP, "weight_format": FMT, "sessions_per_replica": 4, "min_replicas": 1}],
    )
    router_env = {"MIXFLEET_STORE": str(store_root), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    h = {"Authorization": f"Bearer {admin}"}
    with router_process(
        preset, keys=keys, env=router_env, log=logs / "router.log", extra_args=("--heartbeat-timeout", "5")
    ) as router:
        port = free_port()
        argv = mixfleet_argv(
            "replica", "--preset", str(preset), "--group", GROUP, "--store", str(store_root), "--run", RUN,
            "--port", str(port), "--stage-dir", str(stage), "--router", router.url, "--log-dir", str(logs),
            "--replica-id", "r0", "--ready-timeout", "300", "--sidecar-flag=--poll-s", "--sidecar-flag=0.2",
            "--sidecar-flag=--heartbeat-s", "--sidecar-flag=0.5",
        )  # fmt: skip
        env = {"MIXFLEET_API_KEY": replica_key}
        with process(argv, log=logs / "replica.log", env=env) as replica:
            g = _wait(
                lambda: (lambda g: g if g["ready_replicas"] == 1 and g["active_version"] == 0 else None)(
                    _group(router, h)
                ),
                "the router never saw the replica ready at version 0",
                300,
                logs,
            )
            assert replica.poll() is None
            text = (logs / "replica.log").read_text()
            assert "replica r0 ready at version 0" in text, text
            # The engine serves the staged copy on the replica's own disk, not the store's files.
            sidecar_url = f"http://127.0.0.1:{port}"
            info = httpx.get(sidecar_url + "/server_info", timeout=10).json()
            assert Path(info["model_path"]) == (stage / "v000000").resolve(), info
            assert info["enable_return_routed_experts"] is True  # what GroupSpec.returns_routes says
            assert sorted(p.name for p in stage.iterdir()) == ["v000000"]
            status = httpx.get(sidecar_url + "/v1/status", timeout=10).json()
            assert status["ready"] and status["active_version"] == 0 and status["url"] == sidecar_url
            assert status["engine_url"] != sidecar_url and g["ready_replicas"] == 1

            first = _turn(router, h)
            assert {rec["weight_version"] for rec in first["records"]} == {0}, first["records"][:2]
            assert [s["version"] for s in first["weight_versions"]] == [0]

            _publish_version_1(router, h, trained, store_root, logs)
            status = httpx.get(sidecar_url + "/v1/status", timeout=10).json()
            assert status["active_version"] == 1 and status["error"] is None, status
            info = httpx.get(sidecar_url + "/model_info", timeout=10).json()  # /server_info: start-up args
            assert Path(info["model_path"]) == (stage / "v000001").resolve(), info
            second = _turn(router, h)
            assert {rec["weight_version"] for rec in second["records"]} == {1}
            assert second["output_ids"] != first["output_ids"] or second["records"] != first["records"]

            engine_pid = httpx.get(status["engine_url"] + "/server_info", timeout=10).json()["pid"]
            os.kill(replica.pid, signal.SIGTERM)
            assert replica.wait(timeout=60) == 0
            _wait(lambda: not _alive(engine_pid), "the engine outlived the replica", 30, logs)
            with pytest.raises(httpx.HTTPError):
                httpx.get(sidecar_url + "/health", timeout=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _replica_cli(tmp_path: Path, *extra: str, store: Path | None = None):
    preset = write_preset(tmp_path / "preset.toml", [{"name": GROUP, "weight_format": FMT}])
    store = store or tmp_path / "store"
    store.mkdir(exist_ok=True)
    argv = mixfleet_argv(
        "replica", "--preset", str(preset), "--group", GROUP, "--store", str(store), "--run", RUN,
        "--port", str(free_port()), "--stage-dir", str(tmp_path / "stage"), "--replica-id", "r0",
        "--log-dir", str(tmp_path / "logs"), *extra,
    )  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_replica_refuses_bad_input_with_one_line(tmp_path) -> None:
    cases = [
        ((), "nothing is published for run/bf16"),
        (("--group", "nope"), "has no group 'nope' (groups: cpu-bf16)"),
        (("--engine-command", "python3 {nope}"), "--engine-command: cannot fill in 'nope'"),
    ]
    for extra, message in cases:
        done = _replica_cli(tmp_path, *extra)
        assert done.returncode == 2, (extra, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (extra, done.stderr)


def test_an_engine_that_exits_fails_the_replica(tmp_path) -> None:
    """The engine command exits before it serves: the replica stops with one line naming it."""
    src = tmp_path / "v0"
    src.mkdir()
    (src / "config.json").write_text("{}")
    LocalStore(tmp_path / "store").publish(FormatRef(RUN, FMT).at(0), src)
    done = _replica_cli(tmp_path, "--engine-command", "python3 -c 'import sys; sys.exit(3)' {model} {port}")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("mixfleet replica: error: engine-r0 exited with 3; see ")
    )
    assert (tmp_path / "stage" / "v000000" / "config.json").read_text() == "{}"  # it had staged v0


def test_the_engine_never_returns_log_probs_before_temperature(tmp_path, monkeypatch) -> None:
    """SGLANG_RETURN_ORIGINAL_LOGPROB set in the replica's environment does not reach the engine
    (core.sglang_release.ENGINE_ENV): an unfiltered turn's mu is output_token_logprobs."""
    src = tmp_path / "v0"
    src.mkdir()
    (src / "config.json").write_text("{}")
    LocalStore(tmp_path / "store").publish(FormatRef(RUN, FMT).at(0), src)
    seen = tmp_path / "seen"
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    engine = tmp_path / "engine.py"
    engine.write_text(
        "import os, sys\n"
        f"open({str(seen)!r}, 'w').write(os.environ['SGLANG_RETURN_ORIGINAL_LOGPROB'])\n"
        "sys.exit(3)\n"
    )
    done = _replica_cli(tmp_path, "--engine-command", f"python3 {engine} {{model}} {{port}}")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert seen.read_text() == "false"

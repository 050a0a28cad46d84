"""``mixfleet up`` end to end: a fresh data dir becomes a serving fleet, a published version
reaches every group, and Ctrl-C stops every process it started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.procs import free_port, kill_group, mixfleet_argv


def _wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if m := re.search(pattern, text, re.M):
            return m
        if proc.poll() is not None:
            raise AssertionError(f"mixfleet up exited with {proc.returncode}:\n{text}")
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout}s:\n{text}")


def _alive(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_up_serves_publishes_and_stops_cleanly(tmp_path: Path) -> None:
    port, data, out = free_port(), tmp_path / "data", tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}
    argv = mixfleet_argv("up", "--model-preset", "tiny", "--port", str(port), "--data-dir", str(data))
    with open(out, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_for_line(out, r"^mixfleet is up: (http://\S+)", proc, timeout=300)
        key = _wait_for_line(out, r"^  (mf-\S+)$", proc, timeout=5).group(1)
        assert (data / "api_key").read_text().strip() == key
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(url + "/v1/groups").status_code == 401

        groups = httpx.get(url + "/v1/groups", headers=auth).json()["groups"]
        assert {g["name"]: g["active_version"] for g in groups} == {
            "cpu-bf16": 0, "cpu-fp8": 0, "cpu-nvfp4": 0,
        }  # fmt: skip
        sid = httpx.post(url + "/v1/sessions", json={}, headers=auth).json()["session_id"]
        turn = httpx.post(
            url + f"/v1/sessions/{sid}/turns",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "top_p": 0.9}},
            headers=auth,
            timeout=60,
        ).json()
        n = len(turn["output_ids"])  # 5, or fewer when the sampled text ended (EOS)
        assert n == len(turn["records"]) and 1 <= n <= 5, turn
        assert n == 5 or turn["finish_reason"]["type"] == "stop", turn["finish_reason"]
        assert all(r["weight_version"] == 0 for r in turn["records"])

        # The README's promise: with `up` running, publishing the base as version 1 just works.
        pub = subprocess.run(
            mixfleet_argv("weights", "publish", "--version", "1", str(data / "base"), "--json"),
            env={**env, "MIXFLEET_URL": url, "MIXFLEET_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert pub.returncode == 0, pub.stderr
        assert json.loads(pub.stdout)["result"]["version"] == 1
        groups = httpx.get(url + "/v1/groups", headers=auth).json()["groups"]
        assert all(g["active_version"] == 1 for g in groups)
        replica_ports = [int(r["url"].rsplit(":", 1)[1]) for g in groups for r in g["replicas"]]

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in out.read_text()
        assert not _alive(port) and not any(_alive(p) for p in replica_ports)
    finally:
        kill_group(proc)


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            mixfleet_argv("up", "--port", str(port), "--data-dir", str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 2
    assert f"port {port}" in r.stderr and "Traceback" not in r.stderr


def test_free_ports_are_never_handed_out_twice() -> None:
    # The kernel hands out a port it just returned again soon enough (birthday odds over ~28k
    # ephemeral ports are ~99% for 500 draws); two engines would then be told to share it.
    from fleet.tcp import free_port as fleet_free_port

    ports = [fleet_free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


@pytest.mark.timeout(120)
def test_up_refuses_an_engine_port_answered_by_another_process(tmp_path: Path) -> None:
    from fleet.launch import Child, ChildFailed, Probe
    from tests.support.engines import engine_argv
    from tests.support.models import make_model_dir
    from tests.support.procs import process, wait_http

    model = make_model_dir(tmp_path, "tiny", "bf16")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with process(engine_argv(model, port), log=tmp_path / "engine.log") as engine, Probe() as probe:
        wait_http(url + "/health", timeout=120, proc=engine)
        probe.check_own_engine(url, Child("engine-a", tmp_path / "engine.log", engine))
        refused = pytest.raises(ChildFailed, match=f"served by process {engine.pid}, not by this engine")
        with process(["sleep", "60"]) as other, refused:  # as if this one had failed to bind the port
            probe.check_own_engine(url, Child("engine-b", tmp_path / "b.log", other))

"""The router knows the latest published version from its first request (it reads the store's
pointers when it starts, before serving) and follows pointers moved behind its back, without any
weights call: a real router process, a real engine, a real LocalStore. A router with a store
stops its conversion workers when it is stopped, leaving no process and no semaphore behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from replica.sidecar import parse_prometheus
from tests.support.engines import engine_process
from tests.support.router import router_process, write_preset
from weight_sync.store.local import LocalStore
from weight_sync.types import VersionRef

RUN = "run"


@pytest.mark.timeout(180)
def test_latest_version_and_lag_are_known_at_startup(
    tmp_path: Path, tiny_base: Path, tiny_seed2: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    store.publish(VersionRef(RUN, "bf16", 1), tiny_base)  # a BF16 checkpoint is its own bf16 version
    store.publish(VersionRef(RUN, "bf16", 3), tiny_seed2)
    # A plain engine (static replica, no sidecar to move it) still serving version 1.
    with engine_process(store.version_dir(VersionRef(RUN, "bf16", 1)), weight_version=1) as engine:
        preset = write_preset(
            tmp_path / "p.toml", [{"name": "cpu-bf16", "weight_format": "bf16", "replicas": [engine]}]
        )
        env = {"MIXFLEET_STORE": str(store.root), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
        with router_process(preset, env=env, extra_args=("--max-version-lag", "2")) as router:
            # The first request after /healthz: no weights route was called.
            snap = httpx.get(router.url + "/v1/groups", headers=router.headers, timeout=10).json()
            assert snap["latest_version"] == 3, snap
            g = snap["groups"][0]
            assert g["active_version"] == 1 and g["version_lag"] == 2, g
            assert g["ready_replicas"] == 1 and g["replicas"][0]["in_rotation"], g  # lag 2 <= 2
            metrics = parse_prometheus(httpx.get(router.url + "/metrics", timeout=10).text)
            assert metrics["mixfleet_weights_published_version"] == 3

            # A version published straight into the store (not through this router) is adopted,
            # and the replica, now 3 behind, leaves rotation.
            store.publish(VersionRef(RUN, "bf16", 4), tiny_base)
            deadline = time.monotonic() + 20
            while True:
                snap = httpx.get(router.url + "/v1/groups", headers=router.headers, timeout=10).json()
                if snap["latest_version"] == 4:
                    break
                assert time.monotonic() < deadline, snap
                time.sleep(0.2)
            g = snap["groups"][0]
            assert g["ready_replicas"] == 0 and not g["replicas"][0]["in_rotation"], g
            assert g["replicas"][0]["active_version"] == 1


def _group_members(pgid: int) -> dict[int, str]:
    """Live (not zombie) processes of process group ``pgid``: pid -> command line."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out[int(entry)] = cmdline
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["group", "router"])
def test_stopping_the_router_stops_its_conversion_workers_cleanly(tmp_path: Path, target: str) -> None:
    """SIGTERM to the router's process group (as ``mixfleet up`` stops it) or to the router
    alone: it exits, no conversion worker outlives it, and its log has no leaked semaphore."""
    preset = write_preset(
        tmp_path / "p.toml", [{"name": "cpu-bf16", "weight_format": "bf16", "replicas": []}]
    )
    env = {"MIXFLEET_STORE": str(tmp_path / "store"), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "2"}
    log = tmp_path / "router.log"
    with router_process(preset, env=env, log=log) as router:
        pgid = router.proc.pid
        deadline = time.monotonic() + 60
        while sum("spawn_main" in c for c in _group_members(pgid).values()) < 2:  # the pool's workers
            assert router.proc.poll() is None and time.monotonic() < deadline, _group_members(pgid)
            time.sleep(0.2)
        if target == "group":
            os.killpg(pgid, signal.SIGTERM)
        else:
            os.kill(router.proc.pid, signal.SIGTERM)
        router.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any("spawn_main" in c for c in _group_members(pgid).values()):
            assert time.monotonic() < deadline, f"workers outlived the router: {_group_members(pgid)}"
            time.sleep(0.2)
        time.sleep(1.0)  # the resource tracker reports leaks when the last process using it exits
        text = log.read_text(errors="replace")
        assert "leaked semaphore" not in text and "Traceback" not in text, text

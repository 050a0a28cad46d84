"""``mixfleet up``'s supervision of a serving replica (:class:`launcher.children.Supervisor`), on
real engine and sidecar processes over HTTP: a process that stops answering (SIGSTOP: hung, its
port still open) for ``unresponsive_s`` is killed and restarted -- a sidecar alone, an engine
with a new sidecar -- and counted in the new sidecar's ``mixfleet_replica_restarts_total``; an
engine paused as an activation pauses it, and a real activation, are not taken for that."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launcher.children import Launcher, Probe, Replica, ReplicaSpec, Supervisor
from replica.sidecar import parse_prometheus
from tests.support.fleet import SIDECAR_FLAGS
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

RUN = "run"
UNRESPONSIVE_S = 2.0


@dataclass
class Supervised:
    supervisor: Supervisor
    replica: Replica
    events: list[str]
    store: LocalStore
    base: Path

    def tick_until(self, done: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"{what} within {timeout} s; events: {self.events}"
            self.supervisor.tick()
            time.sleep(0.05)

    def serving_again(self, restarts: int) -> bool:
        return self.replica.restarts == restarts and self.replica.state == "running"

    def exported_restarts(self) -> float:
        metrics = parse_prometheus(httpx.get(self.replica.url + "/metrics", timeout=10).text)
        return metrics["mixfleet_replica_restarts_total"]


@pytest.fixture(scope="module")
def supervised(tmp_path_factory, tiny_dir: Path) -> Iterator[Supervised]:
    work = tmp_path_factory.mktemp("supervised")
    store = LocalStore(work / "store")
    publish_checkpoint(store, RUN, 1, tiny_dir, ["bf16"], workers=0)
    events: list[str] = []
    with Launcher(store.root, RUN, engine_threads=1) as launcher, Probe(timeout_s=0.5) as probe:
        replica = launcher.replica(
            ReplicaSpec("cpu-0", "cpu", "bf16", sidecar_flags=(*SIDECAR_FLAGS, "--stage-mode", "inplace")),
            staging_dir=work / "staging",
            engine_log=work / "engine.log",
            sidecar_log=work / "sidecar.log",
        )
        supervisor = Supervisor(
            launcher,
            [replica],
            lambda fmt: store.read_pointer(FormatRef(RUN, fmt)) or 0,
            probe,
            ready_timeout_s=120,
            backoff_initial_s=0.2,
            unresponsive_s=UNRESPONSIVE_S,
            check_interval_s=0.25,
            on_event=events.append,
        )
        supervisor.start()
        supervisor.wait_running(time.monotonic() + 180)
        supervisor.strict = False
        yield Supervised(supervisor, replica, events, store, tiny_dir)


@pytest.mark.timeout(120)
def test_a_hung_sidecar_is_killed_and_restarted_alone(supervised: Supervised) -> None:
    r = supervised.replica
    assert r.engine is not None and r.sidecar is not None
    engine, sidecar, restarts = r.engine, r.sidecar, r.restarts
    os.kill(sidecar.pid, signal.SIGSTOP)
    supervised.tick_until(lambda: supervised.serving_again(restarts + 1), "the sidecar restarted")
    assert sidecar.returncode() == -signal.SIGKILL  # killed (and reaped), not left stopped
    assert r.engine is engine and engine.returncode() is None and r.sidecar.pid != sidecar.pid
    assert any(e.startswith("sidecar-cpu-0 did not answer for") for e in supervised.events), supervised.events
    assert supervised.exported_restarts() == restarts + 1


@pytest.mark.timeout(120)
def test_a_hung_engine_is_killed_and_restarted_with_a_new_sidecar(supervised: Supervised) -> None:
    r = supervised.replica
    assert r.engine is not None and r.sidecar is not None
    engine, sidecar, restarts = r.engine, r.sidecar, r.restarts
    os.kill(engine.pid, signal.SIGSTOP)
    supervised.tick_until(lambda: supervised.serving_again(restarts + 1), "the engine restarted")
    assert engine.returncode() == -signal.SIGKILL and sidecar.returncode() == -signal.SIGKILL
    assert r.engine.pid != engine.pid and r.sidecar.pid != sidecar.pid
    assert any(e.startswith("engine-cpu-0 did not answer for") for e in supervised.events), supervised.events
    assert supervised.exported_restarts() == restarts + 1
    answer = httpx.post(
        r.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text


@pytest.mark.timeout(120)
def test_a_paused_engine_and_an_activation_are_not_unresponsive(supervised: Supervised) -> None:
    """The engine answers ``/health`` while paused (as every activation pauses it), longer than
    ``unresponsive_s``; a version published meanwhile is activated; nothing is restarted."""
    r = supervised.replica
    restarts = r.restarts
    httpx.post(r.engine_url + "/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()
    try:
        until = time.monotonic() + 2 * UNRESPONSIVE_S
        supervised.tick_until(lambda: time.monotonic() > until, "the pause lasted")
    finally:
        httpx.post(r.engine_url + "/continue_generation", json={}, timeout=10).raise_for_status()
    publish_checkpoint(supervised.store, RUN, 2, supervised.base, ["bf16"], workers=0)

    def active() -> int | None:
        return httpx.get(r.url + "/v1/status", timeout=10).json()["active_version"]

    supervised.tick_until(lambda: active() == 2, "version 2 active")
    assert (r.restarts, r.state) == (restarts, "running"), supervised.events

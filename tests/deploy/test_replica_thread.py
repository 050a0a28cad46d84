"""The server's start-up wait (:meth:`deploy.replica_thread.ReplicaThread.wait_ready`, what
``@modal.enter`` blocks on before Modal registers the container): it returns only once the
sidecar answers ``/health`` 200 and its engine serves the store's current version. Shown on the
real replica entrypoint (``replica.entrypoint.run_replica``: a local engine behind a real sidecar on a
real store): ready at version 0; not ready while the engine does not answer (stopped with
SIGSTOP) although the sidecar does; not ready while the store's current version is one the
replica cannot activate (a corrupt copy: the engine keeps serving the older version); ready again
once a good version is current. A port that accepts TCP is not enough; an entrypoint that fails
fails the start at once with its error; stop reaches the entrypoint."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from deploy.replica_thread import ReplicaFailed, ReplicaThread, serves_current
from fleet.specs import GroupSpec
from launcher.children import engine_argv, mixfleet_command
from replica.entrypoint import ReadyReplica, run_replica
from tests.support.models import make_model_dir
from tests.support.procs import free_port
from weight_sync.publish import publish_checkpoint
from weight_sync.store import StoreLocation
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

RUN, FMT = "run", "bf16"
SIDECAR_FLAGS = ("--poll-s", "0.2", "--heartbeat-s", "0.5", "--backoff-max-s", "1")


def _accept_and_close(port: int):
    def target(stop: threading.Event) -> None:
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(0.05)
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                    conn.close()
                except TimeoutError:
                    pass

    return target


def _commit_copy(store: LocalStore, of: int, version: int, *, corrupt: bool) -> None:
    """Commit the files of version ``of`` as ``version`` (one file damaged after the commit when
    ``corrupt``: its checksum no longer matches the manifest), then move the pointer to it."""
    stream = FormatRef(RUN, FMT)
    store.commit(stream.at(version), store.version_dir(stream.at(of)))
    if corrupt:
        victim = sorted(store.version_dir(stream.at(version)).glob("*.safetensors"))[0]
        os.chmod(victim, 0o644)
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    store.advance(stream.at(version))


@pytest.mark.timeout(600)
def test_ready_only_while_the_engine_serves_the_stores_current_version(tmp_path) -> None:
    store_root, logs = tmp_path / "store", tmp_path / "logs"
    logs.mkdir()
    store = LocalStore(store_root)
    publish_checkpoint(store, RUN, 0, make_model_dir(tmp_path / "models", "tiny", FMT), [FMT], workers=0)
    port, engine_port, ready = free_port(), free_port(), []

    def argv(model: str, version: str | None) -> list[str]:
        return [*mixfleet_command(), *engine_argv(Path(model), engine_port, int(version or 0))]

    kwargs = dict(
        group=GroupSpec(name="cpu-bf16", accelerator="cpu", weight_format=FMT),
        run_id=RUN,
        store=StoreLocation(store_root),
        stage_dir=tmp_path / "stage",
        engine_argv=argv,
        engine_port=engine_port,
        public_port=port,
        host="127.0.0.1",
        log_dir=logs,
        on_ready=ready.append,
        ready_timeout_s=300,
        grace_s=5,
        sidecar_flags=SIDECAR_FLAGS,
    )
    replica = ReplicaThread(lambda stop: run_replica(**kwargs, stop=stop), name="replica").start()
    try:
        status = replica.wait_ready(port, timeout_s=300, poll_s=0.2)
        assert status["ready"] and (status["active_version"], status["desired_version"]) == (0, 0)
        deadline = time.monotonic() + 30
        while not ready:
            assert time.monotonic() < deadline and replica.alive
            time.sleep(0.1)
        (started,) = ready
        assert isinstance(started, ReadyReplica)

        os.kill(started.engine_pid, signal.SIGSTOP)  # the sidecar answers; its engine does not
        try:
            with pytest.raises(
                ReplicaFailed, match=r"was not ready within 3s: its /health does not answer 200"
            ):
                replica.wait_ready(port, timeout_s=3, poll_s=0.2)
        finally:
            os.kill(started.engine_pid, signal.SIGCONT)
        assert replica.wait_ready(port, timeout_s=60, poll_s=0.2)["active_version"] == 0

        _commit_copy(store, 0, 1, corrupt=True)  # current is 1; the replica cannot activate it
        deadline = time.monotonic() + 60
        while True:
            status = _status(port)
            if status.get("desired_version") == 1 and status.get("error"):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["ready"] and status["active_version"] == 0  # /health stays 200 on version 0
        with pytest.raises(
            ReplicaFailed, match="its engine serves version 0, the store's current version is 1"
        ):
            replica.wait_ready(port, timeout_s=2, poll_s=0.2)

        _commit_copy(store, 0, 2, corrupt=False)
        status = replica.wait_ready(port, timeout_s=120, poll_s=0.2)
        assert (status["active_version"], status["desired_version"]) == (2, 2)
    finally:
        assert replica.stop(timeout_s=60)
    assert replica.error is None


def _status(port: int) -> dict:
    from launcher.children import Probe

    with Probe() as probe:
        code, body = probe.get_json(f"http://127.0.0.1:{port}/v1/status")
    return body if code == 200 and isinstance(body, dict) else {}


def test_what_each_sidecar_state_lacks() -> None:
    base = {"ready": True, "engine_ok": True, "active_version": 3, "desired_version": 3}
    assert serves_current(True, base) is None
    assert serves_current(True, {**base, "active_version": None, "desired_version": None}) is None
    assert serves_current(True, {**base, "active_version": 4}) is None  # pointers never move back
    assert serves_current(True, {**base, "active_version": 2}) == (
        "its engine serves version 2, the store's current version is 3"
    )
    assert serves_current(False, {**base, "engine_ok": False}) == (
        "its /health does not answer 200 (its engine does not answer)"
    )
    assert serves_current(False, base) == "its /health does not answer 200"
    assert serves_current(True, {**base, "ready": False}) == "it is not ready (engine answering: True)"
    assert serves_current(True, {**base, "engine_ok": False}) == "it is not ready (engine answering: False)"
    assert serves_current(True, None) == "its /v1/status did not answer"


def test_a_port_that_accepts_tcp_is_not_ready() -> None:
    port = free_port()
    replica = ReplicaThread(_accept_and_close(port), name="r").start()
    with pytest.raises(ReplicaFailed, match=r"was not ready within 1s: its port did not answer"):
        replica.wait_ready(port, timeout_s=1, poll_s=0.05)
    assert replica.alive and replica.stop(timeout_s=5)


def test_an_entrypoint_that_fails_fails_the_start_at_once_with_its_error() -> None:
    def target(stop: threading.Event) -> None:
        raise ModuleNotFoundError("No module named 'replica.entrypoint'")

    replica = ReplicaThread(target, name="r").start()
    began = time.monotonic()
    with pytest.raises(
        ReplicaFailed,
        match=r"ended before its sidecar on port \d+ was ready \(ModuleNotFoundError: No module",
    ) as info:
        replica.wait_ready(free_port(), timeout_s=60, poll_s=0.05)
    assert isinstance(info.value.cause, ModuleNotFoundError)
    assert time.monotonic() - began < 30  # long before the start-up timeout


def test_an_entrypoint_that_returns_without_serving_fails_the_start() -> None:
    replica = ReplicaThread(lambda stop: None, name="r").start()
    with pytest.raises(ReplicaFailed, match=r"\(returned\)") as info:
        replica.wait_ready(free_port(), timeout_s=60, poll_s=0.05)
    assert info.value.cause is None


def test_a_port_that_never_serves_times_out() -> None:
    replica = ReplicaThread(lambda stop: stop.wait(), name="r").start()
    with pytest.raises(ReplicaFailed, match="was not ready within 0.3s: its port did not answer"):
        replica.wait_ready(free_port(), timeout_s=0.3, poll_s=0.05)
    assert replica.stop(timeout_s=5)

"""The server's start-up wait: returns once the port serves, fails at once when the entrypoint ends
first (with its error), times out otherwise; stop reaches the entrypoint. Real threads and sockets."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from deploy.replica_thread import ReplicaFailed, ReplicaThread
from fleet.tcp import free_port


def _serve_until_stopped(port: int, delay_s: float, seen: list[str]):
    def target(stop: threading.Event) -> None:
        time.sleep(delay_s)
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(0.05)
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                    conn.close()
                except TimeoutError:
                    pass
        seen.append("stopped")

    return target


def test_returns_once_the_port_serves_and_stop_reaches_the_entrypoint() -> None:
    port, seen = free_port(), []
    replica = ReplicaThread(_serve_until_stopped(port, 0.3, seen), name="r").start()
    replica.wait_serving(port, timeout_s=10, poll_s=0.05)
    assert replica.alive
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    assert replica.stop(timeout_s=5)
    assert seen == ["stopped"]


def test_an_entrypoint_that_fails_fails_the_start_at_once_with_its_error() -> None:
    def target(stop: threading.Event) -> None:
        raise ModuleNotFoundError("No module named 'fleet.replica'")

    replica = ReplicaThread(target, name="r").start()
    began = time.monotonic()
    with pytest.raises(
        ReplicaFailed, match=r"ended before port \d+ served \(ModuleNotFoundError: No module"
    ) as info:
        replica.wait_serving(free_port(), timeout_s=60, poll_s=0.05)
    assert isinstance(info.value.cause, ModuleNotFoundError)
    assert time.monotonic() - began < 30  # long before the start-up timeout


def test_an_entrypoint_that_returns_without_serving_fails_the_start() -> None:
    replica = ReplicaThread(lambda stop: None, name="r").start()
    with pytest.raises(ReplicaFailed, match=r"\(returned\)") as info:
        replica.wait_serving(free_port(), timeout_s=60, poll_s=0.05)
    assert info.value.cause is None


def test_a_port_that_never_serves_times_out() -> None:
    replica = ReplicaThread(lambda stop: stop.wait(), name="r").start()
    with pytest.raises(ReplicaFailed, match="did not accept a connection within 0.3s"):
        replica.wait_serving(free_port(), timeout_s=0.3, poll_s=0.05)
    assert replica.stop(timeout_s=5)

"""A replica entrypoint run on a thread of a Modal server container, and the wait for it to serve.

Modal starts a server's container, runs its ``@modal.enter`` and then waits until the port
accepts connections. :class:`ReplicaThread` runs the (blocking) entrypoint on a daemon thread;
:meth:`ReplicaThread.wait_serving` returns once the public port accepts a connection, and raises
:class:`ReplicaFailed` as soon as the entrypoint ends first (its exception attached), so a replica
that cannot start fails its container at once instead of holding a GPU until the start-up
timeout. :meth:`ReplicaThread.stop` asks the entrypoint to stop (the event it was given) and joins.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


class ReplicaFailed(RuntimeError):
    """The replica entrypoint ended, or did not serve, before its port accepted a connection."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class ReplicaThread:
    """``target(stop)`` on a daemon thread named ``name``; ``stop`` is a :class:`threading.Event`."""

    def __init__(self, target: Callable[[threading.Event], None], name: str) -> None:
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self._target = target
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self._target(self.stop_event)
        except BaseException as exc:  # reported by wait_serving; the thread ends either way
            self.error = exc

    def start(self) -> ReplicaThread:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_serving(self, port: int, timeout_s: float, host: str = "127.0.0.1", poll_s: float = 0.5) -> None:
        """Return once ``host:port`` accepts a TCP connection; :class:`ReplicaFailed` if the entrypoint
        ends first (``cause``: its exception, None for a plain return) or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection((host, port), timeout=poll_s):
                    return
            except OSError:
                pass
            if not self.alive:
                what = f"{type(self.error).__name__}: {self.error}" if self.error else "returned"
                raise ReplicaFailed(f"the replica ended before port {port} served ({what})", self.error)
            if time.monotonic() >= deadline:
                raise ReplicaFailed(f"port {port} did not accept a connection within {timeout_s:g}s")
            self._thread.join(timeout=poll_s)

    def stop(self, timeout_s: float) -> bool:
        """Ask the entrypoint to stop and wait up to ``timeout_s``; whether the thread ended."""
        self.stop_event.set()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

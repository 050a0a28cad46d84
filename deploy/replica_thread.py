"""A replica entrypoint run on a thread of a Modal server container, and the wait for it to be ready.

Modal registers a server's container to serve as soon as its ``@modal.enter`` returns (modal 1.6.4
``_runtime/user_code_imports.py`` 370-376: the enter methods run, a sync one called directly at
line 63, then ``_FlashContainerEntry.enter``, which for a server calls ``server_forward``,
``experimental/_flash_container_entry.py`` 40-41, and that sends ``ContainerServerLifecycleReady``,
``experimental/flash_server.py`` 19-21); from then on Modal's proxy and the router's container
listing (:mod:`router.pinning`) send it requests. A port that accepts TCP is not enough: the
sidecar answers 503 until its engine serves the store's current version.

:class:`ReplicaThread` runs the (blocking) entrypoint on a daemon thread;
:meth:`ReplicaThread.wait_ready` returns once the sidecar on the public port is ready
(:func:`serves_current`), and raises :class:`ReplicaFailed` as soon as the entrypoint ends first
(its exception attached), so a replica that cannot start fails its container at once instead of
holding a GPU until the start-up timeout. :meth:`ReplicaThread.stop` asks the entrypoint to stop
(the event it was given) and joins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from clients.sidecar import STATUS_PATH
from launcher.children import Probe


class ReplicaFailed(RuntimeError):
    """The replica entrypoint ended, or was not ready, before its sidecar served the current version."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def serves_current(health_ok: bool, status: Any) -> str | None:
    """None when a sidecar whose ``/health`` answered 200 (``health_ok``) and whose ``/v1/status``
    is ``status`` is ready to take requests: ready, its engine answering, and its engine serving
    the version of the store's pointer (``active_version >= desired_version``; nothing published
    yet: ``desired_version`` null); else what is missing, in words."""
    if not isinstance(status, dict):
        return "its /v1/status did not answer"
    if not health_ok:
        return "its /health does not answer 200" + (
            "" if status.get("engine_ok") else " (its engine does not answer)"
        )
    if not status.get("ready") or not status.get("engine_ok"):
        return f"it is not ready (engine answering: {bool(status.get('engine_ok'))})"
    active, desired = status.get("active_version"), status.get("desired_version")
    if desired is not None and (active is None or active < desired):
        return f"its engine serves version {active}, the store's current version is {desired}"
    return None


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
        except BaseException as exc:  # reported by wait_ready; the thread ends either way
            self.error = exc

    def start(self) -> ReplicaThread:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(
        self, port: int, timeout_s: float, host: str = "127.0.0.1", poll_s: float = 0.5
    ) -> dict[str, Any]:
        """The sidecar's ``/v1/status`` once the sidecar at ``host:port`` is ready
        (:func:`serves_current`: ``/health`` 200 and its engine serving the store's current
        version), polled every ``poll_s`` through the fleet's probe (:class:`launcher.children.Probe`,
        the one engine client's pool). :class:`ReplicaFailed` if the entrypoint ends first
        (``cause``: its exception, None for a plain return) or ``timeout_s`` passes (naming what
        was missing last)."""
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + timeout_s
        missing = "its port did not answer"
        with Probe(timeout_s=max(poll_s, 2.0)) as probe:
            while True:
                health_ok = probe.healthy(url)
                code, status = probe.get_json(url + STATUS_PATH)
                if code:
                    missing = serves_current(health_ok, status if code == 200 else None) or ""
                    if not missing:
                        return status
                if not self.alive:
                    what = f"{type(self.error).__name__}: {self.error}" if self.error else "returned"
                    raise ReplicaFailed(
                        f"the replica ended before its sidecar on port {port} was ready ({what})", self.error
                    )
                if time.monotonic() >= deadline:
                    raise ReplicaFailed(
                        f"the sidecar on port {port} was not ready within {timeout_s:g}s: {missing}"
                    )
                self._thread.join(timeout=poll_s)

    def stop(self, timeout_s: float) -> bool:
        """Ask the entrypoint to stop and wait up to ``timeout_s``; whether the thread ended."""
        self.stop_event.set()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

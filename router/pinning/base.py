"""Pinning an engine request to the one container a replica id names (the port).

Every container of a Modal server answers at the server's one URL, and each container's sidecar
heartbeats with its own replica id, ``<group>-<MODAL_TASK_ID>`` (:func:`deploy.modal_app.replica_id`),
so the registry holds one entry per container, all with that URL. Without more, Modal's proxy picks
the container of each request, and the router's choice of replica (dispatch, failover to another
replica, ``mark_failed``, the turn's recorded ``replica``) is a guess. Modal's proxy routes a request
that carries ``modal-flash-upstream: <host>:<port>`` to the container registered at that address
(modal 1.6.4 ``experimental/flash.py`` 22, ``_FLASH_UPSTREAM_HEADER``; Stitch's router pins sessions
with it, ``cookbook/common/router.py``), and lists the containers registered to serve a server with
their task id and address (``_server.py`` 177-194, ``Server._experimental_list_containers``:
``ServerContainerInfo(container_id=task_id, host, port)``, ``types.py`` 1023-1030).

:class:`ContainerPins` keeps, per group (its server has the group's name, ``deploy/plan.py``
``ServerPlan.name``), the map replica id -> ``host:port`` from a :data:`ListContainers` adapter
(:mod:`router.pinning.modal_server`), refreshed by the router's context every few seconds. Its
:meth:`~ContainerPins.headers` go with every engine request to that replica.

A replica whose container is not listed is not routable (:meth:`~ContainerPins.upstream` is None;
the registry keeps it out of rotation and out of capacity): Modal lists a container once it is
registered to serve, i.e. after its ``@modal.enter`` returned (``_runtime/user_code_imports.py``
370-376, ``experimental/flash_server.py`` 19-21), and drops it when it leaves; a request sent to
the shared URL without a pin would land on whichever container Modal picks and record the wrong
replica. A listing that fails keeps the group's last good map (a gone container then fails its
request, which fails over and marks it failed); a group never listed has no routable replica and
says so in :attr:`ContainerPins.errors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

PIN_HEADER = "modal-flash-upstream"  # modal 1.6.4 experimental/flash.py 22
log = logging.getLogger("mixfleet.router.pinning")


@dataclass(frozen=True)
class Container:
    """One container registered to serve a group's server: its id (Modal's task id) and the
    ``host:port`` its proxy routes a pinned request to."""

    container_id: str
    upstream: str


ListContainers = Callable[[str], Awaitable[Sequence[Container]]]
"""``await list_containers(group)``: the containers now registered to serve the group's server."""


def replica_id(group: str, container_id: str) -> str:
    """The replica id a container's sidecar heartbeats with (``<group>-<MODAL_TASK_ID>``)."""
    return f"{group}-{container_id}"


class ContainerPins:
    """Replica id -> upstream of its container, per group, from ``list_containers``; each listing
    is given ``timeout_s``."""

    def __init__(self, list_containers: ListContainers, groups: Iterable[str], *, timeout_s: float = 10.0):
        self._list = list_containers
        self.groups = tuple(groups)
        self.timeout_s = timeout_s
        self._upstreams: dict[str, dict[str, str]] = {}
        self.errors: dict[str, str] = {g: "containers not listed yet" for g in self.groups}

    async def _group(self, group: str) -> dict[str, str]:
        async with asyncio.timeout(self.timeout_s):
            found = await self._list(group)
        return {replica_id(group, c.container_id): c.upstream for c in found}

    async def refresh(self) -> None:
        """List every group's containers; a group whose listing fails keeps its last map and its
        error is kept in :attr:`errors` (logged)."""
        results = await asyncio.gather(*(self._group(g) for g in self.groups), return_exceptions=True)
        for group, result in zip(self.groups, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                timed_out = isinstance(result, TimeoutError)
                what = "timed out" if timed_out else f"{type(result).__name__}: {result}"
                self.errors[group] = f"listing the containers of server {group} failed ({what})"[:300]
                log.warning("%s", self.errors[group])
                continue
            self._upstreams[group] = result
            self.errors.pop(group, None)

    def upstream(self, replica: str) -> str | None:
        """The ``host:port`` of the container of ``replica``; None while it is not listed."""
        for upstreams in self._upstreams.values():
            found = upstreams.get(replica)
            if found is not None:
                return found
        return None

    def headers(self, replica: str) -> dict[str, str]:
        """The header that pins a request to ``replica``'s container (empty when not listed)."""
        found = self.upstream(replica)
        return {PIN_HEADER: found} if found is not None else {}

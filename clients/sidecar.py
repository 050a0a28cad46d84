"""The client of a replica sidecar's own routes (:mod:`replica.sidecar`): ``GET /v1/status`` (its
reconciler's state) and ``POST /v1/wake`` (read the store pointer now).

A sidecar speaks SGLang's protocol for everything else, so this client rides on the replica's
engine client (:class:`clients.engine.SGLangClient`): the same connection pool, URL and headers
(a container pin included). Errors are the engine client's: :class:`~clients.engine.EngineUnavailable`
when no usable answer came (a 5xx, a body that is not a JSON object), :class:`~clients.engine.EngineRejected`
for a 4xx (a plain engine without a sidecar answers these routes 404).
"""

from __future__ import annotations

from typing import Any

from clients.engine import EngineUnavailable, SGLangClient

STATUS_PATH = "/v1/status"
WAKE_PATH = "/v1/wake"


class SidecarClient:
    """Calls on the sidecar at ``replica.base_url``, through ``replica`` (its engine client)."""

    def __init__(self, replica: SGLangClient) -> None:
        self.replica = replica

    async def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The sidecar's state: replica id, group, format, active and desired versions, staging,
        error, last activation, load (:meth:`replica.reconciler.Reconciler.status`)."""
        return await self._object("GET", STATUS_PATH, timeout)

    async def wake(self, timeout: float = 5.0) -> dict[str, Any]:
        """Make the sidecar read its store pointer now instead of at its next poll; its answer
        (``ok``, the ``desired_version`` it knew before this read)."""
        return await self._object("POST", WAKE_PATH, timeout)

    async def _object(self, method: str, path: str, timeout: float) -> dict[str, Any]:
        data = await self.replica.call(method, path, timeout=timeout)
        if not isinstance(data, dict):
            raise EngineUnavailable(self.replica.base_url + path, "response is not a JSON object")
        return data

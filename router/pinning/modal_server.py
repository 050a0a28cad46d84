"""The container listing of Modal servers: the one place the router touches ``modal``.

It depends on an experimental API of the installed client, ``modal 1.6.4``
``Server._experimental_list_containers()`` (``modal/_server.py`` 177-194: "This interface is
experimental and may change or be removed without warning"), which calls ``FlashContainerList``
for the server's function and returns ``ServerContainerInfo(container_id=<task id>, host, port)``
(``modal/types.py`` 1023-1030). The server is referenced by ``modal.Server.from_name(app, name,
environment_name=...)`` (``_server.py`` 322-355: lazy, hydrated on first use), once per server and
reused; a failed listing drops the reference so the next one hydrates afresh (a redeploy may have
replaced the server). The deploy names each group's server after the group (``deploy/plan.py``
``ServerPlan.name``).
"""

from __future__ import annotations

from typing import Any

from router.pinning.base import Container

EXPERIMENTAL_API = "modal.Server._experimental_list_containers"


class ClientMismatch(RuntimeError):
    """The ``modal`` client is not installed, or lacks :data:`EXPERIMENTAL_API`."""


def check_client() -> None:
    """Raises :class:`ClientMismatch` unless the installed client offers :data:`EXPERIMENTAL_API`
    (read from the class; nothing contacted)."""
    try:
        import modal
    except ImportError:
        raise ClientMismatch("the modal client is not installed (pip install modal)") from None
    if not hasattr(modal.Server, "_experimental_list_containers"):
        raise ClientMismatch(f"the installed modal {modal.__version__} has no {EXPERIMENTAL_API}")


class ModalServerContainers:
    """``await ModalServerContainers(app)(group)``: the containers now registered to serve the
    server ``group`` of the deployed app ``app`` (a :data:`router.pinning.base.ListContainers`)."""

    def __init__(self, app_name: str, environment_name: str | None = None) -> None:
        check_client()
        self.app_name = app_name
        self.environment_name = environment_name
        self._servers: dict[str, Any] = {}

    def server(self, name: str) -> Any:
        """The (lazy) ``modal.Server`` of ``name`` in the app, created once."""
        import modal

        found = self._servers.get(name)
        if found is None:
            found = modal.Server.from_name(self.app_name, name, environment_name=self.environment_name)
            self._servers[name] = found
        return found

    async def list_containers(self, name: str) -> list[Any]:
        """The server's ``ServerContainerInfo`` list (the experimental call, :data:`EXPERIMENTAL_API`)."""
        try:
            return list(await self.server(name)._experimental_list_containers.aio())
        except Exception:
            self._servers.pop(name, None)
            raise

    async def __call__(self, name: str) -> list[Container]:
        return [
            Container(info.container_id, f"{info.host}:{info.port}")
            for info in await self.list_containers(name)
        ]

"""Applies :mod:`fleet.autoscale` settings to the deployed GPU servers with Modal's autoscaler API.

Read in the installed client (``modal 1.6.4``, ``modal/_server.py``; ``modal/server.py`` wraps it
with ``synchronize_api`` as ``modal.Server``):

- ``_Server.from_name(app_name, name, *, environment_name=None, client=None)`` (lines 322-345) is a
  lazy reference: nothing is contacted until it is used;
- ``_Server.autoscaler`` (136-138) is a ``_ServerAutoscalerManager`` whose ``update(*,
  target_concurrency, min_containers, max_containers, buffer_containers, scaledown_window,
  scaleup_window)`` (686-790) overrides the settings of the deployed server until the next deploy
  resets them; it hydrates the server (contacts Modal) first and then refuses ``min_containers <
  0``, ``max_containers <= 0``, ``buffer_containers < 0``, a ``scaledown_window`` outside 2..3600
  and a non-positive ``target_concurrency`` (``InvalidError``);
- ``_Server.update_autoscaler`` (197-262) is deprecated in favour of ``autoscaler.update``.

:func:`check_client` verifies, from the installed client's signatures alone (no network), that
``update`` takes every keyword :meth:`~fleet.autoscale.ScaleSettings.update_kwargs` passes;
:func:`apply` calls it once per group on the server the deploy named for that group
(:attr:`deploy.plan.ServerPlan.name`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from deploy.plan import APP_NAME, DeployPlan
from fleet.autoscale import ScaleSettings

UPDATE_KEYWORDS = (
    "min_containers",
    "max_containers",
    "buffer_containers",
    "scaledown_window",
    "target_concurrency",
)


class ClientMismatch(RuntimeError):
    """The installed ``modal`` client does not offer the autoscaler call this adapter makes."""


def server_ref(app_name: str, server_name: str, environment_name: str | None = None) -> Any:
    """The lazy ``modal.Server`` reference of ``server_name`` in the deployed app ``app_name``."""
    import modal

    return modal.Server.from_name(app_name, server_name, environment_name=environment_name)


def check_client(server: Any) -> None:
    """Raises :class:`ClientMismatch` unless ``server.autoscaler.update`` takes every keyword of
    :data:`UPDATE_KEYWORDS` as a keyword argument (read from its signature; nothing contacted)."""
    update = getattr(getattr(server, "autoscaler", None), "update", None)
    if update is None:
        raise ClientMismatch("the installed modal client has no Server.autoscaler.update")
    params = inspect.signature(update).parameters
    usable = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    missing = [k for k in UPDATE_KEYWORDS if k not in params or params[k].kind not in usable]
    if missing:
        raise ClientMismatch(
            f"Server.autoscaler.update of the installed modal client lacks {', '.join(missing)}"
        )


def server_names(plan: DeployPlan) -> dict[str, str]:
    """Group name -> the name of its deployed server (the deploy plan's naming)."""
    return {s.group.name: s.name for s in plan.servers}


def apply(
    settings: Sequence[ScaleSettings],
    plan: DeployPlan,
    *,
    app_name: str = APP_NAME,
    environment_name: str | None = None,
    ref: Callable[[str, str, str | None], Any] = server_ref,
) -> list[Any]:
    """Override each group's autoscaler with its settings; returns what each ``update`` returned
    (Modal's ``ServerAutoscalerSettings``), in order. Every server is referenced and checked
    (:func:`check_client`) before the first update. KeyError for a group the plan has no server for."""
    names = server_names(plan)
    servers = [ref(app_name, names[s.group], environment_name) for s in settings]
    for server in servers:
        check_client(server)
    return [
        server.autoscaler.update(**s.update_kwargs()) for server, s in zip(servers, settings, strict=True)
    ]

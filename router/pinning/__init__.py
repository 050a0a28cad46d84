"""Pinning engine requests to containers (:mod:`router.pinning.base`, the port) and the factory
that picks the container listing: Modal's (:mod:`router.pinning.modal_server`) for a fleet served by
a deployed Modal app, none for a local fleet (every replica then has its own URL)."""

from __future__ import annotations

from collections.abc import Iterable

from core.errors import UserError
from router.pinning.base import PIN_HEADER, Container, ContainerPins, ListContainers

__all__ = ["PIN_HEADER", "Container", "ContainerPins", "ListContainers", "open_pins"]


def open_pins(
    modal_app: str | None, groups: Iterable[str], environment_name: str | None = None
) -> ContainerPins | None:
    """:class:`ContainerPins` over the servers of the deployed Modal app ``modal_app`` (one per
    group, named by it); None without an app. :class:`UserError` when the installed ``modal``
    client is missing or lacks the listing call."""
    if not modal_app:
        return None
    from router.pinning.modal_server import ClientMismatch, ModalServerContainers

    try:
        lister = ModalServerContainers(modal_app, environment_name)
    except ClientMismatch as exc:
        raise UserError(f"--modal-app {modal_app}: {exc}") from None
    return ContainerPins(lister, groups)

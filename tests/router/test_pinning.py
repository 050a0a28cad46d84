"""Container pins (router.pinning): the map replica id -> upstream comes from the adapter's one
listing call answering modal's own ``ServerContainerInfo`` values; a failed listing keeps the
group's last good map and says why; a replica whose container is not listed is out of rotation
(and capacity) while a static replica is not affected; a client without the experimental call is
refused at start-up in one line."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest
from modal.types import ServerContainerInfo

from core.errors import UserError
from fleet.specs import FleetSpec, GroupSpec
from mixfleet.router import build_config, default_args
from router.pinning import PIN_HEADER, ContainerPins, modal_server, open_pins
from router.pinning.modal_server import ModalServerContainers
from router.registry import Registry

GROUPS = ("g-a", "g-b")


class Listing:
    """What Modal lists per server, or the error its call raises."""

    def __init__(self) -> None:
        self.by_server: dict[str, list[ServerContainerInfo] | Exception] = {}
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, adapter: ModalServerContainers, name: str) -> list[ServerContainerInfo]:
        self.calls.append((adapter.app_name, name))
        found = self.by_server.get(name, [])
        if isinstance(found, Exception):
            raise found
        return list(found)


@pytest.fixture()
def listing(monkeypatch) -> Listing:
    fake = Listing()

    async def list_containers(self: ModalServerContainers, name: str) -> list[ServerContainerInfo]:
        return await fake(self, name)

    monkeypatch.setattr(ModalServerContainers, "list_containers", list_containers)
    return fake


def test_pins_follow_the_listing_and_keep_the_last_good_one(listing: Listing) -> None:
    pins = open_pins("mixfleet", GROUPS)
    assert isinstance(pins, ContainerPins) and open_pins(None, GROUPS) is None
    assert pins.errors == {g: "containers not listed yet" for g in GROUPS}
    listing.by_server = {"g-a": [ServerContainerInfo("ta-1", "10.0.0.1", 8000)], "g-b": []}
    asyncio.run(pins.refresh())
    assert sorted(listing.calls) == [("mixfleet", "g-a"), ("mixfleet", "g-b")]
    assert pins.upstream("g-a-ta-1") == "10.0.0.1:8000" and pins.errors == {}
    assert pins.headers("g-a-ta-1") == {PIN_HEADER: "10.0.0.1:8000"}
    assert pins.upstream("g-b-ta-1") is None and pins.headers("g-b-ta-1") == {}

    listing.by_server["g-a"] = RuntimeError("FlashContainerList: unavailable")
    listing.by_server["g-b"] = [ServerContainerInfo("tb-9", "10.0.0.2", 8001)]
    asyncio.run(pins.refresh())
    assert pins.upstream("g-a-ta-1") == "10.0.0.1:8000"  # kept: a listing hiccup is not a gone container
    assert pins.upstream("g-b-tb-9") == "10.0.0.2:8001"
    assert pins.errors == {
        "g-a": "listing the containers of server g-a failed (RuntimeError: FlashContainerList: unavailable)"
    }

    listing.by_server["g-a"] = []  # the container left
    asyncio.run(pins.refresh())
    assert pins.upstream("g-a-ta-1") is None and pins.errors == {}


def test_an_unlisted_container_is_out_of_rotation_and_capacity(listing: Listing) -> None:
    fleet = FleetSpec(
        name="t",
        groups=[
            GroupSpec(name="g-a", accelerator="cpu", sessions_per_replica=4),
            GroupSpec(name="g-b", accelerator="cpu", sessions_per_replica=4, replicas=["http://127.0.0.1:1"]),
        ],
    )
    pins = open_pins("mixfleet", GROUPS)
    registry = Registry(fleet, heartbeat_timeout_s=10.0, max_version_lag=None, pins=pins)
    now = time.monotonic()
    for task in ("ta-1", "ta-2"):
        beat = {"replica_id": f"g-a-{task}", "group": "g-a", "url": "https://a.modal.run", "ready": True}
        registry.heartbeat(beat, now=now)
    registry.poll_result("g-b/0", ready=True, version=None, error=None, now=now)
    listing.by_server = {"g-a": [ServerContainerInfo("ta-2", "10.0.0.3", 8000)]}
    asyncio.run(pins.refresh())
    assert [r.replica_id for r in registry.in_rotation("g-a", None, now)] == ["g-a-ta-2"]
    assert [r.replica_id for r in registry.in_rotation("g-b", None, now)] == ["g-b/0"]  # static: its own URL
    assert registry.serves("g-a-ta-1", "g-a", None, None) is None
    loads = {g.name: g.capacity for g in registry.group_loads({}, latest=None, now=now)}
    assert loads == {"g-a": 4.0, "g-b": 4.0}


def test_a_client_without_the_experimental_call_is_refused_at_start(monkeypatch) -> None:
    import modal

    monkeypatch.delattr(modal.Server, "_experimental_list_containers")
    with pytest.raises(UserError, match=r"^--modal-app mixfleet: the installed modal .* has no "):
        open_pins("mixfleet", GROUPS)
    args = argparse.Namespace(**default_args(preset="local", modal_app="mixfleet", insecure_no_auth=True))
    with pytest.raises(UserError, match=r"^--modal-app mixfleet: the installed modal .* has no "):
        build_config(args)  # before any router worker starts
    assert modal_server.EXPERIMENTAL_API == "modal.Server._experimental_list_containers"

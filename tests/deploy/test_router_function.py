"""The router function's body run for real (``Function.local()``, modal's own way to call it here)
on a real redis-server: one instance serves the fleet from its Redis state; two instances, as two
Modal containers would be, must serve the same fleet. It pins requests to the containers of this
app's servers; Modal's listing of them (the one adapter call,
``ModalServerContainers.list_containers``) answers with the installed client's own
``ServerContainerInfo`` of the heartbeating container."""

from __future__ import annotations

import importlib
import json
import sys
import warnings

import pytest
from fastapi.testclient import TestClient
from modal.types import ServerContainerInfo

from core.errors import UserError
from router.pinning.modal_server import ModalServerContainers
from tests.support.procs import redis_server

ADMIN = "tok-admin-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
HEARTBEAT = {
    "replica_id": "b200-bf16-container-1",
    "group": "b200-bf16",
    "url": "https://ws--mixfleet-b200-bf16.modal.run",
    "ready": True,
    "active_version": 0,
}


@pytest.fixture()
def router_module(monkeypatch, tmp_path):
    async def list_containers(self, name: str) -> list[ServerContainerInfo]:
        assert self.app_name == "mixfleet", self.app_name
        return [ServerContainerInfo("container-1", "10.0.0.7", 8000)] if name == "b200-bf16" else []

    monkeypatch.setattr(ModalServerContainers, "list_containers", list_containers)
    with redis_server() as url:
        monkeypatch.setenv("MIXFLEET_PRESET", "homogeneous")
        monkeypatch.delenv("MIXFLEET_FLEET_JSON", raising=False)
        monkeypatch.setenv("MIXFLEET_REDIS_URL", url)
        monkeypatch.setenv("MIXFLEET_API_KEYS", json.dumps({ADMIN: ["admin", "rollout", "trainer"]}))
        sys.modules.pop("deploy.modal_app", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module("deploy.modal_app")
            # the container's environment names the Volume's mount; here a directory stands in
            assert module.ENV["MIXFLEET_STORE"] == "/weights"
            monkeypatch.setenv("MIXFLEET_STORE", str(tmp_path / "store"))
            monkeypatch.setenv("MIXFLEET_RUN", module.RUN_ID)
            yield module, url
        sys.modules.pop("deploy.modal_app", None)


def _ready(client: TestClient) -> list[tuple[str, int]]:
    return [(g["name"], g["ready_replicas"]) for g in client.get("/v1/groups", headers=AUTH).json()["groups"]]


def test_the_router_container_serves_the_fleet_on_redis(router_module) -> None:
    module, url = router_module
    import redis

    with TestClient(module.router.local()) as client:
        assert client.get("/healthz").json() == {"status": "ok", "state": True, "replicas_in_rotation": 0}
        assert client.get("/v1/groups").status_code == 401  # its own keys guard the public URL
        assert _ready(client) == [("b200-bf16", 0)]
        beat = client.post("/v1/replicas/heartbeat", json=HEARTBEAT, headers=AUTH)
        assert beat.status_code == 200, beat.text
        assert _ready(client) == [("b200-bf16", 1)]
        (replica,) = client.get("/v1/groups", headers=AUTH).json()["groups"][0]["replicas"]
        assert replica["container"] == {"upstream": "10.0.0.7:8000", "error": None}
        weights = client.get("/v1/weights", headers=AUTH).json()
        assert weights["run_id"] == module.RUN_ID and list(weights["formats"]) == ["bf16"]
    redis.Redis.from_url(url).ping()


def test_two_router_containers_see_the_same_replicas(router_module) -> None:
    module, _ = router_module
    with TestClient(module.router.local()) as first, TestClient(module.router.local()) as second:
        assert first.post("/v1/replicas/heartbeat", json=HEARTBEAT, headers=AUTH).status_code == 200
        assert _ready(second) == [("b200-bf16", 1)]


def test_router_refuses_to_start_without_keys(router_module, monkeypatch) -> None:
    module, _ = router_module
    monkeypatch.delenv("MIXFLEET_API_KEYS")
    with pytest.raises(UserError, match="no API keys: set MIXFLEET_API_KEYS"):
        module.router.local()

"""The router in front of Modal GPU servers, with the local engine in SGLang's place: a real router
process reaches a real engine through a stand-in for Modal's proxy (a loopback HTTP server that,
like Modal's for a server deployed with ``unauthenticated=False``, refuses a request without the
``Modal-Key`` / ``Modal-Secret`` of the workspace's proxy auth token, and records every request it
forwards). Checked: the router sends the token from ``MIXFLEET_PROXY_KEY`` / ``MIXFLEET_PROXY_SECRET``
on every call to a replica and ``Modal-Session-ID`` on every turn; without the token a turn is a
502 naming what to set; two containers of one server (two replica ids, one URL) are two entries
of the registry, both in rotation and counted in the group's capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
from aiohttp import web

from fleet.specs import load_preset
from router.config import proxy_auth_headers
from router.policy import choose_replica
from router.registry import Registry
from tests.support.engines import engine_process
from tests.support.procs import free_port
from tests.support.router import router_process, write_preset
from weight_sync.errors import UserError

TOKEN = {"Modal-Key": "wk-" + secrets.token_hex(8), "Modal-Secret": "ws-" + secrets.token_hex(16)}
PROXY_ENV = {"MIXFLEET_PROXY_KEY": TOKEN["Modal-Key"], "MIXFLEET_PROXY_SECRET": TOKEN["Modal-Secret"]}
ADMIN = secrets.token_hex(16)
REPLICA = secrets.token_hex(16)
KEYS = {ADMIN: ["rollout", "trainer", "admin"], REPLICA: ["replica"]}
SP = {"max_new_tokens": 3, "temperature": 0.0}
GROUP = "cpu-modal"
HOP = ("host", "content-length", "transfer-encoding", "connection", "modal-key", "modal-secret")


@dataclass
class StandInProxy:
    """Modal's proxy in front of one server: ``url`` (what every container of the server shares)
    forwards to ``upstream`` when the request carries the token, else answers 401 with Modal's
    message; ``seen`` lists ``(method, path, headers)`` of every request that reached it."""

    upstream: str
    url: str = ""
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append((request.method, request.path, headers))
        if (headers.get("modal-key"), headers.get("modal-secret")) != (
            TOKEN["Modal-Key"],
            TOKEN["Modal-Secret"],
        ):
            return web.Response(status=401, text="modal-http: missing credentials for proxy authorization")
        forward = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with (
            aiohttp.ClientSession() as http,
            http.request(
                request.method, self.upstream + request.path_qs, data=await request.read(), headers=forward
            ) as r,
        ):
            body = await r.read()
            return web.Response(status=r.status, body=body, content_type=r.content_type)

    def requests(self, path: str) -> list[dict[str, str]]:
        return [h for _m, p, h in list(self.seen) if p == path]


@contextlib.contextmanager
def stand_in_proxy(upstream: str) -> Iterator[StandInProxy]:
    proxy = StandInProxy(upstream)
    port = free_port()
    proxy.url = f"http://127.0.0.1:{port}"
    loop = asyncio.new_event_loop()
    started = threading.Event()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="stand-in-modal-proxy", daemon=True)
    thread.start()
    assert started.wait(30), "the stand-in proxy did not start"
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _heartbeat(router_url: str, replica_id: str, url: str) -> None:
    body = {"replica_id": replica_id, "group": GROUP, "url": url, "ready": True}
    r = httpx.post(
        router_url + "/v1/replicas/heartbeat", json=body, headers={"Authorization": f"Bearer {REPLICA}"}
    )
    assert r.status_code == 200, r.text


def _group(client: httpx.Client) -> dict:
    return {g["name"]: g for g in client.get("/v1/groups").json()["groups"]}[GROUP]


@pytest.fixture(scope="module")
def proxy(tiny_dir) -> Iterator[StandInProxy]:
    with engine_process(tiny_dir) as engine, stand_in_proxy(engine) as p:
        yield p


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    d = tmp_path_factory.mktemp("modal-routing")
    return write_preset(d / "preset.toml", [{"name": GROUP, "sessions_per_replica": 4}])


def test_every_call_to_a_replica_carries_the_proxy_token_and_every_turn_its_session(
    proxy: StandInProxy, preset
) -> None:
    containers = [f"{GROUP}-ta-01", f"{GROUP}-ta-02"]  # two containers of one server: one URL
    with (
        router_process(preset, keys=KEYS, env=PROXY_ENV, extra_args=("--heartbeat-timeout", "30")) as router,
        httpx.Client(base_url=router.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as client,
    ):
        for rid in containers:
            _heartbeat(router.url, rid, proxy.url)
        group = _group(client)
        assert group["ready_replicas"] == 2 and group["capacity"] == 2 * 4
        assert sorted((r["replica_id"], r["url"], r["in_rotation"]) for r in group["replicas"]) == [
            (rid, proxy.url, True) for rid in containers
        ]
        before = len(proxy.requests("/generate"))
        sessions = []
        for _ in range(2):
            sid = client.post("/v1/sessions", json={"group": GROUP}).json()["session_id"]
            sessions.append(sid)
            for i in range(2):
                r = client.post(
                    f"/v1/sessions/{sid}/turns", json={"input_ids": [5, 6, 7 + i], "sampling_params": SP}
                )
                assert r.status_code == 200, r.text
                assert r.json()["group"] == GROUP and r.json()["replica"] in containers
        native = client.post(
            "/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": SP},
            headers={"X-Session-ID": "native-1"},
        )
        assert native.status_code == 200, native.text

    turns = proxy.requests("/generate")[before:]
    assert [h.get("modal-session-id") for h in turns] == [s for s in sessions for _ in range(2)] + [
        "native-1"
    ]
    assert proxy.seen and all(
        (h.get("modal-key"), h.get("modal-secret")) == (TOKEN["Modal-Key"], TOKEN["Modal-Secret"])
        for _m, _p, h in proxy.seen
    )


def test_without_the_token_modals_proxy_refuses_and_the_turn_names_what_to_set(
    proxy: StandInProxy, preset
) -> None:
    with (
        router_process(preset, keys=KEYS, extra_args=("--heartbeat-timeout", "30")) as router,
        httpx.Client(base_url=router.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as client,
    ):
        _heartbeat(router.url, f"{GROUP}-ta-01", proxy.url)
        sid = client.post("/v1/sessions", json={"group": GROUP}).json()["session_id"]
        before = len(proxy.seen)
        r = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [5, 6, 7], "sampling_params": SP})
    assert r.status_code == 502, r.text
    detail = r.json()["detail"]
    assert "missing credentials for proxy authorization" in detail and "MIXFLEET_PROXY_KEY" in detail
    refused = proxy.requests("/generate")
    assert len(proxy.seen) > before and "modal-key" not in refused[-1]


def test_proxy_token_from_the_environment() -> None:
    assert proxy_auth_headers({}) == {}
    assert proxy_auth_headers(PROXY_ENV) == TOKEN
    with pytest.raises(UserError, match="^MIXFLEET_PROXY_SECRET is not set"):
        proxy_auth_headers({"MIXFLEET_PROXY_KEY": "wk-1"})
    with pytest.raises(UserError, match="^MIXFLEET_PROXY_KEY is not set"):
        proxy_auth_headers({"MIXFLEET_PROXY_SECRET": "ws-1"})


def test_router_cli_refuses_half_a_token_in_one_line(preset) -> None:
    import subprocess

    from tests.support.procs import REPO, mixfleet_argv

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}
    env |= {"MIXFLEET_API_KEYS": json.dumps({ADMIN: ["admin"]}), "MIXFLEET_PROXY_KEY": "wk-1"}
    done = subprocess.run(
        mixfleet_argv("router", "--preset", str(preset), "--port", str(free_port())),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "MIXFLEET_PROXY_SECRET is not set" in done.stderr and done.stderr.strip().count("\n") == 0, (
        done.stderr
    )


def test_containers_sharing_one_url_are_separate_entries(preset) -> None:
    fleet = load_preset(preset)
    url = "https://ws--mixfleet-cpu-modal.modal.run"
    registry = Registry(fleet, heartbeat_timeout_s=10.0, max_version_lag=None)
    now = time.monotonic()
    for i, version in enumerate((3, 4)):
        registry.heartbeat(
            {
                "replica_id": f"c{i}",
                "group": GROUP,
                "url": url,
                "ready": True,
                "active_version": version,
                "running": i,
            },
            now=now,
        )
    assert sorted(registry.replicas) == ["c0", "c1"]
    assert [r.replica_id for r in registry.in_rotation(GROUP, 4, now)] == ["c0", "c1"]
    (load,) = registry.group_loads({GROUP: 0}, latest=4, now=now)
    assert load.capacity == 2 * 4
    views = registry.views(GROUP, 4, now=now)
    assert [(v.replica_id, v.url) for v in views] == [("c0", url), ("c1", url)]
    assert choose_replica(views, "c1").replica_id == "c1"  # the session's own entry, not the first by URL
    assert choose_replica(views, None).replica_id == "c0"  # the least loaded
    assert [v.replica_id for v in registry.views(GROUP, 4, min_version=4, now=now)] == ["c1"]
    assert registry.active_version(GROUP, 4) == 3

    registry.mark_failed("c0", 5.0, "boom", now=now)  # one container failing leaves the other
    assert [r.replica_id for r in registry.in_rotation(GROUP, 4, now)] == ["c1"]

    # another router's view through the store: both entries, each its own state
    other = Registry(fleet, heartbeat_timeout_s=10.0, max_version_lag=None)
    other.merge_shared({rid: r.shared() for rid, r in registry.replicas.items()}, read_since=time.time() - 60)
    assert {rid: (r.url, r.active_version) for rid, r in other.replicas.items()} == {
        "c0": (url, 3),
        "c1": (url, 4),
    }

    assert registry.remove("c1") and list(registry.replicas) == ["c0"]
    assert registry.replicas["c0"].url == url

"""The router in front of Modal GPU servers, with the local engine in SGLang's place: a real router
process reaches real engines (one per container) through a stand-in for Modal's proxy (a loopback
HTTP server that, like Modal's for a server deployed with ``unauthenticated=False``, refuses a
request without the ``Modal-Key`` / ``Modal-Secret`` of the workspace's proxy auth token; routes a
request carrying ``modal-flash-upstream: host:port`` to the container registered at that address
(modal 1.6.4 ``experimental/flash.py`` 22) and any other by hashing ``Modal-Session-ID`` over its
containers; answers 429 for a container at its ``max_concurrency``; and records every request it
forwards and where).

Checked without pinning: the router sends the token from ``MIXFLEET_PROXY_KEY`` /
``MIXFLEET_PROXY_SECRET`` on every call to a replica and ``Modal-Session-ID`` on every turn;
without the token a turn is a 502 naming what to set; two containers of one server (two replica
ids, one URL) are two entries of the registry. With ``--modal-app`` (what the router on Modal runs
with), the container listing is the one adapter call
(:meth:`router.pinning.modal_server.ModalServerContainers.list_containers`) answering the installed
client's own ``ServerContainerInfo`` values (``tests/deploy/pinned_router.py``): the container the
router chose receives the request (turns, SGLang-native requests, scoring on every replica);
failover on a 503 lands on another container and marks the right one failed; a 429 from one
container is retried on another and never reaches the agent; a replica whose container is not
listed is out of rotation until it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

from core.errors import UserError
from fleet.specs import load_preset
from router.config import proxy_auth_headers
from router.pinning import PIN_HEADER
from router.policy import choose_replica
from router.registry import Registry
from tests.support.engines import engine_process
from tests.support.procs import free_port
from tests.support.recorder import serving
from tests.support.router import router_process, write_preset

TOKEN = {"Modal-Key": "wk-" + secrets.token_hex(8), "Modal-Secret": "ws-" + secrets.token_hex(16)}
PROXY_ENV = {"MIXFLEET_PROXY_KEY": TOKEN["Modal-Key"], "MIXFLEET_PROXY_SECRET": TOKEN["Modal-Secret"]}
ADMIN = secrets.token_hex(16)
REPLICA = secrets.token_hex(16)
KEYS = {ADMIN: ["rollout", "trainer", "admin"], REPLICA: ["replica"]}
SP = {"max_new_tokens": 3, "temperature": 0.0}
GROUP = "cpu-modal"
APP = "mixfleet"
HOP = ("host", "content-length", "transfer-encoding", "connection", "modal-key", "modal-secret")
TASKS = ("ta-01", "ta-02")  # Modal task ids of two containers; replica id <group>-<task id>
LATE = "ta-03"  # a third container, listed late (its address is served by the first engine)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    upstream: str | None  # the container it was routed to (host:port), None when refused before


@dataclass
class StandInProxy:
    """Modal's proxy in front of one server: ``url`` (what every container of the server shares)
    forwards to one of ``containers`` (``host:port`` -> the container's base URL) when the request
    carries the token, else answers 401 with Modal's message. ``limits`` caps a container's
    requests in flight (Modal's ``max_concurrency``: 429 above it); ``down`` holds containers that
    answer 503 (a sidecar not ready). ``seen`` lists every request that reached it."""

    containers: dict[str, str]
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    inflight: dict[str, int] = field(default_factory=dict)

    def route(self, headers: dict[str, str]) -> str | None:
        pinned = headers.get(PIN_HEADER)
        if pinned is not None:
            return pinned if pinned in self.containers else None
        key = headers.get("modal-session-id", "")
        return max(self.containers, key=lambda up: hashlib.sha256(f"{key}|{up}".encode()).digest())

    async def handle(self, request: web.Request) -> web.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        if (headers.get("modal-key"), headers.get("modal-secret")) != (
            TOKEN["Modal-Key"],
            TOKEN["Modal-Secret"],
        ):
            self.seen.append(Seen(request.method, request.path, headers, None))
            return web.Response(status=401, text="modal-http: missing credentials for proxy authorization")
        upstream = self.route(headers)
        self.seen.append(Seen(request.method, request.path, headers, upstream))
        if upstream is None:
            return web.Response(status=503, text="stand-in: no container registered at that upstream")
        if self.inflight.get(upstream, 0) >= self.limits.get(upstream, 1 << 30):
            return web.Response(status=429, text="stand-in: container at max_concurrency")
        if upstream in self.down:
            return web.json_response({"error": {"message": "replica is not ready"}}, status=503)
        forward = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        self.inflight[upstream] = self.inflight.get(upstream, 0) + 1
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.request(
                    request.method,
                    self.containers[upstream] + request.path_qs,
                    data=await request.read(),
                    headers=forward,
                ) as r,
            ):
                body = await r.read()
                return web.Response(status=r.status, body=body, content_type=r.content_type)
        finally:
            self.inflight[upstream] -= 1

    def requests(self, path: str) -> list[dict[str, str]]:
        return [s.headers for s in list(self.seen) if s.path == path]

    def routed(self, path: str, since: int = 0) -> list[str | None]:
        return [s.upstream for s in list(self.seen)[since:] if s.path == path]

    def upstream_of(self, task: str) -> str:
        return list(self.containers)[(*TASKS, LATE).index(task)]

    def reset(self) -> None:
        self.limits.clear()
        self.down.clear()


@contextlib.contextmanager
def stand_in_proxy(engines: list[str]) -> Iterator[StandInProxy]:
    proxy = StandInProxy({e.removeprefix("http://"): e for e in engines})
    proxy.containers[f"127.0.0.1:{free_port()}"] = engines[0]
    with serving(proxy, "stand-in-modal-proxy") as served:
        yield served


def _heartbeat(router_url: str, replica_id: str, url: str, running: int = 0) -> None:
    body = {"replica_id": replica_id, "group": GROUP, "url": url, "ready": True, "running": running}
    r = httpx.post(
        router_url + "/v1/replicas/heartbeat", json=body, headers={"Authorization": f"Bearer {REPLICA}"}
    )
    assert r.status_code == 200, r.text


def _group(client: httpx.Client) -> dict:
    return {g["name"]: g for g in client.get("/v1/groups").json()["groups"]}[GROUP]


@pytest.fixture(scope="module")
def proxy(tiny_dir) -> Iterator[StandInProxy]:
    with engine_process(tiny_dir) as one, engine_process(tiny_dir) as two, stand_in_proxy([one, two]) as p:
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
        (s.headers.get("modal-key"), s.headers.get("modal-secret"))
        == (TOKEN["Modal-Key"], TOKEN["Modal-Secret"])
        for s in proxy.seen
    )
    assert all(PIN_HEADER not in h for h in turns)  # no --modal-app: nothing pinned


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


# --- pinned to containers (the router on Modal: --modal-app) -----------------------------------


def _list_containers(path: Path, proxy: StandInProxy, tasks: tuple[str, ...]) -> None:
    """What Modal lists for the group's server: ``tasks``' containers at their upstreams."""
    listed = []
    for task in tasks:
        host, port = proxy.upstream_of(task).split(":")
        listed.append({"container_id": task, "host": host, "port": int(port)})
    path.write_text(json.dumps({GROUP: listed}))


@contextlib.contextmanager
def pinned_router(preset, listing: Path) -> Iterator[tuple[str, httpx.Client]]:
    program = (sys.executable, "-m", "tests.deploy.pinned_router", str(listing))
    with (
        router_process(
            preset,
            keys=KEYS,
            env=PROXY_ENV,
            program=program,
            extra_args=("--heartbeat-timeout", "30", "--modal-app", APP),
        ) as router,
        httpx.Client(base_url=router.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as client,
    ):
        yield router.url, client


def _steer(router_url: str, proxy: StandInProxy, busy: str) -> None:
    """Both containers heartbeat; ``busy`` reports running requests, so the policy picks the other."""
    for task in TASKS:
        _heartbeat(router_url, f"{GROUP}-{task}", proxy.url, running=5 if task == busy else 0)


def _turn(client: httpx.Client, sid: str | None = None) -> tuple[str, httpx.Response]:
    sid = sid or client.post("/v1/sessions", json={"group": GROUP}).json()["session_id"]
    return sid, client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [5, 6, 7], "sampling_params": SP})


def _replicas(client: httpx.Client) -> dict[str, dict]:
    return {r["replica_id"]: r for r in _group(client)["replicas"]}


def test_the_container_the_router_chose_receives_the_request(proxy: StandInProxy, preset, tmp_path) -> None:
    proxy.reset()
    listing = tmp_path / "containers.json"
    _list_containers(listing, proxy, TASKS)
    late = f"{GROUP}-{LATE}"
    with pinned_router(preset, listing) as (url, client):
        _steer(url, proxy, busy="ta-01")
        _heartbeat(url, late, proxy.url)  # heartbeats, but Modal does not list its container
        replicas = _replicas(client)
        assert {rid: (r["in_rotation"], r["container"]["upstream"]) for rid, r in replicas.items()} == {
            f"{GROUP}-ta-01": (True, proxy.upstream_of("ta-01")),
            f"{GROUP}-ta-02": (True, proxy.upstream_of("ta-02")),
            late: (False, None),
        }
        assert replicas[late]["container"]["error"] and _group(client)["capacity"] == 2 * 4

        before = len(proxy.seen)
        sid, turn = _turn(client)
        assert turn.status_code == 200, turn.text
        assert turn.json()["replica"] == f"{GROUP}-ta-02"
        _steer(url, proxy, busy="ta-02")  # now the policy prefers ta-01 for a new session ...
        other, turn = _turn(client)
        assert turn.status_code == 200 and turn.json()["replica"] == f"{GROUP}-ta-01", turn.text
        _, turn = _turn(client, sid)  # ... while the first session keeps its own container
        assert turn.status_code == 200 and turn.json()["replica"] == f"{GROUP}-ta-02", turn.text
        assert proxy.routed("/generate", before) == [
            proxy.upstream_of(t) for t in ("ta-02", "ta-01", "ta-02")
        ]
        sent = proxy.requests("/generate")[-3:]
        assert [h.get("modal-session-id") for h in sent] == [sid, other, sid]
        assert [h.get(PIN_HEADER) for h in sent] == proxy.routed("/generate", before)

        native = client.post(
            "/generate", json={"input_ids": [5, 6, 7], "sampling_params": SP}, headers={"X-Session-ID": "n-1"}
        )
        assert native.status_code == 200, native.text
        assert proxy.requests("/generate")[-1].get(PIN_HEADER) == proxy.upstream_of("ta-01")

        before = len(proxy.seen)  # scoring on every replica reaches each replica's own container
        scored = client.post("/v1/score", json={"input_ids": [[5, 6, 7, 8]], "logprob_start_len": 1})
        assert scored.status_code == 200, scored.text
        assert sorted(r["replica"] for r in scored.json()["results"]) == [f"{GROUP}-{t}" for t in TASKS]
        assert sorted(proxy.routed("/generate", before)) == sorted(proxy.upstream_of(t) for t in TASKS)

        _list_containers(listing, proxy, (*TASKS, LATE))  # Modal lists it once it serves
        deadline = time.monotonic() + 30
        while not _replicas(client)[late]["in_rotation"]:
            assert time.monotonic() < deadline, _replicas(client)[late]
            time.sleep(0.2)
        assert _replicas(client)[late]["container"] == {"upstream": proxy.upstream_of(LATE), "error": None}


def test_failover_on_a_503_lands_on_another_container_and_marks_the_right_one_failed(
    proxy: StandInProxy, preset, tmp_path
) -> None:
    proxy.reset()
    listing = tmp_path / "containers.json"
    _list_containers(listing, proxy, TASKS)
    with pinned_router(preset, listing) as (url, client):
        _steer(url, proxy, busy="ta-01")
        proxy.down.add(proxy.upstream_of("ta-02"))
        before = len(proxy.seen)
        _, turn = _turn(client)
        assert turn.status_code == 200, turn.text
        assert turn.json()["replica"] == f"{GROUP}-ta-01" and turn.json()["timings"]["attempts"] == 2
        assert proxy.routed("/generate", before) == [proxy.upstream_of("ta-02"), proxy.upstream_of("ta-01")]
        replicas = _replicas(client)
        failed, served = replicas[f"{GROUP}-ta-02"], replicas[f"{GROUP}-ta-01"]
        assert "HTTP 503" in failed["error"], failed  # its failure cooldown (2 s) may be over by now
        assert served["in_rotation"] and served["error"] is None, served


def test_a_429_from_a_full_container_is_retried_on_another_and_never_reaches_the_agent(
    proxy: StandInProxy, preset, tmp_path
) -> None:
    proxy.reset()
    listing = tmp_path / "containers.json"
    _list_containers(listing, proxy, TASKS)
    full, free = proxy.upstream_of("ta-02"), proxy.upstream_of("ta-01")
    with pinned_router(preset, listing) as (url, client):
        _steer(url, proxy, busy="ta-01")
        proxy.limits[full] = 0  # over its max_concurrency: Modal's proxy answers 429
        before = len(proxy.seen)
        _, turn = _turn(client)
        assert turn.status_code == 200, turn.text
        assert turn.json()["replica"] == f"{GROUP}-ta-01" and turn.json()["timings"]["attempts"] == 2
        body = {"input_ids": [5, 6, 7], "sampling_params": SP}
        native = client.post("/generate", json=body, headers={"X-Session-ID": "n-2"})
        assert native.status_code == 200, native.text
        with client.stream("POST", "/generate", json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200 and b"data:" in streamed.read()
        assert proxy.routed("/generate", before) == [full, free] * 3
        assert _replicas(client)[f"{GROUP}-ta-02"]["in_rotation"]  # full is not failed

        proxy.limits[free] = 0  # no container can take it: then, and only then, the agent is told
        _, turn = _turn(client)
        assert turn.status_code == 503 and "max_concurrency" in turn.json()["detail"], turn.text
        assert turn.headers.get("retry-after")

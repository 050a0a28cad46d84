"""Two router processes share one Redis: a session opened on one continues on the other, the
trainer takes it from either, and a sidecar heartbeat sent to one puts the replica in rotation
on both."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.procs import redis_server
from tests.support.router import router_process, write_preset

SP = {"max_new_tokens": 3, "seed": 1}


@pytest.fixture(scope="module")
def two_routers(engine_url, tmp_path_factory):
    d = tmp_path_factory.mktemp("shared")
    preset = write_preset(d / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}, {"name": "cpu-b"}])
    keys = {"k" * 32: ["rollout", "trainer", "admin"]}
    with (
        redis_server() as url,
        router_process(preset, state=url, keys=keys) as a,
        router_process(preset, state=url, keys=keys) as b,
    ):
        yield a, b


def test_a_session_moves_between_routers(two_routers) -> None:
    a, b = two_routers
    ca = httpx.Client(base_url=a.url, headers=a.headers, timeout=60)
    cb = httpx.Client(base_url=b.url, headers=b.headers, timeout=60)
    sid = ca.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
    t0 = ca.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2], "sampling_params": SP})
    t1 = cb.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2, 3], "sampling_params": SP, "turn": 1})
    assert t0.status_code == 200 and t1.status_code == 200, (t0.text, t1.text)
    assert [t0.json()["turn"], t1.json()["turn"]] == [0, 1]
    assert cb.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    assert ca.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1]}).status_code == 409
    batch = ca.post("/v1/batches/take", json={"size": 10}).json()
    mine = [t for t in batch["trajectories"] if t["session_id"] == sid]
    assert len(mine) == 1 and [t["output_ids"] for t in mine[0]["turns"]] == [
        t0.json()["output_ids"],
        t1.json()["output_ids"],
    ]
    assert cb.post(f"/v1/batches/{batch['lease_id']}/ack").json()["acked"] == len(batch["trajectories"])


def test_a_heartbeat_to_one_router_reaches_the_other(two_routers, engine_url) -> None:
    a, b = two_routers
    hb = {
        "replica_id": "side-x",
        "group": "cpu-b",
        "url": engine_url.replace("127.0.0.1", "localhost"),
        "ready": True,
        "active_version": 0,
    }
    assert httpx.post(f"{a.url}/v1/replicas/heartbeat", json=hb, headers=a.headers).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        groups = httpx.get(f"{b.url}/v1/groups", headers=b.headers).json()["groups"]
        if next(g for g in groups if g["name"] == "cpu-b")["ready_replicas"] == 1:
            return
        time.sleep(0.2)
    raise AssertionError("router b never saw the heartbeat sent to router a")

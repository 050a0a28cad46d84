"""The router's state stays bounded over a long run (:mod:`router.state.retention`): a real router
on a real redis-server, a real engine whose weights move to a new version 50 times, and per
version sessions finished and trained on (taken, log-probs uploaded, acknowledged), abandoned by
the agent, abandoned by silence, ``/generate`` calls with a routing key and a sidecar that
heartbeats once under a new replica id. After each half of the run, once what expires has expired
and the router has compacted, Redis holds the same keys and about the same memory; nothing
accepted was lost (every session counted, every uploaded token in the mismatch totals, every
acknowledgement an update) and the detail kept is the configured window."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from clients.engine import SGLangClient, make_http_client
from replica.activation import activate
from router.mismatch import BUCKET_LABELS
from tests.support.procs import redis_server
from tests.support.router import router_process, write_preset
from trainer.client import RolloutClient

ADMIN = "b" * 32
REPLICA = "q" * 32
SP = {"max_new_tokens": 2, "seed": 3}  # a session turn's sampling params
GENERATE_SP = {"max_new_tokens": 2, "sampling_seed": 3}  # SGLang's name on /generate
KEEP_VERSIONS, KEEP_UPDATES = 3, 5
BOUNDS = (
    "--keep-versions",
    str(KEEP_VERSIONS),
    "--keep-updates",
    str(KEEP_UPDATES),
    "--retention",
    "1",
    "--lease-timeout",
    "1",
    "--session-idle-timeout",
    "1",
    "--route-key-ttl",
    "1",
    "--replica-forget",
    "2",
    "--compact-interval",
    "1",
    "--heartbeat-timeout",
    "2",  # a replica's booked-until mark lives ten of them
)


async def _set_version(engine_url: str, model_dir: str, version: int) -> None:
    async with make_http_client(connect_timeout_s=5.0, timeout_s=120.0) as http:
        await activate(SGLangClient(http, engine_url), model_dir, version, "bf16")


def _drive(router_url: str, engine_url: str, model_dir: str, versions: range, uploaded: list[int]) -> None:
    """Per version: the engine moves to it, a sidecar heartbeats once, 6 sessions (4 finished, 1
    deleted, 1 left idle) and a keyed ``/generate``; the finished ones are taken, their
    log-probs uploaded (their tokens appended to ``uploaded``) and acknowledged."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with RolloutClient(router_url, ADMIN) as client, httpx.Client(base_url=router_url, timeout=120) as http:
        for v in versions:
            asyncio.run(_set_version(engine_url, model_dir, v))
            beat = {"replica_id": f"side-{v}", "group": "cpu-b", "url": engine_url, "ready": False}
            r = http.post("/v1/replicas/heartbeat", json=beat, headers={"Authorization": f"Bearer {REPLICA}"})
            assert r.status_code == 200, r.text
            for i in range(6):
                s = client.create_session(group="cpu-a")
                if i == 4:
                    assert http.delete(f"/v1/sessions/{s.session_id}", headers=admin).status_code == 200
                    continue
                turn = client.turn(s.session_id, [1, 2, 3 + i], SP)
                assert [x["weight_version"] for x in turn["records"]] == [v] * len(turn["output_ids"]), turn
                if i < 4:
                    client.finish(s.session_id, 1.0)
            body = {"input_ids": [5, 6, 7], "sampling_params": GENERATE_SP}
            r = http.post("/generate", json=body, headers={**admin, "X-Session-Id": f"key-{v}"})
            assert r.status_code == 200, r.text
            batch = client.take(100)
            assert len(batch.trajectories) == 4 and set(batch.versions.tolist()) == {v}, batch.trajectories
            client.upload_trainer_logprobs(batch.lease_id, batch.logprobs)
            uploaded.append(len(batch.logprobs))
            assert client.ack(batch.lease_id)["acked"] == 4


def _settled(store: redis.Redis, wait_s: float = 4.0) -> dict[str, int]:
    """Redis' key count, used memory and the sizes of what compaction bounds (mismatch and
    per-version ledger fields, update records, replicas) once everything expiring has expired
    (TTLs, idle sessions, silent replicas) and the router has compacted since."""
    time.sleep(wait_s)
    deadline = time.monotonic() + 60
    while store.zcard("mf:activity") or store.hlen("mf:replicas") > 1 or store.keys("mf:mark:side-*"):
        assert time.monotonic() < deadline, "idle sessions, silent replicas or their marks never went"
        time.sleep(0.5)
    time.sleep(2.0)  # one more compaction after the last expiry
    sizes = {key: store.hlen(key) for key in ("mf:mismatch", "mf:ledger:v", "mf:replicas")}
    return {
        "keys": store.dbsize(),
        "used_memory": int(store.info("memory")["used_memory"]),
        "updates": store.llen("mf:updates"),
        **sizes,
    }


@pytest.mark.slow
def test_fifty_versions_and_hundreds_of_sessions_leave_the_state_where_it_was(
    engine_url: str, tiny_bf16, tmp_path
) -> None:
    preset = write_preset(
        tmp_path / "p.toml",
        [
            {"name": "cpu-a", "replicas": [engine_url], "sessions_per_replica": 8, "price_per_gpu_hour": 3.6},
            {"name": "cpu-b", "sessions_per_replica": 8, "price_per_gpu_hour": 3.6},
        ],
    )
    keys = {ADMIN: ["rollout", "trainer", "admin"], REPLICA: ["replica"]}
    uploaded: list[int] = []
    with redis_server() as url, router_process(preset, state=url, keys=keys, extra_args=BOUNDS) as router:
        store = redis.Redis.from_url(url)
        _drive(router.url, engine_url, str(tiny_bf16), range(1, 26), uploaded)
        half = _settled(store)
        _drive(router.url, engine_url, str(tiny_bf16), range(26, 51), uploaded)
        full = _settled(store)
        assert full["keys"] == half["keys"], (half, full, sorted(k.decode() for k in store.scan_iter()))
        assert full["used_memory"] <= half["used_memory"] * 1.1 + 65536, (half, full)
        for fp in (half, full):  # two groups, the kept versions and one more (earlier / none reported)
            assert fp["mf:mismatch"] <= 2 * (KEEP_VERSIONS + 1) * len(BUCKET_LABELS) * 5, fp
            assert fp["mf:ledger:v"] <= 2 * (KEEP_VERSIONS + 1) * 4, fp
            assert (fp["updates"], fp["mf:replicas"]) == (KEEP_UPDATES, 1), fp
        assert not store.keys("mf:s:*") and not store.keys("mf:rk:*") and not store.keys("mf:lease:*")

        with httpx.Client(base_url=router.url, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            groups = {g["name"]: g for g in http.get("/v1/groups").json()["groups"]}
            ledger = http.get("/v1/ledger").json()
    a = groups["cpu-a"]
    assert a["sessions_total"] == 50 * 6 and a["active_sessions"] == 0
    assert [v["version"] for v in a["mismatch"]["versions"]] == [48, 49, 50]
    assert a["mismatch"]["tokens"] == sum(uploaded) and a["mismatch"]["k3_kl"] == 0.0
    assert a["mismatch"]["earlier"]["tokens"] == sum(uploaded[:47])
    assert {(v["group"], v["version"]) for v in ledger["versions"]} <= {
        (g, v) for g in ("cpu-a", "cpu-b") for v in (None, 48, 49, 50)
    }
    tokens = {g["name"]: g["tokens"] for g in ledger["groups"]}
    kept = sum(v["tokens"] for v in ledger["versions"] if v["group"] == "cpu-a")
    earlier = {e["group"]: e for e in ledger["earlier_versions"]}
    assert kept + earlier["cpu-a"]["tokens"] == tokens["cpu-a"]
    assert [u["seq"] for u in ledger["updates"]] == list(range(46, 51))
    assert ledger["earlier_updates"]["updates"] == 45 and ledger["earlier_updates"]["trajectories"] == 180
    updates_cost = ledger["earlier_updates"]["cost_dollars"] + sum(
        u["cost_dollars"] for u in ledger["updates"]
    )
    assert 0 < updates_cost <= sum(g["cost_dollars"] for g in ledger["groups"])  # booking goes on after

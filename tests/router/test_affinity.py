"""Load-aware affinity: a session stays on its replica (its prefix cache) until that replica's
queue has stayed above the bound for the hold time; then its new turns go to the least-loaded
other replica of the group, counted as replica moves. A balanced fleet keeps every session where
it is. Over the registry itself, then over a real router with two real engines."""

from __future__ import annotations

import time

import httpx
import pytest

from fleet.specs import FleetSpec
from router.dispatch import _pick
from router.registry import Registry
from tests.support.engines import engine_process
from tests.support.router import router_process, write_preset


def _registry() -> Registry:
    fleet = FleetSpec.model_validate({"name": "t", "groups": [{"name": "g", "accelerator": "cpu"}]})
    return Registry(fleet, heartbeat_timeout_s=1e9, max_version_lag=None, queue_bound=8, overload_hold_s=5.0)


def _hb(rid: str, queued: int = 0, running: int = 0) -> dict:
    return {"replica_id": rid, "group": "g", "url": f"http://{rid}", "ready": True, "active_version": 0,
            "queued": queued, "running": running}  # fmt: skip


def test_an_overloaded_replica_sheds_only_after_the_hold_and_only_to_a_less_loaded_one() -> None:
    reg = _registry()
    reg.heartbeat(_hb("g-a", queued=20), now=100.0)
    reg.heartbeat(_hb("g-b"), now=100.0)
    assert not reg.overloaded("g-a", now=104.9)
    assert reg.overloaded("g-a", now=105.0)
    reg.heartbeat(_hb("g-a", queued=20), now=105.0)  # still high: the clock keeps running
    assert reg.overloaded("g-a", now=105.0)
    assert _pick(reg, "g", "g-a", set(), None, None).replica_id == "g-b"  # overloaded now
    reg.heartbeat(_hb("g-b", queued=30, running=8), now=105.0)  # the other has more to do
    assert _pick(reg, "g", "g-a", set(), None, None).replica_id == "g-a"
    reg.heartbeat(_hb("g-a", queued=8), now=106.0)  # at the bound: no longer overloaded
    assert not reg.overloaded("g-a", now=200.0)
    reg.heartbeat(_hb("g-a", queued=9), now=201.0)  # above again: a new hold starts
    assert not reg.overloaded("g-a", now=205.0) and reg.overloaded("g-a", now=206.0)


def test_a_balanced_replica_keeps_its_sessions() -> None:
    reg = _registry()
    reg.heartbeat(_hb("g-a", queued=3, running=8), now=time.monotonic())
    reg.heartbeat(_hb("g-b"), now=time.monotonic())
    # g-a is busier than g-b, but its queue is under the bound: affinity wins (prefix cache)
    assert _pick(reg, "g", "g-a", set(), None, None).replica_id == "g-a"
    assert _pick(reg, "g", None, set(), None, None).replica_id == "g-b"  # a new session: least loaded


def _moves(router, client: httpx.Client) -> float:
    text = client.get(f"{router.url}/metrics").text
    series = 'mixfleet_router_replica_moves_total{group="g"}'
    line = next(x for x in text.splitlines() if x.startswith(series))
    return float(line.split()[-1])


@pytest.mark.slow
def test_a_router_moves_sessions_off_a_replica_whose_queue_stays_high(tmp_path, tiny_dir) -> None:
    preset = write_preset(tmp_path / "p.toml", [{"name": "g", "sessions_per_replica": 64}])
    args = ("--affinity-queue-bound", "4", "--affinity-hold", "3")
    with (
        engine_process(tiny_dir) as url_a,
        engine_process(tiny_dir) as url_b,
        router_process(preset, extra_args=args) as router,
        httpx.Client(headers={"Authorization": f"Bearer {router.key}"}, timeout=60) as client,
    ):

        def heartbeat(rid: str, url: str, queued: int) -> None:
            body = {"replica_id": rid, "group": "g", "url": url, "ready": True, "active_version": 0,
                    "queued": queued}  # fmt: skip
            assert client.post(f"{router.url}/v1/replicas/heartbeat", json=body).status_code == 200

        def turns() -> list[str]:
            params = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.9}
            out = []
            for sid in sessions:
                r = client.post(f"{router.url}/v1/sessions/{sid}/turns", json={"input_ids": [5, 6, 7],
                                "sampling_params": params})  # fmt: skip
                assert r.status_code == 200, r.text
                out.append(r.json()["replica"])
            return out

        heartbeat("g-a", url_a, 0)
        heartbeat("g-b", url_b, 0)
        sessions = [client.post(f"{router.url}/v1/sessions", json={}).json()["session_id"] for _ in range(4)]
        first = turns()
        home = first[0]
        other = "g-b" if home == "g-a" else "g-a"
        urls = {"g-a": url_a, "g-b": url_b}
        assert all(r == home for r in first)  # idle fleet: every session lands on the first replica
        heartbeat(home, urls[home], 3)  # busy but under the bound: sessions keep their replica
        assert turns() == [home] * 4 and _moves(router, client) == 0
        heartbeat(home, urls[home], 20)  # above the bound, not yet for the hold time
        assert turns() == [home] * 4
        time.sleep(3.1)
        heartbeat(home, urls[home], 20)
        assert turns() == [other] * 4  # shed: each session's new turn went to the other replica
        assert _moves(router, client) == 4
        heartbeat(home, urls[home], 0)
        assert turns() == [other] * 4 and _moves(router, client) == 4  # they stay where they moved

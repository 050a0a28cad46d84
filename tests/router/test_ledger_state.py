"""The cost ledger's part of the state port, against the memory adapter and a real redis-server:
replica time booked by :func:`router.ledger.charge` on each replica's mark, tokens per version
with the turns, an update closed by each acknowledgement that acknowledges something; on Redis the
ledger survives a new store (a router restart) and concurrent bookings of one replica count once."""

from __future__ import annotations

import asyncio

import pytest
import redis

from fleet.specs import FleetSpec, GroupSpec
from router.ledger import LedgerTotals, update_costs
from router.routes_ledger import ledger_view
from router.state.base import RequestRecorded, StateStore, TurnRecord
from tests.support.state import opened

pytestmark = pytest.mark.anyio


async def _book(store: StateStore, rid: str, at: float, version: int | None = 1, group: str = "g") -> float:
    # 2 GPUs at $3.60 per GPU-hour: $0.002 per replica-second
    return await store.book_replica(
        rid, group=group, version=version, at=at, span_s=10.0, gpus_per_replica=2, price_per_gpu_hour=3.6
    )


async def _turned(store: StateStore, sid: str, tokens: dict[int, int], group: str = "g") -> None:
    await store.create_session(sid, group, {}, now=1.0)
    await store.append_turn(
        sid,
        TurnRecord(
            f"{sid}-0",
            b"blob",
            group=group,
            replica="r",
            tokens=sum(tokens.values()),
            min_version=min(tokens),
            max_version=max(tokens),
            version_tokens=tokens,
        ),
    )
    await store.finish_session(sid, f"{sid}-f", 1.0, {})


async def test_replica_time_is_the_union_of_observed_spans(store_url: str) -> None:
    async with opened(store_url) as store:
        assert await store.ledger_totals() == {}
        assert await _book(store, "a", 100.0) == 10.0  # [100, 110)
        assert await _book(store, "a", 105.0) == 5.0  # extends to 115
        assert await _book(store, "a", 105.0) == 0.0  # inside booked time
        assert await _book(store, "a", 130.0, version=2) == 10.0  # a 15 s silence is not booked
        assert await _book(store, "a", 120.0, version=2) == 0.0  # older than the mark: nothing new
        assert await _book(store, "b", 100.0, version=None, group="h") == 10.0  # marks are per replica
        totals = await store.ledger_totals()
        assert set(totals) == {"g", "h"}
        g = totals["g"]
        assert g.replica_seconds == pytest.approx(25.0, rel=1e-12)
        assert g.gpu_seconds == pytest.approx(50.0, rel=1e-12)
        assert g.cost_dollars == pytest.approx(0.05, rel=1e-12)
        assert (g.tokens, g.sessions) == (0, 0)
        snap = await store.ledger()
        assert set(snap.versions) == {("g", 1), ("g", 2), ("h", None)}
        assert snap.versions[("g", 1)].replica_seconds == pytest.approx(15.0, rel=1e-12)
        assert snap.versions[("g", 2)].cost_dollars == pytest.approx(0.02, rel=1e-12)
        assert snap.versions[("h", None)].gpu_seconds == pytest.approx(20.0, rel=1e-12)
        assert snap.updates == []


async def test_tokens_per_version_and_updates(store_url: str) -> None:
    async with opened(store_url) as store:
        await _book(store, "a", 0.0)  # $0.02 booked before the first update
        await _turned(store, "s1", {1: 3, 2: 4})
        await _turned(store, "s2", {2: 5})
        # a retried append (same request id) books nothing twice
        await store.create_session("s3", "g", {}, now=1.0)
        versions = {1: 2}
        record = TurnRecord("s3-0", b"x", "g", "r", 2, min_version=1, max_version=1, version_tokens=versions)
        await store.append_turn("s3", record)
        with pytest.raises(RequestRecorded):
            await store.append_turn("s3", record)
        lease = await store.take(2, trainer_version=2, max_version_age=None, lease_timeout_s=60)
        assert {t.session.session_id for t in lease.trajectories} == {"s1", "s2"}
        first = await store.ack(lease.lease_id)
        assert (first.acked, first.update) == (2, 1)
        await _book(store, "a", 5.0)  # +$0.01
        await _book(store, "b", 5.0, group="h")  # +$0.02 on h
        await store.finish_session("s3", "s3-f", 0.0, {})
        lease = await store.take(5, trainer_version=2, max_version_age=None, lease_timeout_s=60)
        second = await store.ack(lease.lease_id)
        assert (second.acked, second.update) == (1, 2)
        empty = await store.take(5, trainer_version=2, max_version_age=None, lease_timeout_s=60)
        assert empty.trajectories == []

        snap = await store.ledger()
        assert snap.groups["g"] == LedgerTotals(
            pytest.approx(15.0), pytest.approx(30.0), pytest.approx(0.03), tokens=14, sessions=3
        )
        assert snap.versions[("g", 1)].tokens == 5
        assert snap.versions[("g", 2)].tokens == 9
        assert [(u.seq, u.trajectories, u.tokens) for u in snap.updates] == [(1, 2, 12), (2, 1, 2)]
        assert snap.updates[0].cumulative_cost == {"g": pytest.approx(0.02, rel=1e-12)}
        assert snap.updates[1].cumulative_cost == {
            "g": pytest.approx(0.03, rel=1e-12),
            "h": pytest.approx(0.02, rel=1e-12),
        }
        assert snap.updates[0].at <= snap.updates[1].at
        costs = update_costs(snap.updates)
        assert costs[0].cost_by_group == {"g": pytest.approx(0.02, rel=1e-12)}
        assert costs[1].cost_by_group == {"g": pytest.approx(0.01, rel=1e-9), "h": pytest.approx(0.02)}
        assert costs[1].cost_dollars == pytest.approx(0.03, rel=1e-9)
        assert await store.ledger_totals() == snap.groups


async def test_redis_ledger_survives_a_new_store_and_concurrent_bookings_count_once(redis_url: str) -> None:
    redis.Redis.from_url(redis_url).flushdb()
    async with opened(redis_url) as one, opened(redis_url) as two:
        added = await asyncio.gather(*(_book(s, "a", 50.0) for s in (one, two) for _ in range(8)))
        assert sorted(added) == [0.0] * 15 + [10.0]
        await _turned(one, "s1", {4: 6})
        lease = await two.take(1, trainer_version=4, max_version_age=None, lease_timeout_s=60)
        assert (await one.ack(lease.lease_id)).update == 1
        before = await one.ledger()
    async with opened(redis_url) as again:
        after = await again.ledger()
        assert after == before
        assert after.groups["g"].replica_seconds == pytest.approx(10.0)
        assert after.versions[("g", 4)].tokens == 6
        assert await _book(again, "a", 55.0) == 5.0  # the mark survived too
    assert 90 < redis.Redis.from_url(redis_url).ttl("mf:mark:a") <= 100  # ten spans: marks do not pile up


async def test_the_ledger_lists_each_groups_versions_unreported_first_then_ascending(store_url: str) -> None:
    """``GET /v1/ledger``'s versions, per group: the time of replicas that reported no version
    first, then version 0, 1, ... whatever order they were booked in (version 0 is a version)."""
    async with opened(store_url) as store:
        for at, version in ((0.0, 2), (20.0, 0), (40.0, None), (60.0, 1)):
            await _book(store, "r", at, version=version)
        view = ledger_view(
            await store.ledger(),
            FleetSpec(name="f", groups=(GroupSpec(name="g", accelerator="B200"),)),
            10.0,
            0.0,
        )
    assert [v["version"] for v in view["versions"]] == [None, 0, 1, 2]

"""One contract suite for the state port, run against the memory adapter and a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import redis

from router.state.base import (
    LeaseNotFound,
    SessionFinished,
    SessionNotFound,
    StateStore,
    TurnConflict,
    open_store,
)
from tests.support.procs import redis_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
def store_url(request, redis_url) -> str:
    if request.param == "memory":
        return "memory"
    redis.Redis.from_url(redis_url).flushdb()
    return redis_url


@contextlib.asynccontextmanager
async def opened(url: str, **kw) -> AsyncIterator[StateStore]:
    store = open_store(url, **kw)
    try:
        yield store
    finally:
        await store.close()


async def _session(store: StateStore, sid: str, group: str = "g1", turns: int = 1, version: int = 1) -> None:
    await store.create_session(sid, group, {"task": sid}, now=1.0)
    for i in range(turns):
        await store.append_turn(
            sid,
            f"{sid}-{i}",
            f"blob-{sid}-{i}".encode(),
            group=group,
            tokens=3,
            min_version=version,
            max_version=version,
        )


async def test_session_lifecycle_and_counters(store_url: str) -> None:
    async with opened(store_url) as store:
        assert await store.get_session("nope") is None
        await store.create_session("s1", "g1", {"a": 1}, now=5.0)
        info = await store.get_session("s1")
        assert info and info.status == "open" and info.group == "g1" and info.metadata == {"a": 1}
        assert (
            await store.append_turn("s1", "r1", b"t0", group="g1", tokens=4, min_version=2, max_version=3)
            == 0
        )
        assert (
            await store.append_turn("s1", "r2", b"t1", group="g1", tokens=5, min_version=1, max_version=2)
            == 1
        )
        info = await store.get_session("s1")
        assert (info.n_turns, info.tokens, info.min_version, info.max_version) == (2, 9, 1, 3)
        assert await store.get_turns("s1") == [b"t0", b"t1"]
        c = (await store.counters())["g1"]
        assert (c.active_sessions, c.sessions, c.turns, c.tokens) == (1, 1, 2, 9)
        await store.finish_session("s1", "f1", 0.5, {"ok": True})
        info = await store.get_session("s1")
        assert info.status == "finished" and info.reward == 0.5 and info.finish_metadata == {"ok": True}
        assert (await store.counters())["g1"].active_sessions == 0


async def test_appends_are_idempotent_per_request_and_refused_after_finish(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.create_session("s", "g", {}, now=0.0)
        assert (
            await store.append_turn(
                "s", "same", b"x", group="g", tokens=1, min_version=None, max_version=None
            )
            == 0
        )
        assert (
            await store.append_turn(
                "s", "same", b"y", group="g", tokens=1, min_version=None, max_version=None
            )
            == 0
        )
        assert await store.get_turns("s") == [b"x"]
        with pytest.raises(TurnConflict) as conflict:
            await store.append_turn(
                "s", "other", b"z", group="g", tokens=1, min_version=None, max_version=None, expected_turn=0
            )
        assert conflict.value.next_turn == 1
        await store.finish_session("s", "f", 1.0, {})
        await store.finish_session("s", "f", 1.0, {})  # retried finish: no-op
        with pytest.raises(SessionFinished):
            await store.finish_session("s", "f2", 1.0, {})
        with pytest.raises(SessionFinished):
            await store.append_turn(
                "s", "late", b"z", group="g", tokens=1, min_version=None, max_version=None
            )
        with pytest.raises(SessionNotFound):
            await store.append_turn("zz", "r", b"z", group="g", tokens=1, min_version=None, max_version=None)
        with pytest.raises(SessionNotFound):
            await store.finish_session("zz", "r", 1.0, {})
        assert (await store.counters())["g"].turns == 1


async def test_concurrent_appends_get_distinct_indices(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.create_session("s", "g", {}, now=0.0)
        idx = await asyncio.gather(
            *(
                store.append_turn(
                    "s", f"r{i}", bytes([i]), group="g", tokens=1, min_version=None, max_version=None
                )
                for i in range(40)
            )
        )
        assert sorted(idx) == list(range(40))
        turns = await store.get_turns("s")
        assert sorted(turns) == [bytes([i]) for i in range(40)]


async def test_move_and_delete_keep_active_counts(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.create_session("s", "a", {}, now=0.0)
        await store.set_route("s", "b", "rep-1")
        info = await store.get_session("s")
        assert info.group == "b" and info.replica == "rep-1"
        c = await store.counters()
        assert c["a"].active_sessions == 0 and c["b"].active_sessions == 1
        await store.delete_session("s")
        assert await store.get_session("s") is None
        assert (await store.counters())["b"].active_sessions == 0


async def test_take_ack_and_nothing_twice(store_url: str) -> None:
    async with opened(store_url) as store:
        for i in range(5):
            await _session(store, f"s{i}", turns=2)
            await store.finish_session(f"s{i}", "f", float(i), {})
        lease = await store.take(3, trainer_version=1, max_version_age=None, lease_timeout_s=60)
        assert len(lease.trajectories) == 3
        got = {t.session.session_id for t in lease.trajectories}
        assert all(
            t.turns == [f"blob-{t.session.session_id}-{j}".encode() for j in range(2)]
            for t in lease.trajectories
        )
        second = await store.take(10, trainer_version=1, max_version_age=None, lease_timeout_s=60)
        assert {t.session.session_id for t in second.trajectories} == {f"s{i}" for i in range(5)} - got
        assert (await store.ack(lease.lease_id)).acked == 3
        assert (await store.ack(second.lease_id)).acked == 2
        with pytest.raises(LeaseNotFound):
            await store.ack(lease.lease_id)
        empty = await store.take(10, trainer_version=1, max_version_age=None, lease_timeout_s=0.01)
        assert empty.trajectories == []
        assert (await store.get_session("s0")).status == "consumed"
        stats = await store.queue_stats()
        assert stats["ready"] == 0 and stats["pending"] == 0


async def test_unacknowledged_lease_is_redelivered_after_timeout(store_url: str) -> None:
    async with opened(store_url) as store:
        await _session(store, "s")
        await store.finish_session("s", "f", 1.0, {})
        first = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=0.3)
        assert len(first.trajectories) == 1
        assert (
            await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=0.3)
        ).trajectories == []
        await asyncio.sleep(0.4)
        again = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=0.3)
        assert [t.session.session_id for t in again.trajectories] == ["s"] and again.redelivered == 1
        late = await store.ack(first.lease_id)  # the crashed trainer's late ack owns nothing now
        assert (late.acked, late.expired) == (0, 1)
        assert (await store.ack(again.lease_id)).acked == 1


async def test_too_old_trajectories_are_held_back_counted_and_released(store_url: str) -> None:
    async with opened(store_url) as store:
        await _session(store, "old", version=1)
        await _session(store, "new", version=9)
        for sid in ("old", "new"):
            await store.finish_session(sid, "f", 0.0, {})
        lease = await store.take(5, trainer_version=10, max_version_age=2, lease_timeout_s=60)
        assert [t.session.session_id for t in lease.trajectories] == ["new"]
        assert lease.held_back == 1
        assert (await store.queue_stats())["held_back"] == 1
        still = await store.take(5, trainer_version=10, max_version_age=2, lease_timeout_s=60)
        assert still.trajectories == [] and still.held_back == 1
        drained = await store.take(5, trainer_version=10, max_version_age=None, lease_timeout_s=60)
        assert [t.session.session_id for t in drained.trajectories] == ["old"] and drained.held_back == 0


async def test_take_waits_for_a_finish(store_url: str) -> None:
    async with opened(store_url) as store:
        await _session(store, "s")

        async def finish_later() -> None:
            await asyncio.sleep(0.2)
            await store.finish_session("s", "f", 1.0, {})

        task = asyncio.create_task(finish_later())
        lease = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=60, wait_s=5)
        await task
        assert [t.session.session_id for t in lease.trajectories] == ["s"]


async def test_replicas_versions_and_route_keys(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.put_replica("r1", {"group": "g", "ready": True})
        assert (await store.list_replicas())["r1"]["ready"] is True
        assert await store.delete_replica("r1") and not await store.delete_replica("r1")
        assert await store.get_latest_version() is None
        assert await store.set_latest_version(3) == 3
        assert await store.set_latest_version(2) == 3
        assert await store.get_latest_version() == 3
        await store.set_route_key("k", {"group": "g"}, ttl_s=0.2)
        assert await store.get_route_key("k") == {"group": "g"}
        await asyncio.sleep(0.3)
        assert await store.get_route_key("k") is None
        assert await store.ping()


async def test_redis_leases_survive_a_new_store_instance(redis_url: str) -> None:
    """A router restart = a new store object on the same Redis: leases and queue persist."""
    redis.Redis.from_url(redis_url).flushdb()
    async with opened(redis_url) as store:
        await _session(store, "s")
        await store.finish_session("s", "f", 1.0, {})
        lease = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=0.2)
    async with opened(redis_url) as store:
        await asyncio.sleep(0.3)
        again = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=0.2)
        assert [t.session.session_id for t in again.trajectories] == ["s"]
        assert (await store.ack(lease.lease_id)).acked == 0
        assert (await store.ack(again.lease_id)).acked == 1


async def test_idle_open_sessions_expire_and_free_their_slot(store_url: str) -> None:
    async with opened(store_url) as store:
        now = time.time()
        for sid in ("idle", "busy", "done"):
            await store.create_session(sid, "g", {}, now=now - 100)
        for sid in ("busy", "done"):  # a turn now counts as activity
            await store.append_turn(sid, "r", b"x", group="g", tokens=1, min_version=None, max_version=None)
        await store.finish_session("done", "f", 1.0, {})
        assert await store.expire_idle(50) == [("idle", "g")]
        assert await store.get_session("idle") is None
        assert (await store.get_session("busy")).status == "open"
        assert (await store.counters())["g"].active_sessions == 1
        assert await store.expire_idle(50) == []

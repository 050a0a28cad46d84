"""One contract suite for the state port, run against the memory adapter and a real redis-server;
then what only the Redis adapter promises: the URL's database, scripts after the server forgot
them, a restart within the outage window waited out, and a longer outage reported as
:class:`StateUnavailable`."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from router.state.base import (
    LeaseNotFound,
    SessionFinished,
    SessionNotFound,
    StateStore,
    StateUnavailable,
    TurnConflict,
    WindowEntry,
)
from router.state.redis import RedisStore
from tests.support.procs import free_port, redis_server
from tests.support.state import opened

pytestmark = pytest.mark.anyio


async def _session(store: StateStore, sid: str, group: str = "g1", turns: int = 1, version: int = 1) -> None:
    await store.create_session(sid, group, {"task": sid}, now=1.0)
    for i in range(turns):
        await store.append_turn(
            sid,
            f"{sid}-{i}",
            f"blob-{sid}-{i}".encode(),
            group=group,
            replica="rep",
            tokens=3,
            min_version=version,
            max_version=version,
        )


async def test_session_lifecycle_and_counters(store_url: str) -> None:
    async with opened(store_url) as store:
        assert await store.get_session("nope") is None
        await store.create_session("s1", "g1", {"a": 1}, now=5.0)
        await store.create_session("s1", "g1", {"a": 1}, now=5.0)  # a retry: no-op
        with pytest.raises(ValueError, match="exists"):
            await store.create_session("s1", "g1", {"a": 1}, now=6.0)
        info = await store.get_session("s1")
        assert info and info.status == "open" and info.group == "g1" and info.metadata == {"a": 1}
        assert (
            await store.append_turn(
                "s1", "r1", b"t0", group="g1", replica="rep", tokens=4, min_version=2, max_version=3
            )
            == 0
        )
        assert (
            await store.append_turn(
                "s1", "r2", b"t1", group="g1", replica="rep", tokens=5, min_version=1, max_version=2
            )
            == 1
        )
        info = await store.get_session("s1")
        assert (info.n_turns, info.tokens, info.min_version, info.max_version) == (2, 9, 1, 3)
        assert (info.group, info.replica) == ("g1", "rep")
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
                "s", "same", b"x", group="g", replica="rep", tokens=1, min_version=None, max_version=None
            )
            == 0
        )
        assert (
            await store.append_turn(
                "s", "same", b"y", group="g", replica="rep", tokens=1, min_version=None, max_version=None
            )
            == 0
        )
        assert await store.get_turns("s") == [b"x"]
        with pytest.raises(TurnConflict) as conflict:
            await store.append_turn(
                "s",
                "other",
                b"z",
                group="g",
                replica="rep",
                tokens=1,
                min_version=None,
                max_version=None,
                expected_turn=0,
            )
        assert conflict.value.next_turn == 1
        await store.finish_session("s", "f", 1.0, {})
        await store.finish_session("s", "f", 1.0, {})  # retried finish: no-op
        with pytest.raises(SessionFinished):
            await store.finish_session("s", "f2", 1.0, {})
        with pytest.raises(SessionFinished):
            await store.append_turn(
                "s", "late", b"z", group="g", replica="rep", tokens=1, min_version=None, max_version=None
            )
        with pytest.raises(SessionNotFound):
            await store.append_turn(
                "zz", "r", b"z", group="g", replica="rep", tokens=1, min_version=None, max_version=None
            )
        with pytest.raises(SessionNotFound):
            await store.finish_session("zz", "r", 1.0, {})
        assert (await store.counters())["g"].turns == 1


async def test_concurrent_appends_get_distinct_indices(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.create_session("s", "g", {}, now=0.0)
        idx = await asyncio.gather(
            *(
                store.append_turn(
                    "s",
                    f"r{i}",
                    bytes([i]),
                    group="g",
                    replica="rep",
                    tokens=1,
                    min_version=None,
                    max_version=None,
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
        assert (await store.get_session("s")).replica is None
        # a turn served elsewhere moves the session with it
        await store.append_turn(
            "s", "r0", b"t0", group="b", replica="rep-1", tokens=1, min_version=None, max_version=None
        )
        info = await store.get_session("s")
        assert info.group == "b" and info.replica == "rep-1"
        c = await store.counters()
        assert c["a"].active_sessions == 0 and c["b"].active_sessions == 1
        assert (c["a"].turns, c["b"].turns) == (0, 1)
        # a refused or retried append moves nothing
        with pytest.raises(TurnConflict):
            await store.append_turn(
                "s",
                "r1",
                b"t1",
                group="a",
                replica="x",
                tokens=1,
                min_version=None,
                max_version=None,
                expected_turn=0,
            )
        assert (
            await store.append_turn(
                "s", "r0", b"t0", group="a", replica="x", tokens=1, min_version=None, max_version=None
            )
            == 0
        )
        info = await store.get_session("s")
        assert (info.group, info.replica, info.n_turns) == ("b", "rep-1", 1)
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


@contextlib.asynccontextmanager
async def two_routers(url: str) -> AsyncIterator[tuple[StateStore, StateStore]]:
    """The stores of two routers sharing ``url`` (one store for ``memory``: one process)."""
    async with opened(url) as a:
        if url == "memory":
            yield a, a
            return
        async with opened(url) as b:
            yield a, b


async def test_the_routing_window_keeps_the_latest_decisions_in_order(store_url: str) -> None:
    async with two_routers(store_url) as (a, b):
        seen: list[tuple[int, int]] = []

        def decide(window, seq):
            seen.append((len(window), seq))
            return WindowEntry(f"g{seq % 2}", {"g0": seq, "g1": 10 * seq})

        for i in range(5):
            entry = await (a if i % 2 else b).assign(decide, 3)
            assert entry == WindowEntry(f"g{i % 2}", {"g0": i, "g1": 10 * i})
        assert seen == [(0, 0), (1, 1), (2, 2), (3, 3), (3, 4)]
        want = [WindowEntry(f"g{i % 2}", {"g0": i, "g1": 10 * i}) for i in (2, 3, 4)]
        assert await a.window(3) == want and await b.window(3) == want
        assert await b.window(2) == want[1:]
        assert await a.assign(lambda window, seq: None, 3) is None  # declined: nothing changes
        assert await b.window(3) == want
        assert (await a.assign(lambda window, seq: WindowEntry("g9", {"seq": seq}), 3)).tokens_total == {
            "seq": 5
        }


async def test_concurrent_assignments_of_two_routers_each_decide_on_every_earlier_one(store_url: str) -> None:
    """300 assignments at once through two routers: each decision saw a distinct count and a
    window holding exactly the assignments before it, in order (and none waited out the store's
    outage timeout: concurrent callers of one router do not keep invalidating each other)."""
    async with two_routers(store_url) as (a, b):

        def decide(window, seq):
            assert [e.tokens_total["seq"] for e in window] == list(range(max(0, seq - 50), seq))
            return WindowEntry("g", {"seq": seq})

        entries = await asyncio.gather(*((a, b)[i % 2].assign(decide, 50) for i in range(300)))
        assert sorted(e.tokens_total["seq"] for e in entries) == list(range(300))
        assert [e.tokens_total["seq"] for e in await a.window(50)] == list(range(250, 300))


async def test_one_weight_job_holds_the_lock_across_routers_until_released_or_lapsed(store_url: str) -> None:
    async with two_routers(store_url) as (a, b):
        assert await a.job_lock_holder() is None
        assert await a.acquire_job_lock("j1", 30.0)
        assert not await b.acquire_job_lock("j2", 30.0)
        assert await b.job_lock_holder() == "j1"
        assert await a.acquire_job_lock("j1", 30.0)  # a renewal by its holder
        assert not await b.release_job_lock("j2")
        assert await b.job_lock_holder() == "j1"
        assert await b.release_job_lock("j1")
        assert await a.job_lock_holder() is None
        assert await b.acquire_job_lock("j2", 0.2)
        assert not await a.acquire_job_lock("j3", 30.0)
        await asyncio.sleep(0.3)  # the holder stopped renewing: the lock lapses
        assert await a.job_lock_holder() is None
        assert await a.acquire_job_lock("j3", 30.0)
        assert not await b.release_job_lock("j2")


async def test_job_views_are_shared_and_the_latest_ones_kept(store_url: str) -> None:
    async with two_routers(store_url) as (a, b):
        for i in range(1, 6):
            await (a, b)[i % 2].put_job(f"j{i}", {"job_id": f"j{i}", "state": "running"}, keep=3)
        assert await a.get_job("j1") is None and await b.get_job("j2") is None
        await b.put_job("j4", {"job_id": "j4", "state": "done", "events": [{"kind": "x"}]}, keep=3)
        assert await a.get_job("j4") == {"job_id": "j4", "state": "done", "events": [{"kind": "x"}]}
        assert [j["job_id"] for j in await a.list_jobs(10)] == ["j3", "j4", "j5"]
        assert [j["job_id"] for j in await b.list_jobs(2)] == ["j4", "j5"]
        assert await b.list_jobs(0) == []


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
            await store.append_turn(
                sid, "r", b"x", group="g", replica="rep", tokens=1, min_version=None, max_version=None
            )
        await store.finish_session("done", "f", 1.0, {})
        assert await store.expire_idle(50) == [("idle", "g")]
        assert await store.get_session("idle") is None
        assert (await store.get_session("busy")).status == "open"
        assert (await store.counters())["g"].active_sessions == 1
        assert await store.expire_idle(50) == []


async def test_many_concurrent_calls_each_get_their_own_answer(store_url: str) -> None:
    async with opened(store_url) as store:
        sids = [f"c{i}" for i in range(200)]
        await asyncio.gather(
            *(store.create_session(sid, f"g{i % 3}", {"i": i}, now=1.0) for i, sid in enumerate(sids))
        )
        blobs = [bytes([i % 256]) + b"\r\n\x00" + sid.encode() for i, sid in enumerate(sids)]
        idx = await asyncio.gather(
            *(
                store.append_turn(
                    sid, "r", blob, group=f"g{i % 3}", replica="rep", tokens=i, min_version=i, max_version=i
                )
                for i, (sid, blob) in enumerate(zip(sids, blobs, strict=True))
            )
        )
        assert idx == [0] * len(sids)
        infos = await asyncio.gather(*(store.get_session(sid) for sid in sids))
        assert [(s.session_id, s.metadata["i"], s.tokens, s.min_version) for s in infos] == [
            (sid, i, i, i) for i, sid in enumerate(sids)
        ]
        assert await asyncio.gather(*(store.get_turns(sid) for sid in sids)) == [[b] for b in blobs]


async def test_redis_uses_the_database_of_its_url(redis_url: str) -> None:
    other = redis_url.rsplit("/", 1)[0] + "/3"
    plain, third = redis.Redis.from_url(redis_url), redis.Redis.from_url(other)
    plain.flushdb()
    third.flushdb()
    async with opened(other) as store:
        await _session(store, "s")
        assert (await store.get_session("s")).n_turns == 1
    assert plain.dbsize() == 0 and third.exists("mf:s:s")


async def test_redis_scripts_are_loaded_again_after_a_script_flush(redis_url: str) -> None:
    redis.Redis.from_url(redis_url).flushdb()
    async with opened(redis_url) as store:
        await _session(store, "s", turns=1)
        redis.Redis.from_url(redis_url).script_flush()
        assert (
            await store.append_turn(
                "s", "again", b"t1", group="g1", replica="rep", tokens=1, min_version=1, max_version=1
            )
            == 1
        )
        await store.finish_session("s", "f", 1.0, {})
        assert (await store.get_session("s")).status == "finished"


async def test_redis_a_queued_session_whose_keys_are_gone_is_dropped_from_the_queue(redis_url: str) -> None:
    """Keys evicted by Redis (or removed by hand) under a finished session: take hands out the
    others and forgets the orphaned entry."""
    plain = redis.Redis.from_url(redis_url)
    plain.flushdb()
    async with opened(redis_url) as store:
        for sid in ("kept", "gone"):
            await _session(store, sid)
            await store.finish_session(sid, "f", 1.0, {})
        plain.delete("mf:s:gone", "mf:s:gone:t")
        lease = await store.take(5, trainer_version=1, max_version_age=None, lease_timeout_s=60)
        assert [t.session.session_id for t in lease.trajectories] == ["kept"]
        assert (await store.ack(lease.lease_id)).acked == 1
        assert await store.queue_stats() == {"ready": 0, "pending": 0, "held_back": 0, "leases": 0}


async def test_redis_restart_within_the_outage_window_is_waited_out_and_a_longer_one_is_unavailable() -> None:
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="state-restart-"))
    url = f"redis://127.0.0.1:{port}/0"
    patient, short = RedisStore(url, outage_s=15.0), RedisStore(url, outage_s=1.0)
    try:
        with redis_server(port=port, data_dir=data, appendonly=True):
            await _session(patient, "a", turns=2)
            assert await short.get_session("a") is not None
        restarted = asyncio.get_running_loop().run_in_executor(None, _restart_later, port, data, 2.0)
        t0 = time.monotonic()
        with pytest.raises(StateUnavailable):  # down for ~2 s: the short window gives up first
            await short.get_session("a")
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(StateUnavailable):
            await short.append_turn(
                "a", "r", b"x", group="g1", replica="rep", tokens=1, min_version=1, max_version=1
            )
        info = await patient.get_session("a")  # waits the restart out; the data survived it (AOF)
        assert info is not None and info.n_turns == 2
        assert await patient.get_turns("a") == [b"blob-a-0", b"blob-a-1"]
        assert (
            await patient.append_turn(
                "a", "r2", b"t2", group="g1", replica="rep", tokens=1, min_version=1, max_version=1
            )
            == 2
        )
        assert await short.get_session("a") is not None  # the short one works again too
        stop = await restarted
        stop.set()
    finally:
        await patient.close()
        await short.close()


async def test_unreachable_redis_is_unavailable_not_an_error_of_the_caller() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", outage_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(StateUnavailable):
            await store.create_session("s", "g", {}, now=0.0)
        with pytest.raises(StateUnavailable):
            await store.take(1, trainer_version=0, max_version_age=None, lease_timeout_s=1.0)
        assert time.monotonic() - t0 < 10.0
        assert await store.ping() is False
    finally:
        await store.close()


def _restart_later(port: int, data: Path, after: float) -> threading.Event:
    """Start redis-server on ``port`` (same data dir) after ``after`` seconds; return the event
    that stops it."""
    time.sleep(after)
    stop, ready = threading.Event(), threading.Event()

    def serve() -> None:
        with redis_server(port=port, data_dir=data, appendonly=True):
            ready.set()
            stop.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    ready.wait(30)
    return stop

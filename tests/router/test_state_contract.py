"""One contract suite for the state port, run against the memory adapter and a real redis-server;
then what only the Redis adapter promises: the URL's database, scripts after the server forgot
them, a restart within the outage window waited out, and a longer outage reported as
:class:`StateUnavailable`."""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from router.ledger import update_costs
from router.mismatch import MismatchSums, rollup
from router.state.base import (
    AckResult,
    LeaseNotFound,
    LeaseReleased,
    RequestRecorded,
    SessionFinished,
    SessionNotFound,
    StateStore,
    StateUnavailable,
    TakeTakenOver,
    TurnConflict,
    TurnRecord,
    WindowEntry,
)
from router.state.redis import RedisStore
from router.state.retention import Retention
from tests.support.procs import free_port, redis_server
from tests.support.proxy import TcpProxy
from tests.support.state import opened

pytestmark = pytest.mark.anyio


async def _session(store: StateStore, sid: str, group: str = "g1", turns: int = 1, version: int = 1) -> None:
    await store.create_session(sid, group, {"task": sid}, now=1.0)
    for i in range(turns):
        await store.append_turn(
            sid,
            TurnRecord(
                f"{sid}-{i}",
                f"blob-{sid}-{i}".encode(),
                group=group,
                replica="rep",
                tokens=3,
                min_version=version,
                max_version=version,
            ),
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
                "s1",
                TurnRecord("r1", b"t0", group="g1", replica="rep", tokens=4, min_version=2, max_version=3),
            )
            == 0
        )
        assert (
            await store.append_turn(
                "s1",
                TurnRecord("r2", b"t1", group="g1", replica="rep", tokens=5, min_version=1, max_version=2),
            )
            == 1
        )
        info = await store.get_session("s1")
        assert (info.n_turns, info.tokens, info.min_version, info.max_version) == (2, 9, 1, 3)
        assert (info.group, info.replica) == ("g1", "rep")
        assert await store.get_turns("s1") == [b"t0", b"t1"]
        c = (await store.counters())["g1"]
        assert (c.active_sessions, c.sessions, c.turns, c.tokens) == (1, 1, 2, 9)
        assert await store.finish_session("s1", "f1", 0.5, {"ok": True}) == 2  # its turns, as finished
        assert await store.finish_session("s1", "f1", 0.5, {"ok": True}) == 2  # the request's retry
        info = await store.get_session("s1")
        assert info.status == "finished" and info.reward == 0.5 and info.finish_metadata == {"ok": True}
        assert (await store.counters())["g1"].active_sessions == 0


async def test_a_sessions_record_routes_is_stored_with_it_until_the_trainer_takes_it(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.create_session("r", "g1", {"a": 1}, now=5.0, record_routes=True)
        await store.create_session("p", "g1", {"a": 1}, now=5.0)
        await store.create_session("r", "g1", {"a": 1}, now=5.0, record_routes=True)  # a retry: no-op
        for sid, other in (("r", False), ("p", True)):  # the same id asking otherwise is another call
            with pytest.raises(ValueError, match="exists"):
                await store.create_session(sid, "g1", {"a": 1}, now=5.0, record_routes=other)
        assert [(await store.get_session(sid)).record_routes for sid in ("r", "p")] == [True, False]
        for sid in ("r", "p"):
            record = TurnRecord(
                f"q-{sid}", b"t", group="g2", replica="x", tokens=1, min_version=1, max_version=1
            )
            await store.append_turn(sid, record)  # a turn that moved it to another group keeps the flag
            info, _ = await store.get_session_context(sid)
            assert (info.group, info.record_routes) == ("g2", sid == "r")
            await store.finish_session(sid, f"f-{sid}", 1.0, {})
        lease = await store.take(10, trainer_version=1, max_version_age=None, lease_timeout_s=30)
        assert {t.session.session_id: t.session.record_routes for t in lease.trajectories} == {
            "r": True,
            "p": False,
        }


async def test_the_context_grows_by_appends_restarts_at_a_fork_and_goes_at_finish(store_url: str) -> None:
    def rec(rid: str, context: bytes, fork: bool = False, expected: int | None = None) -> TurnRecord:
        return TurnRecord(rid, b"blob-" + rid.encode(), "g", "rep", 1, None, None, context, fork, expected)

    async with opened(store_url) as store:
        assert await store.get_session_context("nope") is None
        await store.create_session("s", "g", {}, now=0.0)
        info, context = await store.get_session_context("s")
        assert (info.session_id, info.n_turns, context) == ("s", 0, b"")
        await store.append_turn("s", rec("a", b"\x01\x00\x00\x00\x02\x00\x00\x00"))
        await store.append_turn("s", rec("b", b"\x03\x00\x00\x00"))
        info, context = await store.get_session_context("s")
        assert (info.n_turns, context) == (2, bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]))
        for known, expect in ((2, None), (1, context), (0, context), (3, context)):  # only n_turns skips
            info, read = await store.get_session_context("s", known)
            assert (info.n_turns, read) == (2, expect), known
        with pytest.raises(TurnConflict):  # a refused append leaves the context as it was
            await store.append_turn("s", rec("c", b"\x09\x00\x00\x00", fork=True, expected=0))
        assert (await store.get_session_context("s"))[1] == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])
        await store.append_turn("s", rec("d", b"\x07\x00\x00\x00", fork=True))
        with pytest.raises(RequestRecorded) as recorded:  # a retry changes nothing
            await store.append_turn("s", rec("d", b"\x08\x00\x00\x00"))
        assert (recorded.value.request_id, recorded.value.index) == ("d", 2)
        assert (await store.get_session_context("s"))[1] == bytes([7, 0, 0, 0])
        await store.finish_session("s", "f", 1.0, {})
        info, context = await store.get_session_context("s")
        assert (info.status, info.n_turns, context) == ("finished", 3, b"")
        assert (await store.get_session_context("s", 2))[1] == b""
        assert await store.get_turns("s") == [b"blob-a", b"blob-b", b"blob-d"]
        await store.create_session("t", "g", {}, now=0.0)
        await store.append_turn("t", rec("a", b"\x05\x00\x00\x00"))
        await store.delete_session("t")
        assert await store.get_session_context("t") is None


async def test_the_chat_note_is_read_with_the_context_and_only_a_later_turn_replaces(store_url: str) -> None:
    async with opened(store_url) as store:
        assert await store.get_chat_state("nope") is None
        assert not await store.put_chat_note("nope", 0, b"x")
        await store.create_session("s", "g", {}, now=0.0)
        state = await store.get_chat_state("s")
        assert (state.session.n_turns, state.context, state.note_turn, state.note) == (0, b"", None, b"")
        rec = TurnRecord("a", b"blob", "g", "rep", 1, None, None, b"\x01\x00\x00\x00")
        await store.append_turn("s", rec)
        assert await store.put_chat_note("s", 0, b"note-0")
        assert await store.put_chat_note("s", 2, b"note-2")
        assert not await store.put_chat_note("s", 1, b"note-1")  # an earlier turn's note comes late
        assert not await store.put_chat_note("s", 2, b"again")
        state = await store.get_chat_state("s")
        assert (state.session.n_turns, state.context) == (1, b"\x01\x00\x00\x00")
        assert (state.note_turn, state.note) == (2, b"note-2")
        for known, context in ((1, None), (0, b"\x01\x00\x00\x00"), (2, b"\x01\x00\x00\x00")):
            state = await store.get_chat_state("s", known)  # the context is skipped only for n_turns
            assert (state.session.n_turns, state.context, state.note) == (1, context, b"note-2"), known
        await store.finish_session("s", "f", 1.0, {})
        state = await store.get_chat_state("s")
        assert (state.session.status, state.note_turn, state.note) == ("finished", None, b"")
        assert not await store.put_chat_note("s", 3, b"late")


async def test_appends_are_idempotent_per_request_and_refused_after_finish(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.create_session("s", "g", {}, now=0.0)
        assert (
            await store.append_turn(
                "s",
                TurnRecord(
                    "same", b"x", group="g", replica="rep", tokens=1, min_version=None, max_version=None
                ),
            )
            == 0
        )
        with pytest.raises(RequestRecorded) as recorded:  # the request id holds turn 0: nothing stored
            await store.append_turn(
                "s",
                TurnRecord(
                    "same", b"y", group="g", replica="rep", tokens=1, min_version=None, max_version=None
                ),
            )
        assert recorded.value.index == 0
        assert await store.get_turns("s") == [b"x"]
        assert (await store.get_session("s")).n_turns == 1
        with pytest.raises(TurnConflict) as conflict:
            await store.append_turn(
                "s",
                TurnRecord(
                    "other",
                    b"z",
                    group="g",
                    replica="rep",
                    tokens=1,
                    min_version=None,
                    max_version=None,
                    expected_turn=0,
                ),
            )
        assert conflict.value.next_turn == 1
        await store.finish_session("s", "f", 1.0, {})
        await store.finish_session("s", "f", 1.0, {})  # retried finish: no-op
        with pytest.raises(SessionFinished):
            await store.finish_session("s", "f2", 1.0, {})
        with pytest.raises(SessionFinished):
            await store.append_turn(
                "s",
                TurnRecord(
                    "late", b"z", group="g", replica="rep", tokens=1, min_version=None, max_version=None
                ),
            )
        with pytest.raises(SessionNotFound):
            await store.append_turn(
                "zz",
                TurnRecord("r", b"z", group="g", replica="rep", tokens=1, min_version=None, max_version=None),
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
                    TurnRecord(
                        f"r{i}",
                        bytes([i]),
                        group="g",
                        replica="rep",
                        tokens=1,
                        min_version=None,
                        max_version=None,
                    ),
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
            "s",
            TurnRecord("r0", b"t0", group="b", replica="rep-1", tokens=1, min_version=None, max_version=None),
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
                TurnRecord(
                    "r1",
                    b"t1",
                    group="a",
                    replica="x",
                    tokens=1,
                    min_version=None,
                    max_version=None,
                    expected_turn=0,
                ),
            )
        with pytest.raises(RequestRecorded):
            await store.append_turn(
                "s",
                TurnRecord("r0", b"t0", group="a", replica="x", tokens=1, min_version=None, max_version=None),
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
        first = await store.ack(lease.lease_id)
        assert (first.acked, first.already_acked) == (3, False)
        assert (await store.ack(second.lease_id)).acked == 2
        again = await store.ack(lease.lease_id)  # a retry: the first one's result, nothing more
        assert again == AckResult(3, 0, first.update, already_acked=True)
        assert [u.trajectories for u in (await store.ledger()).updates] == [3, 2]
        with pytest.raises(LeaseNotFound):
            await store.ack("0" * 32)  # never handed out
        empty = await store.take(10, trainer_version=1, max_version_age=None, lease_timeout_s=0.01)
        assert empty.trajectories == []
        assert (await store.get_session("s0")).status == "consumed"
        stats = await store.queue_stats()
        assert stats["ready"] == 0 and stats["pending"] == 0


async def test_an_ack_script_rerun_after_its_lost_reply_answers_the_acknowledgement(redis_url: str) -> None:
    """Redis runs the acknowledgement's script, its reply is lost (the connection is cut as it
    comes back), redis-py reconnects and runs the script again: the rerun answers the lease's
    acknowledgement (``already_acked``), not an unknown lease, and nothing is counted twice."""
    redis.Redis.from_url(redis_url).flushdb()
    lost: list[bytes] = []

    def lose_the_ack_reply(direction: str, data: bytes, conn: dict) -> bytes | None:
        if direction == "up":
            conn["ack"] = b"mf:lease:" in data and b"mf:updates" in data  # the _ACK script
        elif conn.get("ack") and not lost and not data.startswith(b"-NOSCRIPT"):
            lost.append(data)  # the script's own reply: a NOSCRIPT (first use on this server) ran nothing
            return None
        return data

    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = TcpProxy((host, int(port)), lose_the_ack_reply)
    try:
        async with opened(f"redis://127.0.0.1:{proxy.port}/0") as store:
            await _session(store, "s")
            await store.finish_session("s", "f", 1.0, {})
            lease = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=60)
            result = await store.ack(lease.lease_id)
            assert lost, "the acknowledgement's reply was not cut"
            assert (result.acked, result.expired, result.already_acked) == (1, 0, True)
            assert [u.trajectories for u in (await store.ledger()).updates] == [1]
            assert (await store.get_session("s")).status == "consumed"
    finally:
        proxy.close()


async def test_a_repeated_take_id_answers_its_open_lease_again_and_hands_out_nothing(store_url: str) -> None:
    """A take retried with its take id (its first answer was lost) gets the same lease, the same
    trajectories in the same order, the same counts and trainer version, while that lease is
    open; once it is acknowledged, or timed out, the id takes afresh; a take without an id, or
    with another, takes other trajectories."""
    async with opened(store_url) as store:
        for i in range(4):
            await _session(store, f"s{i}", turns=2)
            await store.finish_session(f"s{i}", "f", float(i), {})
        take = dict(max_version_age=None, lease_timeout_s=60)
        first = await store.take(2, trainer_version=3, take_id="t-1", **take)
        again = await store.take(2, trainer_version=7, take_id="t-1", **take)
        assert again.repeated and not first.repeated
        assert (again.lease_id, again.trajectories) == (first.lease_id, first.trajectories)
        assert (again.held_back, again.redelivered, again.trainer_version) == (0, 0, 3)
        assert (await store.queue_stats())["leases"] == 1
        other = await store.take(1, trainer_version=3, take_id="t-2", **take)
        plain = await store.take(1, trainer_version=3, **take)
        ids = [t.session.session_id for lease in (first, other, plain) for t in lease.trajectories]
        assert sorted(ids) == ["s0", "s1", "s2", "s3"]
        assert (await store.ack(first.lease_id)).acked == 2
        assert [(await store.ack(x.lease_id)).acked for x in (other, plain)] == [1, 1]
        after = await store.take(2, trainer_version=3, take_id="t-1", **take)  # acknowledged: afresh
        assert not after.repeated and after.trajectories == []
        await _session(store, "s4")
        await store.finish_session("s4", "f", 1.0, {})
        short = dict(max_version_age=None, lease_timeout_s=0.3)
        lapsing = await store.take(1, trainer_version=3, take_id="t-3", **short)
        await asyncio.sleep(0.4)
        retaken = await store.take(1, trainer_version=3, take_id="t-3", **short)  # timed out: afresh
        assert not retaken.repeated and retaken.lease_id != lapsing.lease_id
        assert [t.session.session_id for t in retaken.trajectories] == ["s4"] and retaken.redelivered == 1


async def test_a_lease_answered_again_to_its_take_ids_repeat_is_not_released(store_url: str) -> None:
    """The first take's client leaves after a repeat of its take id was answered its lease: the
    release leaves the lease (the repeat's client holds it), nothing goes back on the queue, no
    other take gets its trajectories, and the repeat's acknowledgement acknowledges them."""
    async with opened(store_url) as store:
        for sid in ("a", "b"):
            await _session(store, sid)
            await store.finish_session(sid, "f", 1.0, {})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 300}
        first = await store.take(2, **kw, take_id="t")
        again = await store.take(2, **kw, take_id="t")
        assert again.repeated and again.lease_id == first.lease_id
        assert await store.release(first.lease_id) == 0
        assert await store.queue_stats() == {"ready": 0, "pending": 2, "held_back": 0, "leases": 1}
        assert (await store.take(2, **kw)).trajectories == []
        assert (await store.take(2, **kw, take_id="t")).repeated  # still open, still the retry's
        result = await store.ack(again.lease_id)
        assert (result.acked, result.expired) == (2, 0)


async def test_redis_a_repeat_answered_while_a_release_runs_keeps_its_lease(redis_url: str) -> None:
    """The repeat of the take id is answered between the release's read of the lease and its
    script: the script sees the repeat's mark and leaves the lease."""
    redis.Redis.from_url(redis_url).flushdb()
    async with opened(redis_url) as store, opened(redis_url) as other:
        await _session(store, "s")
        await store.finish_session("s", "f", 1.0, {})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 300}
        first = await store.take(1, **kw, take_id="t")
        give_back = store._give_back
        repeats = []

        async def repeat_first(**script):
            repeats.append(await other.take(1, **kw, take_id="t"))
            return await give_back(**script)

        store._give_back = repeat_first
        assert await store.release(first.lease_id) == 0
        assert [x.repeated for x in repeats] == [True]
        assert await store.queue_stats() == {"ready": 0, "pending": 1, "held_back": 0, "leases": 1}
        assert (await other.ack(first.lease_id)).acked == 1


async def test_a_take_id_taken_over_while_its_first_take_waits_ends_with_one_lease(store_url: str) -> None:
    """A take with a take id waits for more (it picked one); a later take with the same id (its
    client's retry, on another router) starts: the first gives up at once (TakeTakenOver) and puts
    back what it picked; the later one takes it and what comes next, under the one lease the take
    id then names."""
    async with two_routers(store_url) as (a, b):
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 60}
        await _session(a, "s0")
        await a.finish_session("s0", "f", 1.0, {})
        first = asyncio.create_task(a.take(2, **kw, wait_s=20, take_id="t"))
        async with asyncio.timeout(5):  # until it picked "s0" (it waits on for a second one)
            while (await b.queue_stats())["pending"] != 1:
                await asyncio.sleep(0.02)
        retry = asyncio.create_task(b.take(2, **kw, wait_s=20, take_id="t"))
        with pytest.raises(TakeTakenOver):
            async with asyncio.timeout(5):
                await first
        await _session(a, "s1")
        await a.finish_session("s1", "f", 1.0, {})
        async with asyncio.timeout(10):
            lease = await retry
        assert sorted(t.session.session_id for t in lease.trajectories) == ["s0", "s1"]
        assert (lease.redelivered, lease.repeated) == (0, False)
        assert await a.queue_stats() == {"ready": 0, "pending": 2, "held_back": 0, "leases": 1}
        again = await a.take(2, **kw, take_id="t")
        assert again.repeated and (again.lease_id, again.trajectories) == (lease.lease_id, lease.trajectories)


async def test_redis_a_take_ids_record_replaced_during_its_check_is_read_again(redis_url: str) -> None:
    """The check of a repeated take id reads the take id's record and its lease in one atomic
    step: a take whose check is held between its read of the record (naming lease L1) and the
    rest, while L1 is acknowledged and another take with the id makes L2, answers L2 again
    instead of taking a third lease beside L2."""
    redis.Redis.from_url(redis_url).flushdb()
    armed, held, go = threading.Event(), threading.Event(), threading.Event()
    lease_ids: list[bytes] = []

    def hold_the_check(direction: str, data: bytes, conn: dict) -> bytes:
        if direction == "up" and armed.is_set() and not held.is_set() and lease_ids[0] in data:
            held.set()  # the check's first command that names L1, after its read of the record
            go.wait(10)
        return data

    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = TcpProxy((host, int(port)), hold_the_check)
    kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 60}
    try:
        async with opened(redis_url) as direct, opened(f"redis://127.0.0.1:{proxy.port}/0") as slow:
            for sid in ("s0", "s1", "s2"):
                await _session(direct, sid)
                await direct.finish_session(sid, "f", 1.0, {})
            l1 = await direct.take(1, **kw, take_id="t")
            lease_ids.append(f"mf:lease:{l1.lease_id}".encode())
            armed.set()
            checking = asyncio.create_task(slow.take(1, **kw, take_id="t"))
            async with asyncio.timeout(10):
                while not held.is_set():
                    await asyncio.sleep(0.01)
            assert (await direct.ack(l1.lease_id)).acked == 1
            l2 = await direct.take(1, **kw, take_id="t")
            assert not l2.repeated and l2.lease_id != l1.lease_id
            go.set()
            async with asyncio.timeout(10):
                answer = await checking
            assert answer.repeated
            assert (answer.lease_id, answer.trajectories) == (l2.lease_id, l2.trajectories)
            assert await direct.queue_stats() == {"ready": 1, "pending": 1, "held_back": 0, "leases": 1}
    finally:
        go.set()
        proxy.close()


async def test_redis_a_take_whose_key_is_taken_over_just_before_its_lease_makes_none(redis_url: str) -> None:
    """The later take claims the take id after the first picked and before its lease script ran
    (held by a TCP proxy): the script makes no lease (TakeTakenOver, what it picked put back) and
    the later take gets the trajectory under the one lease."""
    plain = redis.Redis.from_url(redis_url)
    plain.flushdb()
    held, go = threading.Event(), threading.Event()

    def hold_the_lease(direction: str, data: bytes, conn: dict) -> bytes:
        if direction == "up" and b"mf:held" in data and b"mf:takeid:t" in data and not held.is_set():
            held.set()  # the lease script's keys: the held set and the take id's record
            go.wait(10)
        return data

    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = TcpProxy((host, int(port)), hold_the_lease)
    kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 60}
    try:
        async with opened(redis_url) as direct, opened(f"redis://127.0.0.1:{proxy.port}/0") as slow:
            await _session(direct, "s0")
            await direct.finish_session("s0", "f", 1.0, {})
            first = asyncio.create_task(slow.take(1, **kw, take_id="t"))
            async with asyncio.timeout(10):
                while not held.is_set():
                    await asyncio.sleep(0.01)
            claim = plain.get("mf:takeid:t")
            retry = asyncio.create_task(direct.take(1, **kw, wait_s=10, take_id="t"))
            async with asyncio.timeout(10):
                while plain.get("mf:takeid:t") == claim:
                    await asyncio.sleep(0.01)
            go.set()
            with pytest.raises(TakeTakenOver):
                async with asyncio.timeout(10):
                    await first
            async with asyncio.timeout(10):
                lease = await retry
            assert [t.session.session_id for t in lease.trajectories] == ["s0"] and lease.redelivered == 0
            assert await direct.queue_stats() == {"ready": 0, "pending": 1, "held_back": 0, "leases": 1}
    finally:
        go.set()
        proxy.close()


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


async def test_a_take_goes_past_the_trajectories_it_holds_back(store_url: str) -> None:
    """A take without a wait (``wait_s`` 0, the default) whose first picks are all held back picks
    on until it has its size or nothing is ready: the Redis store stopped after its first pick."""
    async with opened(store_url) as store:
        for sid, version in (("old-1", 1), ("old-2", 1), ("new", 9)):
            await _session(store, sid, version=version)
            await store.finish_session(sid, "f", 0.0, {})
        lease = await store.take(1, trainer_version=10, max_version_age=2, lease_timeout_s=60)
        assert [t.session.session_id for t in lease.trajectories] == ["new"] and lease.held_back == 2
        none = await store.take(1, trainer_version=10, max_version_age=2, lease_timeout_s=60)
        assert none.trajectories == [] and none.held_back == 2


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


async def test_a_waiting_take_keeps_what_it_picked_and_its_lease_starts_when_it_answers(
    store_url: str,
) -> None:
    """A take waiting for more holds what it picked (no other take gets it, however long the wait
    against the lease timeout) and its lease's timeout counts from its answer."""
    async with two_routers(store_url) as (a, b):
        await _session(a, "s")
        await a.finish_session("s", "f", 1.0, {})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 0.5}
        waiting = asyncio.create_task(a.take(2, **kw, wait_s=1.5))
        await asyncio.sleep(0.8)  # "s" was picked more than a lease timeout ago
        assert (await b.take(1, **kw)).trajectories == []
        lease = await waiting
        assert [t.session.session_id for t in lease.trajectories] == ["s"] and lease.redelivered == 0
        assert (await b.take(1, **kw)).trajectories == []  # its lease has just started
        await asyncio.sleep(0.7)
        again = await b.take(1, **kw)
        assert [t.session.session_id for t in again.trajectories] == ["s"] and again.redelivered == 1
        late = await a.ack(lease.lease_id)
        assert (late.acked, late.expired, late.update) == (0, 1, None)


async def test_a_take_cancelled_while_it_waits_puts_back_what_it_picked_at_once(store_url: str) -> None:
    async with two_routers(store_url) as (a, b):
        await _session(a, "s")
        await a.finish_session("s", "f", 1.0, {})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 60}
        waiting = asyncio.create_task(a.take(2, **kw, wait_s=10))
        async with asyncio.timeout(5):  # until it picked "s" (it waits on for a second one)
            while (await b.queue_stats())["pending"] != 1:
                await asyncio.sleep(0.02)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await b.queue_stats() == {"ready": 1, "pending": 0, "held_back": 0, "leases": 0}
        lease = await b.take(2, **kw)
        assert [t.session.session_id for t in lease.trajectories] == ["s"] and lease.redelivered == 0
        assert (await a.ack(lease.lease_id)).acked == 1


async def test_concurrent_acks_of_one_lease_acknowledge_it_once(store_url: str) -> None:
    """Eight acknowledgements of one lease at once, through two routers (their connections
    open first, so that the eight reach the store together), three leases in turn: one
    acknowledges the lease's three trajectories and closes one update, the seven others find the
    lease acknowledged already and answer its result again (``already_acked``)."""
    async with two_routers(store_url) as (a, b):
        for n in range(1, 4):
            for i in range(3):
                await _session(a, f"s{n}-{i}")
                await a.finish_session(f"s{n}-{i}", "f", 1.0, {})
            lease = await a.take(3, trainer_version=1, max_version_age=None, lease_timeout_s=60)
            await asyncio.gather(*(x.ping() for x in (a, b) * 4))
            answers = await asyncio.gather(
                *(x.ack(lease.lease_id) for x in (a, b) * 4), return_exceptions=True
            )
            assert sorted(r.already_acked for r in answers) == [False] + [True] * 7, answers
            assert {(r.acked, r.expired, r.update) for r in answers} == {(3, 0, n)}
        assert [(u.seq, u.trajectories) for u in (await b.ledger()).updates] == [(1, 3), (2, 3), (3, 3)]
        assert await b.queue_stats() == {"ready": 0, "pending": 0, "held_back": 0, "leases": 0}


async def test_an_ack_racing_the_take_that_redelivers_its_lease_hands_out_nothing_twice(
    store_url: str,
) -> None:
    """An acknowledgement and a take at the moment the lease expires, 20 times through two
    routers: each trajectory is either acknowledged by it or handed out again (and then counted
    expired), never both."""
    async with two_routers(store_url) as (a, b):
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 0.05}
        for i in range(20):
            sids = {f"r{i}-{k}" for k in range(4)}
            for sid in sorted(sids):
                await _session(a, sid)
                await a.finish_session(sid, "f", 1.0, {})
            lease = await a.take(4, **kw)
            await asyncio.sleep(0.04 + 0.005 * (i % 5))
            acked, again = await asyncio.gather(b.ack(lease.lease_id), a.take(4, **kw))
            given = {t.session.session_id for t in again.trajectories}
            assert given <= sids and (acked.acked, acked.expired) == (4 - len(given), len(given)), i
            if again.trajectories:
                assert (await a.ack(again.lease_id)).acked == len(given)
        assert (await b.queue_stats())["pending"] == 0


async def test_a_redelivery_is_counted_though_the_trajectory_was_held_back_in_between(
    store_url: str,
) -> None:
    async with opened(store_url) as store:
        await _session(store, "s", version=1)
        await store.finish_session("s", "f", 1.0, {})
        first = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=0.2)
        assert len(first.trajectories) == 1 and first.redelivered == 0
        await asyncio.sleep(0.3)
        held = await store.take(1, trainer_version=10, max_version_age=2, lease_timeout_s=0.2)
        assert held.trajectories == [] and held.held_back == 1
        again = await store.take(1, trainer_version=10, max_version_age=None, lease_timeout_s=0.2)
        assert [t.session.session_id for t in again.trajectories] == ["s"] and again.redelivered == 1


async def test_a_late_release_of_a_timed_out_lease_leaves_its_delivery_counted(store_url: str) -> None:
    """A lease released after it timed out and another take handed its trajectory out again takes
    back no delivery: that trajectory was handed out twice, so a take after the second lease's
    release is a redelivery (the Redis store took back the first lease's delivery too)."""
    async with opened(store_url) as store:
        await _session(store, "s")
        await store.finish_session("s", "f", 1.0, {})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 0.2}  # the router's one
        first = await store.take(1, **kw)
        await asyncio.sleep(0.3)
        second = await store.take(1, **kw)
        assert [t.session.session_id for t in second.trajectories] == ["s"] and second.redelivered == 1
        assert await store.release(first.lease_id) == 0
        assert await store.release(second.lease_id) == 1  # timed out or not: no take claimed it
        third = await store.take(1, **kw)
        assert [t.session.session_id for t in third.trajectories] == ["s"] and third.redelivered == 1


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
async def two_routers(url: str, **kw) -> AsyncIterator[tuple[StateStore, StateStore]]:
    """The stores of two routers sharing ``url`` (one store for ``memory``: one process), opened
    with ``kw``."""
    async with opened(url, **kw) as a:
        if url == "memory":
            yield a, a
            return
        async with opened(url, **kw) as b:
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
                sid,
                TurnRecord("r", b"x", group="g", replica="rep", tokens=1, min_version=None, max_version=None),
            )
        await store.finish_session("done", "f", 1.0, {})
        assert await store.expire_idle(50) == [("idle", "g")]
        assert await store.get_session("idle") is None
        assert (await store.get_session("busy")).status == "open"
        assert (await store.counters())["g"].active_sessions == 1
        assert await store.expire_idle(50) == []
        await store.create_session("started", "g", {}, now=now - 100)
        await store.get_session_context("started")  # a turn starts: the session is active
        assert await store.expire_idle(50) == []
        await asyncio.sleep(0.3)
        await store.get_session_context("done")  # a finished session stays out of the idle set
        assert sorted(await store.expire_idle(0.2)) == [("busy", "g"), ("started", "g")]


async def test_touched_sessions_stay_active_and_gone_ones_stay_gone(store_url: str) -> None:
    async with opened(store_url) as store:
        now = time.time()
        for sid in ("running", "idle", "done", "deleted"):
            await store.create_session(sid, "g", {}, now=now - 100)
        record = TurnRecord("r", b"x", group="g", replica="rep", tokens=1, min_version=None, max_version=None)
        await store.append_turn("done", record)
        await store.finish_session("done", "f", 1.0, {})
        await store.delete_session("deleted")
        await store.touch_sessions([])
        await store.touch_sessions(["running", "done", "deleted", "unknown"])  # a turn of each runs
        assert await store.expire_idle(50) == [("idle", "g")]
        assert (await store.get_session("running")).status == "open"
        assert (await store.get_session("done")).status == "finished"
        assert await store.get_session("deleted") is None and await store.get_session("unknown") is None
        assert (await store.counters())["g"].active_sessions == 1
        if store_url.startswith("redis"):  # only open sessions are in the activity set, touched or not
            assert redis.Redis.from_url(store_url).zrange("mf:activity", 0, -1) == [b"running"]
        await asyncio.sleep(0.3)
        assert await store.expire_idle(0.2) == [("running", "g")]  # touched once: idle again since


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
                    sid,
                    TurnRecord(
                        "r", blob, group=f"g{i % 3}", replica="rep", tokens=i, min_version=i, max_version=i
                    ),
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
                "s",
                TurnRecord("again", b"t1", group="g1", replica="rep", tokens=1, min_version=1, max_version=1),
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


async def test_redis_what_a_take_that_died_while_it_waited_picked_goes_out_once_its_mark_lapses(
    redis_url: str,
) -> None:
    """A router gone mid-take leaves its pick pending under its consumer and its mark in
    ``mf:taking``: past the lease timeout no take claims it while the mark holds; once the mark
    lapses the next take gets it (not redelivered: no lease was made of it) and drops the mark."""
    plain = redis.Redis.from_url(redis_url)
    plain.flushdb()
    async with opened(redis_url) as store:
        await _session(store, "s")
        await store.finish_session("s", "f", 1.0, {})
        plain.xreadgroup("trainers", "dead", {"mf:ready": ">"}, count=1)
        secs, micros = plain.time()
        plain.zadd("mf:taking", {"dead": secs * 1000 + micros // 1000 + 1000})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 0.1}
        await asyncio.sleep(0.3)
        assert (await store.take(1, **kw)).trajectories == []
        await asyncio.sleep(0.9)
        lease = await store.take(1, **kw)
        assert [t.session.session_id for t in lease.trajectories] == ["s"] and lease.redelivered == 0
        assert plain.zrange("mf:taking", 0, -1) == []
        assert (await store.ack(lease.lease_id)).acked == 1


async def test_redis_a_take_cancelled_after_its_lease_was_made_puts_it_back_uncounted(redis_url: str) -> None:
    """The cancellation lands while the script that made the lease answers (the trainer never
    sees the lease): the lease is gone, the trajectory ready again and not counted delivered."""
    plain = redis.Redis.from_url(redis_url)
    plain.flushdb()
    async with opened(redis_url) as store:
        await _session(store, "s")
        await store.finish_session("s", "f", 1.0, {})
        made = store._lease_picked

        async def made_then_cancelled(**kw):
            await made(**kw)
            raise asyncio.CancelledError

        store._lease_picked = made_then_cancelled
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 60}
        with pytest.raises(asyncio.CancelledError):
            await store.take(1, **kw)
        store._lease_picked = made
        assert plain.keys("mf:lease:*") == [] and plain.zcard("mf:taking") == 0
        assert await store.queue_stats() == {"ready": 1, "pending": 0, "held_back": 0, "leases": 0}
        lease = await store.take(1, **kw)
        assert [t.session.session_id for t in lease.trajectories] == ["s"] and lease.redelivered == 0
        assert plain.hget("mf:s:s", "delivered") == b"1"


async def test_redis_a_lease_made_twice_counts_once_and_an_entry_it_does_not_name_is_not_lost(
    redis_url: str,
) -> None:
    """redis-py reruns a command whose reply a dropped connection lost. The script that makes a
    lease, run again, counts its deliveries once; an entry pending under a lease's consumer that
    the lease does not name (a read whose reply was lost) outlives the lease's acknowledgement
    and is handed out after the lease timeout."""
    plain = redis.Redis.from_url(redis_url)
    plain.flushdb()
    async with opened(redis_url) as store:
        for sid in ("s", "lost"):
            await _session(store, sid)
            await store.finish_session(sid, "f", 1.0, {})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 0.3}
        lease = await store.take(1, **kw)
        key = f"mf:lease:{lease.lease_id}"
        (entry,) = plain.hkeys(key)
        held, seen = await store._lease_picked(
            keys=["mf:ready", "mf:taking", key, "mf:held", key, "mf:s:s"],
            args=["trainers", lease.lease_id, 60_000, "", 1, entry, "s"],
        )
        assert seen == [1] and plain.hget("mf:s:s", "delivered") == b"1"
        plain.xreadgroup("trainers", lease.lease_id, {"mf:ready": ">"}, count=1)
        assert (await store.ack(lease.lease_id)).acked == 1
        await asyncio.sleep(0.4)
        again = await store.take(5, **kw)
        assert [t.session.session_id for t in again.trajectories] == ["lost"]


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
                "a", TurnRecord("r", b"x", group="g1", replica="rep", tokens=1, min_version=1, max_version=1)
            )
        info = await patient.get_session("a")  # waits the restart out; the data survived it (AOF)
        assert info is not None and info.n_turns == 2
        assert await patient.get_turns("a") == [b"blob-a-0", b"blob-a-1"]
        assert (
            await patient.append_turn(
                "a",
                TurnRecord("r2", b"t2", group="g1", replica="rep", tokens=1, min_version=1, max_version=1),
            )
            == 2
        )
        assert await short.get_session("a") is not None  # the short one works again too
        stop = await restarted
        stop.set()
    finally:
        await patient.close()
        await short.close()


async def test_a_poll_gives_up_sooner_while_redis_is_known_down_and_a_turn_waits_the_restart_out() -> None:
    """A real redis-server stopped: the first call that finds it gone waits the whole outage
    window; from then on a background poll's calls (``polling()``) give up after ``poll_s``, each
    of the poll's reads alike, while a request's call (a turn's append) still waits ``outage_s``
    and, Redis restarted within it, records the turn; the first call that reaches Redis again
    ends the short deadline."""
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="state-poll-"))
    url = f"redis://127.0.0.1:{port}/0"
    store = RedisStore(url, outage_s=6.0, poll_s=0.5)
    try:
        with redis_server(port=port, data_dir=data, appendonly=True):
            await _session(store, "a", turns=1)
            with store.polling():
                assert await store.data_lost() is None
        with store.polling(), pytest.raises(StateUnavailable, match=r"for 6 s"):
            await store.list_replicas()  # not known down yet: the whole window
        for poll in (store.data_lost, store.list_replicas, store.get_latest_version, store.compact):
            with store.polling(), pytest.raises(StateUnavailable, match=r"for 0\.5 s"):
                await poll()
        restarted = asyncio.get_running_loop().run_in_executor(None, _restart_later, port, data, 1.0)
        record = TurnRecord(
            "r1", b"blob-a-1", group="g1", replica="rep", tokens=1, min_version=1, max_version=1
        )
        assert await store.append_turn("a", record) == 1  # known down, but a request's call waits
        assert await store.get_turns("a") == [b"blob-a-0", b"blob-a-1"]
        with store.polling():
            assert await store.get_latest_version() is None and await store.data_lost() is None
        stop = await restarted
        stop.set()
    finally:
        await store.close()


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


# bounds (router.state.retention) ---------------------------------------------------------
M1 = MismatchSums(tokens=3, k3=0.1 + 0.2, abs_logprob_diff=1e-5, extreme=1, out_of_band=2)
M2 = MismatchSums(tokens=1, k3=0.7, abs_logprob_diff=2.5, extreme=0, out_of_band=1)


async def _versioned_turn(store: StateStore, sid: str, version: int, tokens: int = 3) -> None:
    await store.create_session(sid, "g1", {}, now=time.time())
    await store.append_turn(
        sid,
        TurnRecord(
            f"{sid}-0",
            b"blob",
            group="g1",
            replica="rep",
            tokens=tokens,
            min_version=version,
            max_version=version,
            version_tokens={version: tokens},
        ),
    )


def _close(a: MismatchSums, b: MismatchSums) -> bool:
    """Equal: the counts exactly, the float sums to rounding (they are added in another order)."""
    return (a.tokens, a.extreme, a.out_of_band) == (b.tokens, b.extreme, b.out_of_band) and (
        a.k3 == pytest.approx(b.k3, rel=1e-12)
        and a.abs_logprob_diff == pytest.approx(b.abs_logprob_diff, rel=1e-12)
    )


async def test_compact_rolls_each_groups_old_versions_into_earlier_totals(store_url: str) -> None:
    """keep_versions=3 over versions 1..10: versions 8-10 stay, 1-7 become each group's earlier
    sums (mismatch: version None; ledger: ``earlier``); every total is what it was; a second
    compact changes nothing; a late sum for a rolled version is rolled in by the next one."""
    async with opened(store_url, retention=Retention(keep_versions=3)) as store:
        for v in range(1, 11):
            for g in ("g1", "g2|x"):
                parts = {(g, v, "0-63"): M1, (g, v, "64-255"): M2}
                assert await store.add_mismatch(f"L-{g}-{v}", parts, ttl_s=60)
            await store.book_replica(
                "r1",
                group="g1",
                version=v,
                at=100.0 + 20 * v,
                span_s=10.0,
                gpus_per_replica=2,
                price_per_gpu_hour=3.6,
            )
            await _versioned_turn(store, f"s{v}", v, tokens=v)
        totals, ledger_totals = rollup(await store.mismatch()), await store.ledger_totals()
        assert (await store.compact()).versions == 2 * 7 + 7
        sums = await store.mismatch()
        kept = {(g, v, b) for g in ("g1", "g2|x") for v in (8, 9, 10) for b in ("0-63", "64-255")}
        assert set(sums) == kept | {(g, None, b) for g in ("g1", "g2|x") for b in ("0-63", "64-255")}
        assert all(sums[k] == (M1 if k[2] == "0-63" else M2) for k in kept)
        seven_m1 = sum([M1] * 6, M1)
        assert _close(sums[("g1", None, "0-63")], seven_m1) and sums[("g2|x", None, "64-255")].tokens == 7
        after = rollup(sums)
        assert all(_close(after[g]["total"], totals[g]["total"]) for g in totals)
        assert sorted(after["g1"]["versions"]) == [8, 9, 10]
        snap = await store.ledger()
        assert set(snap.versions) == {("g1", 8), ("g1", 9), ("g1", 10)}
        early = snap.earlier["g1"]
        assert early.replica_seconds == pytest.approx(70.0) and early.tokens == sum(range(1, 8))
        assert early.cost_dollars == pytest.approx(70 * 0.002)
        assert await store.ledger_totals() == ledger_totals
        assert (await store.compact()).versions == 0 and await store.mismatch() == sums
        assert await store.add_mismatch("late", {("g1", 2, "0-63"): M2}, ttl_s=60)
        assert (await store.compact()).versions == 1
        assert _close((await store.mismatch())[("g1", None, "0-63")], seven_m1 + M2)


async def test_compact_rolls_old_update_records_and_every_cost_still_adds_up(store_url: str) -> None:
    async with opened(store_url, retention=Retention(keep_updates=3)) as store:
        for i in range(7):
            await store.book_replica(
                "r",
                group="g1",
                version=1,
                at=100.0 + 20 * i,
                span_s=10.0,
                gpus_per_replica=1,
                price_per_gpu_hour=3.6,
            )
            await _versioned_turn(store, f"s{i}", 1, tokens=i + 1)
            await store.finish_session(f"s{i}", "f", 1.0, {})
            lease = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=60)
            assert (await store.ack(lease.lease_id)).update == i + 1
        before = await store.ledger()
        assert (await store.compact()).updates == 4
        snap = await store.ledger()
        assert [u.seq for u in snap.updates] == [5, 6, 7]
        e = snap.earlier_updates
        assert (e.updates, e.through_seq, e.trajectories, e.tokens) == (4, 4, 4, 1 + 2 + 3 + 4)
        assert e.at == before.updates[3].at and e.cumulative_cost == before.updates[3].cumulative_cost
        assert update_costs(snap.updates, e.cumulative_cost) == update_costs(before.updates)[4:]
        assert (await store.compact()).updates == 0
        await _versioned_turn(store, "s7", 1)
        await store.finish_session("s7", "f", 1.0, {})
        lease = await store.take(1, trainer_version=1, max_version_age=None, lease_timeout_s=60)
        assert (await store.ack(lease.lease_id)).update == 8


async def _run_a_while(store: StateStore, rules: Retention, versions: range) -> None:
    """Per version: a replica that heartbeats and books once, 20 sessions (5 abandoned, 5 left
    open, 10 finished; half of them with ``record_routes``), a route key, a take whose lease is
    acknowledged (odd versions) or abandoned (even: redelivered to the next take), its take order
    and a mismatch upload."""
    for v in versions:
        await store.put_replica(f"rep{v}", {"group": "g1", "ready": True, "wall_seen": time.time()})
        await store.book_replica(
            f"rep{v}",
            group="g1",
            version=v,
            at=time.time(),
            span_s=0.01,
            gpus_per_replica=1,
            price_per_gpu_hour=1.0,
        )
        for i in range(20):
            sid = f"v{v}-{i}"
            await store.create_session(sid, "g1", {}, now=time.time(), record_routes=i % 2 == 1)
            if i % 4 == 0:
                await store.delete_session(sid)
            elif i % 4 != 1:  # i % 4 == 1 stays open until it expires idle
                await store.append_turn(
                    sid,
                    TurnRecord(
                        "r",
                        b"t" * 64,
                        group="g1",
                        replica="rep",
                        tokens=2,
                        min_version=v,
                        max_version=v,
                        version_tokens={v: 2},
                    ),
                )
                await store.finish_session(sid, "f", 1.0, {})
        await store.set_route_key(f"key-{v}", {"group": "g1", "replica": "rep"}, ttl_s=0.2)
        lease = await store.take(
            100, trainer_version=v, max_version_age=None, lease_timeout_s=rules.lease_timeout_s
        )
        await store.record_lease_order(lease.lease_id, ["x"], ttl_s=rules.lease_record_s())
        assert await store.add_mismatch(lease.lease_id, {("g1", v, "0-63"): M1}, ttl_s=rules.lease_record_s())
        if v % 2:
            assert (await store.ack(lease.lease_id)).acked == len(lease.trajectories)
        else:
            await asyncio.sleep(rules.lease_timeout_s)
    await asyncio.sleep(rules.lease_timeout_s)
    last = await store.take(
        1000, trainer_version=0, max_version_age=None, lease_timeout_s=rules.lease_timeout_s
    )
    if last.trajectories:
        await store.ack(last.lease_id)
    assert (await store.queue_stats())["ready"] == 0


async def test_a_released_lease_takes_no_upload_and_an_acknowledged_one_does(store_url: str) -> None:
    """A release that forgets a lease marks its order released in the same step: its order and a
    booking against it raise LeaseReleased (also a booking whose upload read the order before
    the release), nothing is added, and its trajectory's next lease books as usual; a release
    of an acknowledged lease changes nothing, so it still books once."""
    kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 30.0}
    sums = {("g1", 1, "0-63"): M1}
    async with opened(store_url) as store:
        await _session(store, "a")
        await store.finish_session("a", "f-a", 1.0, {})
        first = await store.take(5, **kw)
        await store.record_lease_order(first.lease_id, ["a"], ttl_s=60.0)
        assert await store.lease_order(first.lease_id) == ["a"]  # an upload read it ...
        assert await store.release(first.lease_id, by_holder=True) == 1  # ... then the release
        with pytest.raises(LeaseReleased):
            await store.add_mismatch(first.lease_id, sums, ttl_s=60.0, digest="d1")
        with pytest.raises(LeaseReleased):
            await store.lease_order(first.lease_id)
        await store.record_lease_order(first.lease_id, ["a"], ttl_s=60.0)  # a late repeat's: kept released
        with pytest.raises(LeaseReleased):
            await store.lease_order(first.lease_id)
        assert await store.mismatch() == {} and await store.mismatch_digest(first.lease_id) is None
        second = await store.take(5, **kw)
        assert [t.session.session_id for t in second.trajectories] == ["a"]
        await store.record_lease_order(second.lease_id, ["a"], ttl_s=60.0)
        await store.record_lease_order(second.lease_id, ["b"], ttl_s=60.0)  # held already: unchanged
        assert await store.lease_order(second.lease_id) == ["a"]
        assert (await store.ack(second.lease_id)).acked == 1
        assert await store.release(second.lease_id, by_holder=True) == 0  # acknowledged: stays so
        assert await store.lease_order(second.lease_id) == ["a"]
        assert await store.add_mismatch(second.lease_id, sums, ttl_s=60.0, digest="d2")
        assert not await store.add_mismatch(second.lease_id, sums, ttl_s=60.0, digest="d2")
        assert (await store.mismatch_totals())["g1"] == M1


async def test_the_footprint_returns_to_one_bound_however_many_versions_and_sessions(store_url: str) -> None:
    """Two rounds of 5 versions and 100 sessions each; once what expires has expired and the store
    is compacted, both leave the same footprint (Redis: the same keys, memory within 10%)."""
    rules = Retention(
        retention_s=0.2, lease_timeout_s=0.2, keep_versions=2, keep_updates=2, replica_forget_s=0.3
    )
    async with opened(store_url, retention=rules) as store:
        prints = []
        for versions in (range(1, 6), range(6, 11), range(11, 16)):
            await _run_a_while(store, rules, versions)
            await asyncio.sleep(0.5)
            assert len(await store.expire_idle(0.4)) == 5 * len(versions)
            await store.compact()
            prints.append(await store.footprint())
        used = [fp.pop("used_memory", 0) for fp in prints]
        assert prints[1] == prints[0] and prints[2] == prints[0], prints
        assert max(used[1:]) <= used[0] * 1.1 + 65536, used  # Redis: bytes (memory: no figure)
        if store_url == "memory":
            assert (prints[0]["mismatch"], prints[0]["ledger_versions"], prints[0]["sessions"]) == (3, 2, 0)
        else:  # fields: 7 per mismatch entry (5 sums and the 2 route counts), 4 per ledger version
            assert (prints[0]["mismatch_fields"], prints[0]["ledger_version_fields"]) == (21, 8)
        assert prints[0]["updates"] == 2 and prints[0]["replicas"] == 0
        counters = (await store.counters())["g1"]
        assert (counters.sessions, counters.active_sessions, counters.turns) == (300, 0, 150)


async def test_routers_compacting_while_others_add_neither_lose_nor_double_a_sum(store_url: str) -> None:
    """Two routers each adding mismatch sums and booking tokens over 30 versions while both
    compact again and again: afterwards every group total is exactly what was added."""
    async with two_routers(store_url, retention=Retention(keep_versions=2)) as (a, b):

        async def add(store: StateStore, v: int) -> None:
            assert await store.add_mismatch(
                f"L{v}", {("g1", v, "0-63"): M1, ("g1", v, "1024+"): M2}, ttl_s=60
            )
            await _versioned_turn(store, f"s{v}", v, tokens=v)

        async def compact(store: StateStore) -> None:
            for _ in range(10):
                await store.compact()
                await asyncio.sleep(0)

        await asyncio.gather(*(add((a, b)[v % 2], v) for v in range(1, 31)), compact(a), compact(b))
        await a.compact()
        sums = await b.mismatch()
        assert sorted({v for _g, v, _b in sums if v is not None}) == [29, 30]
        total = rollup(sums)["g1"]
        assert _close(total["total"], sum([M1] * 30 + [M2] * 30, MismatchSums()))
        assert _close(total["positions"]["0-63"], sum([M1] * 30, MismatchSums()))
        snap = await a.ledger()
        assert snap.earlier["g1"].tokens + sum(t.tokens for t in snap.versions.values()) == sum(range(1, 31))
        assert snap.groups["g1"].tokens == sum(range(1, 31))


async def test_a_redis_that_lost_its_data_takes_new_trajectories_and_refusals_are_unavailable() -> None:
    """A Redis restarted without persistence has no queue and no consumer group: finishes made
    after it still reach a take (the group is asked for before every read, and a finish creates
    it with the queue), the queue's stats answer, and a command Redis refuses (out of memory) is
    StateUnavailable naming it, not a bare error."""
    with redis_server() as url:
        store = RedisStore(url, outage_s=2.0)
        plain = redis.Redis.from_url(url)
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 30.0}
        try:
            await _session(store, "before")
            await store.finish_session("before", "f-before", 1.0, {})
            assert [t.session.session_id for t in (await store.take(5, **kw)).trajectories] == ["before"]
            plain.flushall()  # what a restart without persistence leaves
            await _session(store, "after")
            await store.finish_session("after", "f-after", 0.5, {})
            assert (await store.queue_stats())["ready"] == 1
            lease = await store.take(5, **kw)
            assert [t.session.session_id for t in lease.trajectories] == ["after"]
            assert (await store.ack(lease.lease_id)).acked == 1
            plain.flushall()
            assert (await store.take(5, **kw)).trajectories == []  # a take before any finish
            plain.config_set("maxmemory", 1)
            try:
                with pytest.raises(StateUnavailable, match="redis refused a command: .*maxmemory"):
                    await store.create_session("full", "g1", {}, now=1.0)
            finally:
                plain.config_set("maxmemory", 0)
        finally:
            plain.close()
            await store.close()


async def test_mismatch_totals_only_grow_while_versions_are_rolled_up(store_url: str) -> None:
    """Uploads over 40 versions with a compaction after each (keep_versions=3): the group totals
    (what the ``mixfleet_mismatch_*_total`` counters export) never go down, not even in the last
    bit (a Prometheus counter that does has been reset), and equal the sum of what was added; the
    rolled-up sums still add up to it."""
    rng = random.Random(7)
    async with opened(store_url, retention=Retention(keep_versions=3)) as store:
        before, added = MismatchSums(), MismatchSums()
        for v in range(1, 41):
            parts = {
                ("g|1", v, b): MismatchSums(
                    tokens=100, k3=rng.random() * 0.37, abs_logprob_diff=rng.random() * 3.1
                )
                for b in ("0-63", "64-255", "256-1023")
            }
            assert await store.add_mismatch(f"L{v}", parts, ttl_s=60)
            added = sum(parts.values(), added)
            for step in ("added", "compacted"):
                if step == "compacted":
                    await store.compact()
                total = (await store.mismatch_totals())["g|1"]
                assert total.k3 >= before.k3 and total.abs_logprob_diff >= before.abs_logprob_diff, (v, step)
                before = total
        assert _close(total, added) and total.tokens == 40 * 300
        assert _close(rollup(await store.mismatch())["g|1"]["total"], added)


async def test_mismatch_sums_keep_a_doubles_precision(store_url: str) -> None:
    """A well-matched group's k3 sums are tiny (1e-13 and below): each adapter keeps them as the
    double they add up to, also once rolled up, not rounded to a fixed number of decimals."""
    tiny = MismatchSums(tokens=10, k3=3e-19, abs_logprob_diff=1.2345678901234567e-13)
    async with opened(store_url, retention=Retention(keep_versions=1)) as store:
        for v in (1, 2):
            assert await store.add_mismatch(f"L{v}", {("g", v, "0-63"): tiny}, ttl_s=60)
        assert (await store.mismatch())[("g", 2, "0-63")] == tiny
        assert (await store.mismatch_totals())["g"] == tiny + tiny
        await store.compact()
        assert (await store.mismatch())[("g", None, "0-63")] == tiny


async def test_release_puts_a_lease_back_at_once_uncounted(store_url: str) -> None:
    """A released lease's trajectories are ready again at once (the next take is no
    redelivery), its ack is a 404; releasing an acknowledged or unknown lease does nothing."""
    async with opened(store_url) as store:
        for sid in ("a", "b"):
            await _session(store, sid)
            await store.finish_session(sid, "f", 1.0, {})
        kw = {"trainer_version": 1, "max_version_age": None, "lease_timeout_s": 300}
        lease = await store.take(2, **kw)
        assert await store.release(lease.lease_id) == 2
        assert (await store.queue_stats())["ready"] == 2
        with pytest.raises(LeaseNotFound):
            await store.ack(lease.lease_id)
        again = await store.take(2, **kw)
        assert {t.session.session_id for t in again.trajectories} == {"a", "b"} and again.redelivered == 0
        assert (await store.ack(again.lease_id)).acked == 2
        assert await store.release(again.lease_id) == 0 and await store.release("0" * 32) == 0
        assert await store.queue_stats() == {"ready": 0, "pending": 0, "held_back": 0, "leases": 0}

"""trainer.client against a real router and engine: a session's turns come back in a taken
batch as flat arrays equal to the records the turn calls returned; errors carry status and detail."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.router.conftest import KEYS
from tests.support.proxy import TcpProxy
from trainer.batch import decode_batch
from trainer.client import AsyncRolloutClient, RolloutClient, RouterError


def test_sync_client_round_trip(router) -> None:
    with RolloutClient(router.url, KEYS["all"]) as c:
        empty = c.take(16)
        assert empty.lease_id is None and len(empty) == 0
        s = c.create_session(group="cpu-a", metadata={"task": "t"})
        assert s.group == "cpu-a"
        params = {"max_new_tokens": 6, "top_p": 0.9, "temperature": 1.0, "seed": 3}
        t0 = c.turn(s.session_id, [1, 5, 9], params, return_support=True)
        t1 = c.turn(s.session_id, [1, 5, 9, *t0["output_ids"], 4], params, return_support=True)
        c.finish(s.session_id, 1.0)
        assert c.queue_stats()["ready"] >= 1
        batch = c.take(16)
        assert batch.lease_id is not None
        stats = c.queue_stats()
        assert set(stats) == {"ready", "pending", "held_back", "leases"}
        assert stats["pending"] >= len(batch.trajectories) > 0 and stats["leases"] >= 1
        mine = [i for i, t in enumerate(batch.trajectories) if t["session_id"] == s.session_id]
        assert len(mine) == 1
        rows = np.flatnonzero(batch.trajectory_index == mine[0])
        records = [r for t in (t0, t1) for r in t["records"]]
        assert batch.token_ids[rows].tolist() == [r["token_id"] for r in records]
        np.testing.assert_allclose(batch.logprobs[rows], [r["logprob"] for r in records], rtol=0, atol=1e-6)
        for k, row in enumerate(rows):
            lo, hi = batch.support_offsets[row], batch.support_offsets[row + 1]
            assert batch.support_ids[lo:hi].tolist() == records[k]["support_ids"]
        assert {batch.groups[g] for g in batch.group_index[rows]} == {"cpu-a"}
        assert batch.rewards()[rows].tolist() == [1.0] * len(rows)
        assert batch.trainer_version is not None
        ages = batch.trainer_version - batch.versions[rows]
        assert batch.version_ages[rows].tolist() == [max(0, int(a)) for a in ages]
        first = c.ack(batch.lease_id)
        assert first["acked"] == len(batch.trajectories) and first["already_acked"] is False
        again = c.ack(batch.lease_id)  # a retry: the first acknowledgement's counts, no error
        assert again == {**first, "already_acked": True}
        never = "0" * 32
        with pytest.raises(RouterError) as err:
            c.ack(never)
        assert err.value.status == 404 and never in err.value.detail


@pytest.mark.parametrize("url", ["127.0.0.1:8300", "localhost:8300/", "ftp://127.0.0.1:8300", ""])
def test_a_url_without_http_is_refused_at_construction_naming_it(url: str) -> None:
    """A URL with no scheme was taken and failed only at the first call, with aiohttp's
    NonHttpUrlClientError naming a full path; now a ValueError at construction, naming the URL."""
    for make in (RolloutClient, AsyncRolloutClient):
        with pytest.raises(ValueError, match="router URL must start with http:// or https://") as bad:
            make(url, KEYS["all"])
        assert repr(url) in str(bad.value)


def test_async_client_refusals_name_the_problem(router) -> None:
    async def main() -> None:
        async with AsyncRolloutClient(router.url, KEYS["rollout"], retries=1, backoff_s=0.01) as c:
            with pytest.raises(RouterError) as err:
                await c.take(4)
            assert err.value.status == 403
            with pytest.raises(RouterError) as err:
                await c.turn("no-such-session", [1, 2])
            assert err.value.status == 404 and "no-such-session" in err.value.detail
        async with AsyncRolloutClient(router.url, "wrong-key", retries=0) as c:
            with pytest.raises(RouterError) as err:
                await c.groups()
            assert err.value.status == 401

    asyncio.run(main())


def test_a_repeated_finish_answers_as_the_first_and_a_different_one_is_refused_at_once(router) -> None:
    """A finish whose first answer was lost can be sent again (same reward and metadata: the same
    answer); another reward is a 409 without Retry-After, which the kit raises without retrying."""
    with RolloutClient(router.url, KEYS["all"], retries=5, backoff_s=0.5) as c:
        s = c.create_session(group="cpu-a")
        c.turn(s.session_id, [1, 5, 9], {"max_new_tokens": 2})
        first = c.finish(s.session_id, 0.5, metadata={"k": [1, 2]})
        assert c.finish(s.session_id, 0.5, metadata={"k": [1, 2]}) == first
        t0 = time.monotonic()
        with pytest.raises(RouterError) as err:
            c.finish(s.session_id, 1.0, metadata={"k": [1, 2]})
        assert err.value.status == 409 and "another reward" in err.value.detail
        with pytest.raises(RouterError) as err:
            c.finish(s.session_id, 0.5)
        assert err.value.status == 409 and "another metadata" in err.value.detail
        assert time.monotonic() - t0 < 0.5  # raised at once, not after the kit's backoff
        batch = c.take(16)
        mine = [t for t in batch.trajectories if t["session_id"] == s.session_id]
        assert [t["reward"] for t in mine] == [0.5]  # the first finish stays
        c.ack(batch.lease_id)
        assert c.finish(s.session_id, 0.5, metadata={"k": [1, 2]}) == first  # consumed: the same answer


@contextlib.contextmanager
def losing_first_answer(router, path: bytes) -> Iterator[tuple[str, list[bytes]]]:
    """A proxy in front of ``router`` that drops the first answer to a request line holding
    ``path`` (the router did answer it; the client never reads it, as when a connection is cut
    right after the router answered). Yields the proxy's URL and the dropped answers, each whole
    (its head and its ``Content-Length`` of body, however many chunks they came in)."""
    dropped: list[bytes] = []

    def lose(direction: str, data: bytes, conn: dict) -> bytes | None:
        if direction == "up" and path in data:
            conn["hit"] = True
        elif direction == "down" and conn.get("hit") and not dropped:
            conn["answer"] = answer = conn.get("answer", b"") + data
            head, sep, body = answer.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            if not sep or length is None or len(body) < int(length.group(1)):
                return b""  # held back: the client gets nothing of this answer
            dropped.append(answer)
            return None
        return data

    host, port = router.url.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)), lose)
    try:
        yield f"http://127.0.0.1:{proxy.port}", dropped
    finally:
        proxy.close()


def test_an_ack_whose_answer_is_lost_is_retried_and_succeeds(router) -> None:
    """The router acknowledges the lease, its answer never reaches the trainer (the connection is
    cut right after the router answered): the kit's retry gets the first acknowledgement back
    (200, ``already_acked``) instead of a 404, and the trajectories count once."""
    with (
        losing_first_answer(router, b"/ack ") as (url, dropped),
        RolloutClient(router.url, KEYS["all"]) as direct,
    ):
        s = direct.create_session(group="cpu-a")
        direct.turn(s.session_id, [1, 2], {"max_new_tokens": 2, "seed": 1})
        direct.finish(s.session_id, 1.0)
        with RolloutClient(url, KEYS["all"], backoff_s=0.01) as c:
            batch = c.take(64)
            assert batch.lease_id is not None
            answer = c.ack(batch.lease_id)
        assert dropped and b" 200 " in dropped[0]  # the router did answer the first ack
        assert answer["already_acked"] is True and answer["acked"] == len(batch.trajectories)
        assert direct.queue_stats()["pending"] == 0


def test_a_take_whose_answer_is_lost_is_retried_and_gets_the_same_lease(router) -> None:
    """The router makes the lease and answers, its answer never reaches the trainer (the
    connection is cut right after the router answered): the kit's retry of that take gets the
    same lease and the same trajectories, not a second lease whose first one's trajectories
    would come back only after the lease timeout."""
    with (
        losing_first_answer(router, b"/v1/batches/take ") as (url, dropped),
        RolloutClient(router.url, KEYS["all"]) as direct,
    ):
        while (left := direct.take(64)).lease_id is not None:  # what earlier tests left
            direct.ack(left.lease_id)
        sessions = []
        for seed in (1, 2):
            s = direct.create_session(group="cpu-a")
            direct.turn(s.session_id, [1, 2], {"max_new_tokens": 2, "seed": seed})
            direct.finish(s.session_id, 1.0)
            sessions.append(s.session_id)
        with RolloutClient(url, KEYS["all"], backoff_s=0.01) as c:
            batch = c.take(64)
        assert dropped and b" 200 " in dropped[0]  # the router did answer the first take
        first = decode_batch(dropped[0].split(b"\r\n\r\n", 1)[1])  # the answer the trainer lost
        assert batch.lease_id is not None and first.lease_id == batch.lease_id
        assert first.trajectories == batch.trajectories and np.array_equal(first.token_ids, batch.token_ids)
        assert sorted(t["session_id"] for t in batch.trajectories) == sorted(sessions)
        stats = direct.queue_stats()
        assert (stats["leases"], stats["pending"], stats["ready"]) == (1, 2, 0)
        assert direct.ack(batch.lease_id)["acked"] == 2


def test_a_long_poll_take_may_wait_longer_than_the_clients_call_timeout(router) -> None:
    """``take(wait_s=...)``: the router holds the call up to ``wait_s`` seconds, so the kit's
    per-call timeout counts from the end of that wait (a trainer with a 1 s timeout for a dead
    router, long-polling 2 s, got "cannot reach the router: TimeoutError")."""

    async def main() -> None:
        async with AsyncRolloutClient(router.url, KEYS["all"], timeout_s=1.0, retries=0) as c:
            while (left := await c.take(64)).lease_id is not None:  # empty the queue: the take waits
                await c.ack(left.lease_id)
            t0 = time.monotonic()
            batch = await c.take(64, wait_s=2.0)
            assert batch.lease_id is None and len(batch) == 0
            assert time.monotonic() - t0 >= 1.9

    asyncio.run(main())


def test_a_log_prob_upload_whose_answer_is_lost_is_retried_and_succeeds(router) -> None:
    """The router books the upload, its answer never reaches the trainer (the connection is cut
    right after the router answered): the kit's retry of the same bytes gets the same figures
    (200, ``already_uploaded``) instead of a 409 for an upload that did count, and it counts once."""
    lost = losing_first_answer(router, b"/trainer_logprobs ")
    with lost as (url, dropped), RolloutClient(router.url, KEYS["all"]) as direct:
        s = direct.create_session(group="cpu-a")
        direct.turn(s.session_id, [1, 2], {"max_new_tokens": 3, "seed": 1})
        direct.finish(s.session_id, 1.0)
        with RolloutClient(url, KEYS["all"], backoff_s=0.01) as c:
            batch = c.take(64)
            assert batch.lease_id is not None
            answer = c.upload_trainer_logprobs(batch.lease_id, batch.logprobs - 0.1)
            c.ack(batch.lease_id)
        assert dropped and b" 200 " in dropped[0]  # the router did answer the first upload
        assert answer["already_uploaded"] is True and answer["tokens"] == len(batch)
        assert sum(g["tokens"] for g in answer["groups"]) == len(batch)
        with pytest.raises(RouterError) as err:  # other log-probs for that lease: refused
            direct.upload_trainer_logprobs(batch.lease_id, batch.logprobs)
        assert err.value.status == 409

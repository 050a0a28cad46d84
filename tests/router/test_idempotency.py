"""Retried turns: the same ``Idempotency-Key`` answers the recorded turn instead of sampling again.

The store level runs on both adapters (memory, a real redis-server); the route level on a live
router process over a real local engine (the module fixtures of tests/router/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
import redis

from router.state.base import RequestRecorded, StateStore, StoredTurn, TurnRecord
from tests.support.metrics import turn_replays
from tests.support.procs import redis_server
from tests.support.router import router_process, until_workers, write_preset
from tests.support.state import opened
from trainer.batch import decode_batch

SAMPLED = {"max_new_tokens": 12, "temperature": 1.0}  # unseeded: a second sample would differ


async def _append(store: StateStore, sid: str, request_id: str, blob: bytes, digest: str = "") -> int:
    return await store.append_turn(
        sid, TurnRecord(request_id, blob, "g1", "r1", 3, 1, 1, request_digest=digest)
    )


@pytest.mark.anyio
async def test_store_reads_the_turn_a_request_stored(store_url: str) -> None:
    async with opened(store_url) as store:
        await store.create_session("s1", "g1", {}, now=time.time())
        assert await store.turn_for_request("s1", "k:a") is None
        assert await _append(store, "s1", "k:a", b"first", "d1") == 0
        assert await _append(store, "s1", "k:b", b"second") == 1
        with pytest.raises(RequestRecorded, match="'k:a' already recorded turn 0"):
            await _append(store, "s1", "k:a", b"again", "d2")  # idempotent: nothing changes
        assert await store.turn_for_request("s1", "k:a") == StoredTurn(0, b"first", "d1")
        assert await store.turn_for_request("s1", "k:b") == StoredTurn(1, b"second", "")
        assert (await store.get_session("s1")).n_turns == 2
        await store.finish_session("s1", "f", 1.0, {})
        assert await store.turn_for_request("s1", "k:b") == StoredTurn(1, b"second")  # still answered
        assert await store.turn_for_request("s1", "k:c") is None
        assert await store.turn_for_request("nope", "k:a") is None


def _turn(
    client: httpx.Client,
    sid: str,
    key: str | None,
    input_ids: list[int] | None = None,
    return_support: bool = False,
) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    body = {"input_ids": input_ids or [1, 2, 3], "sampling_params": SAMPLED, "return_support": return_support}
    return client.post(f"/v1/sessions/{sid}/turns", json=body, headers=headers)


def _session(client: httpx.Client) -> str:
    return client.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]


def test_a_retry_with_the_key_answers_the_recorded_turn(router, client: httpx.Client) -> None:
    sid = _session(client)
    found, raced = turn_replays(router.url)
    first = _turn(client, sid, "call-1")
    assert first.status_code == 200, first.text
    again = _turn(client, sid, "call-1")
    assert again.status_code == 200, again.text
    assert again.content == first.content
    supported = _turn(client, sid, "call-1", return_support=True)  # the same turn, with its supports
    records = supported.json()["records"]
    assert {**supported.json(), "records": first.json()["records"]} == first.json()
    assert [{k: r[k] for k in first.json()["records"][0]} for r in records] == first.json()["records"]
    assert all(r["support_ids"] == r["support_logprobs"] == [] for r in records)  # it filtered nothing
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["turns"] == 1
    assert info["tokens"] == len(first.json()["records"])
    assert turn_replays(router.url) == (found + 2, raced)  # the repeat, the one with supports

    second = _turn(client, sid, "call-2")
    assert second.json()["turn"] == 1
    assert _turn(client, sid, None).json()["turn"] == 2  # no key: a new turn each time
    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    late = _turn(client, sid, "call-1")  # a retry that arrives after the finish
    assert late.status_code == 200 and late.content == first.content
    trajectory = client.get(f"/v1/sessions/{sid}/trajectory").json()
    assert [t["turn"] for t in trajectory["turns"]] == [0, 1, 2]


def test_a_key_reused_with_another_request_is_refused(client: httpx.Client) -> None:
    """The same key with another body is a 422 naming the key (nothing sampled); the same request
    spelled differently (key order, spacing, defaults written out) is a retry."""
    sid = _session(client)
    first = _turn(client, sid, "k1")
    assert first.status_code == 200, first.text
    for other in (
        {"input_ids": [9, 9], "sampling_params": SAMPLED},
        {"input_ids": [1, 2, 3], "sampling_params": {**SAMPLED, "temperature": 0.5}},
        {"append_ids": [1, 2, 3], "sampling_params": SAMPLED},
        {"input_ids": [1, 2, 3], "sampling_params": SAMPLED, "min_version": 0},
    ):
        r = client.post(f"/v1/sessions/{sid}/turns", json=other, headers={"Idempotency-Key": "k1"})
        assert r.status_code == 422, (other, r.text)
        assert "Idempotency-Key 'k1'" in r.json()["detail"] and "different request" in r.json()["detail"]
    same = (
        b'{ "sampling_params" : {"top_p": 1.0, "temperature": 1, "max_new_tokens": 12},'
        b' "return_support": false, "input_ids": [1, 2, 3] }'
    )
    headers = {"Idempotency-Key": "k1", "Content-Type": "application/json"}
    again = client.post(f"/v1/sessions/{sid}/turns", content=same, headers=headers)
    assert again.status_code == 200 and again.content == first.content, again.text
    assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 1


def test_keys_are_per_session(client: httpx.Client) -> None:
    a, b = _session(client), _session(client)
    ra, rb = _turn(client, a, "same"), _turn(client, b, "same")
    assert ra.status_code == rb.status_code == 200
    assert client.get(f"/v1/sessions/{b}").json()["turns"] == 1


def test_a_bad_key_is_refused(client: httpx.Client) -> None:
    sid = _session(client)
    for bad in ("x" * 256, "has space", ""):
        r = _turn(client, sid, bad)
        assert r.status_code == 422, (bad, r.text)
        assert "Idempotency-Key" in r.json()["detail"]
    assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 0


def test_a_retry_while_the_first_runs_waits_for_it(client: httpx.Client) -> None:
    sid = _session(client)
    answers: list[httpx.Response] = []

    def call() -> None:
        answers.append(_turn(client, sid, "slow", input_ids=[1, 2, 3, 4]))

    threads = [threading.Thread(target=call) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [200] * 5
    assert len({r.content for r in answers}) == 1
    assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 1


async def _give_up(url: str, headers: dict[str, str], sid: str) -> None:
    """A greedy long turn under key ``t``, abandoned (connection closed) after 1 s."""
    # the tiny base answers [1, 2, 3, 4, 5] greedily for 2000 tokens without an end-of-sequence id
    body = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 2000, "temperature": 0.0}}
    async with aiohttp.ClientSession(headers={**headers, "Idempotency-Key": "t"}) as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(
                f"{url}/v1/sessions/{sid}/turns", json=body, timeout=aiohttp.ClientTimeout(total=1.0)
            )


def test_a_retry_after_a_disconnect_samples_once(router, client: httpx.Client) -> None:
    sid = _session(client)
    asyncio.run(_give_up(router.url, router.headers, sid))
    retry = _turn(client, sid, "t")  # the first was aborted and recorded nothing: this one samples
    assert retry.status_code == 200, retry.text
    assert retry.json()["turn"] == 0
    assert _turn(client, sid, "t").content == retry.content
    assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 1


def test_any_worker_answers_a_retry(engine_url, tmp_path) -> None:
    """``--workers 2`` on a real Redis: retries on new connections reach both workers; every one
    answers the turn the first recorded, and the session holds it once."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    with (
        redis_server() as url,
        router_process(preset, state=url, extra_args=("--workers", "2")) as router,
    ):
        with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
            sid = _session(c)
            first = _turn(c, sid, "w")
            assert first.status_code == 200, first.text

        def retry() -> httpx.Response:
            with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as fresh:
                return _turn(fresh, sid, "w")

        for r in until_workers(retry):
            assert r.status_code == 200 and r.content == first.content, r.text
        with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
            assert c.get(f"/v1/sessions/{sid}").json()["turns"] == 1


def test_a_take_repeated_with_its_key_answers_the_same_bytes_and_a_bad_key_is_refused(
    client: httpx.Client,
) -> None:
    """``POST /v1/batches/take`` with an ``Idempotency-Key``: the same key again, while the lease
    is open, answers the same bytes (records and JSON alike) and takes nothing more; a malformed
    key is a 422 naming the header, before anything is taken."""
    while (left := client.post("/v1/batches/take", json={"size": 64}).json())["lease_id"]:
        client.post(f"/v1/batches/{left['lease_id']}/ack")  # what earlier tests left
    for _ in "ab":
        sid = _session(client)
        assert _turn(client, sid, "t").status_code == 200
        client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    for bad in ("x" * 256, "has space", ""):
        r = client.post("/v1/batches/take", json={"size": 1}, headers={"Idempotency-Key": bad})
        assert r.status_code == 422 and "Idempotency-Key" in r.json()["detail"], (bad, r.text)
    records = {"Idempotency-Key": "take-1", "Accept": "application/x-mixfleet-records"}
    first, again = (client.post("/v1/batches/take", json={"size": 1}, headers=records) for _ in "12")
    assert first.status_code == again.status_code == 200 and first.content == again.content
    key = {"Idempotency-Key": "take-2"}
    one, two = (client.post("/v1/batches/take", json={"size": 1}, headers=key) for _ in "12")
    assert one.json()["lease_id"] is not None and one.content == two.content
    stats = client.get("/v1/batches/stats").json()
    assert (stats["leases"], stats["pending"], stats["ready"]) == (2, 2, 0)
    for lease in (one.json()["lease_id"], decode_batch(first.content).lease_id):
        assert client.post(f"/v1/batches/{lease}/ack").json()["acked"] == 1


@contextlib.contextmanager
def _a_finished_session_on_redis(engine_url: str, tmp_path: Path) -> Iterator[tuple[str, httpx.Client, str]]:
    """A router on a real redis-server (its URL), a client of it, and a session of one turn,
    finished (its trajectory ready for a take)."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    with (
        redis_server() as url,
        router_process(preset, state=url) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
    ):
        sid = _session(c)
        assert _turn(c, sid, None).status_code == 200
        assert c.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).is_success
        yield url, c, sid


def test_a_take_retried_after_the_latest_version_moved_answers_the_version_it_was_taken_for(
    engine_url, tmp_path
) -> None:
    """A take answered for trainer version 0 (the default before any publish) and retried with its
    key once the latest version is 1 answers the same bytes, version 0 and its ages: a retry read
    the lease's version 0 as none and answered the router's default instead."""

    async def publish_latest(url: str, version: int) -> None:
        async with opened(url) as store:
            await store.set_latest_version(version)

    with _a_finished_session_on_redis(engine_url, tmp_path) as (url, c, _sid):
        key = {"Idempotency-Key": "take-at-0"}
        first = c.post("/v1/batches/take", json={"size": 1}, headers=key)
        assert first.json()["trainer_version"] == 0 and first.json()["lease_id"], first.text
        asyncio.run(publish_latest(url, 1))
        deadline = time.monotonic() + 30
        while c.get("/server_info").json()["mixfleet_router"]["latest_version"] != 1:  # the router's poll
            assert time.monotonic() < deadline
            time.sleep(0.1)
        again = c.post("/v1/batches/take", json={"size": 1}, headers=key)
        assert again.status_code == 200 and again.content == first.content, again.text


def test_a_takes_repeat_records_the_order_its_first_answer_could_not(engine_url, tmp_path) -> None:
    """A take whose lease was made but whose order was not recorded (the state store failed between
    the two: the answer was a 503) is retried with its key: the repeat records the order, so the
    lease's log-prob upload finds it (it answered the lease and recorded nothing: the upload's 404)."""
    with _a_finished_session_on_redis(engine_url, tmp_path) as (url, c, sid):
        key = {"Idempotency-Key": "take-order"}
        lease = c.post("/v1/batches/take", json={"size": 1}, headers=key).json()["lease_id"]
        assert redis.Redis.from_url(url).delete(f"mf:lorder:{lease}") == 1  # as if never recorded

        async def order() -> list[str] | None:
            async with opened(url) as store:
                return await store.lease_order(lease)

        assert asyncio.run(order()) is None
        assert c.post("/v1/batches/take", json={"size": 1}, headers=key).json()["lease_id"] == lease
        assert asyncio.run(order()) == [sid]

"""A replica that stops answering while a turn runs on it, on real processes over HTTP: two local
engines, each its own static group (``cpu-a`` behind a pass-through proxy that records the rids
of what it forwards, ``cpu-b`` direct), and a router process.

* An engine stopped with SIGSTOP mid-turn (hung: it accepts connections and answers nothing): the
  router abandons the turn's request once the replica has gone ``--heartbeat-timeout`` without a
  sign of health, sends it ``/abort_request`` for that rid (best effort: nobody answers it), and
  the turn fails over to the other group (``moved_from``, failover reason ``lost``), long before
  ``--engine-timeout``; nothing of the abandoned request is recorded, and the turn's timings put
  the wait in ``failed_ms``, not in the router's own ``router_ms``.
* ``--engine-timeout``: an answer that takes longer times out (once retried on the same replica,
  then elsewhere), and the turn's ``failed_ms`` holds both waits.

And without processes, the dispatcher itself (:func:`router.dispatch.with_failover`): a request
on a replica found lost is cancelled and sent to another replica, or, once part of its answer
reached the caller, ends in a 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import httpx
import pytest

from clients.engine import EngineUnavailable
from fleet.specs import FleetSpec, GroupSpec
from router.config import RouterConfig
from router.context import RouterContext
from router.dispatch import with_failover
from router.errors import ApiError
from tests.support.engines import engine_process
from tests.support.metrics import samples_of
from tests.support.router import RouterHandle, router_process, write_preset
from tests.support.scripted import ScriptedEngine, scripted_engine

HELLO = [72, 101, 108, 108, 111]  # greedy decoding of tiny from here runs >1500 tokens without EOS
LONG = {"max_new_tokens": 1000, "temperature": 0.0}  # ~2 s on one core


@dataclass
class Engines:
    a_front: ScriptedEngine  # cpu-a's replica: a recording proxy of engine A
    a_pid: int
    b_url: str


@pytest.fixture(scope="module")
def engines(tiny_bf16) -> Iterator[Engines]:
    with (
        engine_process(tiny_bf16) as a_url,
        engine_process(tiny_bf16) as b_url,
        scripted_engine(a_url) as front,
    ):
        for url in (a_url, b_url):  # the first generation of a process is slower
            httpx.post(url + "/generate", json={"input_ids": HELLO, "sampling_params": LONG}, timeout=120)
        yield Engines(front, httpx.get(a_url + "/server_info", timeout=10).json()["pid"], b_url)


@contextlib.contextmanager
def _router(engines: Engines, tmp_path, *flags: str) -> Iterator[RouterHandle]:
    groups = [
        {"name": "cpu-a", "replicas": [engines.a_front.url]},
        {"name": "cpu-b", "replicas": [engines.b_url]},
    ]
    with router_process(write_preset(tmp_path / "p.toml", groups), extra_args=flags) as router:
        yield router


def _failovers(router: RouterHandle, reason: str) -> float:
    samples = samples_of(httpx.get(router.url + "/metrics", headers=router.headers, timeout=10).text)
    return samples[("mixfleet_router_failovers_total", (("group", "cpu-a"), ("reason", reason)))]


def _check_recorded_once(c: httpx.Client, sid: str, turn: dict) -> None:
    """The session holds the one turn that answered, exactly as answered."""
    session = c.get(f"/v1/sessions/{sid}").json()
    assert (session["turns"], session["tokens"]) == (1, len(turn["output_ids"]))
    (stored,) = c.get(f"/v1/sessions/{sid}/trajectory").json()["turns"]
    assert (stored["replica"], stored["output_ids"]) == (turn["replica"], turn["output_ids"])


@pytest.mark.timeout(120)
def test_a_turn_on_an_engine_that_hangs_fails_over_once_the_replica_is_lost(engines, tmp_path) -> None:
    front = engines.a_front
    with (
        _router(engines, tmp_path, "--heartbeat-timeout", "1.5", "--engine-timeout", "90") as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=120) as c,
    ):
        sid = c.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
        answer: dict = {}
        turn = threading.Thread(
            target=lambda: answer.update(
                r=c.post(f"/v1/sessions/{sid}/turns", json={"input_ids": HELLO, "sampling_params": LONG})
            )
        )
        sent = len(front.rids)
        turn.start()
        deadline = time.monotonic() + 30
        while not [rid for path, rid in front.rids[sent:] if path == "/generate"]:
            assert time.monotonic() < deadline and turn.is_alive(), "the turn never reached cpu-a"
            time.sleep(0.02)
        time.sleep(0.3)  # generating
        os.kill(engines.a_pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            turn.join(timeout=60)
            waited = time.monotonic() - stopped
        finally:
            os.kill(engines.a_pid, signal.SIGCONT)
        r = answer["r"]
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["group"], out["moved_from"], out["timings"]["attempts"]) == ("cpu-b", "cpu-a", 2)
        assert waited < 20, f"the hung attempt was waited on for {waited:.1f} s"
        assert _failovers(router, "lost") == 1 and _failovers(router, "timeout_retry") == 0
        timings = out["timings"]
        # the hang is the failed attempt's, not the router's: the attempt ran from before the engine
        # saw the turn until the replica was lost, at least the 0.3 s slept before the SIGSTOP (not
        # the whole heartbeat timeout: the last sign of health may predate the attempt's start)
        assert timings["failed_ms"] >= 300 > timings["router_ms"], timings
        (rid,) = [rid for path, rid in front.rids[sent:] if path == "/generate"]
        deadline = time.monotonic() + 10
        while ("/abort_request", rid) not in front.rids:  # sent to the hung replica, best effort
            assert time.monotonic() < deadline, front.rids
            time.sleep(0.05)
        _check_recorded_once(c, sid, out)


@pytest.mark.timeout(120)
def test_an_answer_slower_than_the_engine_timeout_is_retried_then_moved(engines, tmp_path) -> None:
    front = engines.a_front
    front.delay_s = 3.0
    try:
        with (
            _router(engines, tmp_path, "--engine-timeout", "1") as router,
            httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
        ):
            sid = c.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
            t0 = time.monotonic()
            r = c.post(
                f"/v1/sessions/{sid}/turns",
                json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
            )
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text
            out = r.json()
            assert (out["group"], out["moved_from"], out["timings"]["attempts"]) == ("cpu-b", "cpu-a", 3)
            assert _failovers(router, "timeout_retry") == 1 and _failovers(router, "unavailable") == 1
            timings = out["timings"]
            assert 2000 <= timings["failed_ms"] < 3000 and timings["router_ms"] < 500, timings
            assert took < 5  # two 1 s timeouts, not two 3 s answers
            _check_recorded_once(c, sid, out)
    finally:
        front.delay_s = 0.0


def _lost_first_replica(
    committed: bool, *, caller_cancelled: bool = False, answers_as_lost: bool = False, converts: bool = False
) -> tuple[object, list[str], float]:
    """``with_failover`` over two replicas of one group whose first request never answers and
    whose replica is then found lost: (its outcome, the requests cancelled, lost failovers).
    ``caller_cancelled``: the caller is cancelled as the replica is found lost;
    ``answers_as_lost``: the first request answers just as its replica is found lost;
    ``converts``: the first request turns its cancellation into an engine error. The outcome
    is checked to leave the caller's task with no cancellation pending."""
    urls = ("http://127.0.0.1:9/a", "http://127.0.0.1:9/b")
    fleet = FleetSpec(name="t", groups=(GroupSpec(name="g", accelerator="cpu", replicas=urls),))
    ctx = RouterContext(RouterConfig(fleet=fleet, auth_disabled=True, heartbeat_timeout_s=5.0))
    cancelled: list[str] = []

    def lose() -> None:
        assert ctx.registry.signal_lost(now=time.monotonic() + 6) == ["g/0"]

    async def send(client, _group: str) -> str:
        if client.base_url.endswith("/a"):
            if answers_as_lost:
                lose()  # the lost replica's cancellation is scheduled, the answer already here
                return "answer from " + client.base_url
            try:
                await asyncio.sleep(3600)  # hung
            except asyncio.CancelledError:
                cancelled.append(client.base_url)
                if converts:
                    raise EngineUnavailable(client.base_url, "connection closed") from None
                raise
        return "answer from " + client.base_url

    async def caller() -> object:
        outcome = await with_failover(ctx, "g", "g/0", send, committed=lambda: committed)
        for _ in range(5):
            await asyncio.sleep(0)  # a cancellation left pending would be raised here
        assert asyncio.current_task().cancelling() == 0
        return outcome

    async def run() -> object:
        ctx.http = aiohttp.ClientSession()  # the sends above make no request
        try:
            for rid in ctx.registry.replicas:
                ctx.registry.poll_result(rid, ready=True, version=1, error=None)
            task = asyncio.create_task(caller())
            await asyncio.sleep(0.05)
            if not answers_as_lost:
                assert ctx.registry.replicas["g/0"].inflight == 1
                lose()
            if caller_cancelled:
                task.cancel()
            try:
                return await task
            except (ApiError, asyncio.CancelledError) as exc:
                return exc
        finally:
            await ctx.http.close()

    outcome = asyncio.run(run())
    samples = samples_of(ctx.metrics.exposition().decode())
    reason = "unavailable" if converts else "lost"
    return (
        outcome,
        cancelled,
        samples.get(("mixfleet_router_failovers_total", (("group", "g"), ("reason", reason))), 0),
    )


def test_the_dispatcher_cancels_a_request_on_a_lost_replica_and_fails_over() -> None:
    (result, place), cancelled, lost = _lost_first_replica(committed=False)
    assert result == "answer from http://127.0.0.1:9/b" and cancelled == ["http://127.0.0.1:9/a"]
    assert (place.replica_id, place.attempts, place.moved_from) == ("g/1", 2, None) and place.failed_s > 0
    assert lost == 1


def test_a_request_whose_answer_reached_the_caller_is_not_retried_when_its_replica_is_lost() -> None:
    error, cancelled, lost = _lost_first_replica(committed=True)
    assert isinstance(error, ApiError) and error.status == 502, error
    assert "failed mid-stream: replica g/0 lost" in error.message and cancelled == ["http://127.0.0.1:9/a"]
    assert lost == 0


def test_a_caller_cancelled_as_its_replica_is_lost_is_cancelled_not_failed_over() -> None:
    outcome, cancelled, lost = _lost_first_replica(committed=False, caller_cancelled=True)
    assert isinstance(outcome, asyncio.CancelledError) and cancelled == ["http://127.0.0.1:9/a"]
    assert lost == 0


def test_an_answer_that_arrives_as_its_replica_is_found_lost_is_kept() -> None:
    (result, place), cancelled, lost = _lost_first_replica(committed=False, answers_as_lost=True)
    assert result == "answer from http://127.0.0.1:9/a" and cancelled == [] and lost == 0
    assert (place.replica_id, place.attempts) == ("g/0", 1)


def test_a_request_that_turns_the_loss_into_an_engine_error_fails_over_with_nothing_pending() -> None:
    (result, place), cancelled, unavailable = _lost_first_replica(committed=False, converts=True)
    assert result == "answer from http://127.0.0.1:9/b" and cancelled == ["http://127.0.0.1:9/a"]
    assert (place.replica_id, place.attempts) == ("g/1", 2) and unavailable == 1

"""A client that disconnects mid-turn: the router aborts the generation at the engine
(``/abort_request`` with the ``rid`` of the turn's ``/generate``) and records nothing. A trainer
that disconnects while its take waits: what the take picked is back on the queue at once.

Real parts: a local engine process, a recording proxy in front of it (to see what the router sent
and what the engine answered), a router process, and an aiohttp client whose short timeout closes
the connection while the engine is still generating.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import httpx
import pytest

from tests.support.recorder import recording_proxy
from tests.support.router import router_process, write_preset

LONG = {"max_new_tokens": 2000, "temperature": 0.0}  # the tiny model's greedy answer runs for seconds
PROMPT = [1, 2, 3, 4, 5]  # the tiny base answers it greedily for 2000 tokens without an end-of-sequence id


@pytest.fixture(scope="module")
def proxied(engine_url, tmp_path_factory):
    """A router whose one group's replica is a recording proxy of the engine."""
    d = tmp_path_factory.mktemp("abort")
    with recording_proxy(engine_url) as rec:
        preset = write_preset(d / "p.toml", [{"name": "cpu-a", "replicas": [rec.url]}])
        with router_process(preset) as router:
            yield router, rec


async def _disconnecting_turn(url: str, headers: dict[str, str], sid: str, timeout_s: float) -> None:
    """POST a long turn and give up (closing the connection) after ``timeout_s``."""
    async with aiohttp.ClientSession(headers=headers) as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(
                f"{url}/v1/sessions/{sid}/turns",
                json={"input_ids": PROMPT, "sampling_params": LONG},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            )


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_disconnected_turn_is_aborted_at_the_engine_and_not_recorded(proxied) -> None:
    router, rec = proxied
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        asyncio.run(_disconnecting_turn(router.url, router.headers, sid, 1.0))
        _wait_for(lambda: rec.exchanges("/generate"))  # the engine answered the aborted request
        ((sent, answer),) = rec.exchanges("/generate")
        rid = json.loads(sent)["rid"]
        aborts = [json.loads(body) for body, _ in rec.exchanges("/abort_request")]
        assert aborts == [{"rid": rid}]
        meta = json.loads(answer)["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        session = c.get(f"/v1/sessions/{sid}").json()
        assert (session["turns"], session["tokens"], session["status"]) == (0, 0, "open")
        metrics = c.get("/metrics").text
        assert 'route="/v1/sessions/{session_id}/turns",status="4xx"' in metrics

        # the session goes on: the next turn is turn 0, and it is recorded
        turn = c.post(
            f"/v1/sessions/{sid}/turns",
            json={"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}},
        )
        assert turn.status_code == 200, turn.text
        assert turn.json()["turn"] == 0
        assert c.get(f"/v1/sessions/{sid}").json()["turns"] == 1
        rids = [json.loads(body)["rid"] for body, _ in rec.exchanges("/generate")]
        assert len(set(rids)) == 2  # every engine request has its own rid


def test_a_turn_that_finishes_is_not_aborted(proxied) -> None:
    router, rec = proxied
    before = len(rec.exchanges("/abort_request"))
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        r = c.post(
            f"/v1/sessions/{sid}/turns",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}},
        )
        assert r.status_code == 200, r.text
    time.sleep(0.3)
    assert len(rec.exchanges("/abort_request")) == before


async def _disconnecting_take(url: str, headers: dict[str, str], timeout_s: float) -> None:
    """POST a take that waits for more trajectories than there are and give up (closing the
    connection) after ``timeout_s``."""
    async with aiohttp.ClientSession(headers=headers) as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(
                f"{url}/v1/batches/take",
                json={"size": 1000, "wait_s": 30},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            )


def test_a_take_whose_trainer_leaves_while_it_waits_puts_back_what_it_picked_at_once(proxied) -> None:
    """The router's lease timeout is 300 s: the trajectory comes back well before, as ready."""
    router, _rec = proxied
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        turn = c.post(
            f"/v1/sessions/{sid}/turns",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
        )
        assert turn.status_code == 200, turn.text
        assert c.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
        asyncio.run(_disconnecting_take(router.url, router.headers, 1.0))
        ready = {"ready": 1, "pending": 0, "held_back": 0, "leases": 0}
        _wait_for(lambda: c.get("/v1/batches/stats").json() == ready, timeout=10)
        batch = c.post("/v1/batches/take", json={"size": 1000}).json()
        assert [t["session_id"] for t in batch["trajectories"]] == [sid]
        assert c.post(f"/v1/batches/{batch['lease_id']}/ack").json()["acked"] == 1
        assert 'route="/v1/batches/take",status="4xx"' in c.get("/metrics").text


@pytest.fixture(scope="module")
def chat_router(model_root, tmp_path_factory):
    """A router with a chat model (``tiny``, as every preset) whose one replica is a recording proxy of an
    engine serving it."""
    from tests.support.engines import engine_process
    from tests.support.models import make_model_dir

    model = make_model_dir(model_root, "tiny", "bf16")
    d = tmp_path_factory.mktemp("abort-chat")
    with engine_process(model) as url, recording_proxy(url) as rec:
        preset = write_preset(d / "p.toml", [{"name": "cpu", "replicas": [rec.url]}])
        with router_process(preset, extra_args=("--chat-model", str(model))) as router:
            yield router, rec


def test_the_openai_client_timing_out_and_retrying_records_nothing(chat_router) -> None:
    """The official client's defaults: a timed-out call is retried. Each attempt is aborted at
    the engine when its connection closes, and the session records no turn."""
    openai = pytest.importorskip("openai")
    router, rec = chat_router
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        created = c.post("/v1/sessions", json={}).json()
        client = openai.OpenAI(
            base_url=created["openai_base_url"], api_key=router.key, timeout=1.0, max_retries=1
        )
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "count"}],
                max_tokens=1500,
                temperature=0.0,
            )
        _wait_for(lambda: len(rec.exchanges("/generate")) == 2)
        rids = [json.loads(sent)["rid"] for sent, _ in rec.exchanges("/generate")]
        _wait_for(lambda: len(rec.exchanges("/abort_request")) == 2)
        assert sorted(json.loads(b)["rid"] for b, _ in rec.exchanges("/abort_request")) == sorted(rids)
        assert all(
            json.loads(a)["meta_info"]["finish_reason"]["type"] == "abort"
            for _, a in rec.exchanges("/generate")
        )
        assert c.get(f"/v1/sessions/{created['session_id']}").json()["turns"] == 0

"""Retried chat turns with the official clients: the same ``Idempotency-Key`` (sent as
``extra_headers``; the clients keep it on their own retries of that call) answers the recorded turn
byte for byte, streamed or not, instead of sampling again; a retry while the first runs waits for
it; and on a real Redis with two router workers any worker answers a retry and resumes the
conversation from the session's chat note."""

from __future__ import annotations

import threading

import anthropic
import httpx
import openai

from tests.chat.conftest import trajectory
from tests.router.test_workers_metrics import scrape, total
from tests.support.metrics import turn_replays
from tests.support.procs import redis_server
from tests.support.router import router_process, until_workers, write_preset

HELLO = [{"role": "user", "content": "Hello"}]


def _openai(router, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["openai_base_url"], api_key=router.key, max_retries=0)


def _key(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def _turns(router, session) -> int:
    r = httpx.get(f"{router.url}/v1/sessions/{session['session_id']}", headers=router.headers, timeout=30)
    return r.json()["turns"]


def test_openai_retry_answers_the_recorded_turn(router, engine, session):
    client = _openai(router, session)
    kw = {"model": "tiny", "max_tokens": 8, "temperature": 1.0}  # unseeded: a new sample would differ
    sampled, (found, raced) = len(engine.generated), turn_replays(router.url)
    first = client.chat.completions.with_raw_response.create(messages=HELLO, extra_headers=_key("a"), **kw)
    again = client.chat.completions.with_raw_response.create(messages=HELLO, extra_headers=_key("a"), **kw)
    assert again.http_response.content == first.http_response.content
    reply = first.parse()
    assert reply.mixfleet["turn"] == 0 and _turns(router, session) == 1
    messages = [*HELLO, {"role": "assistant", "content": reply.choices[0].message.content}]
    messages.append({"role": "user", "content": "More"})
    streams = []
    for _ in range(2):
        with client.chat.completions.with_streaming_response.create(
            messages=messages, stream=True, extra_headers=_key("b"), **kw
        ) as r:
            streams.append(b"".join(r.iter_bytes()))
    assert streams[0] == streams[1] and streams[0].endswith(b"data: [DONE]\n\n")
    assert len(engine.generated) == sampled + 2
    turns = trajectory(router, session["session_id"])
    assert len(turns) == 2 and turns[1]["fork"] is None
    assert (turns[1]["input_ids"], turns[1]["output_ids"]) == engine.generated[-1]
    done = httpx.post(
        f"{router.url}/v1/sessions/{session['session_id']}/finish",
        json={"reward": 1.0},
        headers=router.headers,
        timeout=30,
    )
    assert done.status_code == 200, done.text
    late = client.chat.completions.with_raw_response.create(messages=HELLO, extra_headers=_key("a"), **kw)
    assert late.http_response.content == first.http_response.content
    assert turn_replays(router.url) == (found + 3, raced)  # the repeat, the streamed one, the late one


def test_anthropic_retry_answers_the_recorded_turn(router, engine, session):
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key, max_retries=0)
    kw = {"model": "tiny", "max_tokens": 8, "extra_body": {"temperature": 1.0}}
    sampled = len(engine.generated)
    first = client.messages.with_raw_response.create(messages=HELLO, extra_headers=_key("a"), **kw)
    again = client.messages.with_raw_response.create(messages=HELLO, extra_headers=_key("a"), **kw)
    assert again.http_response.content == first.http_response.content
    reply = first.parse()
    messages = [*HELLO, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "More"}]
    streams = []
    for _ in range(2):
        with client.messages.with_streaming_response.create(
            messages=messages, stream=True, extra_headers=_key("b"), **kw
        ) as r:
            streams.append(b"".join(r.iter_bytes()))
    assert streams[0] == streams[1] and b"event: message_stop" in streams[0]
    assert len(engine.generated) == sampled + 2 and _turns(router, session) == 2
    assert trajectory(router, session["session_id"])[1]["fork"] is None


def test_a_key_reused_with_another_request_is_the_apis_400(router, engine, session):
    """OpenAI and Anthropic alike: the key of a recorded turn sent with other messages (or other
    sampling options) is a 400 invalid_request_error naming the key, and nothing is sampled; the
    same request again is a retry."""
    oa = _openai(router, session)
    an = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key, max_retries=0)
    kw = {"model": "tiny", "max_tokens": 8, "temperature": 1.0}
    first = oa.chat.completions.with_raw_response.create(messages=HELLO, extra_headers=_key("k"), **kw)
    sampled = len(engine.generated)
    other = [{"role": "user", "content": "Goodbye"}]
    for call in (
        lambda: oa.chat.completions.create(messages=other, extra_headers=_key("k"), **kw),
        lambda: oa.chat.completions.create(
            messages=HELLO, extra_headers=_key("k"), **{**kw, "max_tokens": 9}
        ),
        lambda: an.messages.create(
            model="tiny",
            max_tokens=8,
            messages=other,
            extra_headers=_key("k"),
            extra_body={"temperature": 1.0},
        ),
    ):
        try:
            call()
        except (openai.BadRequestError, anthropic.BadRequestError) as exc:
            assert exc.status_code == 400 and "Idempotency-Key 'k'" in str(exc), exc
            assert exc.body and "invalid_request_error" in str(exc.body), exc.body
        else:
            raise AssertionError("the reused key was not refused")
    again = oa.chat.completions.with_raw_response.create(messages=HELLO, extra_headers=_key("k"), **kw)
    assert again.http_response.content == first.http_response.content
    assert len(engine.generated) == sampled and _turns(router, session) == 1


def test_a_retry_while_the_first_runs_waits_for_it(router, engine, session):
    client = _openai(router, session)
    answers: list[bytes] = []

    def call() -> None:
        r = client.chat.completions.with_raw_response.create(
            model="tiny", messages=HELLO, max_tokens=8, temperature=1.0, extra_headers=_key("slow")
        )
        answers.append(r.http_response.content)

    sampled = len(engine.generated)
    engine.delay_s = 2.0
    try:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.delay_s = 0.0
    assert len(answers) == 3 and len(set(answers)) == 1
    assert len(engine.generated) == sampled + 1 and _turns(router, session) == 1


def test_any_worker_answers_a_retry_and_resumes_the_conversation(engine, chat_model, tmp_path):
    """``--workers 2`` on a real Redis, a new connection per call: the conversation's turns all
    extend the session whichever worker renders them, each after the first rendering only the
    messages after the last turn; a retry reaches both workers; an edited first message is
    rendered whole and recorded as a fork."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "replicas": [engine.url]}])
    args = ("--workers", "2", "--chat-model", str(chat_model))
    with redis_server() as url, router_process(preset, state=url, extra_args=args) as r:
        session = httpx.post(r.url + "/v1/sessions", headers=r.headers, timeout=30).json()
        messages = list(HELLO)
        for i in range(3):
            reply = _openai(r, session).chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, extra_headers=_key(f"t{i}")
            )
            assert reply.mixfleet["extends"] and reply.mixfleet["turn"] == i
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"Go on ({i})"},
            ]
        retries = until_workers(
            lambda: _openai(r, session).chat.completions.with_raw_response.create(
                model="tiny", messages=HELLO, max_tokens=6, extra_headers=_key("t0")
            )
        )
        assert len({raw.http_response.content for raw in retries}) == 1
        edited = [{"role": "user", "content": "Hi"}, *messages[1:]]
        forked = _openai(r, session).chat.completions.create(model="tiny", messages=edited, max_tokens=6)
        assert not forked.mixfleet["extends"]
        samples, _ = scrape(r)
        assert total(samples, "mixfleet_router_chat_turns_total", context="resumed") == 2
        assert total(samples, "mixfleet_router_chat_turns_total", context="whole") == 2
        turns = trajectory(r, session["session_id"])
        assert [t["fork"] is None for t in turns] == [True, True, True, False]
        assert (turns[3]["input_ids"], turns[3]["output_ids"]) == engine.generated[-1]
        for prev, t in zip(turns, turns[1:3], strict=False):
            assert t["input_ids"][: len(prev["input_ids"]) + len(prev["output_ids"])] == (
                prev["input_ids"] + prev["output_ids"]
            )

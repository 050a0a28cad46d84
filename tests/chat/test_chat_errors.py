"""Every answer a chat URL can give is in its API's error shape, as the official clients read it
(:mod:`router.chat.errors`): an unknown path or method under a chat prefix, an unreachable state
store, a context longer than the model's (``context_length_exceeded``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from router.chat import anthropic_routes, openai_routes
from router.chat.errors import api_error, chat_api
from router.errors import ApiError
from tests.chat.conftest import trajectory
from tests.support.procs import redis_server
from tests.support.router import router_process, write_preset

USER = [{"role": "user", "content": "Hi"}]


def _openai(router, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["openai_base_url"], api_key=router.key, max_retries=0)


def _anthropic(router, session) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key, max_retries=0)


def _openai_shape(body, kind: str = "invalid_request_error") -> None:
    """``body``: what the openai client passes its exception (the ``error`` object)."""
    assert set(body) >= {"message", "type", "param", "code"} and body["type"] == kind, body


def _anthropic_shape(body, kind: str) -> None:
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body


def test_chat_api_is_the_routers_prefixes() -> None:
    for router, api in ((openai_routes.router, "openai"), (anthropic_routes.router, "anthropic")):
        prefix = router.prefix.replace("{session_id}", "s1")
        assert chat_api(prefix) == api and chat_api(prefix + "/x/y") == api
    assert chat_api("/v1/sessions/s1/turns") is None and chat_api("/v1/sessions/s1/openai/v2") is None


def test_api_error_shapes() -> None:
    """The statuses a chat URL can answer, in each API's shape: a state conflict (409: Anthropic's
    ``conflict_error``), the param only of a 400, SGLang's two context refusals reworded."""
    conflict = ApiError(409, "SessionFinished: s1")
    assert api_error(conflict, "openai").body()["error"] == {
        "message": "SessionFinished: s1",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert api_error(conflict, "anthropic").body()["error"]["type"] == "conflict_error"
    assert api_error(ApiError(500, "x"), "openai").body()["error"]["type"] == "server_error"
    assert api_error(ApiError(502, "x"), "anthropic").body()["error"]["type"] == "api_error"
    engine = "engine refused the request: "
    total = (
        "Requested token count exceeds the model's maximum context length of 40960 tokens. You requested "
        "a total of 41000 tokens: 40000 tokens from the input messages and 1000 tokens for the completion. "
        "Please reduce the number of tokens in the input messages or the completion to fit within the limit."
    )
    refused = api_error(ApiError(422, engine + total), "openai")
    assert refused.status == 400 and refused.body()["error"]["code"] == "context_length_exceeded"
    assert refused.body()["error"]["message"] == (
        "This model's maximum context length is 40960 tokens. However, you requested 41000 tokens "
        "(40000 in the messages, 1000 in the completion). Please reduce the length of the messages or "
        "completion."
    )
    longer = engine + "The input (50000 tokens) is longer than the model's context length (40960 tokens)."
    assert api_error(ApiError(422, longer), "anthropic").body()["error"] == {
        "type": "invalid_request_error",
        "message": "prompt is too long: 50000 tokens > 40960 maximum",
    }


def test_unknown_paths_and_methods_answer_in_the_apis_shape(router, session):
    oc, ac = _openai(router, session), _anthropic(router, session)
    with pytest.raises(openai.NotFoundError) as info:
        oc.embeddings.create(model="m", input="x")
    _openai_shape(info.value.body)
    with pytest.raises(openai.NotFoundError) as info:
        oc.completions.create(model="m", prompt="x")
    _openai_shape(info.value.body)
    with pytest.raises(anthropic.NotFoundError) as refused:
        ac.messages.batches.list()
    _anthropic_shape(refused.value.body, "not_found_error")
    base = f"{router.url}/v1/sessions/{session['session_id']}"
    r = httpx.post(f"{base}/anthropic/v1/complete", headers=router.headers, json={}, timeout=30)
    assert r.status_code == 404, r.text
    _anthropic_shape(r.json(), "not_found_error")
    r = httpx.get(f"{base}/openai/v1/chat/completions", headers=router.headers, timeout=30)
    assert r.status_code == 405, r.text
    _openai_shape(r.json()["error"])
    r = httpx.get(f"{base}/anthropic/v1/messages", headers=router.headers, timeout=30)
    assert r.status_code == 405, r.text
    _anthropic_shape(r.json(), "invalid_request_error")
    r = httpx.get(f"{base}/nothing", headers=router.headers, timeout=30)  # not a chat URL: FastAPI's
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}, r.text


def test_a_client_pointed_at_the_routers_root_is_told_the_chat_apis_are_per_session(router):
    """An official client whose base_url is the router itself (``http://ROUTER/v1`` or
    ``http://ROUTER``) got a bare 404 "Not Found": now a 404 in its API's shape whose message,
    which the raised exception carries, says to create a session and use its base URL."""
    for base in (router.url + "/v1", router.url):
        oc = openai.OpenAI(base_url=base, api_key=router.key, max_retries=0)
        with pytest.raises(openai.NotFoundError) as chat:
            oc.chat.completions.create(model="m", messages=USER)
        with pytest.raises(openai.NotFoundError) as models:
            oc.models.list()
        for info in (chat, models):
            _openai_shape(info.value.body)
            assert "POST /v1/sessions" in str(info.value) and "its openai_base_url" in str(info.value)
    ac = anthropic.Anthropic(base_url=router.url, api_key=router.key, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as message:
        ac.messages.create(model="m", max_tokens=8, messages=USER)
    with pytest.raises(anthropic.NotFoundError) as models:
        ac.models.list()
    for refused in (message, models):
        _anthropic_shape(refused.value.body, "not_found_error")
        assert "POST /v1/sessions" in str(refused.value) and "its anthropic_base_url" in str(refused.value)
    r = httpx.get(f"{router.url}/v1/nothing", headers=router.headers, timeout=30)  # no chat call: FastAPI's
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}, r.text


def test_a_context_longer_than_the_models_is_context_length_exceeded(router, session):
    oc, ac = _openai(router, session), _anthropic(router, session)
    long = [{"role": "user", "content": "x" * 5000}]  # the tiny model's context is 2,048 tokens
    with pytest.raises(openai.BadRequestError) as info:
        oc.chat.completions.create(model="m", messages=long, max_tokens=4)
    e = info.value
    assert e.code == "context_length_exceeded" and e.param == "messages" and e.type == "invalid_request_error"
    assert e.body["message"].startswith("This model's maximum context length is 2048 tokens. However, your ")
    # within 6 tokens of the context: the tokenizer manager's checks pass, SGLang's scheduler aborts
    # (a prompt of 2,044 tokens asking 1: the longest prompt served is 2,041)
    near = [{"role": "user", "content": "x" * 2025}]
    with pytest.raises(openai.BadRequestError) as info:
        oc.chat.completions.create(model="m", messages=near, max_tokens=1)
    assert info.value.code == "context_length_exceeded", info.value.body
    assert info.value.body["message"].startswith(
        "This model's maximum context length is 2042 tokens. However, your messages resulted in 2044 tokens."
    ), info.value.body
    with pytest.raises(anthropic.BadRequestError) as refused:
        ac.messages.create(model="m", messages=near, max_tokens=1)
    assert refused.value.body["error"]["message"] == "prompt is too long: 2044 tokens > 2042 maximum"
    with pytest.raises(openai.BadRequestError) as info:
        oc.chat.completions.create(model="m", messages=USER, max_completion_tokens=3000)
    e = info.value
    assert e.code == "context_length_exceeded", e.body
    want = "However, you requested 3021 tokens (21 in the messages, 3000 in the completion)"
    assert want in e.body["message"], e.body
    with pytest.raises(openai.BadRequestError) as info:  # streamed: refused before its first token
        oc.chat.completions.create(model="m", messages=long, max_tokens=4, stream=True)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as refused:
        ac.messages.create(model="m", messages=long, max_tokens=4)
    _anthropic_shape(refused.value.body, "invalid_request_error")
    assert refused.value.body["error"]["message"] == "prompt is too long: 5019 tokens > 2048 maximum"
    # count_tokens counts it, as Anthropic's endpoint does (not refused: router.chat.anthropic_routes)
    assert ac.messages.count_tokens(model="m", messages=long).input_tokens == 5019
    with pytest.raises(anthropic.BadRequestError) as refused:
        ac.messages.create(model="m", messages=USER, max_tokens=3000)
    message = refused.value.body["error"]["message"]
    assert message.startswith("input length and `max_tokens` exceed context limit: 21 + 3000 > 2048"), message


def test_an_engine_id_the_router_cannot_record_is_the_apis_502(router, engine, session, renderer):
    """An engine answer whose output id is past what a context holds (``router.engine_answer``: the
    output ids join the session's context, ids up to ``2**31 - 1`` as a request sends them) is a
    502 in each API's shape, naming the id: no turn is recorded. It was a 500 ("internal error of
    the router: ValueError") where the context packs its ids (``router.segments.pack``)."""
    past = [*renderer.encode("Hi"), 2**32 + 5, renderer.stop_ids[0]]
    engine.script.append(past)
    with pytest.raises(openai.APIStatusError) as info:
        _openai(router, session).chat.completions.create(model="m", messages=USER, temperature=1.0)
    assert info.value.status_code == 502
    _openai_shape(info.value.body, "server_error")
    assert "4294967301 is not a token id" in info.value.body["message"]
    engine.script.append(past)
    with pytest.raises(anthropic.APIStatusError) as refused:
        _anthropic(router, session).messages.create(
            model="m", max_tokens=16, messages=USER, extra_body={"temperature": 1.0}
        )
    assert refused.value.status_code == 502
    _anthropic_shape(refused.value.body, "api_error")
    assert "4294967301 is not a token id" in refused.value.body["error"]["message"]
    assert trajectory(router, session["session_id"]) == []


@contextlib.contextmanager
def _router_whose_redis_stops(engine, chat_model, tmp_path: Path) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A chat router over ``engine`` on a real redis-server, and the call that stops that server
    (once; the block's end stops it too)."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "replicas": [engine.url]}])
    with contextlib.ExitStack() as stack:
        down = contextlib.ExitStack()
        stack.callback(down.close)
        url = down.enter_context(redis_server())
        router = stack.enter_context(
            router_process(preset, state=url, extra_args=("--chat-model", str(chat_model)))
        )
        yield router, down.close


@pytest.mark.slow
def test_an_unreachable_state_store_is_the_apis_503(engine, chat_model, tmp_path):
    """Redis stops under a live router: both chat APIs answer 503 with ``Retry-After`` in their
    shape (Anthropic: ``overloaded_error``) once the store's calls give up (20 s)."""
    with _router_whose_redis_stops(engine, chat_model, tmp_path) as (router, stop_redis):
        r = httpx.post(router.url + "/v1/sessions", headers=router.headers, timeout=30)
        session = r.json()
        stop_redis()
        errors: dict[str, Exception] = {}

        def call(name, fn) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the test reads what each client raised
                errors[name] = exc

        calls = {
            "openai": lambda: _openai(router, session).chat.completions.create(model="m", messages=USER),
            "anthropic": lambda: _anthropic(router, session).messages.create(
                model="m", max_tokens=4, messages=USER
            ),
        }
        threads = [threading.Thread(target=call, args=item) for item in calls.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    o, a = errors["openai"], errors["anthropic"]
    assert isinstance(o, openai.InternalServerError) and o.status_code == 503, o
    _openai_shape(o.body, "server_error")
    assert "state store unavailable" in o.body["message"] and o.response.headers["retry-after"] == "1"
    assert isinstance(a, anthropic.ServiceUnavailableError), a
    _anthropic_shape(a.body, "overloaded_error")


@pytest.mark.slow
def test_a_state_store_gone_after_the_first_token_ends_each_stream_with_its_apis_error(
    engine, chat_model, renderer, tmp_path
):
    """Redis stops while both APIs stream a reply: the turn cannot be recorded once sampled, so each
    stream ends with its API's error event for the 503 (OpenAI ``server_error``, Anthropic
    ``overloaded_error``), which the official clients raise as such; it ended with a dropped
    connection (the clients' connection error) and a "response already started" in the log."""
    reply = renderer.encode("Hello there, this is a long reply of text that streams for a while.")
    engine.token_delay_s = 0.2
    try:
        with _router_whose_redis_stops(engine, chat_model, tmp_path) as (router, stop_redis):
            sessions = [
                httpx.post(router.url + "/v1/sessions", headers=router.headers, timeout=30).json()
                for _ in "ab"
            ]
            engine.script += [reply, reply]
            started = [threading.Event(), threading.Event()]
            errors: dict[str, Exception] = {}

            def stream(name: str, chunks: Any, started: threading.Event) -> None:
                try:
                    for _ in chunks:
                        started.set()
                except Exception as exc:  # noqa: BLE001 - the test reads what each client raised
                    errors[name] = exc

            kw = {"model": "m", "messages": USER, "max_tokens": 100, "stream": True}
            calls = {
                "openai": lambda: _openai(router, sessions[0]).chat.completions.create(**kw),
                "anthropic": lambda: _anthropic(router, sessions[1]).messages.create(**kw),
            }
            threads = [
                threading.Thread(target=lambda n=n, f=f, e=e: stream(n, f(), e))
                for (n, f), e in zip(calls.items(), started, strict=True)
            ]
            for t in threads:
                t.start()
            assert all(e.wait(60) for e in started)
            stop_redis()
            for t in threads:
                t.join(120)
    finally:
        engine.token_delay_s = 0.0
    o, a = errors["openai"], errors["anthropic"]
    assert type(o) is openai.APIError and "state store unavailable" in o.message, repr(o)
    _openai_shape(o.body, "server_error")
    assert isinstance(a, anthropic.APIStatusError), repr(a)
    _anthropic_shape(a.body, "overloaded_error")
    assert "state store unavailable" in a.body["error"]["message"]


def test_sampling_parameters_are_held_to_the_apis_ranges(router, session):
    """OpenAI: temperature 0..2, top_p (0, 1], top_logprobs 0..20, max_(completion_)tokens >= 1,
    n 1, stop up to 4 (openai ``types/chat/completion_create_params.py``); Anthropic: temperature
    0..1. Each refusal is a 400 naming the parameter (OpenAI's ``param``)."""
    oc, ac = _openai(router, session), _anthropic(router, session)
    refused = {
        "temperature": {"temperature": 2.5},
        "top_p": {"top_p": 1.5},
        "top_logprobs": {"logprobs": True, "top_logprobs": 21},
        "max_tokens": {"max_tokens": 0},
        "max_completion_tokens": {"max_completion_tokens": 0},
        "n": {"n": 2},
        "stop": {"stop": ["a", "b", "c", "d", "e"]},
    }
    for param, kw in refused.items():
        with pytest.raises(openai.BadRequestError) as info:
            oc.chat.completions.create(model="m", messages=USER, **kw)
        assert info.value.param == param and info.value.body["message"].startswith(f"{param}: "), (
            info.value.body
        )
    ok = oc.chat.completions.create(
        model="m", messages=USER, max_tokens=2, temperature=2.0, stop=["a", "b", "c", "d"], seed=1
    )
    assert ok.usage.completion_tokens <= 2
    for temperature in (1.5, -0.5):
        with pytest.raises(anthropic.BadRequestError) as info:
            ac.messages.create(
                model="m", max_tokens=2, messages=USER, extra_body={"temperature": temperature}
            )
        assert info.value.body["error"]["message"].startswith("temperature: "), info.value.body


def test_a_max_tokens_beyond_64_bits_is_refused_naming_the_limit(router, session):
    """An integer beyond 64 bits reaches the router as a float (its body decoder, orjson); the
    token limits refuse it in one line naming the limit (a 400 in each API's shape)."""
    oc, ac = _openai(router, session), _anthropic(router, session)
    for param in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            oc.chat.completions.create(model="m", messages=USER, **{param: 10**30})
        assert info.value.param == param, info.value.body
        assert info.value.body["message"] == f"{param}: Input should be an integer below 2**64", (
            info.value.body
        )
    with pytest.raises(anthropic.BadRequestError) as info:
        # in the body (the anthropic client itself refuses so large a max_tokens without streaming)
        ac.messages.create(model="m", max_tokens=2, messages=USER, extra_body={"max_tokens": 10**30})
    assert info.value.body["error"]["message"] == "max_tokens: Input should be an integer below 2**64"


def test_what_a_harness_sends_is_honoured_or_refused_by_name(router, session):
    oc, ac = _openai(router, session), _anthropic(router, session)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reply = oc.chat.completions.create(  # none of these changes the answer
        model="m",
        messages=USER,
        max_tokens=2,
        metadata={"run": "1"},
        response_format={"type": "text"},
        store=False,
        prompt_cache_key="k",
        safety_identifier="u",
        user="u",
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    options = {"include_usage": True, "include_obfuscation": False}
    chunks = list(
        oc.chat.completions.create(
            model="m", messages=USER, max_tokens=2, stream=True, stream_options=options
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 2
    refusals = [
        ({"tools": tools, "tool_choice": "required"}, "tool_choice: only 'auto' can be honoured"),
        ({"tools": tools, "tool_choice": "none"}, "tool_choice: only 'auto' can be honoured"),
        (
            {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice: only 'auto' can be honoured",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format: only {'type': 'text'}"),
        ({"stream_options": {"include_usage": True}}, "stream_options: only allowed when stream is true"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]: a 'image_url' part is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi", "name": "alice"}]},
            "messages[0].name: the chat template cannot render a participant name",
        ),
    ]
    for kw, message in refusals:
        with pytest.raises(openai.BadRequestError) as info:
            oc.chat.completions.create(**{"model": "m", "messages": USER, "max_tokens": 2, **kw})
        assert info.value.body["message"].startswith(message), info.value.body
    typed = [{"type": "custom", "name": "f", "input_schema": {"type": "object"}, "strict": True}]
    assert ac.messages.create(model="m", messages=USER, max_tokens=2, tools=typed).usage.output_tokens <= 2
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    anthropic_tools = [{"name": "f", "input_schema": {"type": "object"}}]
    refusals = [
        ({"tools": anthropic_tools, "tool_choice": {"type": "any"}}, "tool_choice.type: only 'auto'"),
        ({"tools": anthropic_tools, "tool_choice": {"type": "tool", "name": "f"}}, "tool_choice.type: only"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]},
            "messages.0.content: block 1 is 'image', which is not supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image]}],
                    }
                ]
            },
            "messages.0.content: block 0's content[0] is 'image', which is not supported",
        ),
    ]
    for kw, message in refusals:
        with pytest.raises(anthropic.BadRequestError) as info:
            ac.messages.create(**{"model": "m", "messages": USER, "max_tokens": 2, **kw})
        assert info.value.body["error"]["message"].startswith(message), info.value.body

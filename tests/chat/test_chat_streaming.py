"""Chat answers streamed as they are sampled, with the official clients against a live router and
the scripted engine (:mod:`tests.support.scripted`) pacing its streamed tokens: content arrives in
many events before the engine sends its last token, cumulative and incremental engine streams
alike; the stored turn equals a non-streamed one's; an ``Idempotency-Key`` replay of a streamed
turn is byte-identical; a tool call is still parsed (its markup never shown as content); an
engine failure after the first token ends the stream with an error and records nothing."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from tests.chat.conftest import reasoning_opened, trajectory
from tests.chat.test_chat_live import OPENAI_TOOLS, _new_session, _stored
from tests.support.recorder import HOP, serving
from tests.support.router import router_process, write_preset
from tests.support.scripted import scripted_engine

PLAIN = "Streaming arrives token by token, as sampled.<|im_end|>"
CALL = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>"
)
HELLO = [{"role": "user", "content": "Hello"}]
PACE_S = 0.1  # wide enough that a loaded machine still delivers text before the engine ends


@pytest.fixture
def paced(engine):
    """The scripted engine streaming one token every ``PACE_S``; reset after the test."""
    engine.token_delay_s = PACE_S
    yield engine
    engine.token_delay_s, engine.incremental, engine.fail_after = 0.0, False, []


def _openai(router, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["openai_base_url"], api_key=router.key, max_retries=0)


def _anthropic(router, session) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key, max_retries=0)


def _openai_stream(client: openai.OpenAI, key: str, **kw) -> list[tuple[float, bytes]]:
    """The raw stream of a keyed streamed completion, each network read with its arrival time."""
    pieces = []
    with client.chat.completions.with_streaming_response.create(
        stream=True, extra_headers={"Idempotency-Key": key}, **kw
    ) as r:
        for piece in r.iter_bytes():
            pieces.append((time.monotonic(), piece))
    return pieces


def _chunks(raw: bytes) -> list[dict]:
    """The complete ``data: {...}`` events of ``raw`` (a prefix of a stream may end inside one)."""
    events = raw.decode(errors="ignore").split("\n\n")[:-1]  # the last piece is unterminated or ""
    return [json.loads(e[6:]) for e in events if e.startswith("data: {")]


def _content(chunks: list[dict]) -> list[str]:
    return [
        c["choices"][0]["delta"]["content"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("content")
    ]


def test_openai_streams_content_as_it_is_sampled(router, paced, session, renderer):
    kw = {"model": "tiny", "messages": HELLO, "max_tokens": 100, "temperature": 1.0, "seed": 7}
    paced.script.append(renderer.encode(PLAIN))
    asked = time.monotonic()
    pieces = _openai_stream(_openai(router, session), "s", **kw)
    early = [p for t, p in pieces if t < paced.finished_at]
    arrived = [round(t - asked, 2) for t, _ in pieces]
    assert len(_content(_chunks(b"".join(early)))) >= 2, (
        f"no content arrived before the engine finished ({paced.finished_at - asked:.2f} s after the "
        f"request): reads arrived at {arrived} s"
    )
    raw = b"".join(p for _, p in pieces)
    chunks = _chunks(raw)
    assert len(_content(chunks)) > 10  # one event per token that shows text
    replay = _openai_stream(_openai(router, session), "s", **kw)
    assert b"".join(p for _, p in replay) == raw
    other = _new_session(router)
    paced.script.append(renderer.encode(PLAIN))
    plain = _openai(router, other).chat.completions.create(**kw)
    assert "".join(_content(chunks)) == plain.choices[0].message.content == PLAIN.removesuffix("<|im_end|>")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    a, b = _stored(router, session), _stored(router, other)
    for t in b:
        t["session_id"] = session["session_id"]
    assert a == b


def test_anthropic_streams_an_incremental_engine_stream(router, paced, session, renderer):
    paced.incremental = True  # SGLang's --incremental-streaming-output: each chunk its new ids only
    kw = {"model": "tiny", "max_tokens": 100, "messages": HELLO, "extra_body": {"temperature": 1.0}}
    paced.script.append(renderer.encode(PLAIN))
    texts = []
    with _anthropic(router, session).messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                texts.append((time.monotonic(), event.delta.text))
        final = stream.get_final_message()
    assert len([t for t, _ in texts if t < paced.finished_at]) >= 2
    assert "".join(x for _, x in texts) == final.content[0].text == PLAIN.removesuffix("<|im_end|>")
    other = _new_session(router)
    paced.script.append(renderer.encode(PLAIN))
    plain = _anthropic(router, other).messages.create(**kw)
    assert [(b.type, b.text) for b in plain.content] == [(b.type, b.text) for b in final.content]
    assert plain.stop_reason == final.stop_reason == "end_turn"
    a, b = trajectory(router, session["session_id"]), trajectory(router, other["session_id"])
    assert (a[0]["input_ids"], a[0]["output_ids"]) == (b[0]["input_ids"], b[0]["output_ids"])
    assert (a[0]["input_ids"], a[0]["output_ids"]) in paced.generated  # unseeded: log-probs differ
    assert len(a[0]["records"]) == len(b[0]["records"]) == len(a[0]["output_ids"])


BEFORE_THINK = "Well, <think>\nLet me see.\n</think>\n\nIt is blue.<|im_end|>"


def test_text_before_reasoning_is_content_streamed_or_not(router, paced, session, renderer):
    """Text sampled before ``<think>`` streams as content before the markup comes; the reply
    without streaming has the same content (that text, then the answer after ``</think>``), the same
    reasoning, and the same stored turn — with both clients; Anthropic's blocks come in the same
    order (text, then thinking) either way."""
    kw = {"model": "tiny", "messages": HELLO, "max_tokens": 100, "temperature": 1.0}
    paced.script.append(renderer.encode(BEFORE_THINK))
    chunks = list(_openai(router, session).chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    other = _new_session(router)
    paced.script.append(renderer.encode(BEFORE_THINK))
    plain = _openai(router, other).chat.completions.create(**kw).choices[0].message
    assert streamed == plain.content == "Well, It is blue."
    assert reasoning == plain.reasoning_content == "Let me see."
    a, b = trajectory(router, session["session_id"]), trajectory(router, other["session_id"])
    assert [(t["input_ids"], t["output_ids"]) for t in a] == [(t["input_ids"], t["output_ids"]) for t in b]
    assert len(a) == 1 and len(a[0]["records"]) == len(b[0]["records"]) == len(a[0]["output_ids"])
    ak = {"model": "tiny", "max_tokens": 100, "messages": HELLO, "extra_body": {"temperature": 1.0}}
    paced.script.append(renderer.encode(BEFORE_THINK))
    with _anthropic(router, _new_session(router)).messages.stream(**ak) as stream:
        final = stream.get_final_message()
    paced.script.append(renderer.encode(BEFORE_THINK))
    message = _anthropic(router, _new_session(router)).messages.create(**ak)
    # the blocks in the order sampled, streamed or not
    assert [b.type for b in final.content] == [b.type for b in message.content] == ["text", "thinking"]
    for m in (final, message):
        assert "".join(b.text for b in m.content if b.type == "text") == "Well, It is blue."
        assert [b.thinking for b in m.content if b.type == "thinking"] == ["Let me see."]


OPENED = "Let me see what the weather is.\n</think>\n\nIt is blue.<|im_end|>"
ODD = [  # odd tag sequences: streamed, the same reasoning and content as without streaming
    "A<think>B<think>C</think>D</think>E<|im_end|>",
    "A</think>B</think>C<|im_end|>",
    "<think>x</think>y<think>z<|im_end|>",
    # a tool call cut by the reasoning: the text around it joined is a call (content "" / "a")
    '<tool_<think>\nr\n</think>\n\ncall>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>",
    'a <tool_<think>r</think>call>{"name": "get_weather", "arguments": {}}</tool_call><|im_end|>',
]


def _openai_parts(chunks) -> tuple[list[str], str]:
    """The reasoning deltas and the content of a streamed completion."""
    reasoning = [
        v for c in chunks if c.choices and (v := getattr(c.choices[0].delta, "reasoning_content", None))
    ]
    return reasoning, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _anthropic_parts(stream) -> tuple[list[str], list[str], anthropic.types.Message]:
    """The ``content_block_start`` types, the thinking deltas and the final message of a stream."""
    started, thinking = [], []
    for e in stream:
        if e.type == "content_block_start":
            started.append(e.content_block.type)
        elif e.type == "content_block_delta" and e.delta.type == "thinking_delta":
            thinking.append(e.delta.thinking)
    return started, thinking, stream.get_final_message()


def test_a_prompt_that_opens_reasoning_streams_it_as_sampled(paced, chat_model, renderer, tmp_path):
    """A chat template whose generation prompt opens ``<think>`` (the reply is sampled reasoning
    first, closed by ``</think>``): streamed, the reasoning comes token by token as it is sampled,
    before the content, and adds up to the answer without streaming — OpenAI's
    ``reasoning_content`` deltas before the ``content`` deltas, Anthropic's thinking block's
    ``thinking_delta`` events before the text block; odd tag sequences too, in both forms."""
    model = reasoning_opened(chat_model, tmp_path / "opened")
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "replicas": [paced.url]}])
    with router_process(preset, extra_args=("--chat-model", str(model))) as router:
        kw = {"model": "tiny", "messages": HELLO, "max_tokens": 100, "temperature": 1.0}
        paced.script.append(renderer.encode(OPENED))
        chunks = list(_openai(router, _new_session(router)).chat.completions.create(stream=True, **kw))
        deltas = [
            (k, v)
            for c in chunks
            if c.choices
            for k in ("reasoning_content", "content")
            if (v := getattr(c.choices[0].delta, k, None))
        ]
        paced.script.append(renderer.encode(OPENED))
        plain = _openai(router, _new_session(router)).chat.completions.create(**kw).choices[0].message
        kinds = [k for k, _ in deltas]
        assert kinds.count("reasoning_content") > 3  # token by token, not whole at </think>
        assert kinds == sorted(kinds, reverse=True)  # all the reasoning before the content
        assert "".join(v for k, v in deltas if k == "reasoning_content") == plain.reasoning_content
        assert plain.reasoning_content == "Let me see what the weather is."
        assert "".join(v for k, v in deltas if k == "content") == plain.content == "It is blue."
        ak = {"model": "tiny", "max_tokens": 100, "messages": HELLO, "extra_body": {"temperature": 1.0}}
        paced.script.append(renderer.encode(OPENED))
        with _anthropic(router, _new_session(router)).messages.stream(**ak) as stream:
            started, thinking, final = _anthropic_parts(stream)
        paced.script.append(renderer.encode(OPENED))
        message = _anthropic(router, _new_session(router)).messages.create(**ak)
        assert started == [b.type for b in final.content] == [b.type for b in message.content]
        assert started == ["thinking", "text"] and len(thinking) > 3
        for m in (final, message):
            assert (m.content[0].thinking, m.content[1].text) == (
                "Let me see what the weather is.",
                "It is blue.",
            )
        paced.token_delay_s = 0.0
        for text in ODD:
            _same_streamed_or_not(router, paced, renderer, text)


@pytest.mark.parametrize("text", ODD)
def test_odd_tag_sequences_stream_the_answer(router, engine, renderer, text):
    """Without a generation prompt that opens ``<think>``: the same (the other form is in
    :func:`test_a_prompt_that_opens_reasoning_streams_it_as_sampled`)."""
    _same_streamed_or_not(router, engine, renderer, text)


def _same_streamed_or_not(router, engine, renderer, text: str) -> None:
    """``text`` sampled streamed and not, with both clients: the streamed reasoning and content
    deltas add up to the answer's, Anthropic's blocks are the same, and so are the stored turns."""
    kw = {"model": "tiny", "messages": HELLO, "max_tokens": 100, "temperature": 1.0}
    s1, s2 = _new_session(router), _new_session(router)
    engine.script.append(renderer.encode(text))
    reasoning, content = _openai_parts(list(_openai(router, s1).chat.completions.create(stream=True, **kw)))
    engine.script.append(renderer.encode(text))
    plain = _openai(router, s2).chat.completions.create(**kw).choices[0].message
    assert ("".join(reasoning), content) == (
        getattr(plain, "reasoning_content", None) or "",
        plain.content or "",
    ), text
    a, b = trajectory(router, s1["session_id"]), trajectory(router, s2["session_id"])
    assert [(t["input_ids"], t["output_ids"]) for t in a] == [(t["input_ids"], t["output_ids"]) for t in b]
    ak = {"model": "tiny", "max_tokens": 100, "messages": HELLO, "extra_body": {"temperature": 1.0}}
    engine.script.append(renderer.encode(text))
    with _anthropic(router, _new_session(router)).messages.stream(**ak) as stream:
        started, _, final = _anthropic_parts(stream)
    engine.script.append(renderer.encode(text))
    message = _anthropic(router, _new_session(router)).messages.create(**ak)
    assert started == [b.type for b in message.content], text
    assert final.model_dump()["content"] == message.model_dump()["content"], text


def test_a_streamed_tool_call_is_parsed(router, paced, session, renderer):
    kw = {"model": "tiny", "messages": HELLO, "tools": OPENAI_TOOLS, "max_tokens": 200, "temperature": 1.0}
    paced.script.append(renderer.encode(CALL))
    raw = b"".join(p for _, p in _openai_stream(_openai(router, session), "t", **kw))
    chunks = _chunks(raw)
    assert "".join(_content(chunks)) == "Let me check."
    assert not any("<" in c for c in _content(chunks))  # the markup is held back, never content
    calls = [
        c["choices"][0]["delta"]["tool_calls"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("tool_calls")
    ]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0][0]["function"]["arguments"]) == {"city": "Paris"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert b"".join(p for _, p in _openai_stream(_openai(router, session), "t", **kw)) == raw
    # the official client's own accumulation of the stream
    paced.script.append(renderer.encode(CALL))
    streamed = list(_openai(router, _new_session(router)).chat.completions.create(stream=True, **kw))
    names = [d.function.name for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert names == ["get_weather"]


def test_an_engine_failure_mid_stream_ends_it_with_an_error(router, paced, session, renderer):
    paced.fail_after.append(5)
    paced.script.append(renderer.encode(PLAIN))
    client = _openai(router, session)
    got = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for chunk in client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=100, temperature=1.0, stream=True
        ):
            got.append(chunk)
    assert got and got[0].choices[0].delta.role == "assistant"
    assert trajectory(router, session["session_id"]) == []  # nothing recorded


def test_a_client_that_leaves_mid_stream_aborts_the_turn(router, paced, session, renderer):
    paced.token_delay_s = 0.1  # PLAIN runs for seconds
    paced.script.append(renderer.encode(PLAIN))
    client = _openai(router, session)
    with client.chat.completions.with_streaming_response.create(
        model="tiny", messages=HELLO, max_tokens=100, temperature=1.0, stream=True
    ) as r:
        for line in r.iter_lines():
            if '"content":"S' in line.replace(" ", ""):
                break  # the first content delta: leave
    generate = [rid for path, rid in paced.rids if path == "/generate"][-1]
    deadline = time.monotonic() + 30
    while ("/abort_request", generate) not in paced.rids:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.05)
    assert trajectory(router, session["session_id"]) == []


def test_a_stream_fails_over_only_before_its_first_token(engine, chat_model, renderer, tmp_path):
    """Two replicas sharing one list of failures: the first streamed answer breaks off before any
    token and the turn runs on the other replica; a break after tokens ends the stream instead.
    Every answer is scripted (12 ids, no stop id): a sampled stop could end a stream before its
    break."""
    fails: list[int] = [0]
    words = renderer.encode(" ".join(["word"] * 12))[:12]
    assert len(words) == 12 and not set(words) & set(renderer.stop_ids)
    with scripted_engine(engine.upstream) as a, scripted_engine(engine.upstream) as b:
        a.fail_after = b.fail_after = fails
        a.script, b.script = [words] * 2, [words] * 2  # each /generate takes one, a broken one too
        preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "replicas": [a.url, b.url]}])
        with router_process(preset, extra_args=("--chat-model", str(chat_model))) as router:
            session = _new_session(router)
            client = _openai(router, session)
            kw = {"model": "tiny", "messages": HELLO, "max_tokens": 12, "temperature": 1.0, "stream": True}
            chunks = list(client.chat.completions.create(**kw))
            assert chunks[-1].choices[0].finish_reason == "length" and not fails
            generated = [len(e.generated) for e in (a, b)]
            assert sorted(generated) == [1, 1]  # the failed attempt, then the other replica's
            (turn,) = trajectory(router, session["session_id"])
            served = b if turn["replica"] == "cpu/1" else a
            assert served.generated == [(turn["input_ids"], turn["output_ids"])]
            # Paced, so the three tokens before the break reach the router (and the client) before
            # the connection drops; unpaced, the drop may be read first, and failing over is right.
            a.token_delay_s = b.token_delay_s = 0.05
            fails.append(3)
            with pytest.raises(openai.APIError, match="mid-stream"):
                list(client.chat.completions.create(**kw))
            assert sum(len(e.generated) for e in (a, b)) == 3  # no second attempt
            assert len(trajectory(router, session["session_id"])) == 1


@dataclass
class _StartPastTheInput:
    """A loopback proxy in front of a real engine that asks every ``/generate`` for input log-probs
    from far past its input (``logprob_start_len``), so the engine's scheduler aborts it as SGLang
    0.5.23's does (managers/scheduler.py 3275-3279: ``set_finish_with_abort``), and passes the
    engine's answer back unchanged; ``answers``: every ``/generate`` answer's body, in order."""

    upstream: str
    url: str = ""
    answers: list[bytes] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == "/generate":
            body = json.dumps(
                {**json.loads(body), "return_logprob": True, "logprob_start_len": 10**6}
            ).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with (
            aiohttp.ClientSession() as http,
            http.request(request.method, self.upstream + request.path_qs, data=body, headers=headers) as r,
        ):
            answer, status, ctype = await r.read(), r.status, r.content_type
        if request.path == "/generate":
            self.answers.append(answer)
        return web.Response(status=status, body=answer, content_type=ctype)


@contextlib.contextmanager
def _start_past_the_input(upstream: str) -> Iterator[_StartPastTheInput]:
    with serving(_StartPastTheInput(upstream), "start-past-the-input") as proxy:
        yield proxy


def test_a_scheduler_abort_with_its_stub_token_streams_nothing_and_fails_over_nowhere(
    engine, chat_model, tmp_path
):
    """The engine's streamed answer to an item its scheduler aborts with a 400 is what SGLang
    0.5.23's is: one event carrying the one id its stub prefill of ``[0]`` drew, ``prompt_tokens``
    1, the abort (``status_code`` 400) as its finish reason, then ``[DONE]``
    (managers/schedule_batch.py 2221-2238, 2011-2014; scheduler_components/
    batch_result_processor.py 363-369; managers/tokenizer_manager.py 1891-1922, 2041-2048). The
    router reads that status before the id reaches the turn's stream
    (``clients.engine_stream._chunk``): the client gets the refusal naming the abort (the router's
    422, the OpenAI API's 400) before any chunk, nothing is recorded, and the other replica is
    never asked."""
    with _start_past_the_input(engine.upstream) as a, _start_past_the_input(engine.upstream) as b:
        preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "replicas": [a.url, b.url]}])
        with router_process(preset, extra_args=("--chat-model", str(chat_model))) as router:
            session = _new_session(router)
            client = _openai(router, session)
            kw = {"model": "tiny", "messages": HELLO, "max_tokens": 8, "temperature": 1.0, "stream": True}
            chunks: list = []
            with pytest.raises(openai.APIStatusError) as info:
                chunks.extend(client.chat.completions.create(**kw))
            # the router's 422 (clients.engine EngineRejected(400)), a 400 in the OpenAI API's form
            assert info.value.status_code == 400, info.value
            assert "engine refused the request: req.logprob_start_len=1000000" in str(info.value.message)
            assert chunks == []
            (answer,) = a.answers + b.answers  # one engine request: no failover
            events = [e.removeprefix("data: ") for e in answer.decode().split("\n\n") if e]
            assert len(events) == 2 and events[1] == "[DONE]", answer
            event = json.loads(events[0])
            assert len(event["output_ids"]) == 1, answer  # the stub's token, which nobody saw
            assert event["meta_info"]["prompt_tokens"] == 1 and event["meta_info"]["completion_tokens"] == 1
            assert event["meta_info"]["finish_reason"]["status_code"] == 400, answer
            assert trajectory(router, session["session_id"]) == []

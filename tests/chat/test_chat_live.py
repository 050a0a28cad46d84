"""The chat APIs per session with the official ``openai`` and ``anthropic`` clients against a live
router and engine (scripted where a reply must be a real tool call: :mod:`tests.support.scripted`):
multi-turn tool use, an edited history, streaming against non-streaming, and every stored turn
equal to the tokens the engine saw and answered."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from router.schemas import MAX_JSON_DEPTH
from tests.chat.conftest import trajectory
from tests.router.test_workers_metrics import scrape, total

TOOL_CALL = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
)
ANSWER = "<think>\nI have it.\n</think>\n\nIt is 20 degrees in Paris.<|im_end|>"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}
]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS}]


def _openai(router, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["openai_base_url"], api_key=router.key, max_retries=0)


def _anthropic(router, session) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key, max_retries=0)


def _check_stored(engine, turns: list[dict]) -> None:
    """Each stored turn is an exchange the engine had (its input and output ids), and each turn's
    context extends the previous turn's context and sampled ids."""
    for t in turns:
        assert (t["input_ids"], t["output_ids"]) in engine.generated
    for prev, t in zip(turns, turns[1:], strict=False):
        seen = prev["input_ids"] + prev["output_ids"]
        assert t["input_ids"][: len(seen)] == seen


def test_session_has_both_base_urls(router, session):
    sid = session["session_id"]
    assert session["openai_base_url"] == f"{router.url}/v1/sessions/{sid}/openai/v1"
    assert session["anthropic_base_url"] == f"{router.url}/v1/sessions/{sid}/anthropic"


def test_openai_tool_conversation(router, engine, session, renderer):
    client = _openai(router, session)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    engine.script.append(renderer.encode(TOOL_CALL))
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=200
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants the weather."
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the harness sends the reply back without its reasoning, as most do
    messages.append(
        {"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump()]}
    )
    # as LangChain sends it: the tool's name too (the call it answers names it; not rendered)
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 20}', "name": "get_weather"}
    )
    engine.script.append(renderer.encode(ANSWER))
    second = client.chat.completions.create(
        model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=200
    )
    assert second.choices[0].message.content == "It is 20 degrees in Paris."
    assert second.choices[0].finish_reason == "stop" and second.mixfleet["extends"]
    messages += [
        {"role": "assistant", "content": "It is 20 degrees in Paris."},
        {"role": "user", "content": "Thanks"},
    ]
    # scripted too: a stop the engine samples within 6 tokens would end the reply early
    engine.script.append(renderer.encode("You are welcome.")[:6])
    third = client.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=6)
    assert third.mixfleet == {"session_id": session["session_id"], "turn": 2, "extends": True}
    turns = trajectory(router, session["session_id"])
    assert [t["output_ids"][-1] for t in turns[:2]] == [renderer.stop_ids[0]] * 2
    assert turns[0]["output_ids"] == renderer.encode(TOOL_CALL)
    assert third.usage.prompt_tokens == len(turns[2]["input_ids"])
    assert third.usage.completion_tokens == len(turns[2]["output_ids"]) == 6
    assert engine.asked[-1]["max_new_tokens"] == 6  # max_tokens reached the engine
    assert "The user wants the weather." in renderer.decode(turns[2]["input_ids"])  # reasoning kept
    _check_stored(engine, turns)


def test_a_reply_without_max_tokens_is_bounded_by_the_context_alone(router, engine, session, renderer):
    """No ``max_tokens``: the engine is asked a null ``max_new_tokens`` (the context's room, as OpenAI
    and SGLang's own chat endpoint), not the token API's 128; so a prompt 50 tokens short of the
    context is answered, where an invented 128 made it a context overflow."""
    engine.script.append(renderer.encode(ANSWER))
    reply = _openai(router, session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}]
    )
    assert engine.asked[-1]["max_new_tokens"] is None
    assert reply.choices[0].message.content == "It is 20 degrees in Paris."
    other = httpx.post(router.url + "/v1/sessions", headers=router.headers, timeout=30).json()
    near = [{"role": "user", "content": "x" * 1979}]  # 1,998 tokens of the tiny model's 2,048
    reply = _openai(router, other).chat.completions.create(model="tiny", messages=near, temperature=0)
    assert reply.usage.prompt_tokens == 1998 and 1 <= reply.usage.completion_tokens <= 48, reply.usage
    assert engine.asked[-1]["max_new_tokens"] is None


def test_anthropic_tool_conversation(router, engine, session, renderer):
    client = _anthropic(router, session)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"model": "tiny", "max_tokens": 200, "system": "Be brief.", "tools": ANTHROPIC_TOOLS}
    engine.script.append(renderer.encode(TOOL_CALL))
    first = client.messages.create(messages=messages, **kw)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    use = first.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    messages.append({"role": "assistant", "content": first.content})
    messages.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 20}'}],
        }
    )
    engine.script.append(renderer.encode(ANSWER))
    with client.messages.stream(messages=messages, **kw) as stream:
        second = stream.get_final_message()
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [
        ("thinking", None),
        ("text", "It is 20 degrees in Paris."),
    ]
    turns = trajectory(router, session["session_id"])
    assert second.usage.input_tokens == len(turns[1]["input_ids"])
    assert turns[1]["output_ids"] == renderer.encode(ANSWER)
    text = renderer.decode(turns[1]["input_ids"])
    assert text.endswith('<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    _check_stored(engine, turns)


def test_a_reply_sent_back_as_the_client_dumps_it_extends(router, engine, session):
    """``message.model_dump()`` has every field of the client's message (``refusal``, ``audio``,
    ``function_call``, ``annotations``: null); sent back, it is the assistant message it was."""
    client = _openai(router, session)
    messages = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="t", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "More"}]
    second = client.chat.completions.create(model="t", messages=messages, max_tokens=4)
    assert second.mixfleet["extends"]
    refusal = {"role": "assistant", "content": None, "refusal": "I can't."}
    with pytest.raises(openai.BadRequestError, match="refusal"):
        client.chat.completions.create(model="t", messages=[*messages[:1], refusal, *messages[2:]])


def test_a_developer_message_mid_conversation_extends(router, engine, session):
    """A developer (system) message after a reply, as harnesses send reminders: rendered where it
    stands, the turn extends the session (it was a 400 "a system message is only rendered as the
    first message")."""
    client = _openai(router, session)
    messages: list = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="t", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(), {"role": "developer", "content": "Now in French."}]
    second = client.chat.completions.create(model="t", messages=messages, max_tokens=4)
    assert second.mixfleet["extends"]


def test_a_reply_of_the_clients_stream_helper_sent_back_extends(router, engine, renderer):
    """The stream helper's final completion (``chat.completions.stream(...).get_final_completion()``)
    has a message with ``parsed`` and tool calls with ``index`` and ``function.parsed_arguments``
    (openai ``types/chat/parsed_chat_completion.py``, ``parsed_function_tool_call.py``); sent back,
    as the object or dumped, it is the assistant message it was (those were refused by name)."""
    kw = {"model": "t", "tools": OPENAI_TOOLS, "max_tokens": 200}
    for dump in (False, True):
        client = _openai(router, _new_session(router))
        messages: list = [{"role": "user", "content": "Weather in Paris?"}]
        engine.script.append(renderer.encode(TOOL_CALL))
        with client.chat.completions.stream(messages=messages, **kw) as stream:
            reply = stream.get_final_completion().choices[0].message
        call = reply.tool_calls[0]
        assert call.function.name == "get_weather" and call.function.parsed_arguments is None
        messages += [
            reply.model_dump() if dump else reply,
            {"role": "tool", "tool_call_id": call.id, "content": "20"},
        ]
        again = client.chat.completions.create(messages=messages, **{**kw, "max_tokens": 2})
        assert again.mixfleet["extends"], again.mixfleet


def test_logprob_bytes_are_each_tokens_own(router, engine, session, renderer):
    """A token that ends inside a UTF-8 character decodes alone to a replacement character; its
    ``bytes`` are its own, so the entries' bytes join into the reply's text, as OpenAI's do."""
    reply = "Grüße 😀"
    engine.script.append(renderer.encode(reply) + [renderer.stop_ids[0]])
    answer = _openai(router, session).chat.completions.create(
        model="t", messages=[{"role": "user", "content": "Hi"}], max_tokens=40, logprobs=True
    )
    assert answer.choices[0].message.content == reply
    entries = answer.choices[0].logprobs.content
    assert "\ufffd" in [e.token for e in entries]
    assert b"".join(bytes(e.bytes) for e in entries) == (reply + "<|im_end|>").encode()


def test_a_stop_sequence_is_no_part_of_the_reply(router, engine, session, renderer):
    """The stop sequence that ended a turn is recorded (the engine sampled it) but left out of the
    reply's text, streamed or not, as both APIs do; sent back without it, the reply extends the
    session."""
    client = _openai(router, session)
    messages = [{"role": "user", "content": "Hi"}]
    engine.script.append(renderer.encode("Hi there!"))
    first = client.chat.completions.create(model="t", messages=messages, max_tokens=20, stop=["!"])
    assert (first.choices[0].message.content, first.choices[0].finish_reason) == ("Hi there", "stop")
    messages += [{"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "More"}]
    engine.script.append(renderer.encode("Yes and?"))
    chunks = list(
        client.chat.completions.create(model="t", messages=messages, max_tokens=20, stop="?", stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Yes and"
    messages += [{"role": "assistant", "content": "Yes and"}, {"role": "user", "content": "Go"}]
    assert client.chat.completions.create(model="t", messages=messages, max_tokens=2).mixfleet["extends"]
    turns = trajectory(router, session["session_id"])
    assert [t["fork"] for t in turns] == [None, None, None]
    assert turns[0]["output_ids"] == renderer.encode("Hi there!")
    _check_stored(engine, turns)


def test_anthropic_stop_sequence_is_no_part_of_the_reply(router, engine, session, renderer):
    client = _anthropic(router, session)
    messages = [{"role": "user", "content": "Hi"}]
    engine.script.append(renderer.encode("Done."))
    first = client.messages.create(model="t", max_tokens=20, messages=messages, stop_sequences=["."])
    assert (first.stop_reason, first.stop_sequence) == ("stop_sequence", ".")
    assert [(b.type, b.text) for b in first.content] == [("text", "Done")]
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "More"}]
    engine.script.append(renderer.encode("Again."))
    with client.messages.stream(model="t", max_tokens=20, messages=messages, stop_sequences=["."]) as stream:
        assert "".join(stream.text_stream) == "Again"
        second = stream.get_final_message()
    assert [(b.type, b.text) for b in second.content] == [("text", "Again")]
    turns = trajectory(router, session["session_id"])
    assert [t["fork"] for t in turns] == [None, None]
    _check_stored(engine, turns)


def test_a_large_tool_output_does_not_hold_up_the_router(router, engine, session):
    """A large new message (megabytes of tool output, rendered after the noted turn) is tokenized
    off the event loop and without the GIL: the router answers meanwhile (a loop held for the
    heartbeat timeout would also take every replica out of rotation)."""
    client = _openai(router, session)
    user = [{"role": "user", "content": "Run it"}]
    first = client.chat.completions.create(model="t", messages=user, max_tokens=2)
    output = "line ✓ 🚀 of the tool's output\n" * 80_000  # ~2.6 MB: past the context
    messages = [*user, first.choices[0].message.model_dump(), {"role": "user", "content": output}]
    waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            httpx.get(router.url + "/healthz", timeout=120).raise_for_status()
            waits.append(time.monotonic() - t0)

    prober = threading.Thread(target=probe)
    t0 = time.monotonic()
    prober.start()
    try:
        with pytest.raises(openai.APIStatusError):  # too long for the engine (or its proxy's body limit)
            client.chat.completions.create(model="t", messages=messages, max_tokens=2)
    finally:
        took = time.monotonic() - t0
        done.set()
        prober.join()
    assert len(waits) >= 3 and max(waits) < took / 3, (took, waits)


def test_a_finished_session_is_refused_once(router, engine, session):
    """A turn on a finished session is a 409 the clients do not retry (``x-should-retry: false``;
    they retry a 409 otherwise): one request, however many retries the client allows."""
    user = [{"role": "user", "content": "Hi"}]
    _openai(router, session).chat.completions.create(model="t", messages=user, max_tokens=2)
    finish = f"{router.url}/v1/sessions/{session['session_id']}/finish"
    httpx.post(finish, headers=router.headers, json={"reward": 0.0}, timeout=30).raise_for_status()
    refused = _refusals(router)
    with pytest.raises(openai.ConflictError, match="accepts no more turns"):
        openai.OpenAI(base_url=session["openai_base_url"], api_key=router.key).chat.completions.create(
            model="t", messages=user, max_tokens=2
        )
    with pytest.raises(anthropic.ConflictError, match="accepts no more turns"):
        anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key).messages.create(
            model="t", max_tokens=2, messages=user
        )
    assert _refusals(router) - refused == 2


def _refusals(router) -> float:
    """The router's 4xx answers so far."""
    return total(scrape(router)[0], "mixfleet_router_request_seconds_count", status="4xx")


def test_edited_history_is_a_fork(router, engine, session, renderer):
    client = _openai(router, session)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    engine.script.append(renderer.encode(TOOL_CALL))
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append({"role": "assistant", "content": "Let me check.", "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 20}'})
    engine.script.append(renderer.encode(ANSWER))
    client.chat.completions.create(model="tiny", messages=messages, tools=OPENAI_TOOLS, max_tokens=200)
    edited = [
        *messages,
        {"role": "assistant", "content": "It is 25 degrees."},
        {"role": "user", "content": "Sure?"},
    ]
    forked = client.chat.completions.create(model="tiny", messages=edited, tools=OPENAI_TOOLS, max_tokens=4)
    assert forked.mixfleet["extends"] is False
    turns = trajectory(router, session["session_id"])
    assert len(turns) == 3
    head = turns[1]["input_ids"]  # turn 0 and its sampled ids, then the tool result: unchanged, kept
    assert turns[2]["input_ids"][: len(head)] == head
    assert turns[2]["input_ids"][: len(head) + len(turns[1]["output_ids"])] != head + turns[1]["output_ids"]
    assert renderer.decode(turns[2]["input_ids"][len(head) :]).startswith("It is 25 degrees.<|im_end|>\n")
    _check_stored(engine, turns[:2])
    assert (turns[2]["input_ids"], turns[2]["output_ids"]) in engine.generated


def _stored(router, session) -> list[dict]:
    return [{k: v for k, v in t.items() if k != "timings"} for t in trajectory(router, session["session_id"])]


def _new_session(router) -> dict:
    r = httpx.post(router.url + "/v1/sessions", headers=router.headers, timeout=30)
    r.raise_for_status()
    return r.json()


def test_openai_streaming_records_as_without(router, engine, session, renderer):
    messages = [{"role": "user", "content": "Hello"}]
    kw = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 8,
        "seed": 7,
        "top_p": 0.9,
        "logprobs": True,
        "top_logprobs": 2,
    }
    plain = _openai(router, session).chat.completions.create(**kw)
    other = _new_session(router)
    chunks = list(
        _openai(router, other).chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (plain.choices[0].message.content or "")
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    streamed_lp = [
        x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content
    ]
    assert [x.model_dump() for x in streamed_lp] == [
        x.model_dump() for x in plain.choices[0].logprobs.content
    ]
    a, b = _stored(router, session), _stored(router, other)
    for t in b:
        t["session_id"] = session["session_id"]
    assert a == b
    lp = plain.choices[0].logprobs.content
    assert [x.logprob for x in lp] == [r["logprob"] for r in a[0]["records"]]
    assert all(1 <= len(x.top_logprobs) <= 2 for x in lp)
    _check_stored(engine, a)


def test_anthropic_streaming_records_as_without(router, engine, session):
    """Greedy (the anthropic 2.15 client takes ``temperature`` only as an extra body field)."""
    kw = {
        "model": "tiny",
        "max_tokens": 8,
        "extra_body": {"temperature": 0.0},
        "messages": [{"role": "user", "content": "Hello"}],
    }
    plain = _anthropic(router, session).messages.create(**kw)
    other = _new_session(router)
    with _anthropic(router, other).messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    a, b = _stored(router, session), _stored(router, other)
    for t in b:
        t["session_id"] = session["session_id"]
    assert a == b


def test_refusals_name_the_problem(router, session):
    client = _openai(router, session)
    user = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="only single-token stop sequences"):
        client.chat.completions.create(model="t", messages=user, stop=["two words"])
    with pytest.raises(openai.BadRequestError) as info:  # a malformed request: the API's 400, its shape
        client.chat.completions.create(
            model="t",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    assert (
        info.value.body["type"] == "invalid_request_error"
        and "messages[0].content[0]: a 'image_url' part" in info.value.body["message"]
    )
    deep: dict = {}
    for _ in range(MAX_JSON_DEPTH):
        deep = {"a": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(openai.BadRequestError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        client.chat.completions.create(model="t", messages=user, tools=[tool])
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        client.chat.completions.create(
            model="t", messages=user, tools=OPENAI_TOOLS, parallel_tool_calls=False
        )
    with pytest.raises(openai.BadRequestError, match="prefilling"):
        client.chat.completions.create(model="t", messages=[*user, {"role": "assistant", "content": "a"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="t", messages=user, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="context length"):  # the engine's refusal
        client.chat.completions.create(model="t", messages=user, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="Idempotency-Key"):
        client.chat.completions.create(model="t", messages=user, extra_headers={"Idempotency-Key": "a b"})
    with pytest.raises(openai.BadRequestError, match="top_logprobs: a turn that filters nothing"):
        client.chat.completions.create(model="t", messages=user, max_tokens=2, logprobs=True, top_logprobs=1)
    body = b'{"model": "t", "messages": [{"role": "user", "content": "a\\ud800b"}]}'  # a lone surrogate
    headers = {**router.headers, "content-type": "application/json"}
    url = session["openai_base_url"] + "/chat/completions"
    r = httpx.post(url, content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"], r.text  # not UTF-8
    ac = _anthropic(router, session)
    result = [{"type": "tool_result", "tool_use_id": "x", "content": "boom", "is_error": True}]
    with pytest.raises(anthropic.BadRequestError, match=r"exceed context limit: 21 \+ 5000 > 2048"):
        ac.messages.create(model="t", max_tokens=5000, messages=user)  # > the context
    with pytest.raises(anthropic.BadRequestError, match="is_error"):
        ac.messages.create(model="t", max_tokens=4, messages=[{"role": "user", "content": result}])
    with pytest.raises(anthropic.BadRequestError) as refused:
        ac.messages.create(
            model="t", max_tokens=4, messages=user, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    assert refused.value.body["type"] == "error" and "thinking" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="messages.1.content"):
        ac.messages.create(model="t", max_tokens=4, messages=[*user, {"role": "user", "content": []}])
    with pytest.raises(anthropic.BadRequestError, match="disable_parallel_tool_use"):
        ac.messages.create(
            model="t",
            max_tokens=4,
            messages=user,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        )
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(
            base_url=session["anthropic_base_url"], api_key="x" * 32, max_retries=0
        ).messages.create(model="t", max_tokens=4, messages=user)
    assert refused.value.body["error"]["type"] == "authentication_error", refused.value.body
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(
            base_url=f"{router.url}/v1/sessions/nope/openai/v1", api_key=router.key
        ).chat.completions.create(model="t", messages=user)

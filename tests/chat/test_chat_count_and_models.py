"""The chat APIs beyond a turn, with the official clients against a live router: Anthropic's
``count_tokens`` (the input a turn with the same messages then has, nothing sampled or recorded)
and both APIs' models routes (the session's one model, in each client's types)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.chat.conftest import trajectory
from tests.chat.test_chat_live import ANSWER, ANTHROPIC_TOOLS, TOOL_CALL, _anthropic, _openai

HELLO = [{"role": "user", "content": "Hello"}]


def test_anthropic_count_tokens_is_the_turns_input(router, engine, session, renderer):
    client = _anthropic(router, session)
    kw = {"model": "tiny", "system": "Be brief.", "tools": ANTHROPIC_TOOLS}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    asked = len(engine.generated)
    counted = client.messages.count_tokens(messages=messages, **kw)
    assert isinstance(counted, anthropic.types.MessageTokensCount)
    assert len(engine.generated) == asked and trajectory(router, session["session_id"]) == []
    engine.script.append(renderer.encode(TOOL_CALL))
    first = client.messages.create(max_tokens=200, messages=messages, **kw)
    assert first.usage.input_tokens == counted.input_tokens
    # the reply sent back: counted as the ids the turn sampled (resumed from the chat note)
    call = next(b for b in first.content if b.type == "tool_use")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "20"}]},
    ]
    counted = client.messages.count_tokens(messages=messages, **kw)
    assert len(trajectory(router, session["session_id"])) == 1
    engine.script.append(renderer.encode(ANSWER))
    second = client.messages.create(max_tokens=200, messages=messages, **kw)
    assert second.mixfleet["extends"]
    assert second.usage.input_tokens == counted.input_tokens
    # the no-thinking form is counted in that form
    off = {"type": "disabled"}
    counted = client.messages.count_tokens(messages=messages[:1], thinking=off, **kw)
    third = client.messages.create(max_tokens=4, messages=messages[:1], thinking=off, **kw)
    assert third.usage.input_tokens == counted.input_tokens


def test_anthropic_count_tokens_refusals(router, session):
    client = _anthropic(router, session)
    with pytest.raises(anthropic.BadRequestError, match="speed"):
        client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}], speed="fast")
    gone = {
        **session,
        "anthropic_base_url": session["anthropic_base_url"].replace(session["session_id"], "x"),
    }
    with pytest.raises(anthropic.NotFoundError, match="unknown session"):
        _anthropic(router, gone).messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )


def test_openai_models(router, session):
    client = _openai(router, session)
    (model,) = client.models.list().data
    assert isinstance(model, openai.types.Model)
    assert model.id == "mixfleet" and model.object == "model" and model.created > 0
    assert client.models.retrieve("mixfleet") == model
    with pytest.raises(openai.NotFoundError) as info:  # as OpenAI answers a model it does not serve
        client.models.retrieve("tiny")
    assert info.value.code == "model_not_found" and info.value.type == "invalid_request_error"
    assert info.value.body["message"] == "The model `tiny` does not exist or you do not have access to it."
    # a turn naming that model still reaches the session's model, and echoes the name
    assert client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1).model == "tiny"


def test_anthropic_models(router, session):
    client = _anthropic(router, session)
    page = client.models.list()
    (model,) = page.data
    assert isinstance(model, anthropic.types.ModelInfo)
    assert model.id == "mixfleet" and model.type == "model" and model.created_at.year >= 2024
    assert not page.has_next_page()
    assert client.models.retrieve("mixfleet") == model
    with pytest.raises(anthropic.NotFoundError) as info:
        client.models.retrieve("claude-x")
    assert info.value.body["error"] == {"type": "not_found_error", "message": "model: claude-x"}
    assert client.messages.create(model="claude-x", messages=HELLO, max_tokens=1).model == "claude-x"


def test_models_of_an_unknown_session(router, session):
    gone = {
        k: v.replace(session["session_id"], "nope") if k.endswith("url") else v for k, v in session.items()
    }
    with pytest.raises(openai.NotFoundError, match="unknown session"):
        _openai(router, gone).models.list()
    with pytest.raises(anthropic.NotFoundError, match="unknown session"):
        _anthropic(router, gone).models.list()

"""Thinking turned off with the official clients: Anthropic's ``thinking: {"type": "disabled"}``
and OpenAI's ``reasoning_effort: "none"`` render the template's no-thinking form (Qwen3's empty
think block after the generation prompt), and a conversation in it extends the session exactly."""

from __future__ import annotations

import anthropic
import openai
import pytest

from router.chat.renderers import Message
from tests.chat.conftest import trajectory

NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_anthropic_thinking_disabled_is_the_no_thinking_form(router, engine, session, renderer):
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key, max_retries=0)
    kw = {"model": "m", "max_tokens": 4, "thinking": {"type": "disabled"}, "extra_body": {"temperature": 0.0}}
    messages = [{"role": "user", "content": "Hi"}]
    first = client.messages.create(messages=messages, **kw)
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "More"}]
    second = client.messages.create(messages=messages, **kw)
    assert second.mixfleet["extends"] is True
    with client.messages.stream(messages=[{"role": "user", "content": "Hi"}], **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.text) for b in streamed.content] == [(b.type, b.text) for b in first.content]
    adaptive = client.messages.create(messages=messages[:1], **{**kw, "thinking": {"type": "adaptive"}})
    turns = trajectory(router, session["session_id"])
    head = renderer.without_thinking().head([Message("user", "Hi")], ())
    assert turns[0]["input_ids"] == head and renderer.decode(head).endswith(NO_THINKING)
    assert turns[1]["input_ids"][: len(head) + len(turns[0]["output_ids"])] == head + turns[0]["output_ids"]
    assert renderer.decode(turns[1]["input_ids"]).endswith(NO_THINKING)
    assert turns[2]["input_ids"] == head and turns[2]["output_ids"] == turns[0]["output_ids"]  # greedy
    assert turns[3]["input_ids"] == renderer.head([Message("user", "Hi")], ()) and adaptive.content
    with pytest.raises(anthropic.BadRequestError, match="thinking.type: 'enabled' cannot be honoured"):
        client.messages.create(
            messages=messages[:1], **{**kw, "thinking": {"type": "enabled", "budget_tokens": 1024}}
        )


def test_openai_reasoning_effort_none_is_the_no_thinking_form(router, engine, session, renderer):
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=router.key, max_retries=0)
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, reasoning_effort="none"
    )
    (turn,) = trajectory(router, session["session_id"])
    assert turn["input_ids"] == renderer.without_thinking().head([Message("user", "Hi")], ())
    with pytest.raises(openai.BadRequestError, match="reasoning_effort: 'high' cannot be honoured") as info:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, reasoning_effort="high"
        )
    assert info.value.param == "reasoning_effort"


def test_switching_the_form_renders_the_conversation_whole(router, engine, session, renderer):
    """A request in the other form than the session's last chat turn is not resumed from its
    chat note: it renders the conversation whole, in its own form, as any router process would
    without the note — so the earlier turn, sampled after the other generation prompt, is no
    longer the context, and the turn is a fork, the same either way."""
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=router.key, max_retries=0)
    kw = {"model": "m", "max_tokens": 4, "extra_body": {"temperature": 0.0}}
    messages = [{"role": "user", "content": "Hi"}]
    first = client.messages.create(messages=messages, thinking={"type": "disabled"}, **kw)
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "More"}]
    second = client.messages.create(messages=messages, **kw)
    assert second.mixfleet["extends"] is False
    turns = trajectory(router, session["session_id"])
    assert turns[1]["fork"] is not None
    assert turns[1]["input_ids"][: len(turns[0]["input_ids"])] != turns[0]["input_ids"]  # default form

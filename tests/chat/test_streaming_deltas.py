"""The content deltas of a streamed chat reply (router.chat.streaming.TextDeltas), per renderer
family (the local byte-level tokenizer and a Qwen3-style BPE one, as in test_renderers): one
delta per token that shows new text, whole UTF-8 characters only, reasoning and tool-call markup
held back, the same deltas whether the ids come one by one or all at once."""

from __future__ import annotations

import pytest

from router.chat.renderers import load_renderer
from router.chat.streaming import Reasoning, TextDeltas
from tests.chat.conftest import reasoning_opened
from tests.chat.test_renderers import _qwen3_dir, _sample, renderer  # noqa: F401 (the parametrized fixture)
from weight_sync.base_model import write_tokenizer


def _one_by_one(renderer, ids: list[int]) -> list[str]:  # noqa: F811
    deltas = TextDeltas(renderer)
    return [d for tok in ids for d in deltas.feed([tok])]


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("It is 20 degrees in Paris.", "It is 20 degrees in Paris."),
        ("  Héllo wörld, ça va? 日本 ", "Héllo wörld, ça va? 日本"),  # stripped; whole characters
        ("a <b> c", "a <b> c"),  # a '<' that becomes no markup is shown once ruled out
        ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "Let me check."),
        ("<think>\nreasoning\n</think>\n\nThe answer.", ""),
        ("Before <think>x</think> after", "Before"),  # the content starts with what was shown
        ("An end </think> with no start", "An end"),  # no reasoning opened: all of it is content
    ],
)
def test_deltas_show_the_text_up_to_markup(renderer, text, shown):  # noqa: F811
    ids = _sample(renderer, text)
    deltas = _one_by_one(renderer, ids)
    assert "".join(deltas) == shown
    assert all(deltas) and not any("\ufffd" in d or "<|" in d for d in deltas)
    whole = TextDeltas(renderer)
    assert whole.feed(ids) == deltas and whole.shown == shown  # a pure function of the ids
    assert renderer.parse(ids).content.startswith(shown)  # the tail sends the rest


def test_text_before_reasoning_markup_is_content(renderer):  # noqa: F811
    """What was shown before the markup cannot be taken back, so it is the reply's content streamed
    or not: the parsed content starts with it and the tail sends the rest (``Tail.rest``)."""
    ids = _sample(renderer, "Before <think>x</think> after")
    shown = "".join(_one_by_one(renderer, ids))
    assert shown == "Before"
    reply = renderer.parse(ids)
    assert (reply.content, reply.reasoning) == ("Before  after", "x")  # the sampled text less the block
    assert shown + reply.content[len(shown) :] == reply.content


def test_a_generation_prompt_that_opens_reasoning_shows_only_the_answer(renderer, tmp_path):  # noqa: F811
    """With a template whose generation prompt opens ``<think>`` (Qwen3 thinking-2507 style), the
    sampled reasoning before ``</think>`` shows no content; once ``</think>`` is sampled the parsed
    reasoning comes first, whole, then the answer after it streams, and is the parsed content."""
    assert not renderer.opens_reasoning and not renderer.without_thinking().opens_reasoning
    root = tmp_path / renderer.family
    if renderer.family == "local":
        root.mkdir()
        write_tokenizer(root)
    else:
        _qwen3_dir(root)
    thinking = load_renderer(reasoning_opened(root, tmp_path / "opened"), renderer.family)
    assert thinking.opens_reasoning
    ids = _sample(thinking, "Let me see.\n</think>\n\nIt is blue.")
    deltas = _one_by_one(thinking, ids)
    reply = thinking.parse(ids)
    assert deltas[0] == Reasoning("Let me see.") == Reasoning(reply.reasoning)  # first, as sampled
    assert "".join(deltas[1:]) == reply.content == "It is blue."
    assert len(deltas) > 3  # the answer streams token by token
    whole = TextDeltas(thinking)
    assert whole.feed(ids) == deltas and whole.reasoned


def test_one_delta_per_token_of_plain_text(renderer):  # noqa: F811
    ids = _sample(renderer, "one two three four five six", stop=False)
    deltas = _one_by_one(renderer, ids)
    trailing_space = sum(1 for tok in ids if renderer.decode([tok]).endswith(" "))
    assert len(deltas) >= len(ids) - trailing_space  # a token ending in a space shows with the next
    assert "".join(deltas) == "one two three four five six"


def test_a_partial_utf8_character_shows_nothing_until_complete(renderer):  # noqa: F811
    ids = _sample(renderer, "é", stop=False)
    deltas = TextDeltas(renderer)
    shown = [deltas.feed([tok]) for tok in ids]
    assert shown[-1] == ["é"] and all(s == [] for s in shown[:-1])

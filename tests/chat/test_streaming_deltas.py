"""The reasoning and content deltas of a streamed chat reply (router.chat.streaming.TextDeltas),
per renderer family (the local byte-level tokenizer and a Qwen3-style BPE one, as in
test_renderers): one delta per token that shows new text, whole UTF-8 characters only, markup held
back, the same deltas whether the ids come one by one or all at once, and always the start of the
reply parsed without streaming (brute force over tag sequences)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from router.chat.renderers import load_renderer
from router.chat.streaming import Reasoning, Tail, TextDeltas
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
        ("Before <think>x</think> after", "Before  after"),  # the content around the reasoning
        ("An end </think> with no start", "An end </think> with no start"),  # no reasoning: text
    ],
)
def test_deltas_show_the_text_up_to_markup(renderer, text, shown):  # noqa: F811
    ids = _sample(renderer, text)
    deltas = [d for d in _one_by_one(renderer, ids) if isinstance(d, str)]
    assert "".join(deltas) == shown
    assert all(deltas) and not any("\ufffd" in d or "<|" in d for d in deltas)
    whole = TextDeltas(renderer)
    assert [d for d in whole.feed(ids) if isinstance(d, str)] == deltas and whole.shown == shown
    assert renderer.parse(ids).content.startswith(shown)  # the tail sends the rest


def test_text_before_reasoning_markup_is_content(renderer):  # noqa: F811
    """What was shown before the markup cannot be taken back, so it is the reply's content streamed
    or not: the parsed content starts with it and the tail sends the rest (``Tail.rest``)."""
    ids = _sample(renderer, "Before <think>x</think> after")
    shown = "".join(d for d in _one_by_one(renderer, ids) if isinstance(d, str))
    assert shown == "Before  after"
    reply = renderer.parse(ids)
    assert (reply.content, reply.reasoning) == ("Before  after", "x")  # the sampled text less the block
    assert shown + reply.content[len(shown) :] == reply.content


def _opened(renderer, tmp_path):  # noqa: F811
    """``renderer``'s family with a template whose generation prompt opens ``<think>``."""
    root = tmp_path / renderer.family
    if renderer.family == "local":
        root.mkdir()
        write_tokenizer(root)
    else:
        _qwen3_dir(root)
    thinking = load_renderer(reasoning_opened(root, tmp_path / "opened"), renderer.family)
    assert thinking.opens_reasoning
    return thinking


def _split(deltas) -> tuple[str, str]:
    return (
        "".join(d.text for d in deltas if isinstance(d, Reasoning)),
        "".join(d for d in deltas if isinstance(d, str)),
    )


@pytest.mark.parametrize("opens", [False, True])
def test_reasoning_streams_token_by_token(renderer, tmp_path, opens):  # noqa: F811
    """The reasoning is streamed as it is sampled, whether the generation prompt opened it (Qwen3
    thinking-2507 style) or the model sampled ``<think>``: one delta per token that shows new
    reasoning, before ``</think>`` is sampled, then the answer token by token; together they are
    the parsed reasoning and content."""
    r = _opened(renderer, tmp_path) if opens else renderer
    assert not renderer.opens_reasoning and not renderer.without_thinking().opens_reasoning
    reasoning = "Let me see what the weather is in Paris."
    ids = _sample(r, ("" if opens else "<think>\n") + reasoning + "\n</think>\n\nIt is blue.")
    deltas = TextDeltas(r)
    per_token = [deltas.feed([tok]) for tok in ids]
    end = next(i for i, tok in enumerate(ids) if "</think>" in r.decode(ids[: i + 1]))
    before_end = [d for ds in per_token[:end] for d in ds]
    assert all(isinstance(d, Reasoning) for d in before_end)
    assert len([d for d in before_end if d.text]) > 5  # token by token, not whole at </think>
    reply = r.parse(ids)
    flat = [d for ds in per_token for d in ds]
    assert _split(flat) == (reply.reasoning, reply.content) == (reasoning, "It is blue.")
    assert flat[0] == Reasoning("") or opens  # the reasoning opens at the sampled <think>
    assert TextDeltas(r).feed(ids) == flat  # a pure function of the ids


PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    '{"name": "f", "arguments": {}}</tool_call>',
    "a b",
    "\n",
    " ",
]


@pytest.mark.parametrize("opens", [False, True])
def test_every_tag_sequence_streams_the_parsed_reply(renderer, tmp_path, opens):  # noqa: F811
    """Brute force over every sequence of up to four pieces of reasoning and tool-call markup and
    text (odd ones too: ``<think>`` twice, ``</think>`` unopened or twice, a call inside the
    reasoning), fed token by token, with and without a stop token: at every step what was shown
    is the start of the parsed reasoning and content, so the deltas followed by the tail's rest
    are the reply without streaming (nothing shown twice, nothing shown that it lacks); a reasoning
    delta comes only for a reply with reasoning, and text before it only when the reply's text
    came first (Anthropic's block order)."""
    r = _opened(renderer, tmp_path) if opens else renderer
    pieces = {p: r.encode(p) for p in PIECES}
    for n in range(5):
        for seq in itertools.product(PIECES, repeat=n):
            _streams_the_parsed_reply(r, seq, pieces)


BEFORE = ["", "<", "<tool_", "a <tool_", "<tool_call"]  # sampled before <think>
INSIDE = ["", "a", "<tool_", "call>"]  # the reasoning
AFTER = ["call>", "tool_call>", ">", "\n", " ", "a", '{"name": "f", "arguments": {}}</tool_call>']


def test_a_tool_call_cut_by_the_reasoning_streams_the_parsed_reply(renderer):  # noqa: F811
    """Brute force over a ``<tool_call>`` cut by the reasoning: every start of one sampled before
    ``<think>``, every reasoning (with markup pieces in it), closed or not, and up to two pieces
    after it that may complete the call in the text the parse joins around the reasoning: the
    same checks as for every tag sequence (a piece that may still become a call is held back
    until what follows the reasoning rules it out)."""
    pieces = {p: renderer.encode(p) for p in {*BEFORE, *INSIDE, *AFTER, "<think>", "</think>"}}
    for before, inside, end in itertools.product(BEFORE, INSIDE, ["", "</think>"]):
        for n in range(3 if end else 1):
            for after in itertools.product(AFTER, repeat=n):
                _streams_the_parsed_reply(renderer, [before, "<think>", inside, end, *after], pieces)


def _streams_the_parsed_reply(r, seq, pieces) -> None:  # noqa: F811
    """Fed token by token, with and without a stop token, what the deltas of ``seq`` show is at
    every step the start of its parsed reasoning and content; the tail adds the rest; a reasoning
    delta comes only for a reply with reasoning, and text before it only when the reply's text
    came first (Anthropic's block order)."""
    for stop in (True, False):
        ids = [i for p in seq for i in pieces[p]] + [r.stop_ids[0]] * stop
        reply = r.parse(ids)
        deltas, flat = TextDeltas(r), []
        for tok in ids:
            flat += deltas.feed([tok])
            reasoning, content = _split(flat)
            assert reply.content.startswith(content) and content == deltas.shown, (seq, flat)
            assert (reply.reasoning or "").startswith(reasoning), (seq, flat)
        opened = [i for i, d in enumerate(flat) if isinstance(d, Reasoning)]
        assert not opened or reply.reasoning is not None, (seq, flat)
        assert reply.text_first == any(isinstance(d, str) for d in flat[: opened[0] if opened else 0])
        tail = Tail(_Result(reply), deltas.shown, deltas.reasoning)
        assert reasoning + tail.reasoning_rest == (reply.reasoning or "")
        assert content + tail.rest == reply.content


@dataclass
class _Result:
    reply: object


@pytest.mark.parametrize(
    ("text", "opens", "reasoning", "content"),
    [
        ("<think>\nr\n</think>\n\nA", False, "r", "A"),
        ("X<think>Y</think>Z", True, "X<think>Y", "Z"),  # a second <think> is reasoning text
        ("<think>a<think>b</think>c", False, "a<think>b", "c"),
        ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # markup after the end is text
        ("An end </think> with no start", False, None, "An end </think> with no start"),
        ("<think>cut short", False, "cut short", ""),  # truncated reasoning is reasoning
        ("cut short", True, "cut short", ""),
        ('<think>r<tool_call>{"name": "f", "arguments": {}}</tool_call>', False, "r", ""),  # a call ends it
        (
            '<think>r<tool_call>{"name": "f"}</tool_call></think>A',
            False,
            'r<tool_call>{"name": "f"}</tool_call>',
            "A",
        ),
    ],
)
def test_odd_tag_sequences_parse(renderer, tmp_path, text, opens, reasoning, content):  # noqa: F811
    r = _opened(renderer, tmp_path) if opens else renderer
    reply = r.parse(_sample(r, text))
    assert (reply.reasoning, reply.content) == (reasoning, content)


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


def _junk(renderer, rng, n: int) -> list[int]:  # noqa: F811
    """``n`` random ids of byte-level tokens: mostly of bytes that are no UTF-8 character alone
    (continuation bytes, long runs of which never complete one, and lead bytes), some ASCII
    letters; none decoding to whitespace or markup, so the content shown is the text decoded."""
    pools: dict[str, list[int]] = {"cont": [], "high": [], "ascii": []}
    for tok in range(2000):  # both tokenizers' vocabularies, and ids past them (which show nothing)
        data = renderer.token_bytes(tok)
        if tok in renderer.stop_ids or not data or renderer.decode([tok]) == "" or len(data) > 3:
            continue
        if all(0x80 <= b < 0xC0 for b in data):
            pools["cont"].append(tok)
        elif all(b >= 0x80 for b in data):
            pools["high"].append(tok)
        elif data.isalpha():
            pools["ascii"].append(tok)
    assert all(pools.values()), {k: len(v) for k, v in pools.items()}
    ids: list[int] = []
    while len(ids) < n:
        kind = rng.choice(["cont", "high", "high", "ascii"])
        ids += [rng.choice(pools[kind]) for _ in range(rng.randrange(1, 40 if kind == "cont" else 4))]
    return ids[:n]


def test_byte_level_junk_streams_the_whole_decode(renderer):  # noqa: F811
    """Random ids whose bytes are mostly no UTF-8 characters (long runs never complete one): the
    content deltas are at every step the start of the text of all the ids decoded at once, the
    replacement characters the tokenizer gives included, and lag behind the text of the ids so far
    by at most what their last few ids decode to (a run that cannot complete a character is shown,
    not held to its end); with the tail they are that text."""
    import random

    rng = random.Random(5)
    for _ in range(20):
        ids = _junk(renderer, rng, 300)
        full = renderer.decode(ids)
        if any(c.isspace() for c in full):
            continue
        deltas, shown = TextDeltas(renderer), ""
        for i, tok in enumerate(ids):
            shown += "".join(d for d in deltas.feed([tok]) if isinstance(d, str))
            assert full.startswith(shown)
            recent = sum(len(renderer.token_bytes(t)) for t in ids[max(i - 7, 0) : i + 1])
            assert len(renderer.decode(ids[: i + 1])) - len(shown) <= recent, (i, len(shown))
        deltas.feed([renderer.stop_ids[0]])
        reply = renderer.parse([*ids, renderer.stop_ids[0]])
        assert reply.content == full and shown + reply.content[len(shown) :] == full

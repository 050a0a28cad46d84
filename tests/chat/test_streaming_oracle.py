"""The streamed deltas (router.chat.streaming.TextDeltas) and the parse of a reply against the
algorithm they replaced, kept here only as a reference oracle: it split the whole text again for
every token (quadratic in the reply's length). Delta by delta, byte for byte: long replies (a
5,000-token reasoning then text, with and without a tool call), every short sequence of pieces of
markup cut where a token can cut it, and random longer ones; and the cost of a token does not grow
with the reply's length. The oracle holds back the start of a ``<tool_call>`` at the end of the
text joined around the reasoning (text sampled before ``<think>`` that text after ``</think>`` may
complete), which the algorithm it replaced showed."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Sequence

import pytest

from router.chat.renderers.base import Renderer, ToolCall, call_id
from router.chat.streaming import Reasoning, TextDeltas
from tests.chat.test_renderers import renderer  # noqa: F401 (the parametrized fixture)
from tests.chat.test_streaming_deltas import _opened

THINK, END, CALL = "<think>", "</think>", "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


# --- the oracle: the algorithm before (router/chat/renderers/qwen3.py, streaming.py) -------------


def _first(text: str, marks: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    found = [(at, m) for m in marks if (at := text.find(m, start)) >= 0]
    return min(found) if found else (-1, None)


def _held(text: str, marks: Sequence[str], start: int = 0) -> int:
    for k in range(min(max(map(len, marks)) - 1, len(text) - start), 0, -1):
        if any(m.startswith(text[-k:]) for m in marks):
            return len(text) - k
    return len(text)


def _split(text: str, opens: bool, final: bool = True) -> tuple[str, str | None, str]:
    if opens:
        pre, start = "", 0
    else:
        at, mark = _first(text, (THINK, END, CALL))
        if mark is None and not final:
            return text[: _held(text, (THINK, CALL))], None, ""
        if mark != THINK:
            return text if final else text[: _held(text, (CALL,))], None, ""
        pre, start = text[:at], at + len(THINK)
    end = text.find(END, start)
    if end >= 0:  # what may become a call is held in the text joined around the reasoning (_shown)
        return pre, text[start:end], text[end + len(END) :]
    call = text.find(CALL, start)
    if final:
        return (pre, text[start:], "") if call < 0 else (pre, text[start:call], text[call:])
    stop = _held(text, (END, CALL), start) if call < 0 else call
    return pre, text[start:stop], ""


def _reply_text(pre: str, reasoning: str | None, post: str) -> tuple[str | None, str]:
    return (None if reasoning is None else reasoning.strip("\n")), pre + post.lstrip("\n")


def _parse(text: str, output_ids: Sequence[int], opens: bool) -> tuple:
    pre, r, post = _split(text, opens)
    reasoning, text = _reply_text(pre, r, post)
    calls: list[ToolCall] = []
    first = text.find(CALL)
    if first >= 0:
        for i, m in enumerate(_CALL.finditer(text)):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                calls = []
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls = []
                break
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(ToolCall(call_id(output_ids, i), obj["name"], json.dumps(args, ensure_ascii=False)))
    content = text[:first].strip() if calls else text.strip()
    return (
        content,
        reasoning,
        tuple(calls),
        reasoning is not None and bool(pre[: _held(pre, (CALL,))].strip()),
    )


def _shown(text: str, opens: bool) -> tuple[str | None, str]:
    reasoning, rest = _reply_text(*_split(text, opens, final=False))
    at = rest.find(CALL)
    if at < 0 and reasoning is not None:
        at = _held(rest, (CALL,))
    return reasoning, (rest if at < 0 else rest[:at]).strip()


class _Oracle:
    """The TextDeltas before: ``shown`` of the whole text so far, for every token."""

    def __init__(self, renderer: Renderer) -> None:  # noqa: F811
        self.renderer = renderer
        self.stops = frozenset(renderer.stop_ids)
        self.ids: list[int] = []
        self.text, self.prefix, self.read = "", 0, 0
        self.shown, self.reasoning = "", None

    def feed(self, ids: Sequence[int]) -> list:
        out: list = []
        for tok in ids:
            self.ids.append(tok)
            if tok in self.stops or not self._decode():
                continue
            reasoning, content = _shown(self.text, self.renderer.opens_reasoning)
            if reasoning is not None and self.reasoning is None:
                self._content(content, out)
                self.reasoning = ""
                out.append(Reasoning(""))
            if reasoning is not None and len(reasoning) > len(self.reasoning or ""):
                out.append(Reasoning(reasoning[len(self.reasoning or "") :]))
                self.reasoning = reasoning
            self._content(content, out)
        return out

    def _content(self, content: str, out: list) -> None:
        if len(content) > len(self.shown) and content.startswith(self.shown):
            out.append(content[len(self.shown) :])
            self.shown = content

    def _decode(self) -> bool:
        decode = self.renderer.decode
        before = decode(self.ids[self.prefix : self.read])
        after = decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return False
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        return True


# --- the checks --------------------------------------------------------------------------------


def _same(r: Renderer, ids: list[int]) -> None:
    """Token by token, the deltas are the oracle's; the parse is the oracle's."""
    new, old = TextDeltas(r), _Oracle(r)
    for i, tok in enumerate(ids):
        assert new.feed([tok]) == old.feed([tok]), (i, r.decode(ids[: i + 1])[-40:])
    assert (new.shown, new.reasoning) == (old.shown, old.reasoning)
    stopped = bool(ids) and ids[-1] in r.stop_ids
    reply = r.parse(ids)
    text = r.decode(ids[:-1] if stopped else ids)
    assert (reply.content, reply.reasoning, reply.tool_calls, reply.text_first) == _parse(
        text, ids, r.opens_reasoning
    )


def _long_reasoning(n: int) -> str:
    rng = random.Random(n)
    words = ["the", "tool", "output", "shows", "a", "failing", "test;", "next", "I", "read", "it"]
    lines = []
    while sum(map(len, lines)) < n:
        lines.append(
            " ".join(rng.choice(words) for _ in range(rng.randrange(3, 14))) + rng.choice([".", ":", ""])
        )
    return "\n".join(lines)


CALL_TEXT = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'


@pytest.mark.parametrize("opens", [False, True])
@pytest.mark.parametrize("tail", ["\n\nThe test fails on line 3.  \n", "\n\nLet me look.\n" + CALL_TEXT])
def test_a_long_reasoning_then_text_streams_as_the_oracle(renderer, tmp_path, opens, tail):  # noqa: F811
    """A 5,000-token reasoning, then the answer (or a tool call), delta by delta."""
    r = _opened(renderer, tmp_path) if opens else renderer
    body = _long_reasoning(40_000)
    ids = r.encode(("" if opens else "<think>\n") + body)[:5000]
    ids += r.encode("\n\n\n</think>" + tail) + [r.stop_ids[0]]
    assert len(ids) > 5000
    _same(r, ids)


PIECES = ["<", "<tool_", "call>", "</", "think>", THINK, END, CALL, "\n", " ", "a", "}</tool_call>"]
SEAMS = [  # text before <think> that text after </think> makes a <tool_call> of
    ["<tool_", THINK, "a", END, "call>"],
    ["a <tool_", THINK, END, "\n\n", "call>", '{"name": "f", "arguments": {}}</tool_call>'],
    [" <", THINK, "\n", END, "\n", "tool_", "call>", " a"],
    ["<tool_", THINK, END, "\n", "\n", "a"],
    ["<tool_call", THINK, END, ">"],
    ["<", THINK, END, "tool_call>"],
]


@pytest.mark.parametrize("opens", [False, True])
def test_every_cut_markup_sequence_streams_as_the_oracle(renderer, tmp_path, opens):  # noqa: F811
    """Every sequence of up to three pieces of markup cut where tokens can cut it (``<tool_`` then
    ``call>``), whitespace and text, with and without a stop token; text before ``<think>`` that
    text after ``</think>`` completes a ``<tool_call>`` of; and random sequences of up to twelve."""
    r = _opened(renderer, tmp_path) if opens else renderer
    pieces = {p: r.encode(p) for p in {*PIECES, *itertools.chain(*SEAMS)}}
    rng = random.Random(7)
    seqs = [s for n in range(4) for s in itertools.product(PIECES, repeat=n)]
    seqs += SEAMS + [[rng.choice(PIECES) for _ in range(rng.randrange(4, 13))] for _ in range(600)]
    for seq in seqs:
        for stop in (True, False):
            _same(r, [i for p in seq for i in pieces[p]] + [r.stop_ids[0]] * stop)

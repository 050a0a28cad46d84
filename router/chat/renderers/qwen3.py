"""The Qwen3 family (the study's model): the checkpoint's own ``tokenizer.json`` and chat template;
assistant turns end with ``<|im_end|>`` (or ``<|endoftext|>``), reasoning is ``<think>...</think>``
before the answer, tool calls are Hermes-style ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` blocks after it (SGLang 0.5.23 parses the same blocks:
``function_call/qwen25_detector.py``; its reasoning parser splits at ``</think>``:
``parser/reasoning_parser.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.chat.renderers.base import Message, Reply, ToolCall, call_id
from router.chat.renderers.template import TemplateRenderer

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")


THINK, END, CALL = "<think>", "</think>", "<tool_call>"


@dataclass(frozen=True)
class Split:
    """A reply's text in parts: ``pre``, the text sampled before the reasoning (all of it when
    the reply has none), ``reasoning`` (None: none), ``post``, the text after the reasoning ends."""

    pre: str
    reasoning: str | None
    post: str


def _first(text: str, marks: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    """Where the first of ``marks`` occurs in ``text`` from ``start`` on, and which (-1, None: none)."""
    found = [(at, m) for m in marks if (at := text.find(m, start)) >= 0]
    return min(found) if found else (-1, None)


def _held(text: str, marks: Sequence[str], start: int = 0) -> int:
    """``len(text)`` less a trailing piece (from ``start`` on) that could still become one of
    ``marks``."""
    for k in range(min(max(map(len, marks)) - 1, len(text) - start), 0, -1):
        if any(m.startswith(text[-k:]) for m in marks):
            return len(text) - k
    return len(text)


def split_reply(text: str, opens: bool, final: bool = True) -> Split:
    """The parts of a reply's ``text`` (stop token removed). The reasoning opens at the start when
    the generation prompt opened it (``opens``), else at a ``<think>`` sampled before any other
    markup (a ``</think>`` or ``<tool_call>`` sampled first: the reply has no reasoning, its markup
    is text); it ends at the first ``</think>`` after that, else at a ``<tool_call>`` in it, which
    starts ``post`` (SGLang 0.5.23 ``srt/parser/reasoning_parser.py`` 175-191: a tool call in an
    unclosed reasoning ends it, and reasoning truncated before its end is reasoning), else at the
    reply's end. Markup inside the reasoning and after its end is text.

    ``final`` False: ``text`` is the start of a reply still being sampled, and each part is what
    the part of every reply that starts with ``text`` starts with (markup that a next token could
    complete is held back; ``reasoning`` None while it is not known to open): a streamed reply
    shows these parts as they grow (:mod:`router.chat.streaming`)."""
    if opens:
        pre, start = "", 0
    else:
        at, mark = _first(text, (THINK, END, CALL))
        if mark is None and not final:  # a <think> may still open the reasoning
            return Split(text[: _held(text, (THINK, CALL))], None, "")
        if mark != THINK:
            return Split(text if final else text[: _held(text, (CALL,))], None, "")
        pre, start = text[:at], at + len(THINK)
    end = text.find(END, start)
    if end >= 0:
        post = text[end + len(END) :]
        return Split(pre, text[start:end], post if final else post[: _held(post, (CALL,))])
    call = text.find(CALL, start)
    if final:
        return Split(pre, text[start:], "") if call < 0 else Split(pre, text[start:call], text[call:])
    stop = _held(text, (END, CALL), start) if call < 0 else call  # a </think> may still follow a call
    return Split(pre, text[start:stop], "")


def reply_text(split: Split) -> tuple[str | None, str]:
    """The reasoning of a reply's parts (newlines around it stripped) and its text less the
    reasoning: ``pre`` followed by ``post`` (its leading newlines stripped)."""
    reasoning = None if split.reasoning is None else split.reasoning.strip("\n")
    return reasoning, split.pre + split.post.lstrip("\n")


def parse_reply(text: str, output_ids: Sequence[int], stopped: bool, opens: bool = False) -> Reply:
    """Reasoning, content and tool calls of a Qwen3-style reply ``text`` (stop token removed): the
    reasoning and the rest as :func:`split_reply` cuts them; text sampled before the ``<think>``
    is content, followed by the text after the reasoning: a streamed reply shows it as content
    before the reasoning comes (:mod:`router.chat.streaming`), and both must give the same
    content. (SGLang 0.5.23's one-shot reasoning parser, ``srt/parser/reasoning_parser.py``
    ``BaseReasoningFormatDetector.detect_and_parse``, folds such text into the reasoning while
    its streaming parser emits it as normal text.) A ``<tool_call>`` block that is not a JSON
    object with a string ``name`` leaves the whole answer as content (no calls), as SGLang's
    detector does."""
    split = split_reply(text, opens)
    reasoning, text = reply_text(split)
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
    text_first = reasoning is not None and bool(split.pre.strip())
    return Reply(content, reasoning, tuple(calls), stopped, text_first)


class Qwen3Renderer(TemplateRenderer):
    """``opens_reasoning``: the template's generation prompt leaves a ``<think>`` open (Qwen3's
    thinking-only templates end it with ``<think>\n``): the reply is reasoning up to ``</think>``."""

    family = "qwen3"
    STOP_TEXTS: tuple[str, ...] = STOP_TEXTS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        probe = [Message("user", "?")]
        prompt = self.render_text(probe, (), gp=True)[len(self.render_text(probe, (), gp=False)) :]
        self.opens_reasoning = prompt.rfind("<think>") > prompt.rfind("</think>")

    @classmethod
    def load(cls, model_dir: str | Path) -> Qwen3Renderer:
        """From a checkpoint directory (``tokenizer.json`` and its chat template)."""
        return cls.from_dir(model_dir, cls.STOP_TEXTS)  # type: ignore[return-value]

    def parse(self, output_ids: Sequence[int]) -> Reply:
        ids = list(output_ids)
        stopped = bool(ids) and ids[-1] in self.stop_ids
        if stopped:
            ids = ids[:-1]
        return parse_reply(self.decode(ids), output_ids, stopped, self.opens_reasoning)

    def shown(self, text: str) -> tuple[str | None, str]:
        """:func:`split_reply` of a reply still being sampled, as :func:`parse_reply` reads the
        parts: its content cut at the first ``<tool_call>`` (which may be a call's) and stripped."""
        reasoning, rest = reply_text(split_reply(text, self.opens_reasoning, final=False))
        at = rest.find(CALL)
        return reasoning, (rest if at < 0 else rest[:at]).strip()

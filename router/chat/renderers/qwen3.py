"""The Qwen3 family (the study's model): the checkpoint's own ``tokenizer.json`` and chat template;
assistant turns end with ``<|im_end|>`` (or ``<|endoftext|>``), reasoning is ``<think>...</think>``
before the answer, tool calls are Hermes-style ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` blocks after it (SGLang 0.5.23 parses the same blocks:
``function_call/qwen25_detector.py``; its reasoning parser splits at ``</think>``:
``parser/reasoning_parser.py``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from router.chat.renderers.base import Message, Reply, Shown, ToolCall, call_id
from router.chat.renderers.growing import WHITESPACE, GrowingText
from router.chat.renderers.template import TemplateRenderer

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")


THINK, END, CALL = "<think>", "</think>", "<tool_call>"


class Split(NamedTuple):
    """Where a reply's parts are in its text (:meth:`ReplyScan.split`): ``pre``, the text sampled
    before the reasoning (all of it when the reply has none), is ``text[:pre]``; ``reasoning``
    (None: none) and ``post``, the text after the reasoning ends, are ``(start, stop)`` spans."""

    pre: int
    reasoning: tuple[int, int] | None
    post: tuple[int, int]


class Parts(NamedTuple):
    """A reply's parts as :func:`parse_reply` reads them (:meth:`ReplyScan.parts`): the span of
    its reasoning, newlines around it stripped (None: none), and its text less the reasoning,
    ``text[:pre]`` followed by ``text[post[0]:post[1]]`` (the text after the reasoning, its leading
    newlines stripped). ``after``: where the text after the reasoning starts, before stripping."""

    reasoning: tuple[int, int] | None
    pre: int
    post: tuple[int, int]
    after: int


@functools.cache
def _prefixes(marks: tuple[str, ...]) -> tuple[int, frozenset[str]]:
    """The longest piece that could still become one of ``marks`` and all such pieces (their
    starts, short of the whole)."""
    return max(map(len, marks)) - 1, frozenset(m[:k] for m in marks for k in range(1, len(m)))


def _held(text: str, marks: tuple[str, ...]) -> int:
    """``len(text)`` less a trailing piece that could still become one of ``marks``."""
    longest, prefixes = _prefixes(marks)
    for k in range(min(longest, len(text)), 0, -1):
        if text[-k:] in prefixes:
            return len(text) - k
    return len(text)


class ReplyScan:
    """The one reading of a reply's text (stop token removed) into its parts, the same for its
    parse (:func:`parse_reply`: the whole text at once) and while it streams
    (:class:`ShownReply`: fed as it is sampled). The text only grows at its end, so each mark's
    first occurrence is looked for once, the search resuming where it stopped, and the parts'
    ends come from :class:`~router.chat.renderers.growing.GrowingText`'s running indices: reading
    the parts again after more text costs the text added (amortized), not the text's length."""

    def __init__(self, opens: bool, text: str = "") -> None:
        self.opens = opens
        self.text = GrowingText(text)
        self.found: dict[tuple[str, int], tuple[int, int]] = {}  # (mark, start): (at, scanned up to)
        self.first: tuple[int, str] | None = None  # the first mark, once found

    def feed(self, text: str) -> None:
        """Append ``text``, the next text of the reply."""
        self.text.append(text)

    def find(self, mark: str, start: int = 0) -> int:
        """``text.find(mark, start)``, resumed where the last search for it stopped."""
        key = (mark, start)
        at, scanned = self.found.get(key, (-1, start))
        size = self.text.size
        if at < 0 and scanned < size:
            frm = max(start, scanned - len(mark) + 1)
            hit = self.text[frm:size].find(mark)
            at = frm + hit if hit >= 0 else -1
            self.found[key] = (at, size)
        return at

    def held(self, marks: tuple[str, ...], start: int = 0) -> int:
        """``len(text)`` less a trailing piece (from ``start`` on) that could still become one of
        ``marks``."""
        size = self.text.size
        tail = self.text[max(start, size - _prefixes(marks)[0]) : size]
        return size - len(tail) + _held(tail, marks)

    def split(self, final: bool = True) -> Split:
        """The parts of the reply. The reasoning opens at the start when the generation prompt
        opened it (``opens``), else at a ``<think>`` sampled before any other markup (a
        ``</think>`` or ``<tool_call>`` sampled first: the reply has no reasoning, its markup is
        text); it ends at the first ``</think>`` after that, else at a ``<tool_call>`` in it,
        which starts ``post`` (SGLang 0.5.23 ``srt/parser/reasoning_parser.py`` 175-191: a tool
        call in an unclosed reasoning ends it, and reasoning truncated before its end is
        reasoning), else at the reply's end. Markup inside the reasoning and after its end is
        text.

        ``final`` False: the text is the start of a reply still being sampled, and each part is
        what the part of every reply that starts with it starts with (markup that a next token
        could complete is held back; ``reasoning`` None while it is not known to open): a streamed
        reply shows these parts as they grow (:mod:`router.chat.streaming`)."""
        n = self.text.size
        if self.opens:
            pre, start = 0, 0
        else:
            if self.first is None:  # once found it stays first: no mark contains another
                found = [(at, m) for m in (THINK, END, CALL) if (at := self.find(m)) >= 0]
                self.first = min(found) if found else None
            at, mark = self.first or (-1, None)
            if mark is None and not final:  # a <think> may still open the reasoning
                return Split(self.held((THINK, CALL)), None, (n, n))
            if mark != THINK:
                return Split(n if final else self.held((CALL,)), None, (n, n))
            pre, start = at, at + len(THINK)
        end = self.find(END, start)
        if end >= 0:
            after = end + len(END)
            return Split(pre, (start, end), (after, n if final else self.held((CALL,), after)))
        call = self.find(CALL, start)
        if final:
            return Split(pre, (start, n), (n, n)) if call < 0 else Split(pre, (start, call), (call, n))
        stop = self.held((END, CALL), start) if call < 0 else call  # a </think> may still follow a call
        return Split(pre, (start, stop), (n, n))

    def parts(self, final: bool = True) -> Parts:
        """:meth:`split`'s parts as :class:`Parts`: the reasoning's newlines around it and the
        leading newlines of the text after it stripped."""
        split, text = self.split(final), self.text
        reasoning = None
        if split.reasoning is not None:
            start, stop = split.reasoning
            first = text.first_not("\n", start, stop)
            reasoning = (first, max(text.last_not("\n", stop) + 1, first))
        after, stop = split.post
        return Parts(reasoning, split.pre, (text.first_not("\n", after, stop), stop), after)


def parse_reply(text: str, output_ids: Sequence[int], stopped: bool, opens: bool = False) -> Reply:
    """Reasoning, content and tool calls of a Qwen3-style reply ``text`` (stop token removed): the
    reasoning and the rest as :meth:`ReplyScan.parts` reads them; text sampled before the ``<think>``
    is content, followed by the text after the reasoning: a streamed reply shows it as content
    before the reasoning comes (:mod:`router.chat.streaming`), and both must give the same
    content. (SGLang 0.5.23's one-shot reasoning parser, ``srt/parser/reasoning_parser.py``
    ``BaseReasoningFormatDetector.detect_and_parse``, folds such text into the reasoning while
    its streaming parser emits it as normal text.) ``text_first``: that text, less a start of a
    ``<tool_call>`` at its end (which the text after the reasoning may complete: a stream shows
    it only after the reasoning), is not all whitespace. A ``<tool_call>`` block that is not a JSON
    object with a string ``name`` leaves the whole answer as content (no calls), as SGLang's
    detector does."""
    parts = ReplyScan(opens, text).parts()
    reasoning = None if parts.reasoning is None else text[slice(*parts.reasoning)]
    pre = text[: parts.pre]
    text = pre + text[slice(*parts.post)]
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
    text_first = reasoning is not None and bool(pre[: _held(pre, (CALL,))].strip())
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

    def shown(self) -> ShownReply:
        return ShownReply(self.opens_reasoning)


class ShownReply(Shown):
    """What a Qwen3-style reply shows while it is sampled: :meth:`ReplyScan.parts` of a reply
    still being sampled (``final`` False), as :func:`parse_reply` reads them: the reasoning, and
    the content, its text less the reasoning (``text[:pre]`` followed by ``text[post]``, the
    "joined" text) cut at its first ``<tool_call>`` (which may be a call's), or else, once the
    reply has reasoning, less a start of one at the joined text's end (text sampled before
    ``<think>`` that the text after ``</think>`` may complete), and stripped. The content is kept
    as where it lies in the joined text (``joined[start:stop]``), never built."""

    def __init__(self, opens: bool) -> None:
        self.scan = ReplyScan(opens)
        self.parts = self.scan.parts(final=False)
        self.start = self.stop = 0

    def feed(self, text: str) -> None:
        self.scan.feed(text)
        self.parts = parts = self.scan.parts(final=False)
        text, pre, (post, end) = self.scan.text, parts.pre, parts.post
        cut = pre + end - post  # where the content is cut: the first <tool_call>, else the end
        call = self.scan.find(CALL) if pre >= len(CALL) else -1
        if 0 <= call <= pre - len(CALL):
            cut = call
        elif post < end:  # one across the seam, else one in the text after the reasoning
            left = text[max(pre - len(CALL) + 1, 0) : pre]
            seam = (left + text[post : min(end, post + len(CALL) - 1)]).find(CALL)
            call = self.scan.find(CALL, parts.after)
            if seam >= 0:
                cut = pre - len(left) + seam
            elif 0 <= call <= end - len(CALL):
                cut = pre + call - post
        # no call: a start of one waits, across the seam too (a longer text after it holds its own)
        near = pre > 0 and parts.reasoning is not None and text.size - post < len(CALL) - 1
        if near and cut == pre + end - post:
            cut = pre + text.size - post - self._held_call(pre, post)
        head = min(pre, cut)  # the part of the content in text[:pre]
        start = text.first_not(WHITESPACE, 0, head)
        if start == head and cut > pre:
            start = pre + text.first_not(WHITESPACE, parts.after, post + cut - pre) - post
        last = text.last_not(WHITESPACE, post + cut - pre) if cut > pre else -1
        last = pre + last - post if last >= post else text.last_not(WHITESPACE, head)
        self.start, self.stop = start, max(last + 1, start)

    def _held_call(self, pre: int, post: int) -> int:
        """How many characters at the end of the joined text (``text[:pre]`` followed by
        ``text[post:]``, all of the text after the reasoning) could still become a
        ``<tool_call>``: one sampled before the reasoning may be completed by the text after it,
        which the parse joins to it."""
        text, k = self.scan.text, len(CALL) - 1
        right = text[max(post, text.size - k) : text.size]
        tail = text[max(pre - k + len(right), 0) : pre] + right
        return len(tail) - _held(tail, (CALL,))

    @property
    def reasoning_size(self) -> int | None:
        span = self.parts.reasoning
        return None if span is None else span[1] - span[0]

    @property
    def content_size(self) -> int:
        return self.stop - self.start

    def reasoning(self, start: int) -> str:
        assert self.parts.reasoning is not None
        first, stop = self.parts.reasoning
        return self.scan.text[first + start : stop]

    def content(self, start: int) -> str:
        text, pre, post = self.scan.text, self.parts.pre, self.parts.post[0]
        first = self.start + start
        return text[first : min(self.stop, pre)] + text[post + max(first - pre, 0) : post + self.stop - pre]

"""A chat turn streamed as it is sampled, for both chat APIs' ``stream: true``.

:func:`stream_chat` runs the turn (:func:`router.chat.service.run_chat` with ``on_tokens``) and
yields, in order, the turn's :class:`~router.chat.service.Head`, one content delta (a ``str``)
per sampled token that shows new text (after a generation prompt that opens the reasoning, the
:class:`Reasoning`, whole, before the first of them), and a :class:`Tail` (the recorded turn and
what was shown). Those items are a pure function of the sampled ids and the head, whether the ids arrive
one by one from the engine or all at once from a turn recorded earlier (an ``Idempotency-Key``
replay, or a turn that ended before its first token came): the routes render them into the same
bytes either way.

What the content deltas show (:class:`TextDeltas`): the text of the ids so far, decoded by the
renderer's tokenizer incrementally (a token that ends inside a UTF-8 character shows nothing until
the character is complete; a stop id, a stop sequence's too, shows nothing), cut at the first
markup text of the renderer's family (:attr:`~router.chat.renderers.Renderer.markup`: reasoning
and tool-call openers) and short of a trailing piece that could still become one, without leading
or trailing whitespace. From the first markup on nothing more shows while sampling; the tail then carries
the parsed structure (reasoning, the rest of the content, tool calls). Text shown before markup is
the start of the parsed content (the family's parser keeps text sampled before ``<think>`` as
content), so the content streamed and the content answered without streaming are the same. After a
generation prompt that opens the reasoning (:attr:`~router.chat.renderers.Renderer.opens_reasoning`)
the reply is sampled reasoning first: once the reasoning's end is sampled, the parsed reasoning is
yielded whole (a :class:`Reasoning`), then the text after its end is shown by the same rules, so
the stream gives the reasoning before the content, in the order sampled, as the answer without
streaming does.

Errors: before the first token, :func:`stream_chat` raises the turn's ApiError (the route answers
it as a status); after it, the iterator raises it (the route ends the stream with an error event;
nothing was recorded). A cancelled iteration (the client went away) cancels the turn, which
aborts its engine request (:func:`router.dispatch.run_turn`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass

from router.chat.conversation import matched_stop
from router.chat.renderers import Renderer
from router.chat.service import ChatRequest, ChatResult, Head, request_renderer, request_stops, run_chat
from router.context import RouterContext

_REPLACEMENT = "\ufffd"  # what the tokenizer decodes an incomplete UTF-8 sequence to


@dataclass(frozen=True)
class Reasoning:
    """The reply's reasoning (as :meth:`~router.chat.renderers.Renderer.parse` reads it), streamed
    whole once its end was sampled, after a generation prompt that opens the reasoning."""

    text: str


@dataclass(frozen=True)
class Tail:
    """The end of a streamed turn: its result, the content the deltas showed and whether its
    reasoning was streamed (a :class:`Reasoning`)."""

    result: ChatResult
    shown: str
    reasoned: bool = False

    @property
    def rest(self) -> str:
        """The reply's content not shown yet (all of it when it does not begin with what was
        shown: text sampled before reasoning markup was shown and stays shown)."""
        content = self.result.reply.content
        return content[len(self.shown) :] if content.startswith(self.shown) else content


class TextDeltas:
    """The content deltas of a reply's ids (module docstring), fed in sampling order. ``stops``:
    stop ids beside the renderer's, shown as nothing (the request's stop sequences: one ends the
    turn, and is no part of the reply's text)."""

    def __init__(self, renderer: Renderer, stops: Collection[int] = ()) -> None:
        self.renderer = renderer
        self.stops = frozenset(renderer.stop_ids) | frozenset(stops)
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read]
        self.prefix = 0  # the ids decoded again with each new one, for the tokenizer's context
        self.read = 0
        self.shown = ""
        self.frozen = False  # markup seen: nothing more shows
        self.reasoned = False  # the reasoning opened by the generation prompt was streamed

    def feed(self, ids: Sequence[int]) -> list[str | Reasoning]:
        """The deltas of ``ids``, the next sampled ids: one per id that shows new text, after the
        :class:`Reasoning` when its end is among them (module docstring)."""
        out: list[str | Reasoning] = []
        for tok in ids:
            self.ids.append(tok)
            if self.frozen or tok in self.stops or not self._decode():
                continue
            if (reasoning := self._closed_reasoning()) is not None:
                out.append(reasoning)
            visible = self._visible()
            if len(visible) > len(self.shown) and visible.startswith(self.shown):
                out.append(visible[len(self.shown) :])
                self.shown = visible
        return out

    def _decode(self) -> bool:
        """Extend ``text`` by the newest id; False while it ends inside a UTF-8 character."""
        decode = self.renderer.decode
        before = decode(self.ids[self.prefix : self.read])
        after = decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT) or not after.startswith(before):
            return False
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        return True

    def _closed_reasoning(self) -> Reasoning | None:
        """The reasoning, once, when the text just decoded closes the one the generation prompt
        opened."""
        end = self.renderer.reasoning_end
        if self.reasoned or not self.renderer.opens_reasoning or end is None or end not in self.text:
            return None
        self.reasoned = True
        reasoning = self.renderer.parse(self.ids).reasoning
        return None if reasoning is None else Reasoning(reasoning)

    def _visible(self) -> str:
        """``text`` cut at the first markup (then frozen) or short of a possible one, stripped;
        after a generation prompt that opens the reasoning, only the text after its end."""
        text, markup = self.text, self.renderer.markup
        end = self.renderer.reasoning_end
        if self.renderer.opens_reasoning and end is not None:
            at = text.find(end)
            if at < 0:
                return ""
            text = text[at + len(end) :]
        cuts = [i for i in (text.find(m) for m in markup) if i >= 0]
        if cuts:
            self.frozen = True
            return text[: min(cuts)].strip()
        longest = max(map(len, markup), default=0)
        for k in range(min(longest - 1, len(text)), 0, -1):
            if any(m.startswith(text[-k:]) for m in markup):
                return text[:-k].strip()
        return text.strip()


class _Arrivals:
    """The ids the turn sampled that the response has not taken yet."""

    def __init__(self) -> None:
        self.items: list[tuple[Head, list[int]]] = []
        self.event = asyncio.Event()

    async def put(self, head: Head, ids: list[int]) -> None:
        self.items.append((head, ids))
        self.event.set()

    def take(self) -> list[tuple[Head, list[int]]]:
        items, self.items = self.items, []
        self.event.clear()
        return items

    async def wait(self, task: asyncio.Future) -> None:
        """Until some ids arrived or ``task`` ended."""
        got = asyncio.ensure_future(self.event.wait())
        try:
            await asyncio.wait({task, got}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            got.cancel()


Item = Head | str | Reasoning | Tail
"""What :func:`stream_chat` yields (module docstring)."""


async def stream_chat(
    ctx: RouterContext, session_id: str, req: ChatRequest, key: str | None
) -> AsyncIterator[Item]:
    """The items of the turn (module docstring), once its first token was sampled or it ended;
    raises the turn's ApiError when it failed before its first token."""
    renderer = request_renderer(ctx.config, req)
    arrivals = _Arrivals()
    task = asyncio.ensure_future(run_chat(ctx, session_id, req, key, arrivals.put))
    try:
        await arrivals.wait(task)
    except BaseException:
        await _cancel(task)
        raise
    if task.done():
        return _recorded(renderer, task.result())
    return _live(TextDeltas(renderer, request_stops(renderer, req)), arrivals, task)


async def _cancel(task: asyncio.Future) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _recorded(renderer: Renderer, result: ChatResult) -> AsyncIterator[Item]:
    """The items of a turn recorded before any of its tokens was streamed."""
    yield Head(result.turn["turn"], result.created, result.prompt_tokens)
    deltas = recorded_deltas(renderer, result)
    for delta in deltas.feed(result.output_ids):
        yield delta
    yield Tail(result, deltas.shown, deltas.reasoned)


def recorded_deltas(renderer: Renderer, result: ChatResult) -> TextDeltas:
    """The :class:`TextDeltas` of a recorded turn, fed nothing yet (its stop sequence, if one
    ended it, shows nothing)."""
    matched = matched_stop(result.turn.get("finish_reason"))
    return TextDeltas(renderer, () if matched is None else (matched,))


def text_before_reasoning(result: ChatResult) -> bool:
    """Whether the turn sampled text before its reasoning: what its stream shows before the
    reasoning block (not after a generation prompt that opens the reasoning, where the text
    shown follows it). The Anthropic reply's blocks follow this order streamed or not."""
    renderer = result.renderer
    if result.reply.reasoning is None or renderer.opens_reasoning:
        return False
    deltas = recorded_deltas(renderer, result)
    deltas.feed(result.output_ids)
    return bool(deltas.shown)


async def _live(deltas: TextDeltas, arrivals: _Arrivals, task: asyncio.Future) -> AsyncIterator[Item]:
    """The items of a turn whose ids arrive while ``task`` runs it, shown by ``deltas``."""
    try:
        batch = arrivals.take()
        yield batch[0][0]
        while batch:
            for _, ids in batch:
                for delta in deltas.feed(ids):
                    yield delta
            if not task.done():
                await arrivals.wait(task)
            batch = arrivals.take()
        yield Tail(task.result(), deltas.shown, deltas.reasoned)
    finally:
        await _cancel(task)

"""A chat turn streamed as it is sampled, for both chat APIs' ``stream: true``.

:func:`stream_chat` runs the turn (:func:`router.chat.service.run_chat` with ``on_tokens``) and
yields, in order, the turn's :class:`~router.chat.service.Head`, the deltas of the reply's
reasoning (a :class:`Reasoning`) and of its content (a ``str``) as its tokens are sampled, and a
:class:`Tail` (the recorded turn and what was shown). Those items are a pure function of the
sampled ids and the head, whether the ids arrive one by one from the engine or all at once from a
turn recorded earlier (an ``Idempotency-Key`` replay, or a turn that ended before its first token
came): the routes render them into the same bytes either way.

What the deltas show (:class:`TextDeltas`): the text of the ids so far, decoded by the renderer's
tokenizer incrementally (a token that ends inside a UTF-8 character shows nothing until the
character is complete, or until the next ids rule it out, and then shows what the tokenizer
decodes the bytes to, as in the whole reply's text; a stop id, a stop sequence's too, shows
nothing), split into reasoning and
content by the renderer as the reply will be parsed
(:meth:`~router.chat.renderers.base.Renderer.shown`: only what no later token can change, so
markup a next token could complete, trailing whitespace and a possible tool call wait; fed each
token's text, it costs in proportion to that text, not to the reply so far). Each id
that shows new text gives a delta: the reasoning's growth (the first :class:`Reasoning`, possibly
empty, says the reasoning opened: at the first token after a generation prompt that opens it, else
at a sampled ``<think>``), then or else the content's. What was shown is always the start of
what :meth:`~router.chat.renderers.base.Renderer.parse` gives, so the reasoning deltas followed by
:attr:`Tail.reasoning_rest` are the answer's reasoning and the content deltas followed by
:attr:`Tail.rest` its content, streamed or not, for any sequence of ids.

Errors: before the first token, :func:`stream_chat` raises the turn's ApiError (the route answers
it as a status); after it, the iterator raises it, or whatever else failed, a state store gone
while the turn is recorded included (the route ends the stream with an error event,
:func:`router.chat.errors.stream_error`; nothing was recorded). A cancelled iteration (the client
went away) cancels the turn, which aborts its engine request (:func:`router.dispatch.run_turn`).
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
_SETTLED = 3  # ids after which every UTF-8 character that began before them has ended


@dataclass(frozen=True)
class Reasoning:
    """A delta of the reply's reasoning (module docstring)."""

    text: str


@dataclass(frozen=True)
class Tail:
    """The end of a streamed turn: its result and what the deltas showed of its content
    (``shown``) and of its reasoning (``reasoning``; None: no reasoning delta came)."""

    result: ChatResult
    shown: str
    reasoning: str | None = None

    @property
    def rest(self) -> str:
        """The reply's content not shown yet (what was shown is its start)."""
        return self.result.reply.content[len(self.shown) :]

    @property
    def reasoning_rest(self) -> str:
        """The reply's reasoning not shown yet (what was shown is its start)."""
        return (self.result.reply.reasoning or "")[len(self.reasoning or "") :]


class TextDeltas:
    """The deltas of a reply's ids (module docstring), fed in sampling order. ``stops``: stop ids
    beside the renderer's, shown as nothing (the request's stop sequences: one ends the turn, and
    is no part of the reply's text). A token costs time in proportion to its own text, not to the
    reply's length: its decoded text is fed to the renderer's
    :class:`~router.chat.renderers.base.Shown`, which is asked only for each part's growth."""

    def __init__(self, renderer: Renderer, stops: Collection[int] = ()) -> None:
        self.renderer = renderer
        self.stops = frozenset(renderer.stop_ids) | frozenset(stops)
        self.ids: list[int] = []
        self.view = renderer.shown()  # fed the decoded text of ids[:read]
        self.prefix = 0  # the ids decoded again with each new one, for the tokenizer's context
        self.read = 0
        self.content: list[str] = []  # the content deltas
        self.shown_size = 0
        self.reasoning_deltas: list[str] | None = None  # None: the reasoning has not opened
        self.reasoning_size = 0

    @property
    def shown(self) -> str:
        """The content shown."""
        return "".join(self.content)

    @property
    def reasoning(self) -> str | None:
        """The reasoning shown (None: it has not opened)."""
        return None if self.reasoning_deltas is None else "".join(self.reasoning_deltas)

    def feed(self, ids: Sequence[int]) -> list[str | Reasoning]:
        """The deltas of ``ids``, the next sampled ids (module docstring). Within one id the
        content sampled before the reasoning opens comes first, else the reasoning's growth."""
        out: list[str | Reasoning] = []
        view = self.view
        for tok in ids:
            self.ids.append(tok)
            if tok in self.stops or not self._decode():
                continue
            size = view.reasoning_size
            if size is not None:
                if self.reasoning_deltas is None:
                    self._content(out)
                    self.reasoning_deltas = []
                    out.append(Reasoning(""))
                if size > self.reasoning_size:
                    delta = view.reasoning(self.reasoning_size)
                    out.append(Reasoning(delta))
                    self.reasoning_deltas.append(delta)
                    self.reasoning_size = size
            self._content(out)
        return out

    def _content(self, out: list[str | Reasoning]) -> None:
        """The content's growth, if it grew (a longer content starts with the one shown:
        :class:`~router.chat.renderers.base.Shown`)."""
        size = self.view.content_size
        if size > self.shown_size:
            delta = self.view.content(self.shown_size)
            out.append(delta)
            self.content.append(delta)
            self.shown_size = size

    def _decode(self) -> bool:
        """Feed the view the text of the ids not fed yet that no later id can change; False when
        there is none. That is all of it unless it ends with a replacement character (an id
        ending inside a UTF-8 character, or bytes that are none); then the text of the ids but
        the last :data:`_SETTLED`, if no character runs across them (its text decoded alone
        joins the rest's to the text of both): a character is at most 4 bytes and an id at
        least one, so whatever began before them has ended in them, and its text is final, the
        replacement characters the tokenizer gives for bytes that are no character included (the
        text of the whole reply starts with it). Decodes only the ids from the one before the
        last text fed on: a few, unless a run of ids decodes to nothing."""
        decode, ids = self.renderer.decode, self.ids
        before = decode(ids[self.prefix : self.read])
        after, read = decode(ids[self.prefix :]), len(ids)
        if after.endswith(_REPLACEMENT):
            read -= _SETTLED
            if read <= self.read:
                return False
            head, rest = decode(ids[self.prefix : read]), decode(ids[read:])
            if not rest or head + rest != after:  # a character runs across ids[read]
                return False
            after = head
        if len(after) <= len(before) or not after.startswith(before):
            return False
        self.view.feed(after[len(before) :])
        self.prefix, self.read = self.read, read
        return True


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
    yield Tail(result, deltas.shown, deltas.reasoning)


def recorded_deltas(renderer: Renderer, result: ChatResult) -> TextDeltas:
    """The :class:`TextDeltas` of a recorded turn, fed nothing yet (its stop sequence, if one
    ended it, shows nothing)."""
    matched = matched_stop(result.turn.get("finish_reason"))
    return TextDeltas(renderer, () if matched is None else (matched,))


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
        yield Tail(task.result(), deltas.shown, deltas.reasoning)
    finally:
        await _cancel(task)

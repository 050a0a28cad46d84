"""One chat turn, shared by the OpenAI and Anthropic routes: render the context
(:mod:`router.chat.conversation`), run and record it as an ordinary token-in-token-out turn
(:func:`router.idempotency.answer_turn`), parse the sampled ids.

The chat model is the checkpoint directory of the router's configuration,
:attr:`router.config.RouterConfig.chat_model` (``mixfleet router --chat-model DIR``; its
``tokenizer.json`` and chat template); ``chat_family`` (``--chat-family``) picks the renderer
family, else :func:`router.chat.renderers.load_renderer` detects it. Without one the chat routes
answer 503.

A turn costs what it appends: the session is read with its context and chat note in one step
(:meth:`~router.state.base.StateStore.get_chat_state`), the context of the session's last turn is
resumed from them (:func:`router.chat.conversation.resume`) and only the messages after it are
rendered; after recording, the turn's note is kept (:meth:`~router.state.base.StateStore.put_chat_note`).
Rendering runs on a worker thread, decoding the trajectory too when the conversation is rendered
whole (no note to resume from: a first turn, an edited history), so that a long history or a large
new message (a tool's output) does not hold up the router's other requests (its replicas'
heartbeats among them); the renderers hold no mutable state and tokenize without the GIL.

Concurrent turns of one session: the turn's input is always the whole context rendered against the
state read (``input_ids``, never ``append_ids``, which the turn store would place on whatever
context it reads later). When another turn of the session is recorded in between, that input no
longer extends the stored context and the turn is recorded as a fork
(:func:`router.turns.record_turn`): the engine sees exactly the conversation the request sent, and
the note of the later turn replaces the earlier one's, never the reverse.

Retries (``Idempotency-Key``, :mod:`router.idempotency`): a turn recorded under the key is
answered without rendering or sampling (the key reused with a different request, :func:`chat_digest`,
is the API's 400); the answer is a function of the recorded turn and the
request (the prompt length is the recorded input's, ``extends`` is whether the turn was recorded
without a fork, OpenAI's ``created`` is the session's creation time), so a retry with the same
body gets the first answer byte for byte from any router process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic

from core.jsonio import loads
from router.chat.conversation import (
    Note,
    build_context,
    digests,
    from_trajectory,
    matched_stop,
    reply_ids,
    resume,
)
from router.chat.renderers import Message, Renderer, RenderError, Reply, Tool, load_renderer
from router.config import RouterConfig
from router.context import RouterContext
from router.errors import ApiError
from router.idempotency import answer_turn, recorded, request_digest
from router.records import decode_turn
from router.schemas import SamplingParams, TurnRequest
from router.state.base import ChatState
from router.turn_data import TurnData


@functools.lru_cache(maxsize=4)
def _load(path: str, family: str | None) -> Renderer:
    return load_renderer(path, family)


def chat_renderer(config: RouterConfig) -> Renderer:
    """The renderer of ``config``'s chat model (module docstring), loaded once per process;
    ApiError 503 when none is configured or it cannot be loaded."""
    if config.chat_model is None:
        raise ApiError(503, "this router has no chat model: start it with --chat-model <checkpoint dir>")
    try:
        return _load(str(config.chat_model), config.chat_family)
    except (OSError, ValueError) as exc:
        raise ApiError(503, f"the chat model {config.chat_model} cannot be loaded: {exc}") from None


def request_renderer(config: RouterConfig, req: ChatRequest) -> Renderer:
    """The renderer of ``config``'s chat model in the form ``req`` asks for (``no_thinking``);
    ApiError 400 naming what cannot be honoured."""
    renderer = chat_renderer(config)
    if req.no_thinking is None:
        return renderer
    try:
        return renderer.without_thinking()
    except RenderError as exc:
        raise ApiError(400, f"{req.no_thinking}: {exc}") from None


@dataclass(frozen=True)
class ChatRequest:
    """A chat turn in either API's terms. ``stop``: stop sequences (single tokens). ``supports``:
    the turn's records carry their sampling supports (OpenAI's ``top_logprobs`` are ranked from
    them; a turn's answer leaves them out otherwise, as ``/turns`` does). ``no_thinking``: the
    request's parameter that turned thinking off (Anthropic's ``thinking.type``, OpenAI's
    ``reasoning_effort``): the context ends with the template's no-thinking form of the generation
    prompt (:meth:`~router.chat.renderers.base.Renderer.without_thinking`; a 400 naming the
    parameter when it has none); None: the template's default."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    supports: bool = False
    no_thinking: str | None = None


@dataclass(frozen=True)
class Head:
    """What a streamed answer starts with, known before the first token: the turn's index (the
    session's next turn when it started; a turn of the session recorded concurrently moves the
    recorded one on), the session's creation time (seconds) and the input's length."""

    turn: int
    created: int
    prompt_tokens: int


HeadCallback = Callable[[Head, list[int]], Awaitable[None]]
"""Called with the turn's :class:`Head` and each batch of new output ids as they are sampled."""


@dataclass(frozen=True)
class ChatResult:
    """The recorded turn (its JSON answer, :func:`router.turns.record_turn`), the reply parsed
    from it, the length of its input, whether it extended the session (recorded without a fork),
    which stop sequence ended it (None: none did) and the session's creation time (seconds)."""

    turn: dict[str, Any]
    reply: Reply
    prompt_tokens: int
    extends: bool
    stop_sequence: str | None
    renderer: Renderer
    created: int

    @property
    def output_ids(self) -> list[int]:
        return self.turn["output_ids"]

    @property
    def finish_type(self) -> str:
        """``stop`` (a stop token or sequence), ``length`` or ``unknown``."""
        reason = self.turn.get("finish_reason") or {}
        return str(reason.get("type") or "unknown")


async def run_chat(
    ctx: RouterContext,
    session_id: str,
    req: ChatRequest,
    key: str | None = None,
    on_tokens: HeadCallback | None = None,
) -> ChatResult:
    """Render, run, record and parse one chat turn of ``session_id`` (once per ``key``, module
    docstring); ``on_tokens`` gets the new ids of a turn this call samples as they are sampled.
    ApiError 400 for what the renderer cannot represent, 404 / 409 for an unknown or finished
    session; the turn's own refusals as :func:`record_turn` raises them."""
    renderer = request_renderer(ctx.config, req)
    stops = request_stops(renderer, req)
    digest = None if key is None else chat_digest(req)
    if key is not None and (first := await recorded(ctx, session_id, key, digest)) is not None:
        return await _replay(ctx, session_id, renderer, first, stops)
    state, chain, input_ids, whole = await _render(ctx, session_id, renderer, req)
    spec = _turn_request(input_ids, req, [*renderer.stop_ids, *stops]).spec()
    head = Head(state.session.n_turns, int(state.session.created_at), len(input_ids))
    sink = None if on_tokens is None else functools.partial(on_tokens, head)
    done = await answer_turn(ctx, session_id, spec, key, sink, digest=digest)
    turn, prompt = loads(done.answer), done.turn.prompt_len
    if done.sampled:
        note = Note(
            len(req.messages), chain[-1], len(turn["output_ids"]), matched_stop(turn.get("finish_reason"))
        )
        await ctx.store.put_chat_note(session_id, turn["turn"], note.encode())
        ctx.metrics.chat_turns.labels(turn["group"], "whole" if whole else "resumed").inc()
    return _result(turn, renderer, prompt, stops, state)


async def count_input(ctx: RouterContext, session_id: str, req: ChatRequest) -> int:
    """How many tokens a turn of ``session_id`` with ``req`` would send the engine as its input now
    (its ``prompt_tokens``): the context :func:`run_chat` renders, rendered the same way, without
    sampling or recording anything. The same refusals as :func:`run_chat` before it samples (400,
    404, 409)."""
    renderer = request_renderer(ctx.config, req)
    request_stops(renderer, req)
    return len((await _render(ctx, session_id, renderer, req))[2])


async def _render(
    ctx: RouterContext, session_id: str, renderer: Renderer, req: ChatRequest
) -> tuple[ChatState, list[str], np.ndarray, bool]:
    """The open session's chat state, the digests of ``req``'s messages, the turn's input ids and
    whether they were rendered whole (no chat note to resume from: module docstring); ApiError 400
    for what the renderer cannot represent, 404 / 409 for an unknown or finished session."""
    held = ctx.context_text.known(session_id)  # the context this process's last turn left
    state = _open(
        ctx, await ctx.store.get_chat_state(session_id, None if held is None else held[0]), session_id
    )
    context = held[1] if state.context is None and held is not None else state.context or b""
    chain = digests(
        f"{renderer.family}/{renderer.form}" if renderer.form else renderer.family, req.tools, req.messages
    )
    try:
        known = resume(state, context, req.messages, chain)
        whole = known is None
        render = functools.partial(build_context, renderer, req.messages, req.tools)
        if known is None:  # the whole conversation
            blobs = await ctx.store.get_turns(session_id)
            known = await asyncio.to_thread(lambda: from_trajectory([decode_turn(b) for b in blobs]))
        input_ids = (await asyncio.to_thread(render, known)).input_ids  # off the event loop
    except RenderError as exc:
        raise ApiError(400, str(exc)) from None
    return state, chain, input_ids, whole


MODEL_ID = "mixfleet"
"""The id the models routes list for a session's one chat model, and the one id either API's model
retrieval answers (another is its 404). A turn names any model (its ``model`` is echoed back:
harnesses send their configured name) and reaches the session's model all the same."""


async def session_created(ctx: RouterContext, session_id: str) -> int:
    """The creation time (seconds) of ``session_id``, open or finished, whose chat model is the
    router's: the models routes' ``created``. ApiError 404 for an unknown session, 503 without a
    chat model (:func:`chat_renderer`)."""
    chat_renderer(ctx.config)
    info = await ctx.store.get_session(session_id)
    if info is None:
        raise ctx.unknown_session(session_id)
    return int(info.created_at)


def chat_digest(req: ChatRequest) -> str:
    """The digest an ``Idempotency-Key`` keeps for a chat request
    (:func:`router.idempotency.request_digest`): the request in both APIs' common form, without
    ``supports`` (how the answer is presented: OpenAI's log-prob options)."""
    fields = dataclasses.fields(req)
    return request_digest({f.name: getattr(req, f.name) for f in fields if f.name != "supports"})


def request_stops(renderer: Renderer, req: ChatRequest) -> dict[int, str]:
    """The request's stop sequences by their token id; ApiError 400 for one that is not one token."""
    try:
        return {renderer.stop_token(s): s for s in req.stop}
    except RenderError as exc:
        raise ApiError(400, str(exc)) from None


async def _replay(
    ctx: RouterContext, session_id: str, renderer: Renderer, first: TurnData, stops: dict[int, str]
) -> ChatResult:
    """The result of the turn recorded under the request's key (the session may be finished since),
    counted as a replay (``mixfleet_router_turn_replays_total``, :mod:`router.idempotency`)."""
    ctx.metrics.turn_replays.labels("found").inc()
    info = await ctx.store.get_session(session_id)
    if info is None:
        raise ctx.unknown_session(session_id)
    turn = first.to_json(session_id, with_input=False)
    return _result(turn, renderer, first.prompt_len, stops, ChatState(info, b""))


def _result(
    turn: dict[str, Any], renderer: Renderer, prompt: int, stops: dict[int, str], state: ChatState
) -> ChatResult:
    matched = matched_stop(turn.get("finish_reason"))
    return ChatResult(
        turn=turn,
        reply=renderer.parse(reply_ids(renderer, turn["output_ids"], matched)),
        prompt_tokens=prompt,
        extends=turn["fork"] is None,
        stop_sequence=None if matched is None else stops.get(matched),
        renderer=renderer,
        created=int(state.session.created_at),
    )


def _open(ctx: RouterContext, state: ChatState | None, session_id: str) -> ChatState:
    """The session's chat state, if it exists and is open; else 404 / 409 (as a token turn)."""
    if state is None:
        raise ctx.unknown_session(session_id)
    if state.session.status != "open":
        raise ApiError(409, f"session {session_id!r} is {state.session.status}: it accepts no more turns")
    return state


def _turn_request(input_ids: np.ndarray, req: ChatRequest, stop_ids: Sequence[int]) -> TurnRequest:
    """The token turn of a chat request, validated as ``/turns`` validates one (400 naming the
    field it refuses)."""
    given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed}
    try:
        params = SamplingParams(
            stop_token_ids=sorted(set(stop_ids)),
            max_new_tokens=req.max_tokens,  # None: the context's room, as OpenAI and SGLang's chat
            **{k: v for k, v in given.items() if v is not None},
        )
        return TurnRequest(input_ids=input_ids, sampling_params=params, return_support=req.supports)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "request"
        names = {"max_new_tokens": "max_tokens"}
        raise ApiError(400, f"{names.get(where, where)}: {err.get('msg')}") from None

"""One chat turn, shared by the OpenAI and Anthropic routes: render the context
(:mod:`router.chat.conversation`), run and record it as an ordinary token-in-token-out turn
(:func:`router.turns.record_turn`, full ``input_ids``), parse the sampled ids.

The chat model is the checkpoint directory of the router's configuration,
:attr:`router.config.RouterConfig.chat_model` (``mixfleet router --chat-model DIR``; its
``tokenizer.json`` and chat template); ``chat_family`` (``--chat-family``) picks the renderer
family, else :func:`router.chat.renderers.load_renderer` detects it. Without one the chat routes
answer 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import pydantic

from core.jsonio import loads
from router.chat.conversation import build_context, sampled_turns
from router.chat.renderers import Message, Renderer, RenderError, Reply, Tool, load_renderer
from router.config import RouterConfig
from router.context import RouterContext
from router.errors import ApiError
from router.records import decode_turn
from router.schemas import SamplingParams, TurnRequest
from router.turns import load_open, record_turn


@lru_cache(maxsize=4)
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


@dataclass(frozen=True)
class ChatRequest:
    """A chat turn in either API's terms. ``stop``: stop sequences (single tokens)."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class ChatResult:
    """The recorded turn (its JSON answer, :func:`router.turns.record_turn`), the reply parsed
    from it, the context length and which stop sequence ended it (None: none did)."""

    turn: dict[str, Any]
    reply: Reply
    prompt_tokens: int
    extends: bool
    stop_sequence: str | None
    renderer: Renderer

    @property
    def output_ids(self) -> list[int]:
        return self.turn["output_ids"]

    @property
    def finish_type(self) -> str:
        """``stop`` (a stop token or sequence), ``length`` or ``unknown``."""
        reason = self.turn.get("finish_reason") or {}
        return str(reason.get("type") or "unknown")


async def run_chat(ctx: RouterContext, session_id: str, req: ChatRequest) -> ChatResult:
    """Render, run, record and parse one chat turn of ``session_id``. ApiError 400 for what the
    renderer cannot represent; the turn's own refusals as :func:`record_turn` raises them."""
    renderer = chat_renderer(ctx.config)
    await load_open(ctx, session_id)
    turns = sampled_turns([decode_turn(b) for b in await ctx.store.get_turns(session_id)])
    try:
        stops = {renderer.stop_token(s): s for s in req.stop}
        context = build_context(renderer, req.messages, req.tools, turns)
    except RenderError as exc:
        raise ApiError(400, str(exc)) from None
    spec = _turn_request(context.input_ids, req, [*renderer.stop_ids, *stops]).spec()
    turn = loads(await record_turn(ctx, session_id, spec))
    matched = (turn.get("finish_reason") or {}).get("matched")
    return ChatResult(
        turn=turn,
        reply=renderer.parse(turn["output_ids"]),
        prompt_tokens=len(context.input_ids),
        extends=context.extends,
        stop_sequence=stops.get(matched) if isinstance(matched, int) else None,
        renderer=renderer,
    )


def _turn_request(input_ids: list[int], req: ChatRequest, stop_ids: Sequence[int]) -> TurnRequest:
    """The token turn of a chat request, validated as ``/turns`` validates one (400 naming the
    field it refuses)."""
    given = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "max_new_tokens": req.max_tokens,
        "seed": req.seed,
    }
    try:
        params = SamplingParams(
            stop_token_ids=sorted(set(stop_ids)), **{k: v for k, v in given.items() if v is not None}
        )
        return TurnRequest(input_ids=input_ids, sampling_params=params)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "request"
        names = {"max_new_tokens": "max_tokens"}
        raise ApiError(400, f"{names.get(where, where)}: {err.get('msg')}") from None


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    502: "api_error",
    503: "overloaded_error",
}


def api_error(exc: ApiError, api: Literal["openai", "anthropic"]) -> ApiError:
    """``exc`` with its body also in the API's own error shape (``error.message`` and
    ``error.type``; Anthropic's adds ``"type": "error"``), which the official clients read."""
    error = {"message": exc.message, "type": _ERROR_TYPES.get(exc.status, "api_error")}
    fields = {**exc.fields, "error": error} | ({"type": "error"} if api == "anthropic" else {})
    return ApiError(exc.status, exc.message, retry_after=exc.retry_after, fields=fields)

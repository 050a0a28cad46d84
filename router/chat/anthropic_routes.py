"""Anthropic Messages per session: base URL ``{router}/v1/sessions/{session_id}/anthropic``,
``POST .../v1/messages`` (the official ``anthropic`` client works unchanged with that base URL and a
``rollout`` key, sent as ``x-api-key`` or as a bearer token); ``POST .../v1/messages/count_tokens``
(:func:`count_tokens`) and ``GET .../v1/models`` (:func:`list_models`, :func:`retrieve_model`).

Supported: ``system`` (text), text / ``thinking`` / ``tool_use`` blocks of assistant messages,
text / ``tool_result`` blocks of user messages, ``tools``, ``tool_choice`` ``auto``,
``max_tokens`` (at least 1), ``temperature`` (0..1, Anthropic's range), ``top_p``, ``top_k``,
single-token ``stop_sequences``, ``metadata``, ``usage``, ``stream``. Anything else that would
change the answer (an image or document block, ``is_error`` tool results, a thinking budget
(``thinking`` ``disabled`` is the template's no-thinking form: :class:`ThinkingConfig`), a
``tool_choice`` other than ``auto``, ``disable_parallel_tool_use``: a sampled answer may hold
several tool calls) is a 400 naming it. The sampled reasoning comes back as a
``thinking`` block (its ``signature`` is empty: nothing is signed), after the text block when
text was sampled before the reasoning, else first, streamed or not (:func:`message`).

``Idempotency-Key`` (header): a retry answers the turn recorded under the key, byte for byte, streamed
or not (:mod:`router.idempotency`, :mod:`router.chat.service`).

Streaming sends Anthropic's server-sent events as the turn is sampled
(:mod:`router.chat.streaming`): ``message_start``, a thinking block whose ``thinking_delta`` events
are the reasoning deltas (from the token that opens the reasoning), a text block whose
``text_delta`` events are the content deltas, then the rest of the open block and each other block
whole (``content_block_start`` / ``content_block_delta`` / ``content_block_stop``),
``message_delta`` (with ``mixfleet``) and ``message_stop``; a failure after the first token is an
``error`` event. When text was sampled before the reasoning, the thinking block follows the text
block (the order of the answer's blocks) and comes whole at the end: a block does not open inside
another. The blocks add up to the answer without streaming, and the turn recorded is the same.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from core.jsonio import dumps
from router.auth import scopes_for
from router.chat.errors import model_not_found, stream_error
from router.chat.renderers import Message, Tool, ToolCall
from router.chat.service import (
    MODEL_ID,
    ChatRequest,
    ChatResult,
    Head,
    count_input,
    run_chat,
    session_created,
)
from router.chat.streaming import Item, Reasoning, Tail, stream_chat
from router.errors import AUTH, BODY, ApiError, error_responses
from router.idempotency import HEADER, KEY_DOC
from router.json_route import JsonRoute
from router.schemas import JsonObject, SessionId, unbounded_int


async def _key(
    request: Request,
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> None:
    """The ``rollout`` scope, from ``x-api-key`` (the anthropic client's header) or a bearer token."""
    config = request.app.state.ctx.config
    if config.auth_disabled:
        return
    token = x_api_key
    if not token and authorization and authorization.lower().startswith("bearer "):
        token = authorization[7:].strip()
    if not token:
        raise HTTPException(401, "missing API key (x-api-key: <key> or Authorization: Bearer <key>)")
    scopes = scopes_for(token, config.api_keys)
    if scopes is None:
        raise HTTPException(401, "invalid API key")
    if "rollout" not in scopes:
        raise HTTPException(403, "API key lacks the 'rollout' scope")


router = APIRouter(
    prefix="/v1/sessions/{session_id}/anthropic",
    tags=["chat"],
    dependencies=[Depends(_key)],
    responses=error_responses(*AUTH),
    route_class=JsonRoute,  # bodies decoded by core.jsonio, strictly
)


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextBlock(_M):
    type: Literal["text"]
    text: str
    cache_control: JsonObject | None = None
    citations: None = None  # a reply's block sent back as it came


class ThinkingBlock(_M):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class ToolUseBlock(_M):
    type: Literal["tool_use"]
    id: str
    name: str
    input: JsonObject
    cache_control: JsonObject | None = None
    caller: None = None
    toolset_name: None = None


class ToolResultBlock(_M):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: JsonObject | None = None


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


_BLOCKS = ("text", "thinking", "tool_use", "tool_result")


def _items(value: Any) -> list[tuple[int, Any]]:
    return list(enumerate(value)) if isinstance(value, list) else []


class InMessage(_M):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]  # an empty list: refused, as the API does

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        """A block of another type (an image, a document) is refused by name, not as a mismatch
        of every block type."""
        for j, b in enumerate(content if isinstance(content, list) else ()):
            kind = b.get("type") if isinstance(b, dict) else None
            inner = b.get("content") if kind == "tool_result" else None
            for where, part in [
                (f"block {j}", b),
                *((f"block {j}'s content[{k}]", x) for k, x in _items(inner)),
            ]:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in _BLOCKS:
                    raise PydanticCustomError(
                        "unsupported_block",
                        "{where} is {kind}, which is not supported (the chat model reads text)",
                        {"where": where, "kind": repr(kind)},
                    )
        return content


class ToolIn(_M):
    """A client tool as anthropic 2.15 ``types/tool_param.py`` sends it (``type`` ``custom`` or
    none; ``strict`` taken, the schema is not enforced on sampling either way)."""

    type: Literal["custom"] | None = None
    name: str
    description: str = ""
    input_schema: JsonObject
    cache_control: JsonObject | None = None
    strict: bool | None = None


class ToolChoice(_M):
    type: str = Field(description="only auto: a sampled answer cannot be forced to call a tool")
    name: str | None = None
    disable_parallel_tool_use: Literal[False] | None = Field(
        None, description="true is refused: a sampled answer may hold several tool calls"
    )


class ThinkingConfig(_M):
    """Anthropic's ``thinking`` (anthropic 2.15 ``types/thinking_config_param.py``; which types a
    model takes, and what omitting it means, "depend on the model"). ``disabled``
    (``ThinkingConfigDisabledParam``): the template's no-thinking form
    (:meth:`~router.chat.renderers.base.Renderer.without_thinking`; a 400 naming it when the
    template has none: the model would reason all the same). ``adaptive`` ("Claude decides when and
    how much to think") and no ``thinking``: the template's default, in which the model decides.
    ``enabled`` is refused: its ``budget_tokens`` cannot be held to."""

    type: str
    budget_tokens: int | None = None
    display: Literal["summarized"] | None = Field(None, description="omitted is refused: nothing is signed")


class InputRequest(_M):
    """What renders a turn's input: the body of ``count_tokens`` (anthropic 2.15
    ``resources/messages/messages.py`` ``Messages.count_tokens``, its ``_post`` of
    ``/v1/messages/count_tokens``: ``messages``, ``model``, ``system``, ``thinking``, ``tool_choice``,
    ``tools``; its ``cache_control``, ``output_config``, ``speed`` are refused by name) and the
    part of a :class:`MessagesRequest` that is not sampling."""

    model: str = ""
    messages: list[InMessage]
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def chat(self) -> ChatRequest:
        """The turn's input in the common form (its sampling options unset)."""
        if self.thinking is not None and self.thinking.type not in ("disabled", "adaptive"):
            raise ApiError(
                400,
                f"thinking.type: {self.thinking.type!r} cannot be honoured (a thinking budget cannot be held "
                "to); 'disabled' renders the template's no-thinking form, 'adaptive' or no thinking its "
                "default",
            )
        if self.tool_choice is not None and self.tool_choice.type != "auto":
            raise ApiError(
                400,
                f"tool_choice.type: only 'auto' can be honoured, not {self.tool_choice.type!r}: a sampled "
                "answer cannot be forced to call a tool, or kept from calling one",
            )
        messages: list[Message] = []
        if self.system:
            messages.append(Message("system", _text(self.system)))
        for i, m in enumerate(self.messages):
            messages += _messages(i, m)
        return ChatRequest(
            messages=tuple(messages),
            tools=tuple(Tool(t.name, t.description, t.input_schema) for t in self.tools or ()),
            no_thinking="thinking.type"
            if self.thinking is not None and self.thinking.type == "disabled"
            else None,
        )


class MessagesRequest(InputRequest):
    max_tokens: unbounded_int(1, strict=False)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: JsonObject | None = None

    def chat(self) -> ChatRequest:
        return dataclasses.replace(
            super().chat(),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop_sequences or ()),
        )


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _messages(i: int, m: InMessage) -> list[Message]:
    """The chat messages of one Anthropic message: an assistant message is one; a user message is
    its tool results (each a tool message) then its text, if any."""
    blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    if m.role == "assistant":
        if any(isinstance(b, ToolResultBlock) for b in blocks):
            raise ApiError(400, f"messages[{i}]: tool_result blocks belong in a user message")
        thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
        calls = tuple(
            ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
            for b in blocks
            if isinstance(b, ToolUseBlock)
        )
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        return [
            Message("assistant", text, reasoning="".join(thinking) if thinking else None, tool_calls=calls)
        ]
    out: list[Message] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        if isinstance(b, (ThinkingBlock, ToolUseBlock)):
            raise ApiError(
                400, f"messages[{i}].content[{j}]: a {b.type} block belongs in an assistant message"
            )
        if isinstance(b, ToolResultBlock):
            if b.is_error:
                raise ApiError(
                    400,
                    f"messages[{i}].content[{j}].is_error: the chat template cannot render an error result",
                )
            if texts:
                raise ApiError(400, f"messages[{i}].content[{j}]: tool_result blocks must come before text")
            out.append(Message("tool", _text(b.content), tool_call_id=b.tool_use_id))
        else:
            texts.append(b.text)
    if texts:
        out.append(Message("user", "".join(texts)))
    return out


@router.post(
    "/v1/messages",
    summary="Anthropic Messages on this session",
    responses=error_responses(*BODY, 404, 409, 502, 503),
)
async def create_message(
    request: Request,
    session_id: SessionId,
    body: MessagesRequest,
    idempotency_key: Annotated[str | None, Header(alias=HEADER, description=KEY_DOC)] = None,
) -> Response:
    ctx = request.app.state.ctx
    chat = body.chat()
    if body.stream:
        items = await stream_chat(ctx, session_id, chat, idempotency_key)
        return StreamingResponse(_sse(session_id, body, items), media_type="text/event-stream")
    return JSONResponse(message(session_id, body, await run_chat(ctx, session_id, chat, idempotency_key)))


@router.post(
    "/v1/messages/count_tokens",
    summary="Count the input tokens of an Anthropic Messages turn on this session",
    responses=error_responses(*BODY, 404, 409, 503),
)
async def count_tokens(request: Request, session_id: SessionId, body: InputRequest) -> Response:
    """``{"input_tokens": N}`` (anthropic 2.15 ``types/message_tokens_count.py``): the
    ``usage.input_tokens`` a turn with this input would have now, as the router renders it
    (:func:`router.chat.service.count_input`); nothing is sampled or recorded. An input longer than
    the model's context is counted, not refused, as Anthropic's endpoint counts it (a 281k-token
    prompt to a 200k-token model answered ``{"input_tokens": 281257}``:
    github.com/stdapi-ai/stdapi.ai/issues/297): harnesses ask it to learn that a conversation no
    longer fits."""
    return JSONResponse({"input_tokens": await count_input(request.app.state.ctx, session_id, body.chat())})


def _model(model_id: str, created: int) -> dict[str, Any]:
    """A ``ModelInfo`` (anthropic 2.15 ``types/model_info.py``: ``id``, ``created_at`` RFC 3339,
    ``display_name``, ``type``)."""
    at = datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": at}


@router.get(
    "/v1/models", summary="The session's one chat model", responses=error_responses(400, 404, 422, 503)
)
async def list_models(request: Request, session_id: SessionId) -> Response:
    """A page of ``ModelInfo`` (anthropic 2.15 ``pagination.py`` ``SyncPage``: ``data``,
    ``has_more``, ``first_id``, ``last_id``) holding :data:`~router.chat.service.MODEL_ID`, created
    when the session was."""
    created = await session_created(request.app.state.ctx, session_id)
    return JSONResponse(
        {"data": [_model(MODEL_ID, created)], "has_more": False, "first_id": MODEL_ID, "last_id": MODEL_ID}
    )


@router.get(
    "/v1/models/{model_id}", summary="The session's chat model", responses=error_responses(400, 404, 422, 503)
)
async def retrieve_model(request: Request, session_id: SessionId, model_id: str) -> Response:
    """The session's model, :data:`~router.chat.service.MODEL_ID` (the id the list holds); another
    id is the API's 404 (:func:`~router.chat.errors.model_not_found`), as the real API answers a
    model it does not serve."""
    created = await session_created(request.app.state.ctx, session_id)
    if model_id != MODEL_ID:
        raise model_not_found(model_id, "anthropic")
    return JSONResponse(_model(MODEL_ID, created))


async def _sse(session_id: str, body: MessagesRequest, items: AsyncIterator[Item]) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed turn's items (:mod:`router.chat.streaming`):
    ``message_start``, a thinking block open from the first reasoning delta (unless a text block
    is open: the reasoning then comes whole at the end, after the text), a text block from the
    first content delta (closing the thinking block), then :func:`tail_events`; an error after the
    first token is an ``error`` event."""
    index, block = 0, None  # the open block's index and type (None: none is open)
    try:
        async for item in items:
            if isinstance(item, Head):
                yield _event(_start(session_id, body, item))
            elif isinstance(item, Reasoning):
                if block is None:
                    block = "thinking"
                    yield _event(
                        {"type": "content_block_start", "index": index, "content_block": _thinking("")}
                    )
                if block == "thinking" and item.text:
                    delta = {"type": "thinking_delta", "thinking": item.text}
                    yield _event({"type": "content_block_delta", "index": index, "delta": delta})
            elif isinstance(item, str):
                if block == "thinking":
                    for e in _close(index, "thinking", ""):
                        yield _event(e)
                    index, block = index + 1, None
                if block is None:
                    block = "text"
                    yield _event({"type": "content_block_start", "index": index, "content_block": _TEXT})
                yield _event({"type": "content_block_delta", "index": index, "delta": _text_delta(item)})
            else:
                for e in tail_events(message(session_id, body, item.result), index, block, item):
                    yield _event(e)
    except Exception as exc:  # after the first token: the stream's last event (not a status)
        yield _event(stream_error(exc, "anthropic").fields)


_TEXT = {"type": "text", "text": ""}


def _text_delta(text: str) -> dict[str, Any]:
    return {"type": "text_delta", "text": text}


def _event(e: dict[str, Any]) -> bytes:
    return f"event: {e['type']}\ndata: ".encode() + dumps(e) + b"\n\n"


def _start(session_id: str, body: MessagesRequest, head: Head) -> dict[str, Any]:
    """``message_start`` of a streamed turn (``mixfleet.extends`` comes with ``message_delta``)."""
    start = {
        "id": f"msg_{session_id}_{head.turn}",
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": head.prompt_tokens, "output_tokens": 0},
        "mixfleet": {"session_id": session_id, "turn": head.turn},
    }
    return {"type": "message_start", "message": start}


def message(session_id: str, body: MessagesRequest, result: ChatResult) -> dict[str, Any]:
    """The ``message`` object of a recorded turn; its blocks in the order sampled: a thinking block
    after the text when text was sampled before the reasoning
    (:attr:`~router.chat.renderers.base.Reply.text_first`; the stream sends them so), else first."""
    reply = result.reply
    content: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        content.append({"type": "text", "text": reply.content})
    if reply.reasoning is not None:
        content.insert(len(content) if reply.text_first else 0, _thinking(reply.reasoning))
    for c in reply.tool_calls:
        args = c.parsed_arguments()
        content.append(
            {"type": "tool_use", "id": c.id, "name": c.name, "input": args if isinstance(args, dict) else {}}
        )
    if result.finish_type == "length":
        stop = "max_tokens"
    elif result.stop_sequence is not None:
        stop = "stop_sequence"
    else:
        stop = "tool_use" if reply.tool_calls else "end_turn"
    turn = result.turn["turn"]
    return {
        "id": f"msg_{session_id}_{turn}",
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": result.stop_sequence,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": len(result.output_ids)},
        "mixfleet": {"session_id": session_id, "turn": turn, "extends": result.extends},
    }


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tail_events(
    answer: dict[str, Any], index: int, block: str | None, tail: Tail
) -> Iterator[dict[str, Any]]:
    """The events that end a streamed ``answer`` after its deltas, in order. ``index``: the first
    block of ``answer`` not closed yet; ``block``: its type when it is open (None: none is), which
    gets the rest of its text (``tail``'s) and is closed first; then each later block of
    ``answer`` (whole), ``message_delta``, ``message_stop``."""
    blocks = answer["content"]
    if block is not None:
        yield from _close(index, block, tail.reasoning_rest if block == "thinking" else tail.rest)
        index += 1
    for i in range(index, len(blocks)):
        yield from _block_events(i, blocks[i])
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": answer["stop_reason"], "stop_sequence": answer["stop_sequence"]},
        "usage": {"output_tokens": answer["usage"]["output_tokens"]},
        "mixfleet": answer["mixfleet"],
    }
    yield {"type": "message_stop"}


def _close(i: int, block: str, rest: str) -> Iterator[dict[str, Any]]:
    """The end of the open ``block`` (``thinking`` or ``text``) at index ``i``: ``rest``, the text
    not streamed yet, its signature (a thinking block's: empty), its stop."""
    if block == "thinking":
        if rest:
            yield {
                "type": "content_block_delta",
                "index": i,
                "delta": {"type": "thinking_delta", "thinking": rest},
            }
        yield {
            "type": "content_block_delta",
            "index": i,
            "delta": {"type": "signature_delta", "signature": ""},
        }
    elif rest:
        yield {"type": "content_block_delta", "index": i, "delta": _text_delta(rest)}
    yield {"type": "content_block_stop", "index": i}


def _block_events(i: int, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One content block of an answer, whole, at ``index`` ``i``: its start, its deltas, its stop."""
    kind = block["type"]
    if kind == "thinking":
        first = _thinking("")
        deltas = [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": ""},
        ]
    elif kind == "text":
        first, deltas = _TEXT, [_text_delta(block["text"])] if block["text"] else []
    else:
        first = {**block, "input": {}}
        deltas = [
            {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        ]
    yield {"type": "content_block_start", "index": i, "content_block": first}
    for d in deltas:
        yield {"type": "content_block_delta", "index": i, "delta": d}
    yield {"type": "content_block_stop", "index": i}

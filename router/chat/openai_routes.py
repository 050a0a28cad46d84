"""OpenAI Chat Completions per session: base URL ``{router}/v1/sessions/{session_id}/openai/v1``,
``POST .../chat/completions`` (the official ``openai`` client works unchanged with that base URL
and a ``rollout`` key); ``GET .../models`` (:func:`list_models`, :func:`retrieve_model`).

Supported: text messages (system/developer, user, assistant with ``tool_calls`` and an optional
``reasoning_content``, tool), ``tools`` (functions), ``tool_choice`` ``auto``, ``max_tokens`` /
``max_completion_tokens`` (the latter wins; neither: no bound but the model's context, as OpenAI and
SGLang's own chat endpoint, ``srt/entrypoints/openai/protocol.py`` 1214), ``temperature``,
``top_p``, ``seed``, single-token ``stop``, ``logprobs`` / ``top_logprobs``, ``response_format``
``text``, ``metadata``, ``reasoning_effort`` ``none`` (the template's no-thinking form, as
Anthropic's ``thinking`` ``disabled``:
:meth:`~router.chat.renderers.base.Renderer.without_thinking`), ``usage`` and ``stream`` (with
``stream_options.include_usage``), each in OpenAI's range (:class:`ChatCompletionRequest`). Anything
else that would change the answer is a 400 naming it (an image part, ``n`` other than 1, a forced or
forbidden ``tool_choice``, a JSON ``response_format``, ``parallel_tool_calls: false``: a sampled
answer may hold several tool calls). The reply carries ``reasoning_content`` (the sampled
``<think>`` text) and ``mixfleet`` (session, turn, whether it extended the recorded history).

``Idempotency-Key`` (header): a retry answers the turn recorded under the key, byte for byte, streamed
or not (:mod:`router.idempotency`, :mod:`router.chat.service`); ``created`` is the session's creation
time.

Streaming sends ``chat.completion.chunk`` server-sent events as the turn is sampled
(:mod:`router.chat.streaming`): the role, one ``reasoning_content`` or ``content`` delta per token
that shows new reasoning or content, then the rest of the reasoning and of the content (with the
log-probs, when asked), each tool call, the finish reason, the usage and ``[DONE]``; a failure after
the first token is an ``error`` event. The deltas add up to the answer without streaming, and the
turn recorded is the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from core.jsonio import dumps
from router.auth import require
from router.chat.errors import model_not_found, stream_error
from router.chat.renderers import Message, Renderer, Tool, ToolCall
from router.chat.service import MODEL_ID, ChatRequest, ChatResult, Head, run_chat, session_created
from router.chat.streaming import Item, Reasoning, stream_chat
from router.errors import AUTH, BODY, ApiError, error_responses
from router.idempotency import HEADER, KEY_DOC
from router.json_route import JsonRoute
from router.schemas import JsonObject, SessionId, unbounded_int

router = APIRouter(
    prefix="/v1/sessions/{session_id}/openai/v1",
    tags=["chat"],
    dependencies=[Depends(require("rollout"))],
    responses=error_responses(*AUTH),
    route_class=JsonRoute,  # bodies decoded by core.jsonio, strictly
)


_NO_SUPPORT = (
    "top_logprobs: a turn that filters nothing records no sampling support to rank; use top_p < 1 or "
    "temperature 0"
)


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ContentPart(BaseModel):
    """A part of a message's content: only ``text`` parts are rendered (another type, an image
    or audio, is refused by name: :func:`_text`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_M):
    name: str
    arguments: str
    parsed_arguments: Any = None  # the stream helper's (``ParsedFunction``): ``arguments`` parsed; ignored


class ToolCallIn(_M):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # the stream helper's accumulated deltas keep it; ignored


class ChatMessage(_M):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    name: str | None = None
    # a reply sent back as the client dumps it (``message.model_dump()``): these are null
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: None = None
    # ... and as the stream helper's final completion has it (openai ``ParsedChatCompletionMessage``,
    # ``types/chat/parsed_chat_completion.py``): ``content`` parsed, ignored
    parsed: Any = None


class FunctionDef(_M):
    name: str
    description: str = ""
    parameters: JsonObject = Field(default_factory=dict)
    strict: bool | None = None


class ToolDef(_M):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_M):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # a transport padding; none is sent (it changes no answer)


MAX_STOP = 4
"""OpenAI's most ``stop`` sequences (``completion_create_params.py``: "Up to 4 sequences")."""


class ResponseFormat(_M):
    type: str


class ChatCompletionRequest(_M):
    """The parameters of OpenAI's ``completion_create_params.py`` (openai 3.57) that a turn can
    honour, in OpenAI's ranges: ``temperature`` 0..2, ``top_p`` (0, 1], ``top_logprobs`` 0..20,
    ``max_tokens`` / ``max_completion_tokens`` at least 1, ``stop`` up to 4 sequences, ``n`` 1,
    ``metadata`` up to 16 string pairs; ``store``, ``prompt_cache_key``, ``safety_identifier`` and
    ``user`` are taken and kept nowhere (none changes the answer)."""

    model: str = ""
    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: Literal[True] | None = Field(
        None, description="false is refused: a sampled answer may hold several tool calls"
    )
    max_tokens: unbounded_int(1, strict=False) | None = None
    max_completion_tokens: unbounded_int(1, strict=False) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Literal[1] | None = Field(None, description="one choice per request: a turn is one sample")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    response_format: ResponseFormat | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = Field(
        None, description="none: the template's no-thinking form; another effort is refused"
    )
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    def chat(self) -> ChatRequest:
        if self.tool_choice not in (None, "auto"):
            raise ApiError(
                400,
                f"tool_choice: only 'auto' can be honoured, not {self.tool_choice!r}: a sampled answer "
                "cannot be forced to call a tool, or kept from calling one",
            )
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true (as OpenAI answers)")
        if self.response_format is not None and self.response_format.type != "text":
            raise ApiError(
                400,
                f"response_format: only {{'type': 'text'}}, not {self.response_format.type!r}: sampling is "
                "not constrained to a format",
            )
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs true")
        if self.top_logprobs and self.temperature != 0 and (self.top_p is None or self.top_p >= 1):
            raise ApiError(400, _NO_SUPPORT)
        if self.reasoning_effort not in (None, "none"):
            raise ApiError(
                400,
                f"reasoning_effort: {self.reasoning_effort!r} cannot be honoured; 'none' renders the "
                "template's no-thinking form, no reasoning_effort its default",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stop) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} sequences (as OpenAI takes), not {len(stop)}")
        return ChatRequest(
            messages=tuple(_message(i, m) for i, m in enumerate(self.messages)),
            tools=tuple(
                Tool(t.function.name, t.function.description, t.function.parameters) for t in self.tools or ()
            ),
            max_tokens=self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=tuple(stop),
            seed=self.seed,
            supports=bool(self.logprobs and self.top_logprobs),
            no_thinking="reasoning_effort" if self.reasoning_effort == "none" else None,
        )


def _text(i: int, content: str | list[ContentPart] | None) -> str:
    """The text of message ``i``'s content; 400 naming a part that is not text."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, p in enumerate(content):
        if p.type != "text":
            raise ApiError(
                400,
                f"messages[{i}].content[{j}]: a {p.type!r} part is not supported (the chat model reads text)",
            )
        if p.text is None:
            raise ApiError(400, f"messages[{i}].content[{j}].text: a text part needs its text")
    return "".join(p.text or "" for p in content)


def _message(i: int, m: ChatMessage) -> Message:
    if m.name is not None and m.role != "tool":  # a tool message's names the tool (LangChain sends it)
        raise ApiError(400, f"messages[{i}].name: the chat template cannot render a participant name")
    if m.role != "assistant" and (m.tool_calls or m.reasoning_content is not None):
        raise ApiError(400, f"messages[{i}]: only an assistant message has tool_calls or reasoning_content")
    if m.role == "tool":
        return Message("tool", _text(i, m.content), tool_call_id=m.tool_call_id)
    if m.role == "assistant":
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
        return Message("assistant", _text(i, m.content), reasoning=m.reasoning_content, tool_calls=calls)
    return Message("system" if m.role == "developer" else m.role, _text(i, m.content))


@router.post(
    "/chat/completions",
    summary="OpenAI Chat Completions on this session",
    responses=error_responses(*BODY, 404, 409, 502, 503),
)
async def chat_completions(
    request: Request,
    session_id: SessionId,
    body: ChatCompletionRequest,
    idempotency_key: Annotated[str | None, Header(alias=HEADER, description=KEY_DOC)] = None,
) -> Response:
    ctx = request.app.state.ctx
    chat = body.chat()
    if body.stream:
        items = await stream_chat(ctx, session_id, chat, idempotency_key)
        return StreamingResponse(_sse(session_id, body, items), media_type="text/event-stream")
    return JSONResponse(completion(session_id, body, await run_chat(ctx, session_id, chat, idempotency_key)))


def _model(model_id: str, created: int) -> dict[str, Any]:
    """A ``Model`` (openai 3.57 ``types/model.py``: ``id``, ``created``, ``object``, ``owned_by``)."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mixfleet"}


@router.get("/models", summary="The session's one chat model", responses=error_responses(400, 404, 422, 503))
async def list_models(request: Request, session_id: SessionId) -> Response:
    """``{"object": "list", "data": [Model]}`` (openai 3.57 ``pagination.py`` ``SyncPage``) holding
    :data:`~router.chat.service.MODEL_ID`, created when the session was."""
    created = await session_created(request.app.state.ctx, session_id)
    return JSONResponse({"object": "list", "data": [_model(MODEL_ID, created)]})


@router.get(
    "/models/{model_id}", summary="The session's chat model", responses=error_responses(400, 404, 422, 503)
)
async def retrieve_model(request: Request, session_id: SessionId, model_id: str) -> Response:
    """The session's model, :data:`~router.chat.service.MODEL_ID` (the id the list holds); another
    id is the API's 404 (:func:`~router.chat.errors.model_not_found`), as the real API answers a
    model it does not serve."""
    created = await session_created(request.app.state.ctx, session_id)
    if model_id != MODEL_ID:
        raise model_not_found(model_id, "openai")
    return JSONResponse(_model(MODEL_ID, created))


async def _sse(
    session_id: str, body: ChatCompletionRequest, items: AsyncIterator[Item]
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed turn's items (:mod:`router.chat.streaming`): a
    ``chat.completion.chunk`` with the role, one per reasoning delta (``reasoning_content``) and
    content delta (``content``), then :func:`tail_chunks`; an error after the first token is an
    ``error`` event; ``[DONE]`` last."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    head: dict[str, Any] = {}
    try:
        async for item in items:
            if isinstance(item, Head):
                head = {"id": f"chatcmpl-{session_id}-{item.turn}", "object": "chat.completion.chunk"}
                head |= {"created": item.created, "model": body.model}
                yield _data(_chunk(head, {"role": "assistant", "content": ""}))
            elif isinstance(item, Reasoning):
                if item.text:
                    yield _data(_chunk(head, {"reasoning_content": item.text}))
            elif isinstance(item, str):
                yield _data(_chunk(head, {"content": item}))
            else:
                answer = completion(session_id, body, item.result)
                for c in tail_chunks(head, answer, item.reasoning_rest, item.rest, include_usage):
                    yield _data(c)
    except Exception as exc:  # after the first token: the stream's last event (not a status)
        yield _data({"error": stream_error(exc, "openai").fields["error"]})
    yield b"data: [DONE]\n\n"


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def completion(session_id: str, body: ChatCompletionRequest, result: ChatResult) -> dict[str, Any]:
    """The ``chat.completion`` object of a recorded turn."""
    reply = result.reply
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    finish = "tool_calls" if reply.tool_calls else "stop"
    if result.finish_type == "length":
        finish = "length"
    n_out = len(result.output_ids)
    turn = result.turn["turn"]
    return {
        "id": f"chatcmpl-{session_id}-{turn}",
        "object": "chat.completion",
        "created": result.created,
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(result, body.top_logprobs or 0) if body.logprobs else None,
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": result.prompt_tokens + n_out,
        },
        "mixfleet": {"session_id": session_id, "turn": turn, "extends": result.extends},
    }


def _entry(renderer: Renderer, token_id: int, logprob: float | None) -> dict[str, Any]:
    """A token's log-prob entry: its text, and its own bytes (a token ending inside a UTF-8
    character shows a replacement character; its bytes join the next tokens' into the text)."""
    text, raw = renderer.decode([token_id]), list(renderer.token_bytes(token_id))
    return {"token": text, "logprob": -9999.0 if logprob is None else logprob, "bytes": raw}


def _logprobs(result: ChatResult, top: int) -> dict[str, Any]:
    """Per sampled token its behaviour log-prob and, with ``top``, the most likely of the turn's
    recorded sampling support (400 when the turn recorded none: it filtered nothing)."""
    renderer = result.renderer
    content = []
    for rec in result.turn["records"]:
        item = _entry(renderer, rec["token_id"], rec["logprob"])
        if top:
            if not rec["support_ids"]:
                raise ApiError(400, _NO_SUPPORT)
            ranked = sorted(
                zip(rec["support_ids"], rec["support_logprobs"], strict=True),
                key=lambda x: -9999.0 if x[1] is None else -x[1],
            )
            item["top_logprobs"] = [_entry(renderer, i, lp) for i, lp in ranked[:top]]
        else:
            item["top_logprobs"] = []
        content.append(item)
    return {"content": content, "refusal": None}


def _chunk(
    head: dict[str, Any], delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    return head | {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def tail_chunks(
    head: dict[str, Any], answer: dict[str, Any], reasoning_rest: str, rest: str, include_usage: bool
) -> Iterator[dict[str, Any]]:
    """The chunks that end a streamed ``answer`` after its deltas, in stream order: the reasoning
    not streamed yet ``reasoning_rest``, the content not streamed yet ``rest`` (with the turn's
    log-probs when asked), each tool call, the finish reason, the usage."""
    choice = answer["choices"][0]
    message = choice["message"]
    if reasoning_rest:
        yield _chunk(head, {"reasoning_content": reasoning_rest})
    if rest or choice["logprobs"] is not None:
        yield _chunk(head, {"content": rest}, logprobs=choice["logprobs"])
    for i, call in enumerate(message.get("tool_calls", ())):
        yield _chunk(head, {"tool_calls": [{"index": i, **call}]})
    yield _chunk(head, {}, finish=choice["finish_reason"])
    if include_usage:
        yield head | {"choices": [], "usage": answer["usage"]}

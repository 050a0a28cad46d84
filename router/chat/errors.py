"""Refusals of the chat routes in each API's own error shape: the one error path of everything a
chat URL can answer (the app's exception handlers, :mod:`router.app`, and the ``error`` event of a
stream that fails after its first token).

Which API a request is for is its URL path (:func:`chat_api`), not the route it matched, so an
unknown path under a chat prefix (``.../openai/v1/embeddings``), a method the route does not take,
an unreadable state store (503) and a state conflict (409) are answered in that API's shape too.

The bodies keep the router's ``detail`` (:class:`router.schemas.ErrorBody`) and add what the
official clients read:

- OpenAI: ``{"error": {"message", "type", "param", "code"}}`` (openai 3.57 ``types/shared/
  error_object.py``: ``code``, ``param`` optional strings, ``type`` a string; ``_client.py``
  ``_make_status_error`` passes ``body["error"]`` to the exception, ``_exceptions.py`` ``APIError``
  reads its ``code``, ``param`` and ``type``). ``type`` is ``invalid_request_error`` for a 4xx,
  ``server_error`` for a 5xx; ``code`` ``invalid_api_key`` for a 401 and
  ``context_length_exceeded`` for a context longer than the model's (what harnesses match to
  compact a conversation); ``param``, on a 400, the field the message names first (a refusal
  of a request's field starts with it: ``temperature: ...``).
- Anthropic: ``{"type": "error", "error": {"type", "message"}}`` (anthropic 2.15
  ``types/shared/error_response.py``; the types are ``types/shared/error_type.py``'s, per status as
  Anthropic's errors page lists them: 400 ``invalid_request_error`` — also for "other 4XX status
  codes not listed" —, 401 ``authentication_error``, 403 ``permission_error``, 404
  ``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 500 ``api_error``,
  529 ``overloaded_error``; a 409 is ``conflict_error``, a 504 ``timeout_error``; the router's 503,
  "unavailable now, retry after ``Retry-After``" (no state store, no replica), is
  ``overloaded_error``, the page's "temporarily overloaded" (retryable), not ``api_error``, its
  "unexpected error": the client's handling does not depend on the type, it picks the exception
  class by the status (``_error_classes.py`` ``make_status_error``: 503 ``ServiceUnavailableError``,
  529 ``OverloadedError``, both ``InternalServerError``; only ``error.details.error_code`` refines
  it) and retries any status >= 500 honouring ``Retry-After`` (``_base_client.py``
  ``_should_retry``); a 502 and any other 5xx ``api_error``).

A 422 (a request the router or its engine refuses) is either API's 400, as both answer an invalid
request. An engine's refusal of a context longer than the model's (SGLang 0.5.23
``srt/managers/tokenizer_manager.py`` ``_validate_one_request``'s two messages, and its scheduler's
abort of a prompt within 6 tokens of the context, ``srt/managers/utils.py``
``validate_input_length``, whose limit, the longest input plus one, is named as the model's: the
local engine answers all three verbatim, :mod:`engine.server.protocol`) is reworded as the API
words it: OpenAI's "This model's maximum context length is M tokens. However, ..." with ``code:
"context_length_exceeded"``, ``param: "messages"``; Anthropic's "prompt is too long: N tokens > M
maximum", or for the input with ``max_tokens`` "input length and `max_tokens` exceed context
limit: N + K > M, ...".
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from router.errors import ApiError, refusal_of

log = logging.getLogger(__name__)

Api = Literal["openai", "anthropic"]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_OPENAI_CODES = {401: "invalid_api_key"}
_PARAM = re.compile(r"([A-Za-z_][\w.\[\]]*): ")

# SGLang 0.5.23 TokenizerManager._validate_one_request's two refusals
_INPUT_TOO_LONG = re.compile(
    r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)"
)
# ... and its scheduler's abort of a prompt within 6 tokens of the context (managers/utils.py 283-287)
_INPUT_ABORTED = re.compile(
    r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)"
)
_TOTAL_TOO_LONG = re.compile(
    r"maximum context length of (\d+) tokens\. You requested a total of \d+ tokens: (\d+) tokens from the "
    r"input messages and (\d+) tokens for the completion"
)


@dataclass(frozen=True)
class ContextOverflow:
    """An engine's refusal of a turn longer than the model's context: the input's length, the
    completion asked for (None: the input alone is too long) and the model's context length."""

    prompt: int
    completion: int | None
    limit: int

    @classmethod
    def of(cls, message: str) -> ContextOverflow | None:
        """The overflow an engine's refusal ``message`` states, if it states one."""
        if m := _INPUT_TOO_LONG.search(message) or _INPUT_ABORTED.search(message):
            return cls(int(m[1]), None, int(m[2]))
        if m := _TOTAL_TOO_LONG.search(message):
            return cls(int(m[2]), int(m[3]), int(m[1]))
        return None

    def message(self, api: Api) -> str:
        if api == "anthropic":
            if self.completion is None:
                return f"prompt is too long: {self.prompt} tokens > {self.limit} maximum"
            return (
                f"input length and `max_tokens` exceed context limit: {self.prompt} + {self.completion} > "
                f"{self.limit}, decrease input length or `max_tokens` and try again"
            )
        if self.completion is None:
            return (
                f"This model's maximum context length is {self.limit} tokens. However, your messages "
                f"resulted in {self.prompt} tokens. Please reduce the length of the messages."
            )
        total = self.prompt + self.completion
        return (
            f"This model's maximum context length is {self.limit} tokens. However, you requested {total} "
            f"tokens ({self.prompt} in the messages, {self.completion} in the completion). Please reduce "
            "the length of the messages or completion."
        )


class ChatError(ApiError):
    """A refusal already in its API's shape (its ``fields`` hold the API's members)."""


def api_error(exc: ApiError, api: Api) -> ChatError:
    """``exc`` in ``api``'s error shape (module docstring); ``exc`` itself when it already is."""
    if isinstance(exc, ChatError):
        return exc
    status = 400 if exc.status == 422 else exc.status
    message, param, code = exc.message, None, _OPENAI_CODES.get(status)
    overflow = ContextOverflow.of(message) if status == 400 else None
    if overflow is not None:
        message, param, code = overflow.message(api), "messages", "context_length_exceeded"
    elif status == 400 and (m := _PARAM.match(message)):
        param = m[1]
    if api == "openai":
        kind = "server_error" if status >= 500 else "invalid_request_error"
        shaped: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    else:
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        shaped = {"type": "error", "error": {"type": kind, "message": message}}
    fields = {k: v for k, v in exc.fields.items() if k not in ("error", "type")} | shaped
    return ChatError(status, message, retry_after=exc.retry_after, fields=fields)


def stream_error(exc: Exception, api: Api) -> ChatError:
    """The error event a stream that fails after its first token ends with, in ``api``'s shape:
    ``exc``'s refusal (:func:`router.errors.refusal_of`: a state store gone is a 503, as a status
    before the first token would be). An unexpected failure is logged with its traceback first,
    as the app's handler has the server log one answered as a status."""
    refusal = refusal_of(exc)
    if refusal is not exc and refusal.status == 500:
        log.error("a chat stream failed after its first token", exc_info=exc)
    return api_error(refusal, api)


def model_not_found(model_id: str, api: Api) -> ChatError:
    """The 404 of a model retrieval naming a model the session does not serve, as each API words
    it: OpenAI's ``{"message": "The model `X` does not exist or you do not have access to it.",
    "type": "invalid_request_error", "param": null, "code": "model_not_found"}`` (the answer
    quoted in github.com/Aider-AI/aider/issues/2030), Anthropic's ``not_found_error`` with the
    message ``model: X`` (quoted in github.com/mattermost/mattermost-plugin-agents/issues/257)."""
    if api == "openai":
        message = f"The model `{model_id}` does not exist or you do not have access to it."
        error = {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
        return ChatError(404, message, fields={"error": error})
    message = f"model: {model_id}"
    return ChatError(
        404, message, fields={"type": "error", "error": {"type": "not_found_error", "message": message}}
    )


def chat_api(path: str) -> Api | None:
    """The chat API whose URL prefix ``path`` is under, if any (whether a route matched it or not)."""
    if m := _PREFIX.match(path):
        return "openai" if m["api"] == "openai/v1" else "anthropic"
    return None


_PREFIX = re.compile(r"/v1/sessions/[^/]+/(?P<api>openai/v1|anthropic)(?:/|$)")
"""The chat routers' prefixes (``openai_routes.router.prefix``, ``anthropic_routes.router.prefix``:
a test checks they agree)."""

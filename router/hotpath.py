"""The hot routes as lean ASGI handlers in front of the FastAPI app.

``POST /v1/sessions/{session_id}/turns`` and non-streaming ``POST /generate`` are answered here
without FastAPI's routing, dependency injection and pydantic models when the request is
canonical: a bearer key with the ``rollout`` scope (or auth disabled), a JSON body (no
content type, or ``application/json``) within ``max_body_bytes`` that
:func:`router.schemas.turn_spec_fast` / :func:`router.schemas.generate_rows_fast` accepts.
They run the same code as the FastAPI routes (:func:`router.turns.record_turn`,
:func:`router.routes_sglang.forward_generate`) and refuse the same way (``{"detail": ...}``
with the same statuses and ``Retry-After``).

Everything else - no key or a wrong one, an oversize, malformed or non-canonical body,
streaming, ``text`` input - goes to the FastAPI app unchanged (the body already read is
replayed), so each refusal is exactly the documented one. The OpenAPI schema comes from the
FastAPI routes as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.auth import admits
from router.context import RouterContext
from router.errors import ApiError
from router.jsonio import dumps
from router.routes_sglang import KEY_HEADERS, forward_generate
from router.schemas import generate_rows_fast, turn_spec_fast
from router.state.base import StateError, StateUnavailable
from router.turns import record_turn

try:
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
    _JSONError: type[Exception] = orjson.JSONDecodeError
except ImportError:  # pragma: no cover
    import json

    _loads = json.loads
    _JSONError = ValueError

log = logging.getLogger("mixfleet.router")

TURN_ROUTE = "/v1/sessions/{session_id}/turns"
GENERATE_ROUTE = "/generate"
_SESSIONS = "/v1/sessions/"
_JSON_HEADERS = [(b"content-type", b"application/json")]
_KEY_HEADERS = tuple(k.encode() for k in KEY_HEADERS)
_ROLLOUT = frozenset({"rollout"})


class _Fallback(Exception):
    """The request is not canonical: let the FastAPI app answer it."""


class HotPath:
    """``await hot(scope, receive, send)`` returns False (having done nothing) when the request
    is not for a hot route; else it answers it, itself or through ``fallback``."""

    def __init__(self, ctx: RouterContext, fallback: ASGIApp) -> None:
        self.ctx = ctx
        self.fallback = fallback
        self.limit = ctx.config.max_body_bytes
        self.seconds = ctx.metrics.request_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        if scope["method"] != "POST" or scope.get("root_path"):
            return False
        path: str = scope["path"]
        if path == GENERATE_ROUTE:
            await self._serve(scope, receive, send, GENERATE_ROUTE, self._generate)
            return True
        if path.startswith(_SESSIONS) and path.endswith("/turns"):
            session_id = path[len(_SESSIONS) : -len("/turns")]
            if session_id and "/" not in session_id:
                await self._serve(scope, receive, send, TURN_ROUTE, self._turn)
                return True
        return False

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: str,
        handler: Callable[[Scope, Any, dict[bytes, bytes]], Awaitable[tuple[int, bytes, list]]],
    ) -> None:
        t0 = time.perf_counter()
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        body: list[bytes] = []
        more = True
        try:
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.limit):
                raise _Fallback
            ctype = headers.get(b"content-type")
            if ctype is not None and not ctype.lower().startswith(b"application/json"):
                raise _Fallback
            auth = headers.get(b"authorization")
            if not admits(self.ctx.config, None if auth is None else auth.decode("latin-1"), _ROLLOUT):
                raise _Fallback
            size = 0
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client went away
                    return
                chunk = message.get("body", b"")
                body.append(chunk)
                size += len(chunk)
                if size > self.limit:
                    raise _Fallback
                more = message.get("more_body", False)
            raw = body[0] if len(body) == 1 else b"".join(body)
            try:
                parsed = _loads(raw)
            except _JSONError:
                raise _Fallback from None
            status, content, extra = await handler(scope, (raw, parsed), headers)
        except _Fallback:
            await self.fallback(scope, _replay(body, more, receive), send)
            return
        except ApiError as exc:
            status, content = exc.status, dumps({"detail": exc.message})
            extra = []
            if exc.retry_after:
                extra.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
        except StateUnavailable as exc:
            status, content = 503, dumps({"detail": f"state store unavailable: {exc}"})
            extra = [(b"retry-after", b"1")]
        except StateError as exc:
            status, content, extra = 409, dumps({"detail": f"{type(exc).__name__}: {exc}"}), []
        except Exception:
            log.exception("unhandled error on %s", route)
            status, content = 500, b"Internal Server Error"
            extra = [(b"content-type", b"text/plain; charset=utf-8")]
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    *(extra if extra and extra[0][0] == b"content-type" else _JSON_HEADERS),
                    (b"content-length", str(len(content)).encode()),
                    *(h for h in extra if h[0] != b"content-type"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": content})
        self.seconds.labels(route, f"{status // 100}xx").observe(time.perf_counter() - t0)

    async def _turn(self, scope: Scope, body: tuple[bytes, Any], headers: dict[bytes, bytes]):
        spec = turn_spec_fast(body[1])
        if spec is None:
            raise _Fallback
        session_id = scope["path"][len(_SESSIONS) : -len("/turns")]
        return 200, await record_turn(self.ctx, session_id, spec), []

    async def _generate(self, scope: Scope, body: tuple[bytes, Any], headers: dict[bytes, bytes]):
        rows = generate_rows_fast(body[1])
        if rows is None:
            raise _Fallback
        key = None
        for name in _KEY_HEADERS:
            value = headers.get(name)
            if value:
                key = value.decode("latin-1")[:256]
                break
        response = await forward_generate(self.ctx, body[0], rows, key)
        ctype = response.headers.get("content-type", "application/json").encode("latin-1")
        return response.status_code, response.content, [(b"content-type", ctype)]


def _replay(body: list[bytes], more: bool, receive: Receive) -> Receive:
    """``receive`` that first hands out what was already read (one message; ``more``: the
    client has more to send), then defers to ``receive``."""
    pending = [b"".join(body)] if body else []

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": more}
        return await receive()

    return replay

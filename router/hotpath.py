"""The hot routes, answered without FastAPI: ``POST /v1/sessions/{session_id}/turns`` and
non-streaming ``POST /generate``.

A request is served here when it is canonical: a bearer key with the ``rollout`` scope (or auth
disabled), a JSON body (no content type, or ``application/json``) within ``max_body_bytes``
that :func:`router.schemas.turn_spec_fast` / :func:`router.schemas.generate_rows_fast` accepts.
It then runs the same code as the FastAPI routes (:func:`router.turns.record_turn`,
:func:`router.routes_sglang.forward_generate`) and is refused the same way
(``{"detail": ...}``, same statuses, ``Retry-After``). Everything else - no key or a wrong
one, an oversize, malformed or non-canonical body, streaming, ``text`` input - goes to the
FastAPI app unchanged, so each refusal is exactly the documented one, and the OpenAPI schema
comes from the FastAPI routes as before.

Two front ends use :class:`HotPath`: its ASGI ``__call__`` (in front of the app in any ASGI
server, :class:`router.app.RouterApp`) and the router's own HTTP protocol
(:mod:`router.server`), which skips the ASGI request cycle as well.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
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
_KEY_HEADERS = tuple(k.encode() for k in KEY_HEADERS)
_ROLLOUT = frozenset({"rollout"})
JSON_TYPE = b"application/json"
_STATUS_CLASS = {200: "2xx"}

Answer = tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]  # status, body, content type, extra headers
Job = Callable[[], Awaitable[Answer | bytes]]  # bytes: a 200 JSON body
_NO_HEADERS: list[tuple[bytes, bytes]] = []


def hot_route(method: str, path: str) -> str | None:
    """The route template when (method, path) is a hot route, else None."""
    if method != "POST":
        return None
    if path == GENERATE_ROUTE:
        return GENERATE_ROUTE
    if path.startswith(_SESSIONS) and path.endswith("/turns"):
        session_id = path[len(_SESSIONS) : -len("/turns")]
        if session_id and "/" not in session_id:
            return TURN_ROUTE
    return None


class HotPath:
    """Decides and answers hot-route requests for one app (see the module docstring)."""

    def __init__(self, ctx: RouterContext, fallback: ASGIApp) -> None:
        self.ctx = ctx
        self.fallback = fallback
        self.limit = ctx.config.max_body_bytes
        self.seconds = ctx.metrics.request_seconds

    # the decision, in two synchronous steps -------------------------------------------------
    def admit(self, headers: dict[bytes, bytes], seen: dict[tuple, bool] | None = None) -> bool:
        """Whether the request head allows the hot path (``headers``: lower-case names, first
        occurrence of each). ``seen`` (per connection) remembers the decision for the last
        content type and key (the configured keys do not change while the app runs)."""
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return False
        ctype = headers.get(b"content-type")
        auth = headers.get(b"authorization")
        if seen is not None:
            known = seen.get((ctype, auth))
            if known is not None:
                return known
        ok = (ctype is None or ctype.lower().startswith(JSON_TYPE)) and admits(
            self.ctx.config, None if auth is None else auth.decode("latin-1"), _ROLLOUT
        )
        if seen is not None:
            seen.clear()
            seen[(ctype, auth)] = ok
        return ok

    def prepare(self, route: str, path: str, body: bytes, headers: dict[bytes, bytes]) -> Job | None:
        """The work of an admitted request whose body is ``body``, or None when the body is not
        canonical (the FastAPI route must answer)."""
        try:
            parsed = _loads(body)
        except _JSONError:
            return None
        ctx = self.ctx
        if route == TURN_ROUTE:
            spec = turn_spec_fast(parsed)
            if spec is None:
                return None
            return partial(record_turn, ctx, path[len(_SESSIONS) : -len("/turns")], spec)
        rows = generate_rows_fast(parsed)
        if rows is None:
            return None
        key = None
        for name in _KEY_HEADERS:
            value = headers.get(name)
            if value:
                key = value.decode("latin-1")[:256]
                break

        async def generate() -> Answer:
            response = await forward_generate(ctx, body, rows, key)
            ctype = response.headers.get("content-type", "application/json").encode("latin-1")
            return response.status_code, response.content, ctype, []

        return generate

    async def run(self, route: str, job: Job, t0: float) -> Answer:
        """Run ``job``; refusals become their documented answers. Records the request metric."""
        try:
            result = await job()
        except Exception as exc:
            result = self.refusal(route, exc)
        return self.answered(route, result, t0)

    def refusal(self, route: str, exc: Exception) -> Answer:
        """The answer to a job that raised ``exc``."""
        if isinstance(exc, ApiError):
            extra = []
            if exc.retry_after:
                extra.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
            return exc.status, dumps({"detail": exc.message}), JSON_TYPE, extra
        if isinstance(exc, StateUnavailable):
            detail = dumps({"detail": f"state store unavailable: {exc}"})
            return 503, detail, JSON_TYPE, [(b"retry-after", b"1")]
        if isinstance(exc, StateError):
            return 409, dumps({"detail": f"{type(exc).__name__}: {exc}"}), JSON_TYPE, []
        log.error("unhandled error on %s", route, exc_info=exc)
        return 500, b"Internal Server Error", b"text/plain; charset=utf-8", []

    def answered(self, route: str, result: Answer | bytes, t0: float) -> Answer:
        """``result`` of a job (or :meth:`refusal`) as an answer; records the request metric."""
        answer = (200, result, JSON_TYPE, _NO_HEADERS) if type(result) is bytes else result
        status = answer[0]
        self.seconds.labels(route, _STATUS_CLASS.get(status) or f"{status // 100}xx").observe(
            time.perf_counter() - t0
        )
        return answer  # type: ignore[return-value]

    # the ASGI front end ---------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Serve a hot-route request (returns True) or do nothing (False: not a hot route)."""
        if scope.get("root_path"):
            return False
        route = hot_route(scope["method"], scope["path"])
        if route is None:
            return False
        t0 = time.perf_counter()
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        body: list[bytes] = []
        more = True
        job = None
        if self.admit(headers):
            size = 0
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client went away
                    return True
                chunk = message.get("body", b"")
                body.append(chunk)
                size += len(chunk)
                if size > self.limit:
                    break
                more = message.get("more_body", False)
            if not more:
                job = self.prepare(route, scope["path"], b"".join(body), headers)
        if job is None:
            await self.fallback(scope, _replay(body, more, receive), send)
            return True
        status, content, ctype, extra = await self.run(route, job, t0)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype),
                    (b"content-length", str(len(content)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": content})
        return True


def _replay(body: list[bytes], more: bool, receive: Receive) -> Receive:
    """``receive`` that first hands out what was already read (one message; ``more``: the
    client has more to send), then defers to ``receive``."""
    pending = [b"".join(body)] if body else []

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": more}
        return await receive()

    return replay

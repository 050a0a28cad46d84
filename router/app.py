"""The router's FastAPI app: ``create_app(config)``.

Routes: sessions and turns (:mod:`router.routes_sessions`), trainer batches
(:mod:`router.routes_trainer`), groups and replica heartbeats (:mod:`router.routes_fleet`), the
cost ledger (:mod:`router.routes_ledger`), Prometheus service discovery (:mod:`router.routes_prometheus`),
SGLang's native API (:mod:`router.routes_sglang`), ``/healthz``, ``/metrics`` and
``/openapi.json``. Extra routers (e.g. the weight-sync admin routes) come in through
``extra_routers`` or :func:`include_routes`; they reach the :class:`RouterContext` as
``request.app.state.ctx``.

Every request goes through the FastAPI app and its middleware. Every refusal is a 4xx with an
:class:`router.schemas.ErrorBody` (``{"detail": "<message naming the field or problem>"}``,
plus ``errors`` on a 422), documented on each route that can answer it; on the chat routes it
also carries the API's own ``error`` object and a malformed request is a 400, as OpenAI's and
Anthropic's APIs answer; an unexpected failure is a 500 in the same shapes, naming only the
exception's type; a chat API's call sent to the router's root is a 404 in that API's shape
saying where a session's chat URLs come from; an unreachable state store or fleet is a 503 with
``Retry-After``; bodies over ``config.max_body_bytes`` get 413 before they are read, except
where a route sets its own request's limit (the trainer log-prob upload: its lease's size,
:mod:`router.body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import (
    routes_fleet,
    routes_ledger,
    routes_prometheus,
    routes_sessions,
    routes_sglang,
    routes_trainer,
)
from router.body import SCOPE_KEY, BodyLimit, declared_size
from router.chat import anthropic_routes, openai_routes
from router.chat.errors import Api, api_error, chat_api
from router.config import RouterConfig
from router.context import RouterContext
from router.disconnect import CancelOnDisconnect
from router.errors import ApiError, refusal_of
from router.schemas import Healthz
from router.state.base import StateError, StateStore, StateUnavailable

log = logging.getLogger("mixfleet.router")
ROUTER_HEADER = b"x-mixfleet-router"


class EdgeMiddleware:
    """Pure ASGI: holds every request's body to its limit (413), times every request into the
    metrics and names the router process that answered (``X-Mixfleet-Router: <host>/<pid>``).

    The limit is the request's :class:`router.body.BodyLimit` (put in its scope: the router's
    ``max_body_bytes``, unless its route set its own before reading, :func:`router.body.read_body`),
    checked at the body's first read against a declared ``Content-Length`` (before any byte is
    read) and then against the bytes received. Not FastAPI's own body limit
    (``FastAPI(max_body_size=...)``, fastapi 0.164): to a request whose declared Content-Length is
    over it, that limit answers a plain-text "Content Too Large" in place of whatever the app's
    handlers answer (starlette 1.10 middleware/body_limit.py 115-121), and every refusal of the
    router is an :class:`router.schemas.ErrorBody` (JSON naming the problem)."""

    def __init__(self, app: ASGIApp, ctx: RouterContext) -> None:
        self.app = app
        self.ctx = ctx
        self.limit = ctx.config.max_body_bytes
        self.worker = (ROUTER_HEADER, f"{os.uname().nodename}/{os.getpid()}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]
        bound = scope[SCOPE_KEY] = BodyLimit(self.limit)
        declared = declared_size(scope)
        received = -1  # bytes of the body received; -1 before its first read

        async def counted_receive() -> Message:
            nonlocal received
            if received < 0:
                received = 0
                if declared is not None:
                    bound.refuse_over(declared, declared=True)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                bound.refuse_over(received, declared=False)
            return message

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), self.worker]}
            await send(message)

        try:
            await self.app(scope, counted_receive, timed_send)
        finally:
            self._observe(scope, status[0], t0)

    def _observe(self, scope: Scope, status: int, t0: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self.ctx.metrics.request_seconds.labels(path, f"{status // 100}xx").observe(time.perf_counter() - t0)


def _validation_detail(exc: RequestValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors = []
    parts = []
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            where = ".".join(loc[1:]) or loc[0]
        else:
            where = ".".join(loc) or "body"
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "json_invalid":
            where, msg = "body", f"malformed JSON ({msg})"
        parts.append(f"{where}: {msg}")
        errors.append({"loc": loc, "msg": msg, "type": str(e.get("type", ""))})
    return "; ".join(parts[:5]) or "invalid request", errors


def include_routes(app: FastAPI, *routers: APIRouter) -> None:
    """Add routers to a router app (they see ``request.app.state.ctx``)."""
    for r in routers:
        app.include_router(r)


def create_app(
    config: RouterConfig, extra_routers: Iterable[APIRouter] = (), *, store: StateStore | None = None
) -> FastAPI:
    """A router app for ``config``, on ``store`` (default: the one ``config.state_url`` names).
    The state store, HTTP pool and replica polling start with the app's lifespan and stop with
    it (the store is closed then, whoever made it)."""
    ctx = RouterContext(config, store=store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if config.auth_disabled:
            log.warning("AUTH IS DISABLED: every client may open sessions, take batches and change the fleet")
        if config.vocab_size is None:
            log.warning("no vocabulary size (--vocab-size): input ids reach the engines unchecked against it")
        await ctx.start()
        try:
            yield
        finally:
            await ctx.stop()

    app = FastAPI(
        title="mixfleet router",
        version="0.1.0",
        description="Rollout API of a mixed-precision sampler fleet: sessions, token-in-token-out turns "
        "with behavior records, trainer batches, SGLang-native /generate.",
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry off: the router's metrics are Prometheus (router/metrics.py),
        # and with it on every request looks up the global tracer, meter and logger providers
        # (fastapi 0.165 telemetry/_asgi.py 174-198)
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.ctx = ctx
    app.add_middleware(CancelOnDisconnect)  # inside the edge: its metrics see the 499
    app.add_middleware(EdgeMiddleware, ctx=ctx)
    _add_error_handlers(app)
    _add_ops_routes(app, ctx)
    for r in (
        routes_sessions.router,
        routes_trainer.router,
        routes_trainer.score_router,
        routes_fleet.router,
        routes_ledger.router,
        routes_sglang.router,
        routes_prometheus.router,
        openai_routes.router,
        anthropic_routes.router,
        *extra_routers,
    ):
        app.include_router(r)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as JSON: an :class:`ApiError` as it says, an unreachable state store 503 with
    ``Retry-After``, a state conflict 409, a malformed request 422 naming its fields. Under a chat
    API's URL prefix (a route of it or not: an unknown path, a method it does not take) every
    answer also carries that API's own error shape (:mod:`router.chat.errors`, what the official
    clients read), a malformed request is that API's 400, and an unexpected failure a 500 in that
    shape. A chat API's call sent to the router's root (a client whose ``base_url`` is the router:
    ``POST /v1/chat/completions``, ``/v1/messages``, ``GET /v1/models``, :func:`_root_chat_api`)
    is a 404 in that API's shape saying the chat APIs are per session and where they are."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _refusal(request, exc)

    @app.exception_handler(HTTPException)  # Starlette's: FastAPI's and the router's own 404 / 405
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        if chat_api(request.url.path) is not None:
            return _refusal(request, ApiError(exc.status_code, str(exc.detail)), exc.headers)
        if exc.status_code == 404 and (api := _root_chat_api(request)) is not None:
            return _refusal(request, ApiError(404, _per_session(request, api)), api=api)
        return await http_exception_handler(request, exc)

    @app.exception_handler(StateUnavailable)
    async def _state_down(request: Request, exc: StateUnavailable) -> JSONResponse:
        return _refusal(request, refusal_of(exc))

    @app.exception_handler(StateError)
    async def _state_error(request: Request, exc: StateError) -> JSONResponse:
        return _refusal(request, refusal_of(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, errors = _validation_detail(exc)
        return _refusal(request, ApiError(422, message, fields={"errors": errors}))

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        """An unexpected failure: a 500 whose body names the exception's type only (not its
        message, no traceback), an :class:`router.schemas.ErrorBody`, in the chat API's shape
        under a chat URL. Starlette's ServerErrorMiddleware calls this, sends its answer, then
        re-raises ``exc`` (starlette 1.10 middleware/errors.py 163-186), which the server logs
        once with its traceback and answers by closing the connection (uvicorn 0.55
        protocols/http/httptools_impl.py 423-429, h11_impl.py 410-416: "Exception in ASGI
        application"); the answer says ``Connection: close``, so no client sends its next request
        on a connection being closed (it would be reset)."""
        return _refusal(request, refusal_of(exc), {"Connection": "close"})


def _refusal(
    request: Request, exc: ApiError, headers: Mapping[str, str] | None = None, *, api: Api | None = None
) -> JSONResponse:
    """The one answer of a refusal: its body (in the chat API's shape under a chat URL, or in
    ``api``'s), status, ``Retry-After`` and ``headers``; a chat 409 also tells the official
    clients not to retry it."""
    api = api or chat_api(request.url.path)
    if api is not None:
        exc = api_error(exc, api)
    out = dict(headers or {})
    if exc.retry_after:
        out["Retry-After"] = str(max(1, round(exc.retry_after)))
    if api is not None and exc.status == 409:
        # the official clients retry a 409 (a lock timeout on their APIs: openai and anthropic
        # _base_client.py _should_retry) unless told not to; a chat 409 is a session that takes
        # no more turns
        out["x-should-retry"] = "false"
    return JSONResponse(exc.body(), status_code=exc.status, headers=out or None)


_ROOT_CHAT = re.compile(
    r"(?:/v1){0,2}/(?:(?P<openai>chat/completions|completions|responses|embeddings)"
    r"|(?P<anthropic>messages(?:/count_tokens|/batches)?)|(?P<models>models(?:/[^/]+)?))/?"
)
"""A chat API's path as an official client sends it when its ``base_url`` is the router itself
(``http://ROUTER`` or ``http://ROUTER/v1``), not a session's chat URL."""


def _root_chat_api(request: Request) -> Api | None:
    """The chat API an unmatched request is for when it is one of those APIs' calls sent to the
    router's root (:data:`_ROOT_CHAT`): ``/v1/models`` is Anthropic's when the request carries
    the ``anthropic-version`` header its client always sends, else OpenAI's."""
    m = _ROOT_CHAT.fullmatch(request.url.path)
    if m is None:
        return None
    if m["openai"]:
        return "openai"
    if m["anthropic"] or "anthropic-version" in request.headers:
        return "anthropic"
    return "openai"


def _per_session(request: Request, api: Api) -> str:
    """What a 404 for a chat call sent to the router's root says: where that API is served."""
    field = "openai_base_url" if api == "openai" else "anthropic_base_url"
    path = "openai/v1" if api == "openai" else "anthropic"
    return (
        f"no {request.method} {request.url.path} at the router's root: the chat APIs are per session; "
        f"create one with POST /v1/sessions and use its {field} (.../v1/sessions/<id>/{path}) as the "
        "client's base_url"
    )


def _add_ops_routes(app: FastAPI, ctx: RouterContext) -> None:
    """``/healthz`` (liveness and state-store reachability) and ``/metrics`` (Prometheus)."""

    @app.get(
        "/healthz",
        tags=["ops"],
        summary="Router liveness and state-store reachability",
        response_model=Healthz,
        responses={503: {"model": Healthz, "description": "The state store is unreachable"}},
    )
    async def healthz() -> JSONResponse:
        ok = await ctx.store.ping()
        latest = ctx.latest_version()
        ready = sum(len(ctx.registry.in_rotation(g.name, latest)) for g in ctx.fleet.groups)
        return JSONResponse(
            {"status": "ok" if ok else "degraded", "state": ok, "replicas_in_rotation": ready},
            status_code=200 if ok else 503,
        )

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics (text exposition format)",
        response_class=PlainTextResponse,
    )
    async def metrics() -> PlainTextResponse:
        try:
            async with asyncio.timeout(METRICS_STATE_TIMEOUT_S):
                ctx.metrics.snapshot = await _fleet_snapshot(ctx)
        except (StateError, TimeoutError) as exc:
            log.warning("metrics without state: %s", exc or f"no answer in {METRICS_STATE_TIMEOUT_S:g} s")
            ctx.metrics.snapshot = {"state_up": False}
        return PlainTextResponse(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


METRICS_STATE_TIMEOUT_S = 5.0
"""How long a scrape of ``/metrics`` waits for the state store: half a Prometheus scrape's default
timeout (10 s), so a state outage (a Redis call retries for 20 s) still answers the request-path
families and ``mixfleet_router_state_up 0`` in time, instead of failing the scrape."""


async def _fleet_snapshot(ctx: RouterContext) -> dict[str, Any]:
    """``RouterMetrics.snapshot`` read now from the registry and the state store (StateError when
    the store does not answer)."""
    snap = await ctx.groups_snapshot()
    snap["queue"] = await ctx.store.queue_stats()
    snap["ledger"] = await ctx.store.ledger_totals()
    snap["mismatch"] = await ctx.store.mismatch()
    snap["mismatch_totals"] = await ctx.store.mismatch_totals()
    snap["mismatch_band"] = ctx.config.mismatch_band
    snap["state_up"] = True
    for g in snap["groups"]:
        spec = ctx.fleet.group(g["name"])
        g["gpus_per_replica"] = spec.gpus_per_replica
        g["price_per_gpu_hour"] = spec.price_per_gpu_hour
    return snap

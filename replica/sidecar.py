"""The per-replica sidecar: the replica's HTTP front and its weight-version reconciler.

docs/architecture.md, "2. A weight version". One sidecar runs beside one engine (the local CPU engine or
SGLang) and is the replica's only public port:

- **Proxy**: SGLang's generation routes (``/generate``, streaming included, ``/health_generate``,
  ``/model_info``, ``/server_info`` and their ``/get_*`` aliases) go to the engine unchanged.
  The engine's control routes (weights, pause, continue, flush, memory, profiling) answer
  403: only the sidecar drives them. ``/abort_request`` naming one request (``rid``, no
  ``abort_all``) is proxied, so the router can abort a turn whose client went away; an abort of
  every request, or one without a ``rid``, is a control route (403).
- **Health**: ``/health`` is 200 only while the engine answers (during an activation, as it
  answered before: :meth:`Reconciler.engine_health`) and the replica is *ready*: it
  has served the store pointer's version at least once since the sidecar started (a new
  replica joins at the current version). ``/metrics`` is the sidecar's own ``mixfleet_replica_*``
  metrics (Prometheus conventions, no colons: ``promtool check metrics`` passes);
  ``/engine/metrics`` is the engine's ``/metrics`` unchanged (SGLang's ``sglang:*`` names, empty
  while the engine does not answer), so one scrape target per replica serves both (the engine's
  own port need not be reachable). ``/v1/status`` is the JSON state.
- **Reconcile** (:mod:`replica.reconciler`): the store pointer is read every ``poll_s`` (<= 1 s)
  and on ``POST /v1/wake``; a newer version is staged (copied, checksums verified) while
  serving, then activated (:func:`replica.activation.activate`: ``/pause_generation`` retract ->
  ``/update_weights_from_disk`` with a cache flush -> ``/continue_generation``); the active
  version changes only once the engine reports it;
  pending versions coalesce into the newest; failures keep the old version, are reported and
  retried with backoff.
- **Hold**: while an activation has the engine paused, a ``/generate`` waits in the sidecar
  (:mod:`replica.hold`), and an ``/abort_request`` naming it ends it there: it is answered in the
  shape of SGLang's answer to an abort of a request that never ran (finish reason "Abort in
  waiting queue", nothing generated) and never reaches the engine, where SGLang would hold it
  out of the abort's reach. Its version constraint is checked once the hold opens.
- **Version constraints**: a ``/generate`` body field or header ``min_version`` /
  ``exact_version`` (headers ``X-Mixfleet-Min-Version`` / ``X-Mixfleet-Exact-Version``, or
  ``X-Min-Version`` / ``X-Exact-Version``) that the active version does not meet gets a
  retryable 409 naming the target and applied versions (the fields are
  removed before the body goes to the engine).
- **Heartbeats** (:mod:`replica.reconciler`): with a router URL, ``POST
  {router}/v1/replicas/heartbeat`` every ``heartbeat_s`` and on every activation, naming the
  replica by its id and the URL it advertises. Every container of one Modal server advertises
  the server's one URL with its own id, so the router holds one entry per container
  (:mod:`router.registry`); the router pins each request to its container (:mod:`router.pinning`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from clients.engine import EngineUnavailable, SGLangClient, make_http_client
from clients.router import RouterClient
from clients.sidecar import STATUS_PATH, WAKE_PATH
from core.jsonio import dumps, loads
from core.sglang_release import WAITING_ABORT
from replica.reconciler import Activation, Reconciler, ReconcileSettings, parse_prometheus
from weight_sync.store.base import VersionStore
from weight_sync.types import InvalidVersion, VersionConstraint, VersionUnavailable

__all__ = [
    "Activation",
    "ReconcileSettings",
    "Reconciler",
    "SidecarConfig",
    "create_app",
    "routes",
    "parse_prometheus",
    "version_conflict",
]

PROXIED_GET = ("/health_generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info")
BLOCKED = (
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/start_profile",
    "/stop_profile",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/set_internal_state",
    "/shutdown",
)
# The router sends X-Mixfleet-Min-Version; the short names are accepted too.
MIN_HEADERS = ("x-mixfleet-min-version", "x-min-version")
EXACT_HEADERS = ("x-mixfleet-exact-version", "x-exact-version")


def version_conflict(rec: Reconciler, body: Any, headers: Any) -> VersionUnavailable | InvalidVersion | None:
    """The request's version constraint (body fields win over headers) checked against the active
    version: VersionUnavailable (409) or InvalidVersion (400), or None when it is met. The engine
    never sees the body's constraint fields (:func:`_forwarded`)."""
    want_min = next((headers.get(h) for h in MIN_HEADERS if headers.get(h) is not None), None)
    want_exact = next((headers.get(h) for h in EXACT_HEADERS if headers.get(h) is not None), None)
    if isinstance(body, dict):
        bmin, bexact = body.get("min_version"), body.get("exact_version")
        want_min = bmin if bmin is not None else want_min
        want_exact = bexact if bexact is not None else want_exact
    try:
        constraint = VersionConstraint.parse(min_version=want_min, exact_version=want_exact)
    except InvalidVersion as exc:
        return exc
    active = rec.state.active_version
    if constraint.satisfied_by(active):
        return None
    return VersionUnavailable(
        constraint,
        applied_version=active,
        pending_version=rec.state.desired_version,
        replica=rec.config.replica_id,
        group=rec.config.group,
    )


@dataclass(frozen=True)
class SidecarConfig:
    """Everything one sidecar needs: its engine (``engine_url``), the router its heartbeats go to
    (``router_url``, with ``api_key``; none without a router) and what its reconciler serves."""

    engine_url: str
    reconcile: ReconcileSettings
    router_url: str | None = None
    api_key: str | None = None


def create_app(config: SidecarConfig, store: VersionStore) -> FastAPI:
    """The sidecar's ASGI app (the module's :data:`routes` on a :class:`Reconciler` of ``config``
    kept as ``app.state.sidecar``); its connections open and reconciling starts with the app's
    lifespan, and both end with it."""
    settings = config.reconcile
    sidecar = Reconciler(settings, store)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        http = make_http_client(timeout_s=settings.engine_timeout_s)
        engine = SGLangClient(http, config.engine_url)
        router = RouterClient(http, config.router_url, config.api_key, 5.0) if config.router_url else None
        await sidecar.start(engine, router)
        try:
            yield
        finally:
            await sidecar.stop()
            await http.close()

    app = FastAPI(title=f"mixfleet sidecar {settings.replica_id}", lifespan=lifespan)
    app.state.sidecar = sidecar
    app.include_router(routes)
    return app


routes = APIRouter()
"""Every route of a sidecar; each handler serves the :class:`Reconciler` at ``app.state.sidecar``."""


def _sidecar(request: Request) -> Reconciler:
    return request.app.state.sidecar


def _engine(request: Request) -> SGLangClient:
    engine = _sidecar(request).engine
    assert engine is not None, "the sidecar's engine client opens with the app's lifespan"
    return engine


def _error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message}, **extra}, status_code=status, headers=headers)


@routes.api_route("/health", methods=["GET", "POST"])
async def health(request: Request) -> JSONResponse:
    sidecar = _sidecar(request)
    ok = await sidecar.engine_health()
    s = sidecar.state
    body = {
        "ready": s.ready,
        "engine_ok": ok,
        "active_version": s.active_version,
        "desired_version": s.desired_version,
        "error": s.error,
    }
    return JSONResponse(body, status_code=200 if (ok and s.ready) else 503)


@routes.get(STATUS_PATH)
async def status(request: Request) -> dict[str, Any]:
    return _sidecar(request).status()


@routes.post(WAKE_PATH)
async def wake(request: Request) -> dict[str, Any]:
    sidecar = _sidecar(request)
    sidecar.wake()
    return {"ok": True, "desired_version": sidecar.state.desired_version}


@routes.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    registry = _sidecar(request).metrics.registry
    return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@routes.get("/engine/metrics")
async def engine_metrics(request: Request) -> PlainTextResponse:
    text = await _sidecar(request).engine_metrics_text()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _blocked(path: str):
    async def handler() -> JSONResponse:
        return _error(
            403,
            f"{path} is a control route of this replica's engine; only its sidecar may call it (publish "
            "weights through the router's /v1/weights)",
        )

    return handler


def _proxy_simple(path: str):
    async def handler(request: Request) -> Response:
        body = await request.body()
        query = request.url.query
        headers = {"content-type": request.headers.get("content-type", "application/json")} if body else None
        try:
            r = await _engine(request).forward(
                request.method,
                path + (f"?{query}" if query else ""),
                body or None,
                headers=headers,
                timeout=30.0,
            )
        except EngineUnavailable as exc:
            return _error(502, f"engine unreachable: {exc.message}")
        # unchanged: an answer without a content type (SGLang's /abort_request, /health_generate)
        # is passed on without one
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return handler


for _path in BLOCKED:
    routes.add_api_route(
        _path, _blocked(_path), methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False
    )
for _path in PROXIED_GET:
    routes.add_api_route(_path, _proxy_simple(_path), methods=["GET", "POST"], include_in_schema=False)


@routes.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """SGLang's ``/abort_request`` (``AbortReq``: ``rid``, ``abort_all``; io_struct.py 2285-2296),
    proxied for one named request only."""
    try:
        body = loads(await request.body() or b"{}")
    except ValueError:
        return _error(400, "/abort_request: the body is not JSON")
    rid = body.get("rid") if isinstance(body, dict) else None
    if not (isinstance(rid, str) and rid) or body.get("abort_all"):
        return _error(
            403,
            "/abort_request of more than one named request (abort_all, or no rid) is a control route; "
            "only its sidecar may call it",
        )
    if _sidecar(request).hold.abort(rid):  # never sent to the engine: ended here
        return Response(status_code=200)
    return await _proxy_simple("/abort_request")(request)


@routes.post("/generate")
async def generate(request: Request) -> Response:
    """SGLang's ``/generate``, proxied once the request's version constraint is met and the
    replica is ready (409 / 400 / 503 otherwise); streamed when the body asks for it."""
    sidecar = _sidecar(request)
    raw = await request.body()
    try:
        body = loads(raw) if raw else None
    except ValueError:
        body = None
    rid = body.get("rid") if isinstance(body, dict) else None
    t0 = time.monotonic()
    if not await sidecar.hold.wait(rid):
        return _aborted_while_held(sidecar, body, rid, time.monotonic() - t0)
    problem = version_conflict(sidecar, body, request.headers)
    if isinstance(problem, VersionUnavailable):
        sidecar.metrics.conflicts.inc()
        return JSONResponse(problem.body(), status_code=409, headers={"Retry-After": "1"})
    if problem is not None:
        return _error(400, str(problem))
    if not sidecar.state.ready:
        message = (
            f"replica {sidecar.config.replica_id} is not ready (joining at version "
            f"{sidecar.state.desired_version})"
        )
        return _error(503, message, {"Retry-After": "1"}, retryable=True)
    try:
        content = _forwarded(raw, body)
    except ValueError as exc:
        return _error(
            400, f"/generate: a body with {' or '.join(CONSTRAINT_FIELDS)} must be strict JSON: {exc}"
        )
    release = _count_in_flight(sidecar)
    if isinstance(body, dict) and body.get("stream"):
        return await _stream(_engine(request), content, release)
    try:
        r = await _engine(request).forward("POST", "/generate", content)
    except EngineUnavailable as exc:
        return _error(502, f"engine unreachable: {exc.message}")
    finally:
        release()
    return Response(
        r.content, status_code=r.status_code, media_type=r.headers.get("content-type", "application/json")
    )


CONSTRAINT_FIELDS = ("min_version", "exact_version")
"""A ``/generate`` body's version constraint fields: the sidecar's, never the engine's."""


def _forwarded(raw: bytes, body: Any) -> bytes:
    """What the engine is sent of a ``/generate`` body: its bytes as received (the engine judges
    them, as it judges a body sent to it directly), unless it carries a version constraint field,
    then it re-encoded without them, from its strict reading (ValueError for a body that is not
    strict JSON, a NaN or a lone surrogate, which could not be sent on as it came)."""
    if not (isinstance(body, dict) and any(k in body for k in CONSTRAINT_FIELDS)):
        return raw
    strict = loads(raw, strict=True)
    for key in CONSTRAINT_FIELDS:
        strict.pop(key, None)
    return dumps(strict)


def _aborted_while_held(sidecar: Reconciler, body: dict[str, Any], rid: str, held_s: float) -> Response:
    """The answer to a request aborted in the hold, in the shape of SGLang's answer to an abort of
    a request in its waiting queue that never ran (``_handle_abort_req``,
    managers/tokenizer_manager.py 3577-3642: finish reason :data:`~core.sglang_release.WAITING_ABORT`,
    nothing generated; the log-prob keys, all empty, left out), whole or as a stream's one event
    before ``[DONE]``."""
    answer = {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": dict(WAITING_ABORT),
            "weight_version": str(sidecar.state.active_version),
            "e2e_latency": held_s,
            "completion_tokens": 0,
        },
    }
    if body.get("stream"):
        return Response(b"data: " + dumps(answer) + b"\n\ndata: [DONE]\n\n", media_type="text/event-stream")
    return Response(dumps(answer), media_type="application/json")


def _count_in_flight(sidecar: Reconciler) -> Callable[[], None]:
    """Count one more request in flight; the returned function counts it out (once, however often
    it is called)."""
    s = sidecar.state
    s.in_flight += 1
    sidecar.metrics.in_flight.set(s.in_flight)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            s.in_flight -= 1
            sidecar.metrics.in_flight.set(s.in_flight)

    return release


async def _stream(engine: SGLangClient, content: bytes, release: Callable[[], None]) -> Response:
    """The engine's streamed answer to ``content``, relayed chunk by chunk; ``release`` runs when
    the relay ends (or at once when the engine cannot be reached)."""
    try:
        head, chunks = await engine.stream("POST", "/generate", content)
    except EngineUnavailable as exc:
        release()
        return _error(502, f"engine unreachable: {exc.message}")

    async def relay():
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            release()

    media = head.headers.get("content-type", "text/event-stream")
    return StreamingResponse(
        relay(), status_code=head.status_code, media_type=media, background=BackgroundTask(release)
    )

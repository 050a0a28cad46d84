"""The per-replica sidecar: the replica's HTTP front and its weight-version reconciler.

DESIGN.md, "Weight versions". One sidecar runs beside one engine (the local CPU engine or
SGLang) and is the replica's only public port:

- **Proxy**: SGLang's generation routes (``/generate``, streaming included, ``/health_generate``,
  ``/model_info``, ``/server_info`` and their ``/get_*`` aliases) go to the engine unchanged.
  The engine's control routes (weights, pause, continue, flush, abort, memory, profiling) answer
  403: only the sidecar drives them.
- **Health**: ``/health`` is 200 only while the engine answers and the replica is *ready*: it
  has served the store pointer's version at least once since the sidecar started (a new
  replica joins at the current version). ``/metrics`` is the sidecar's ``mixfleet_replica_*``
  metrics followed by the engine's ``sglang:*`` metrics. ``/v1/status`` is the JSON state.
- **Reconcile** (:mod:`fleet.reconciler`): the store pointer is read every ``poll_s`` (<= 1 s)
  and on ``POST /v1/wake``; a newer version is staged (copied, checksums verified) while
  serving, then activated (``/pause_generation`` in place -> ``/update_weights_from_disk`` ->
  ``/continue_generation``); the active version changes only once the engine reports it;
  pending versions coalesce into the newest; failures keep the old version, are reported and
  retried with backoff.
- **Version constraints**: a ``/generate`` body field or header ``min_version`` /
  ``exact_version`` (headers ``X-Mixfleet-Min-Version`` / ``X-Mixfleet-Exact-Version``, or
  ``X-Min-Version`` / ``X-Exact-Version``) that the active version does not meet gets a
  retryable 409 naming the target and applied versions (the fields are
  removed before the body goes to the engine).
- **Heartbeats** (:mod:`fleet.reconciler`): with a router URL, ``POST
  {router}/v1/replicas/heartbeat`` every ``heartbeat_s`` and on every activation.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.background import BackgroundTask

from fleet.reconciler import Activation, Reconciler, SidecarConfig, parse_prometheus
from weight_sync.store.base import VersionStore
from weight_sync.types import InvalidVersion, VersionConstraint, VersionUnavailable

__all__ = ["Activation", "Reconciler", "SidecarConfig", "create_app", "parse_prometheus", "version_conflict"]

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
    "/abort_request",
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


def version_conflict(
    rec: Reconciler, body: Any, headers: Any
) -> tuple[VersionUnavailable | InvalidVersion | None, Any]:
    """The request's version constraint (body fields win over headers) checked against the active
    version: ``(VersionUnavailable (409) or InvalidVersion (400), or None when it is met; the body
    without its constraint fields, which the engine must not see)``."""
    want_min = next((headers.get(h) for h in MIN_HEADERS if headers.get(h) is not None), None)
    want_exact = next((headers.get(h) for h in EXACT_HEADERS if headers.get(h) is not None), None)
    if isinstance(body, dict):
        body = dict(body)
        bmin, bexact = body.pop("min_version", None), body.pop("exact_version", None)
        want_min = bmin if bmin is not None else want_min
        want_exact = bexact if bexact is not None else want_exact
    try:
        constraint = VersionConstraint.parse(min_version=want_min, exact_version=want_exact)
    except InvalidVersion as exc:
        return exc, body
    active = rec.state.active_version
    if constraint.satisfied_by(active):
        return None, body
    return VersionUnavailable(
        constraint,
        applied_version=active,
        pending_version=rec.state.desired_version,
        replica=rec.config.replica_id,
        group=rec.config.group,
    ), body


def create_app(config: SidecarConfig, store: VersionStore) -> FastAPI:
    """The sidecar's ASGI app; reconciling starts with the app's lifespan."""

    sidecar = Reconciler(config, store)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await sidecar.start()
        try:
            yield
        finally:
            await sidecar.stop()

    app = FastAPI(title=f"mixfleet sidecar {config.replica_id}", lifespan=lifespan)
    app.state.sidecar = sidecar

    @app.api_route("/health", methods=["GET", "POST"])
    async def health() -> JSONResponse:
        ok = await sidecar._engine_health() if sidecar._engine is not None else False
        s = sidecar.state
        body = {
            "ready": s.ready,
            "engine_ok": ok,
            "active_version": s.active_version,
            "desired_version": s.desired_version,
            "error": s.error,
        }
        return JSONResponse(body, status_code=200 if (ok and s.ready) else 503)

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return sidecar.status()

    @app.post("/v1/wake")
    async def wake() -> dict[str, Any]:
        sidecar.wake()
        return {"ok": True, "desired_version": sidecar.state.desired_version}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        own = generate_latest(sidecar.metrics.registry).decode()
        engine = await sidecar.engine_metrics_text()
        return PlainTextResponse(own + engine, media_type="text/plain; version=0.0.4; charset=utf-8")

    for path in BLOCKED:
        app.add_api_route(
            path, _blocked(path), methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False
        )

    for path in PROXIED_GET:
        app.add_api_route(
            path, _proxy_simple(sidecar, path), methods=["GET", "POST"], include_in_schema=False
        )

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if body is not None:
            problem, body = version_conflict(sidecar, body, request.headers)
        else:
            problem, _ = version_conflict(sidecar, None, request.headers)
        if isinstance(problem, VersionUnavailable):
            sidecar.metrics.conflicts.inc()
            return JSONResponse(problem.body(), status_code=409, headers={"Retry-After": "1"})
        if problem is not None:
            return JSONResponse({"error": {"message": str(problem)}}, status_code=400)
        if not sidecar.state.ready:
            return JSONResponse(
                {
                    "error": {
                        "message": f"replica {config.replica_id} is not ready (joining at version "
                        f"{sidecar.state.desired_version})"
                    },
                    "retryable": True,
                },
                status_code=503,
                headers={"Retry-After": "1"},
            )
        content = json.dumps(body).encode() if body is not None else raw
        assert sidecar._engine is not None
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

        try:
            req = sidecar._engine.build_request(
                "POST", "/generate", content=content, headers={"content-type": "application/json"}
            )
            resp = await sidecar._engine.send(req, stream=True)
        except httpx.HTTPError as exc:
            release()
            return JSONResponse({"error": {"message": f"engine unreachable: {exc!r}"}}, status_code=502)
        media = resp.headers.get("content-type", "application/json")
        if isinstance(body, dict) and body.get("stream"):

            async def chunks():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
                    release()

            return StreamingResponse(
                chunks(), status_code=resp.status_code, media_type=media, background=BackgroundTask(release)
            )
        try:
            data = await resp.aread()
        except httpx.HTTPError as exc:
            return JSONResponse(
                {"error": {"message": f"engine failed mid-response: {exc!r}"}}, status_code=502
            )
        finally:
            await resp.aclose()
            release()
        return Response(data, status_code=resp.status_code, media_type=media)

    return app


def _blocked(path: str):
    async def handler() -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": f"{path} is a control route of this replica's engine; only its sidecar "
                    "may call it (publish weights through the router's /v1/weights)"
                }
            },
            status_code=403,
        )

    return handler


def _proxy_simple(sidecar: Reconciler, path: str):
    async def handler(request: Request) -> Response:
        assert sidecar._engine is not None
        try:
            r = await sidecar._engine.request(
                request.method,
                path,
                content=await request.body(),
                headers={"content-type": request.headers.get("content-type", "application/json")},
                params=dict(request.query_params),
                timeout=30.0,
            )
        except httpx.HTTPError as exc:
            return JSONResponse({"error": {"message": f"engine unreachable: {exc!r}"}}, status_code=502)
        return Response(
            r.content, status_code=r.status_code, media_type=r.headers.get("content-type", "application/json")
        )

    return handler

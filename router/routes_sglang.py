"""SGLang's native API on the router, so frameworks that talk to one SGLang server (Miles,
slime, veRL) can point at the fleet unchanged.

``POST /generate`` is validated, then forwarded unchanged (streaming included) to a replica.
The routing key comes from ``X-Session-ID``, ``X-SMG-Routing-Key`` or ``Modal-Session-ID``
(first present wins): requests with the same key stay on one group and, while it is in
rotation, one replica (on Modal, pinned to its container: :mod:`router.pinning`); it is forwarded
as ``Modal-Session-ID``. Without a key a request is
one-shot (group by policy). Failover is as for turns, before the first response byte only.
These requests are not recorded as trajectories.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from clients.engine import EngineRejected, EngineUnavailable, RawResponse, SGLangClient
from router.auth import require
from router.context import RouterContext
from router.dispatch import check_vocab, with_failover
from router.errors import AUTH, BODY, ApiError, error_responses, unavailable
from router.json_route import JsonRoute
from router.policy import assign_group
from router.schemas import GenerateRefusal, GenerateRequest, Health

router = APIRouter(tags=["sglang"], route_class=JsonRoute)
KEY_HEADERS = ("x-session-id", "x-smg-routing-key", "modal-session-id")
_PASS_HEADERS = ("content-type", "x-request-id")


def _ctx(request: Request) -> RouterContext:
    return request.app.state.ctx


def routing_key(request: Request) -> str | None:
    for name in KEY_HEADERS:
        value = request.headers.get(name)
        if value:
            return value[:256]
    return None


@router.post(
    "/generate",
    dependencies=[Depends(require("rollout"))],
    summary="SGLang native generate (validated, then forwarded unchanged to one replica)",
    responses={
        200: {
            "description": "The engine's answer, passed through (JSON; server-sent events when streaming)",
            "content": {"application/json": {}, "text/event-stream": {}},
        },
        **error_responses(*AUTH, *BODY, 503),
        400: {
            "model": GenerateRefusal,
            "description": "An undecodable body, or the engine refused the request (its body, unchanged)",
        },
    },
)
async def generate(request: Request, body: GenerateRequest) -> Response:
    ctx = _ctx(request)
    raw = await request.body()
    if body.text == "" and body.input_ids is None:  # with input_ids the ids are the input (io_struct.py 969)
        raise ApiError(422, "text: empty input")
    for field, row in body.rows():
        check_vocab(ctx, row, field)
    key = routing_key(request)
    if not body.stream:
        response = await forward_generate(ctx, raw, key)
        return Response(
            response.content,
            status_code=response.status_code,
            media_type=response.headers.get("content-type", "application/json"),
        )
    route = await ctx.store.get_route_key(key) if key else None
    group = await _group_of(ctx, route)
    headers = {"Modal-Session-ID": key} if key else {}

    async def send_stream(client: SGLangClient, _group: str):
        return await client.stream_generate(raw, headers=headers)

    (response, chunks), place = await with_failover(
        ctx, group, route.get("replica") if route else None, send_stream
    )
    await _remember(ctx, key, route, place.group, place.replica_id)
    ctx.metrics.generate.labels(place.group).inc()
    return StreamingResponse(
        chunks,
        status_code=response.status_code,
        media_type=response.headers.get("content-type", "text/event-stream"),
    )


async def _group_of(ctx: RouterContext, route: dict[str, Any] | None) -> str:
    group = route["group"] if route and route.get("group") in ctx.registry.group_names() else None
    return group if group is not None else await assign_group(ctx)


async def forward_generate(ctx: RouterContext, raw: bytes, key: str | None) -> RawResponse:
    """Forward a validated non-streaming ``/generate`` body unchanged to a replica of the key's
    group (by policy without a key), with failover; the engine's answer (4xx included)."""
    route = await ctx.store.get_route_key(key) if key else None
    group = await _group_of(ctx, route)
    headers = {"Modal-Session-ID": key} if key else {}

    async def send(client: SGLangClient, _group: str) -> RawResponse:
        return await client.post_generate(raw, headers=headers)

    response, place = await with_failover(ctx, group, route.get("replica") if route else None, send)
    await _remember(ctx, key, route, place.group, place.replica_id)
    ctx.metrics.generate.labels(place.group).inc()
    return response


async def _remember(
    ctx: RouterContext, key: str | None, route: dict[str, Any] | None, group: str, replica: str
) -> None:
    if key and (route is None or route.get("group") != group or route.get("replica") != replica):
        await ctx.store.set_route_key(key, {"group": group, "replica": replica}, ctx.config.route_key_ttl_s)


async def _any_replica(ctx: RouterContext, path: str) -> Any:
    latest = ctx.latest_version()
    for g in ctx.fleet.groups:
        for r in ctx.registry.in_rotation(g.name, latest):
            c = ctx.replica_client(r.replica_id, r.url)
            try:
                return await (c.model_info() if path == "model_info" else c.server_info())
            except (EngineUnavailable, EngineRejected):
                continue
    raise unavailable("no replica in rotation")


@router.get(
    "/health",
    response_model=Health,
    summary="200 when at least one replica is in rotation",
    responses=error_responses(503),
)
async def health(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    latest = ctx.latest_version()
    if not any(ctx.registry.in_rotation(g.name, latest) for g in ctx.fleet.groups):
        raise unavailable("no replica in rotation")
    return JSONResponse({"status": "ok"})


@router.get(
    "/model_info",
    dependencies=[Depends(require("rollout"))],
    summary="A replica's model info",
    responses=error_responses(*AUTH, 503),
)
@router.get("/get_model_info", dependencies=[Depends(require("rollout"))], include_in_schema=False)
async def model_info(request: Request) -> JSONResponse:
    return JSONResponse(await _any_replica(_ctx(request), "model_info"))


@router.get(
    "/server_info",
    dependencies=[Depends(require("rollout"))],
    summary="A replica's server info plus the router's groups",
    responses=error_responses(*AUTH, 503),
)
@router.get("/get_server_info", dependencies=[Depends(require("rollout"))], include_in_schema=False)
async def server_info(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    info = await _any_replica(ctx, "server_info")
    if isinstance(info, dict):
        info = {
            **info,
            "mixfleet_router": {
                "groups": [g.name for g in ctx.fleet.groups],
                "latest_version": ctx.latest_version(),
            },
        }
    return JSONResponse(info)

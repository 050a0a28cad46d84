"""SGLang's native API on the router, so frameworks that talk to one SGLang server (Miles,
slime, veRL) can point at the fleet unchanged.

``POST /generate`` is validated, then forwarded unchanged (streaming included) to a replica.
The routing key comes from ``X-Session-ID``, ``X-SMG-Routing-Key`` or ``Modal-Session-ID``
(first present wins): requests with the same key stay on one group and, while it is in
rotation, one replica; it is forwarded as ``Modal-Session-ID``. Without a key a request is
one-shot (group by policy). Failover is as for turns, before the first response byte only.
These requests are not recorded as trajectories.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fleet.sglang_client import EngineRejected, EngineUnavailable
from router.auth import require
from router.context import RouterContext
from router.dispatch import assign_group, check_vocab, with_failover
from router.errors import ApiError, unavailable
from router.schemas import GenerateRequest

router = APIRouter(tags=["sglang"])
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
)
async def generate(request: Request, body: GenerateRequest) -> Response:
    ctx = _ctx(request)
    raw = await request.body()
    if body.input_ids is None and body.text is None:
        raise ApiError(422, "body: one of input_ids or text is required")
    if isinstance(body.text, str) and not body.text:
        raise ApiError(422, "text: empty input")
    key = routing_key(request)
    route = await ctx.store.get_route_key(key) if key else None
    group = route["group"] if route and route.get("group") in ctx.registry.group_names() else None
    if group is None:
        group = await assign_group(ctx)
    check_vocab(ctx, group, body.rows(), "input_ids")
    headers = {"Modal-Session-ID": key} if key else {}

    if body.stream:

        async def send_stream(url: str):
            response, chunks = await ctx.client(url).stream_generate(raw, headers=headers)
            return response, chunks

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

    async def send(url: str):
        response = await ctx.client(url).generate_raw(raw, headers=headers)
        if 400 <= response.status_code < 500 and response.status_code != 409:
            return response  # the request's own fault: pass the engine's answer through
        if response.status_code == 409:
            raise EngineRejected(url, 409, response.text[:300])
        return response

    response, place = await with_failover(ctx, group, route.get("replica") if route else None, send)
    await _remember(ctx, key, route, place.group, place.replica_id)
    ctx.metrics.generate.labels(place.group).inc()
    return Response(
        response.content,
        status_code=response.status_code,
        media_type=response.headers.get("content-type", "application/json"),
    )


async def _remember(
    ctx: RouterContext, key: str | None, route: dict[str, Any] | None, group: str, replica: str
) -> None:
    if key and (route is None or route.get("group") != group or route.get("replica") != replica):
        await ctx.store.set_route_key(key, {"group": group, "replica": replica}, ctx.config.route_key_ttl_s)


async def _any_replica(ctx: RouterContext, path: str) -> Any:
    latest = ctx.latest_version()
    for g in ctx.fleet.groups:
        for r in ctx.registry.in_rotation(g.name, latest):
            c = ctx.client(r.url)
            try:
                return await (c.model_info() if path == "model_info" else c.server_info())
            except (EngineUnavailable, EngineRejected):
                continue
    raise unavailable("no replica in rotation")


@router.get("/health", summary="200 when at least one replica is in rotation")
async def health(request: Request) -> Response:
    ctx = _ctx(request)
    latest = ctx.latest_version()
    ok = any(ctx.registry.in_rotation(g.name, latest) for g in ctx.fleet.groups)
    return Response(status_code=200 if ok else 503)


@router.get("/model_info", dependencies=[Depends(require("rollout"))], summary="A replica's model info")
@router.get("/get_model_info", dependencies=[Depends(require("rollout"))], include_in_schema=False)
async def model_info(request: Request) -> JSONResponse:
    return JSONResponse(await _any_replica(_ctx(request), "model_info"))


@router.get(
    "/server_info",
    dependencies=[Depends(require("rollout"))],
    summary="A replica's server info plus the router's groups",
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

"""Fleet routes: ``GET /v1/groups`` (any valid key), sidecar heartbeats (scope ``replica`` or
``admin``) and deregistration (scope ``admin``). Every route answers from the state store's
registry, whichever router process serves it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from router.auth import require
from router.context import RouterContext
from router.errors import AUTH, BODY, ApiError, error_responses
from router.json_route import JsonRoute
from router.registry import StaticReplicaTaken
from router.schemas import GroupsResponse, Heartbeat, HeartbeatAck, ReplicaRemoved

router = APIRouter(tags=["fleet"], responses=error_responses(*AUTH), route_class=JsonRoute)


def _ctx(request: Request) -> RouterContext:
    return request.app.state.ctx


@router.get(
    "/v1/groups",
    response_model=GroupsResponse,
    dependencies=[Depends(require("any"))],
    summary="Per group: capacity, replicas, sessions, shares, active version",
)
async def groups(request: Request) -> dict[str, Any]:
    return await _ctx(request).groups_snapshot()


@router.post(
    "/v1/replicas/heartbeat",
    dependencies=[Depends(require("replica", "admin"))],
    response_model=HeartbeatAck,
    summary="A sidecar reports its replica (missing heartbeats take it out of rotation)",
    responses=error_responses(*BODY, 409),
)
async def heartbeat(request: Request, body: Heartbeat) -> dict[str, Any]:
    ctx = _ctx(request)
    if body.group not in ctx.registry.group_names():
        raise ApiError(
            422, f"group: unknown group {body.group!r} (known: {', '.join(ctx.registry.group_names())})"
        )
    try:
        r = ctx.registry.heartbeat(body.model_dump())
    except StaticReplicaTaken as exc:
        raise ApiError(409, str(exc)) from None
    await ctx.store.put_replica(r.replica_id, r.shared())
    await ctx.book_replica(r)
    latest = ctx.latest_version()
    in_rotation = any(x.replica_id == r.replica_id for x in ctx.registry.in_rotation(r.group, latest))
    return {"replica_id": r.replica_id, "in_rotation": in_rotation, "latest_version": latest}


@router.delete(
    "/v1/replicas/{replica_id:path}",
    dependencies=[Depends(require("admin"))],
    response_model=ReplicaRemoved,
    summary="Deregister a heartbeat replica (static ones stay: edit the preset)",
    responses=error_responses(404, 409, 422),
)
async def deregister(request: Request, replica_id: str) -> dict[str, Any]:
    ctx = _ctx(request)
    await ctx.adopt_shared()  # a replica that heartbeated to another router counts too
    r = ctx.registry.replicas.get(replica_id)
    if r is None:
        raise ApiError(404, f"unknown replica {replica_id!r}")
    if r.static:
        raise ApiError(409, f"replica {replica_id!r} is listed in the preset")
    ctx.registry.remove(replica_id)
    await ctx.store.delete_replica(replica_id)
    return {"replica_id": replica_id, "removed": True}

"""Agent-facing routes (scope ``rollout``): sessions, token-in-token-out turns, finish, trajectory.

A turn's answer is the JSON bytes :func:`router.turns.record_turn` built once from the turn as
stored; the route returns them as they are (its ``response_model`` documents them and is not
applied again)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from core.jsonio import dumps
from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG as ROUTES_FLAG
from router.auth import require
from router.context import RouterContext
from router.errors import AUTH, BODY, ApiError, error_responses
from router.idempotency import HEADER, KEY_DOC, answer_turn
from router.json_route import JsonRoute
from router.policy import assign_group
from router.records import decode_turn
from router.schemas import (
    CreateSession,
    Finished,
    FinishRequest,
    SessionCreated,
    SessionDeleted,
    SessionId,
    SessionOut,
    Trajectory,
    Turn,
    TurnRequest,
    VersionConflict,
)
from router.state.base import SessionFinished, SessionInfo, SessionNotFound

router = APIRouter(
    prefix="/v1/sessions",
    tags=["sessions"],
    dependencies=[Depends(require("rollout"))],
    responses=error_responses(*AUTH),
    route_class=JsonRoute,  # a turn's body of 100K+ ids is decoded by orjson
)


def _ctx(request: Request) -> RouterContext:
    return request.app.state.ctx


@router.post(
    "",
    response_model=SessionCreated,
    summary="Open a session",
    responses=error_responses(*BODY, 503),
)
async def create_session(
    request: Request, body: Annotated[CreateSession | None, Body()] = None
) -> JSONResponse:
    ctx = _ctx(request)
    body = body or CreateSession()
    group = await _session_group(ctx, body)
    session_id = uuid.uuid4().hex
    await ctx.store.create_session(
        session_id, group, body.metadata, now=time.time(), record_routes=body.record_routes
    )
    ctx.metrics.sessions.labels(group).inc()
    base = f"{str(request.base_url).rstrip('/')}/v1/sessions/{session_id}"
    return JSONResponse(
        {
            "session_id": session_id,
            "group": group,
            "record_routes": body.record_routes,
            "openai_base_url": f"{base}/openai/v1",
            "anthropic_base_url": f"{base}/anthropic",
        }
    )


async def _session_group(ctx: RouterContext, body: CreateSession) -> str:
    """The group a new session goes to: ``body.group`` (422 when unknown), else the policy's
    choice (:func:`router.policy.assign_group`).

    A session with ``record_routes`` goes only to a group whose engines return routed experts
    (:attr:`fleet.specs.GroupSpec.returns_routes`); asking for another is a 422 naming the group
    and the flag, and with no group named the policy chooses among those only (422 when the fleet
    has none). Refused here, at creation, because the engine would not refuse: SGLang 0.5.23
    accepts ``return_routed_experts`` from a server started without
    ``--enable-return-routed-experts`` (``managers/scheduler.py`` 3300-3319 checks only the start)
    and answers without routes (no capturer: ``state_capturer/routed_experts.py`` 50-51,
    ``managers/scheduler_components/batch_result_processor.py`` 151-153; no key:
    ``managers/tokenizer_manager.py`` 2602-2609), so the agent would learn it only after a
    generation, as a 502 (:func:`router.engine_answer.parse_turn` refuses such an answer: no turn
    is ever stored without the routes it asked for)."""
    names = ctx.registry.group_names()
    if body.group is not None and body.group not in names:
        raise ApiError(422, f"group: unknown group {body.group!r} (known: {', '.join(names)})")
    routed = [g.name for g in ctx.fleet.groups if g.returns_routes]
    if body.record_routes and body.group is not None and body.group not in routed:
        raise ApiError(
            422,
            f"record_routes: group {body.group!r} cannot return routed experts (its engines are not "
            f"started with {ROUTES_FLAG}; groups that can: {', '.join(routed) or 'none'})",
        )
    if body.record_routes and not routed:
        raise ApiError(422, f"record_routes: no group of the fleet starts its engines with {ROUTES_FLAG}")
    if body.group is not None:
        return body.group
    return await assign_group(ctx, exclude=set(names) - set(routed) if body.record_routes else frozenset())


@router.get(
    "/{session_id}", response_model=SessionOut, summary="Session state", responses=error_responses(404, 422)
)
async def get_session(request: Request, session_id: SessionId) -> dict[str, Any]:
    ctx = _ctx(request)
    info = await ctx.store.get_session(session_id)
    if info is None:
        raise ctx.unknown_session(session_id)
    return {
        "session_id": info.session_id,
        "group": info.group,
        "replica": info.replica,
        "status": info.status,
        "turns": info.n_turns,
        "tokens": info.tokens,
        "reward": info.reward,
        "metadata": info.metadata,
        "min_version": info.min_version,
        "max_version": info.max_version,
        "record_routes": info.record_routes,
    }


@router.post(
    "/{session_id}/turns",
    response_model=Turn,
    summary="Generate one turn (token-in-token-out): the full context or only the appended tokens",
    responses=error_responses(*BODY, 404, 409, 502, 503, models={409: VersionConflict}),
)
async def create_turn(
    request: Request,
    session_id: SessionId,
    body: TurnRequest,
    idempotency_key: Annotated[str | None, Header(alias=HEADER, description=KEY_DOC)] = None,
) -> Response:
    """The body gives the whole context (``input_ids``, checked against the stored one: a turn
    that does not extend it is a fork and starts a new segment) or only what the turn appends
    (``append_ids``). The turn stores only its appended tokens (:mod:`router.records`)."""
    turn = await answer_turn(_ctx(request), session_id, body.spec(), idempotency_key)
    return Response(turn.answer, media_type="application/json")


@router.post(
    "/{session_id}/finish",
    response_model=Finished,
    summary="Finish with a reward",
    responses=error_responses(*BODY, 404, 409),
)
async def finish_session(request: Request, session_id: SessionId, body: FinishRequest) -> dict[str, Any]:
    """Finish an open session with its reward: its trajectory joins the trainer queue. A repeat
    of the finish (same reward and metadata) answers as the first did, so a retry is safe; a
    finish of a finished session with another reward or metadata is a 409 (the first stays)."""
    ctx = _ctx(request)
    ctx.context_text.forget(session_id)
    info = await ctx.store.get_session(session_id)
    if info is None:
        raise ctx.unknown_session(session_id)
    if info.status != "open":
        return _finished_again(info, body)
    if info.n_turns == 0:
        raise ApiError(409, f"session {session_id!r} has no turns; delete it instead of finishing")
    try:
        turns = await ctx.store.finish_session(session_id, uuid.uuid4().hex, body.reward, body.metadata)
    except SessionFinished:  # a concurrent finish won
        again = await ctx.store.get_session(session_id)
        if again is None:
            raise ctx.unknown_session(session_id) from None
        return _finished_again(again, body)
    except SessionNotFound:
        raise ctx.unknown_session(session_id) from None
    return {"session_id": session_id, "status": "finished", "turns": turns}


def _finished_again(info: SessionInfo, body: FinishRequest) -> dict[str, Any]:
    """The answer to a finish of a session that is no longer open: the first finish's answer when
    this one repeats it (same reward and metadata: a retry whose first answer was lost), else 409
    naming what differs."""
    if info.reward == body.reward and info.finish_metadata == body.metadata:
        return {"session_id": info.session_id, "status": "finished", "turns": info.n_turns}
    why = "reward" if info.reward != body.reward else "metadata"
    raise ApiError(
        409,
        f"session {info.session_id!r} is already {info.status}, with another {why} (the first stays)",
    )


@router.delete(
    "/{session_id}",
    response_model=SessionDeleted,
    summary="Abandon an open session (never handed to a trainer)",
    responses=error_responses(404, 409, 422),
)
async def delete_session(request: Request, session_id: SessionId) -> dict[str, Any]:
    ctx = _ctx(request)
    ctx.context_text.forget(session_id)
    try:
        await ctx.store.delete_session(session_id)
    except SessionNotFound:
        raise ctx.unknown_session(session_id) from None
    except SessionFinished:
        raise ApiError(409, f"session {session_id!r} is finished; it belongs to the trainer queue") from None
    return {"session_id": session_id, "status": "deleted"}


@router.get(
    "/{session_id}/trajectory",
    response_model=Trajectory,
    summary="The recorded trajectory",
    responses=error_responses(404, 422),
)
async def get_trajectory(request: Request, session_id: SessionId) -> Response:
    ctx = _ctx(request)
    info = await ctx.store.get_session(session_id)
    if info is None:
        raise ctx.unknown_session(session_id)
    blobs = await ctx.store.get_turns(session_id)
    return Response(
        dumps(
            {
                "session_id": session_id,
                "group": info.group,
                "status": info.status,
                "reward": info.reward,
                "metadata": info.metadata,
                "finish_metadata": info.finish_metadata,
                "turns": [decode_turn(b).to_json(session_id) for b in blobs],
            }
        ),
        media_type="application/json",
    )

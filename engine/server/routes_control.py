"""Scheduler control: ``/pause_generation``, ``/continue_generation``, ``/abort_request``,
``/flush_cache``."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from core.sglang_release import FLUSH_OK_TEXT, FLUSH_REFUSED_TEXT, FLUSH_TIMEOUT_MESSAGE
from engine.runtime.request import RequestError
from engine.server.protocol import AbortReq, PauseGenerationReqInput
from engine.server.requests import engine_of, error, parse

router = APIRouter()


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    try:
        obj = await parse(request, PauseGenerationReqInput, optional=True)
    except RequestError as exc:
        return error(str(exc))
    await asyncio.wrap_future(engine_of(request).scheduler.pause(obj.mode))
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await asyncio.wrap_future(engine_of(request).scheduler.resume())
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    try:
        obj = await parse(request, AbortReq)
    except RequestError as exc:
        return error(str(exc))
    scheduler = engine_of(request).scheduler
    await asyncio.wrap_future(scheduler.abort(obj.rid, obj.abort_all, "Aborted by /abort_request."))
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, timeout: float = Query(0.0, ge=0.0)) -> Response:
    """http_server.py 1025-1041; with ``timeout`` the flush waits that long for the scheduler to
    be fully idle, no request running or waiting even while paused, then answers
    :data:`~core.sglang_release.FLUSH_TIMEOUT_MESSAGE` (scheduler_components/flush_wrapper.py
    22-60). Flushes sent at once are judged each on its own here; SGLang's tokenizer manager sends
    them one at a time (docs/sglang-contract.md, row 3); the fleet sends no timed flush."""
    scheduler = engine_of(request).scheduler
    deadline = time.monotonic() + timeout
    timed = timeout > 0
    while (
        not (ok := await asyncio.wrap_future(scheduler.flush_cache(fully_idle=timed)))
        and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.02)
    if ok:
        return PlainTextResponse(FLUSH_OK_TEXT)
    return PlainTextResponse(FLUSH_TIMEOUT_MESSAGE if timed else FLUSH_REFUSED_TEXT, status_code=400)

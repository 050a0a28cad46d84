"""Scheduler control: ``/pause_generation``, ``/continue_generation``, ``/abort_request``,
``/flush_cache``, answered as SGLang 0.5.23 answers them (entrypoints/http_server.py 1025-1041,
1721-1731, 1831-1855). Each body is required (FastAPI ``Body()``): an empty, malformed or
mistyped one is refused by SGLang's request validation handler (635-691), :func:`refusal`."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from core.sglang_release import FLUSH_OK_TEXT, FLUSH_REFUSED_TEXT, FLUSH_TIMEOUT_MESSAGE
from engine.runtime.request import RequestError
from engine.server.protocol import AbortReq, ContinueGenerationReqInput, PauseGenerationReqInput
from engine.server.requests import engine_of, parse, refusal

router = APIRouter()


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    try:
        obj = await parse(request, PauseGenerationReqInput)
    except RequestError as exc:
        return refusal(exc)
    engine = engine_of(request)
    await engine.admission.pause()  # tokenizer_manager.py 2267-2271: new requests wait, then the scheduler
    await asyncio.wrap_future(engine.scheduler.pause(obj.mode))
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    """Resumes once an update that is loading or swapping has swapped (``Engine.applying``): SGLang's
    scheduler loads and swaps inside its loop (scheduler_components/weight_updater.py 120-160) and
    reads the continue after (tokenizer_manager.py 2282-2286 sends it behind the update), so a
    request resumed by it never runs on the old weights past the swap. SGLang answers the continue
    when sent; this engine once it took effect (a later pause comes after it either way)."""
    try:
        await parse(request, ContinueGenerationReqInput)
    except RequestError as exc:
        return refusal(exc)
    engine = engine_of(request)
    async with engine.applying:
        await asyncio.wrap_future(engine.scheduler.resume())
    await engine.admission.resume()  # tokenizer_manager.py 2282-2286: then the waiting requests go on
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """200 with no body and no content type (``Response(status_code=200)``). One rid goes through
    :class:`~engine.runtime.admission.Admission` (once per request; nothing for a request held
    by a pause or unknown), ``abort_all`` to the scheduler alone."""
    try:
        obj = await parse(request, AbortReq)
    except RequestError as exc:
        return refusal(exc)
    engine = engine_of(request)
    message = "Aborted by /abort_request."
    if obj.abort_all:
        await asyncio.wrap_future(engine.scheduler.abort(abort_all=True, message=message))
    elif (sent := engine.admission.abort(obj.rid or "", message)) is not None:
        await asyncio.wrap_future(sent)
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, timeout: float = Query(0.0, ge=0.0)) -> Response:
    """http_server.py 1025-1041; with ``timeout`` the flush waits that long for the scheduler to
    be fully idle, no request running or waiting even while paused, then answers
    :data:`~core.sglang_release.FLUSH_TIMEOUT_MESSAGE` (scheduler_components/flush_wrapper.py
    22-60). Flushes sent at once are judged each on its own here; SGLang's tokenizer manager sends
    them one at a time (docs/sglang-contract.md, row 3); the fleet sends no timed flush. The text
    is sent as SGLang's ``Response(content=...)`` sends it: without a content type."""
    scheduler = engine_of(request).scheduler
    deadline = time.monotonic() + timeout
    timed = timeout > 0
    while (
        not (ok := await asyncio.wrap_future(scheduler.flush_cache(fully_idle=timed)))
        and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.02)
    if ok:
        return Response(FLUSH_OK_TEXT)
    return Response(FLUSH_TIMEOUT_MESSAGE if timed else FLUSH_REFUSED_TEXT, status_code=400)

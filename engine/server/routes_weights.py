"""``/update_weights_from_disk`` and ``/update_weight_version`` (SGLang 0.5.23's contract;
the module docstring of :mod:`engine.server.app` and docs/sglang-contract.md have the table).

A body SGLang's request validation refuses (empty, malformed, a field of the wrong type, e.g. a
version sent as a JSON number) is answered as its validation handler answers it, before the
route runs (entrypoints/http_server.py 635-691: 400 ``ErrorResponse``); only what the route
itself refuses answers in the route's own shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import NoReturn

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from core.sglang_release import UPDATE_NOT_FLUSHED_MESSAGE
from engine.runtime.engine import LOADER, Engine, WeightsNotFound
from engine.runtime.request import RequestError
from engine.server.protocol import UpdateWeightFromDiskReqInput, UpdateWeightVersionReqInput, parse_version
from engine.server.requests import engine_of, parse, refusal

log = logging.getLogger("mixfleet.engine")

router = APIRouter()


def _update_refused(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, 400)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    engine = engine_of(request)
    scheduler = engine.scheduler
    try:
        obj = await parse(request, UpdateWeightFromDiskReqInput)
    except RequestError as exc:
        return refusal(exc)
    try:
        version = parse_version(obj.weight_version)
    except RequestError as exc:
        return _update_refused(str(exc))
    if obj.load_format not in (None, "auto"):
        return _update_refused(
            f"Failed to get model loader: load_format {obj.load_format!r} is not loadable."
        )
    if obj.abort_all_requests:  # tokenizer_manager.py 2298-2299: before the update
        await asyncio.wrap_future(scheduler.abort(abort_all=True, message="Aborted by a weight update."))
    async with engine.update_lock:
        # tokenizer_manager.py 2302-2309: unpaused, the update waits for every request in flight.
        paused = engine.admission.paused
        async with contextlib.nullcontext() if paused else engine.model_update_lock.writer(), engine.applying:
            return await _apply_update(engine, obj, version)


async def _apply_update(
    engine: Engine, obj: UpdateWeightFromDiskReqInput, version: int | None
) -> JSONResponse:
    """Load, then swap + record the version + flush at one step boundary
    (scheduler_components/weight_updater.py 138-160). A path without weights is refused and
    the old version keeps serving; a load that fails once weights were found ends the process
    (:func:`_exit_as_sglang`). Success moves ``/model_info``'s ``model_path`` and
    ``served_model_name`` to the path as sent (tokenizer_manager.py 2365-2370, 2381-2383) and
    answers SGLang's message, "Succeeded to update model weights." (scheduler_components/
    weight_updater.py 141), then with a version " Weight version updated to V." with V as sent
    (tokenizer_manager.py 2318-2320)."""
    t0 = time.monotonic()
    try:
        model = await asyncio.get_running_loop().run_in_executor(
            LOADER, engine.load_replacement, obj.model_path
        )
    except WeightsNotFound as exc:
        log.warning("update_weights_from_disk refused %s: %s", obj.model_path, exc)
        return _update_refused(f"Failed to get weights iterator: {exc}.")
    except Exception as exc:
        _exit_as_sglang(obj.model_path, exc)
    log.info("update_weights_from_disk %s loaded in %.2fs", obj.model_path, time.monotonic() - t0)
    flushed = await asyncio.wrap_future(engine.scheduler.update_weights(model, version, obj.flush_cache))
    if not flushed:  # weights and scheduler version changed; /model_info keeps the old one
        log.warning("update_weights_from_disk: %s", UPDATE_NOT_FLUSHED_MESSAGE)
        return _update_refused(UPDATE_NOT_FLUSHED_MESSAGE)
    engine.model_path = engine.reported_model_name = obj.model_path
    engine.precision = getattr(model, "precision", engine.precision)
    message = "Succeeded to update model weights."
    if version is not None:
        engine.reported_version = version
        message += f" Weight version updated to {obj.weight_version}."
    return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})


def _exit_as_sglang(model_path: str, exc: Exception) -> NoReturn:
    """End the process as SGLang 0.5.23's server ends when a load fails once its weight files
    were found: the "rollback" re-reads ``model_config.model_path``, already set to the new path
    (model_executor/model_runner_components/weight_updater.py 193, 228-237), outside any ``try``,
    so a failure that repeats (a tensor of another shape, an unreadable shard) escapes the
    scheduler's loop; the scheduler process logs "Scheduler hit an exception" and sends SIGQUIT
    to the server (managers/scheduler.py 6366-6373), whose handler kills its whole process tree,
    itself with SIGKILL (managers/tokenizer_manager.py 4072-4081, utils/common.py 2548-2552). The
    update's caller gets no answer; the weights it half wrote die with the process."""
    log.error("Scheduler hit an exception: update_weights_from_disk(%s): %s", model_path, exc)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    engine = engine_of(request)
    scheduler = engine.scheduler
    try:
        obj = await parse(request, UpdateWeightVersionReqInput)
    except RequestError as exc:
        return refusal(exc)
    try:
        version = parse_version(obj.new_version)
    except RequestError as exc:
        return JSONResponse({"success": False, "message": f"Failed to update weight version: {exc}"}, 400)
    if obj.abort_all_requests:
        await asyncio.wrap_future(scheduler.abort(abort_all=True, message="Aborted by a weight update."))
    await asyncio.wrap_future(scheduler.update_weights(None, version, False))
    engine.reported_version = version
    message = f"Weight version updated to {obj.new_version}"
    return JSONResponse({"success": True, "message": message, "new_version": obj.new_version})

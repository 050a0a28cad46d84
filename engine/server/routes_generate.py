"""``/generate`` (single or batch, SSE streaming) and ``/health_generate``.

A ``"stream": true`` request refused at step 3 (``GenerateReqInput.normalize``: what SGLang
0.5.23's tokenizer manager raises) is answered inside its stream, as SGLang answers it
(:func:`_refused_stream`); steps 1 and 2 answer a 400 before any stream. An item SGLang's
scheduler aborts when it takes it is, streamed, one event whose finish reason is the abort, the
other items running on: the sampling-mask rule's (``GenerateSpec.abort``) is never submitted and
carries nothing generated (:func:`aborted_body`); a ``logprob_start_len`` or
``routed_experts_start_len`` past the input (``GenerateSpec.to_finish``) runs as SGLang runs it,
a one-token prefill of input ``[0]`` finished after its first token, and carries that token.
Unstreamed, the request is a 400 with its message. A request is admitted, waits out a pause
outside the scheduler (:mod:`engine.runtime.admission`), then runs under the model-update lock's
reader side (tokenizer_manager.py 940-957), so an unpaused weight update waits for it; a client
that goes away has its requests aborted once they reached the scheduler.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from core.jsonio import dumps
from core.sglang_contract import stream_error_event
from engine.runtime.engine import Engine
from engine.runtime.request import RequestError, duplicate_rid
from engine.runtime.scheduler import FinishEvent, TokenEvent
from engine.server.protocol import GenerateReqInput
from engine.server.requests import engine_of, error, parse, refusal
from engine.server.response import GenerateResponse, streamer_sends

router = APIRouter()


class _Refused(RequestError):
    """A request refused for a rid another request holds, found once admitted or submitted (after
    ``GenerateReqInput.normalize`` checked the request's rids, which refuses the whole request
    before anything is submitted or streamed; only two requests racing for one rid get here):
    SGLang raises it as a ``ValueError`` of ``generate_request`` (managers/tokenizer_manager.py
    3833-3837), which a stream answers as :func:`core.sglang_contract.stream_error_event`, code
    400 (entrypoints/http_server.py 956-973). The engine's own failures (shutting down) stay an
    event without a code: the router fails over from them. The other request, which holds the rid,
    is never aborted on this one's account (this one owns no admission state)."""


async def run_one(engine: Engine, spec: Any, on_token: Any = None) -> dict[str, Any]:
    """One request from admission to its answer, as SGLang's tokenizer manager runs it
    (:class:`~engine.runtime.admission.Admission`; tokenizer_manager.py 926-966): admitted, it
    waits out a pause, then runs under the model-update lock's reader side (an unpaused weight
    update waits for it). Cancelled once sent to the scheduler, it is aborted there (once)."""
    admission = engine.admission
    state = admission.admit(spec.rid)
    if state is None:  # a request that came meanwhile holds its rid
        raise _Refused(duplicate_rid(spec.rid))
    finished = False
    try:
        await admission.wait_unpaused()
        async with engine.model_update_lock.reader():
            body = await _run_locked(engine, spec, on_token, state)
        finished = True
        return body
    finally:
        admission.release(spec.rid, state, finished=finished)


def _due(spec: Any, sent: int, made: int) -> bool:
    """Whether a stream that has sent ``sent`` tokens sends its body at ``made`` tokens: only
    where SGLang's output streamer sends one (:func:`engine.server.response.streamer_sends`), so
    every chunk is one SGLang can send; one passed over while events coalesced is skipped, as
    SGLang's tokenizer manager yields only the last pending output (tokenizer_manager.py
    1985-1993). The finish is always sent."""
    return made > sent and streamer_sends(spec, made)


def _finishing(event: Any) -> bool:
    """Whether ``event`` is a token whose finish follows at once (:attr:`TokenEvent.finishes`):
    SGLang sends the two as one output, so a stream waits for the finish."""
    return isinstance(event, TokenEvent) and event.finishes


async def _run_locked(engine: Engine, spec: Any, on_token: Any, state: Any) -> dict[str, Any]:
    scheduler = engine.scheduler
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    resp = GenerateResponse(engine, spec, time.monotonic())
    fut = scheduler.submit(spec, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    try:
        await asyncio.wrap_future(fut)
    except ValueError as exc:  # the request's fault (a rid already running): a 400, in a stream code 400
        raise _Refused(str(exc)) from None
    except RuntimeError as exc:  # the engine's (shutting down): a stream's event names no code
        raise RequestError(str(exc)) from None
    engine.admission.dispatched(state)
    sent = 0
    while True:
        ev = await events.get()
        while True:  # coalesce what is already there: the last token and the finish
            resp.add(ev)
            if isinstance(ev, FinishEvent):
                return resp.body()
            try:
                ev = events.get_nowait()
            except asyncio.QueueEmpty:
                break
        if on_token is not None and not _finishing(ev) and _due(spec, sent, len(resp.output_ids)):
            sent = len(resp.output_ids)
            await on_token(resp)


async def _watch_disconnect(engine: Engine, request: Request, specs: list[Any]) -> None:
    """Abort the requests of a client gone away, as SGLang notices it: only once they reached
    the scheduler (:meth:`~engine.runtime.admission.Admission.abort_dispatched`)."""
    while True:
        await asyncio.sleep(0.5)
        if await request.is_disconnected():
            for spec in specs:
                engine.admission.abort_dispatched(spec.rid, "The client disconnected.")
            if all(engine.admission.held([s.rid]) is None for s in specs):
                return


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    engine = engine_of(request)
    try:
        obj = await parse(request, GenerateReqInput)
    except RequestError as exc:  # steps 1 and 2: a 400 before any stream
        return refusal(exc)
    try:
        specs = obj.normalize(engine.limits, engine.encode, engine.admission.held)
    except RequestError as exc:  # step 3: inside the stream when one was asked for
        if obj.stream:
            answer = _broken_stream(str(exc)) if exc.fails else _refused_stream(str(exc))
            return StreamingResponse(answer, media_type="text/event-stream")
        return refusal(exc)
    batch = obj.is_batch()
    if obj.stream:
        return StreamingResponse(_stream(engine, specs, batch), media_type="text/event-stream")
    aborted = next((s.scheduler_abort for s in specs if s.scheduler_abort is not None), None)
    if aborted is not None:  # the tokenizer manager raises it: a 400, nothing else of it answered
        return error(aborted["message"])
    watcher = asyncio.create_task(_watch_disconnect(engine, request, specs))
    runs = [asyncio.ensure_future(run_one(engine, s)) for s in specs]
    try:
        results = await asyncio.gather(*runs)
    except RequestError as exc:  # the batch fails: its other items are released (run_one)
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        return error(str(exc))
    finally:
        watcher.cancel()
    return Response(dumps(results if batch else results[0]), media_type="application/json")


async def _refused_stream(message: str) -> AsyncIterator[bytes]:
    """A streamed request refused at step 3 (``GenerateReqInput.normalize``), as SGLang 0.5.23
    answers a ``ValueError`` of ``tokenizer_manager.generate_request`` once its stream has begun
    (entrypoints/http_server.py 949-979): HTTP 200, one event
    :func:`core.sglang_contract.stream_error_event`, then ``data: [DONE]``; a batch or ``n``
    changes nothing (every item is judged before the first yield, tokenizer_manager.py
    2074-2128)."""
    yield b"data: " + dumps(stream_error_event(message)) + b"\n\n"
    yield b"data: [DONE]\n\n"


class StreamBrokenOff(RuntimeError):
    """Ends a stream the way SGLang 0.5.23's ends on what it fails on (:func:`_broken_stream`)."""


async def _broken_stream(message: str) -> AsyncIterator[bytes]:
    """A streamed request SGLang 0.5.23 does not refuse but fails on (a short list, a ``choice``,
    ...: :attr:`core.sglang_contract.Refusal.fails`; unstreamed a 500, refused here as a 400), as
    SGLang's stream answers it: the exception is no ``ValueError``, so ``stream_results`` does not
    catch it (entrypoints/http_server.py 949-979) and it leaves the body iterator of a
    ``StreamingResponse`` whose HTTP 200 head is sent: the server closes the connection before
    any event or ``[DONE]``, which a client reads as a broken stream (the fleet's client: a
    failing engine, ``clients.engine``; the router never forwards such a body, refusing it with
    a 422). ``message`` goes to the log, as SGLang's traceback does."""
    raise StreamBrokenOff(message)
    yield b""  # never reached: it makes this an async generator, which raises at its first step


def aborted_body(engine: Engine, spec: Any) -> dict[str, Any]:
    """The answer of an item SGLang 0.5.23's scheduler answers at once when it takes it, running
    nothing (``spec.abort``: the sampling-mask rule, ``_reject_sampling_mask_request``,
    managers/scheduler.py 3513-3518; :func:`core.sglang_release.scheduler_abort`), as its stream
    carries it: the item's output (nothing generated, its real ``prompt_tokens``) whose
    ``finish_reason`` is the abort with its ``status_code`` 400, one event of an HTTP 200 stream
    that ``[DONE]`` then ends, the batch's other items running on (managers/tokenizer_manager.py
    1891-1922, 2041-2048, 2211-2228; entrypoints/http_server.py 951-975). Unstreamed the route
    answers the abort's message as a 400 instead."""
    resp = GenerateResponse(engine, spec, time.monotonic())
    resp.add(FinishEvent(spec.abort, 0, engine.weight_version))
    return resp.body()


async def _stream(engine: Engine, specs: list[Any], batch: bool) -> AsyncIterator[bytes]:
    chunks: asyncio.Queue = asyncio.Queue()

    async def one(i: int, spec: Any) -> None:
        async def on_token(resp: GenerateResponse) -> None:
            body = resp.body()
            if batch:
                body["index"] = i
            await chunks.put(body)

        try:
            body = (
                aborted_body(engine, spec)
                if spec.abort is not None
                else await run_one(engine, spec, on_token)
            )
            if batch:
                body["index"] = i
            await chunks.put(body)
        except _Refused as exc:
            await chunks.put(stream_error_event(str(exc)))
        except RequestError as exc:
            await chunks.put({"error": {"message": str(exc)}})

    tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(specs)]
    done = asyncio.gather(*tasks)
    try:
        while not (done.done() and chunks.empty()):
            getter = asyncio.create_task(chunks.get())
            finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if getter in finished:
                yield b"data: " + dumps(getter.result()) + b"\n\n"
            else:
                getter.cancel()
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()


# entrypoints/http_server.py 218: read once, at start-up, in seconds
HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """SGLang 0.5.23's generation check (entrypoints/http_server.py 721-799): 503 unless the
    scheduler runs; else it submits a one-token greedy request of input ``[0]`` and checks every
    second whether the scheduler has answered anything since the check began
    (:attr:`Scheduler.last_output`, SGLang's ``last_receive_tstamp``,
    managers/tokenizer_manager.py 2465-2479): 200 as soon as it has, 503 after
    ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds without. While generation is paused the scheduler
    answers nothing, so the check is a 503 unless the pause ends first. Either way the check's
    request is then cancelled, which aborts it if unfinished (:func:`run_one`): nothing of it
    stays in the engine."""
    engine = engine_of(request)
    scheduler = engine.scheduler
    if not scheduler.alive:
        return Response(status_code=503)
    obj = GenerateReqInput(
        input_ids=[0],
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
    )
    task = asyncio.create_task(run_one(engine, obj.normalize(engine.limits, None)[0]))
    tic = time.time()
    try:
        while time.time() < tic + HEALTH_CHECK_TIMEOUT:
            await asyncio.sleep(1)
            if scheduler.last_output > tic:
                return Response(status_code=200)
        return Response(status_code=503)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

"""The engine's FastAPI app: SGLang's native routes over an :class:`~fleet.engine.engine.Engine`.

Routes (SGLang names and shapes): ``/generate`` (single or batch, SSE streaming),
``/update_weights_from_disk``, ``/update_weight_version``, ``/pause_generation``, ``/continue_generation``,
``/abort_request``, ``/flush_cache``, ``/model_info`` (+ ``/get_model_info``), ``/server_info``
(+ ``/get_server_info``), ``/get_weight_version``, ``/health``, ``/health_generate``, ``/metrics``.

Errors: a request the engine refuses (malformed JSON, wrong types, token ids outside the
vocabulary, empty input, too long a context, bad sampling parameters, a weight directory that
is missing or holds another architecture) gets HTTP 400 with SGLang's body
``{"error": {"message": "..."}}`` (``/update_weights_from_disk`` answers
``{"success": false, "message": "..."}`` with 400, as SGLang does) and the server keeps serving.

``meta_info`` per response: ``id``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
``cached_tokens`` (always 0: no prefix cache), ``weight_version`` (str: version of the last
output token, or the serving version if there is none), ``weight_versions`` (spans
``{"version": int, "start", "end"}``, end exclusive, over output indices), ``e2e_latency``;
with ``return_logprob``: ``input_token_logprobs`` / ``output_token_logprobs`` as
``[logprob, token_id, text_or_null]`` triples (and ``*_top_logprobs`` when
``top_logprobs_num > 0``); with ``return_sampling_mask``: ``output_token_sampling_mask``
(sorted support ids per token; ``[]`` = whole vocabulary), ``output_token_sampling_logprobs``
(per token the behavior log-prob μ of the sampled token, as upstream SGLang; with
``sampling_logprobs_mode: support`` per token the support's log-probs, aligned with the mask),
``output_token_sampling_mask_length`` and, a mixfleet extension,
``output_token_sampling_support_logprobs`` (per token the renormalized log-probs aligned with
the mask); with ``return_routed_experts`` on an engine started with
``--enable-return-routed-experts``, once finished: ``routed_experts`` (base64 int32
``[seqlen - 1 - routed_experts_start_len, layers, k]``, :mod:`core.sglang_release`; without the
flag the key is absent, as in SGLang). Non-finite floats are sent as ``null``.

Weight updates keep SGLang 0.5.23's contract (docs/sglang-contract.md has the table):
``/update_weights_from_disk`` sent while generation is not paused waits for every request in
flight (model-update lock; new requests wait for it); paused, it runs at once. It loads and checks
the new directory on a worker thread, then, at one step boundary, swaps the weights, stamps the
new version on every later token and -- ``flush_cache`` defaults to true -- flushes, which is
refused while requests run (after an ``in_place`` pause under load; never after ``retract``).
A refused flush answers 400 ``success: false`` with SGLang's message although the new weights
serve, and ``/model_info`` keeps the old version (SGLang's tokenizer manager moves it only on
success); ``/update_weight_version`` then sets it. Versions are integers here (the fleet's
versions); upstream SGLang spells span versions as strings -- ``weight_version`` is a string in
both.

Kept apart from the CLI module (``mixfleet.engine``) so ``mixfleet --help`` does not import
FastAPI.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from core.sglang_release import (
    FLUSH_OK_TEXT,
    FLUSH_REFUSED_TEXT,
    META_ROUTED_EXPERTS,
    UPDATE_NOT_FLUSHED_MESSAGE,
    encode_routed_experts,
)
from engine.runtime.engine import ENGINE_VERSION, LOADER, Engine
from engine.runtime.sampler import finite_or_none
from engine.runtime.scheduler import FinishEvent, PrefillEvent, TokenEvent
from engine.server.debug import debug_router
from engine.server.metrics import CONTENT_TYPE
from engine.server.protocol import (
    AbortReq,
    GenerateReqInput,
    PauseGenerationReqInput,
    RequestError,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
    parse_version,
)

log = logging.getLogger("mixfleet.engine")


# --------------------------------------------------------------------------- responses


class _Response:
    """Accumulates one request's events into SGLang's response shape."""

    def __init__(self, engine: Engine, spec: Any, start: float) -> None:
        self.engine = engine
        self.spec = spec
        self.start = start
        self.output_ids: list[int] = []
        self.draws: list[Any] = []
        self.versions: list[int] = []
        self.prefill: Any = None
        self.finish: Any = None

    def add(self, event: Any) -> None:
        if isinstance(event, TokenEvent):
            self.output_ids.append(event.draw.token_id)
            self.draws.append(event.draw)
            self.versions.append(event.weight_version)
        elif isinstance(event, PrefillEvent):
            self.prefill = event
        elif isinstance(event, FinishEvent):
            self.finish = event

    def spans(self) -> list[dict[str, int]]:
        if not self.versions:
            v = self.finish.weight_version if self.finish is not None else self.engine.weight_version
            return [{"version": v, "start": 0, "end": 0}]
        spans: list[dict[str, int]] = []
        for i, v in enumerate(self.versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        return spans

    def _text(self, token_id: int) -> str | None:
        return self.engine.decode([token_id], False) if self.spec.return_text_in_logprobs else None

    def body(self) -> dict[str, Any]:
        f = finite_or_none
        spec = self.spec
        spans = self.spans()
        meta: dict[str, Any] = {
            "id": spec.rid,
            "finish_reason": self.finish.finish_reason if self.finish is not None else None,
            "prompt_tokens": len(spec.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": str(spans[-1]["version"]),
            "weight_versions": spans,
            "e2e_latency": time.monotonic() - self.start,
        }
        if spec.return_logprob:
            pre = self.prefill
            meta["input_token_logprobs"] = (
                [[None if lp is None else f(lp), t, self._text(t)] for lp, t in pre.input_token_logprobs]
                if pre is not None
                else []
            )
            meta["output_token_logprobs"] = [
                [f(d.logprob), d.token_id, self._text(d.token_id)] for d in self.draws
            ]
            if spec.top_logprobs_num > 0:
                meta["input_top_logprobs"] = (
                    [
                        None if top is None else [[f(lp), t, self._text(t)] for lp, t in top]
                        for top in pre.input_top_logprobs
                    ]
                    if pre is not None
                    else []
                )
                meta["output_top_logprobs"] = [
                    [[f(lp), t, self._text(t)] for lp, t in d.top_logprobs] for d in self.draws
                ]
        if spec.return_sampling_mask:
            meta["output_token_sampling_mask"] = [list(d.support_ids) for d in self.draws]
            if spec.sampling_logprobs_mode == "support":  # SGLang: the support's log-probs per token
                meta["output_token_sampling_logprobs"] = [
                    [f(x) for x in d.support_logprobs] for d in self.draws
                ]
            else:
                meta["output_token_sampling_logprobs"] = [f(d.sampling_logprob) for d in self.draws]
            meta["output_token_sampling_support_logprobs"] = [
                [f(x) for x in d.support_logprobs] for d in self.draws
            ]
            meta["output_token_sampling_mask_length"] = len(self.draws)
        routes = self.finish.routed_experts if self.finish is not None else None
        if routes is not None:  # only when asked and served with --enable-return-routed-experts
            meta[META_ROUTED_EXPERTS] = encode_routed_experts(routes.numpy())
        return {
            "text": self.engine.decode(self.output_ids, spec.skip_special_tokens),
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


# --------------------------------------------------------------------------- app


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    app = FastAPI(title="mixfleet CPU engine (SGLang native API)", version=ENGINE_VERSION)
    scheduler = engine.scheduler

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    def validation_message(exc: ValidationError | RequestValidationError) -> str:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return "Invalid request: " + "; ".join(parts)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(validation_message(exc))

    async def parse(request: Request, model: type[BaseModel], optional: bool = False) -> Any:
        raw = await request.body()
        if not raw.strip():
            if optional:
                return model()
            raise RequestError("The request body is empty; expected a JSON object.")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"Malformed JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise RequestError(f"The request body must be a JSON object, got {type(data).__name__}.")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise RequestError(validation_message(exc)) from None

    async def run_one(spec: Any, request: Request, on_token: Any = None) -> dict[str, Any]:
        """One request from submission to its answer, under the model-update lock's reader side
        (tokenizer_manager.py 940-957): an unpaused weight update waits for it."""
        async with engine.model_update_lock.reader():
            return await run_locked(spec, on_token)

    async def run_locked(spec: Any, on_token: Any) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        resp = _Response(engine, spec, time.monotonic())
        fut = scheduler.submit(spec, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        try:
            await asyncio.wrap_future(fut)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        except RuntimeError as exc:
            raise RequestError(str(exc)) from None
        try:
            while True:
                ev = await events.get()
                new_token = False
                while True:  # coalesce what is already there: the last token and the finish
                    resp.add(ev)
                    new_token |= isinstance(ev, TokenEvent)
                    if isinstance(ev, FinishEvent):
                        return resp.body()
                    try:
                        ev = events.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                if on_token is not None and new_token:
                    await on_token(resp)
        finally:
            if resp.finish is None:  # cancelled (client went away): free the slot
                scheduler.abort(spec.rid, message="The client disconnected.")

    async def watch_disconnect(request: Request, specs: list[Any]) -> None:
        while True:
            await asyncio.sleep(0.5)
            if await request.is_disconnected():
                for spec in specs:
                    scheduler.abort(spec.rid, message="The client disconnected.")
                return

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            obj = await parse(request, GenerateReqInput)
            specs = obj.normalize(engine.limits, engine.encode)
        except RequestError as exc:
            return error(str(exc))
        batch = obj.is_batch()
        if obj.stream:
            return StreamingResponse(stream(specs, batch, request), media_type="text/event-stream")
        watcher = asyncio.create_task(watch_disconnect(request, specs))
        try:
            results = await asyncio.gather(*(run_one(s, request) for s in specs))
        except RequestError as exc:
            for s in specs:
                scheduler.abort(s.rid, message="Another item of the batch was refused.")
            return error(str(exc))
        finally:
            watcher.cancel()
        return Response(_dumps(results if batch else results[0]), media_type="application/json")

    async def stream(specs: list[Any], batch: bool, request: Request) -> AsyncIterator[bytes]:
        chunks: asyncio.Queue = asyncio.Queue()

        async def one(i: int, spec: Any) -> None:
            async def on_token(resp: _Response) -> None:
                body = resp.body()
                if batch:
                    body["index"] = i
                await chunks.put(body)

            try:
                body = await run_one(spec, request, on_token)
                if batch:
                    body["index"] = i
                await chunks.put(body)
            except RequestError as exc:
                await chunks.put({"error": {"message": str(exc)}})

        tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(specs)]
        done = asyncio.gather(*tasks)
        try:
            while not (done.done() and chunks.empty()):
                getter = asyncio.create_task(chunks.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    yield b"data: " + _dumps(getter.result()) + b"\n\n"
                else:
                    getter.cancel()
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    def update_refused(message: str) -> JSONResponse:
        return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, 400)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        try:
            obj = await parse(request, UpdateWeightFromDiskReqInput)
            version = parse_version(obj.weight_version)
        except RequestError as exc:
            return update_refused(str(exc))
        if obj.load_format not in (None, "auto"):
            return update_refused(
                f"Failed to get model loader: load_format {obj.load_format!r} is not loadable."
            )
        if obj.abort_all_requests:  # tokenizer_manager.py 2298-2299: before the update
            await asyncio.wrap_future(scheduler.abort(abort_all=True, message="Aborted by a weight update."))
        async with engine.update_lock:
            # tokenizer_manager.py 2301-2314: unpaused, the update waits for every request in flight.
            paused = scheduler.paused is not None
            async with contextlib.nullcontext() if paused else engine.model_update_lock.writer():
                return await apply_update(obj, version)

    async def apply_update(obj: UpdateWeightFromDiskReqInput, version: int | None) -> JSONResponse:
        """Load, then swap + record the version + flush at one step boundary
        (scheduler_components/weight_updater.py 138-160)."""
        t0 = time.monotonic()
        try:
            model = await asyncio.get_running_loop().run_in_executor(
                LOADER, engine.load_replacement, obj.model_path
            )
        except Exception as exc:  # any failure to load leaves the old version serving
            log.warning("update_weights_from_disk refused %s: %s", obj.model_path, exc)
            return update_refused(f"Failed to update weights: {exc}")
        load_s = time.monotonic() - t0
        flushed = await asyncio.wrap_future(scheduler.update_weights(model, version, obj.flush_cache))
        if not flushed:  # weights and scheduler version changed; /model_info keeps the old one
            log.warning("update_weights_from_disk: %s", UPDATE_NOT_FLUSHED_MESSAGE)
            return update_refused(UPDATE_NOT_FLUSHED_MESSAGE)
        engine.model_path = str(Path(obj.model_path).resolve())
        engine.config = model.config
        engine.precision = getattr(model, "precision", engine.precision)
        message = f"Succeeded to update model weights (loaded in {load_s:.2f}s)."
        if version is not None:
            engine.reported_version = version
            message += f" Weight version updated to {version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        try:
            obj = await parse(request, UpdateWeightVersionReqInput)
            version = parse_version(obj.new_version)
        except RequestError as exc:
            return JSONResponse({"success": False, "message": f"Failed to update weight version: {exc}"}, 400)
        if obj.abort_all_requests:
            await asyncio.wrap_future(scheduler.abort(abort_all=True, message="Aborted by a weight update."))
        await asyncio.wrap_future(scheduler.update_weights(None, version, False))
        engine.reported_version = version
        return JSONResponse(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}
        )

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        try:
            obj = await parse(request, PauseGenerationReqInput, optional=True)
        except RequestError as exc:
            return error(str(exc))
        await asyncio.wrap_future(scheduler.pause(obj.mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await asyncio.wrap_future(scheduler.resume())
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            obj = await parse(request, AbortReq)
        except RequestError as exc:
            return error(str(exc))
        await asyncio.wrap_future(scheduler.abort(obj.rid, obj.abort_all, "Aborted by /abort_request."))
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> Response:
        """http_server.py 1025-1041; with ``timeout`` the flush waits that long for the scheduler
        to become idle (scheduler_components/flush_wrapper.py 22-60)."""
        deadline = time.monotonic() + timeout
        while not (ok := await asyncio.wrap_future(scheduler.flush_cache())) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if ok:
            return PlainTextResponse(FLUSH_OK_TEXT)
        text = FLUSH_REFUSED_TEXT if timeout <= 0 else "Timed out waiting for idle state."
        return PlainTextResponse(text, status_code=400)

    def model_info() -> dict[str, Any]:
        cfg = engine.config
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.reported_version),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": cfg.vocab_size,
            "context_len": cfg.max_position_embeddings,
            "kv_cache_dtype": engine.kv_cache_dtype,
            "weight_format": engine.precision,
        }

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)

    def server_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "kv_cache_dtype": engine.kv_cache_dtype,
            "weight_version": str(engine.startup_version),
            "max_running_requests": scheduler.max_running,
            "chunked_prefill_size": scheduler.prefill_budget,
            "enable_return_routed_experts": scheduler.record_routes,
            "context_length": engine.config.max_position_embeddings,
            "torch_num_threads": _torch_threads(),
            "internal_states": [
                {
                    **scheduler.load(),
                    "paused": scheduler.paused,
                    "steps": scheduler.steps,
                    "step_seconds": scheduler.step_seconds,
                    "forward_seconds": scheduler.forward_seconds,
                    "sample_seconds": scheduler.sample_seconds,
                    "gen_throughput": engine.metrics.refresh_throughput(),
                }
            ],
            "version": ENGINE_VERSION,
            "uptime_s": time.time() - engine.started,
            "pid": os.getpid(),
        }

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": str(engine.reported_version)}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if scheduler.alive else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        if not scheduler.alive:
            return Response(status_code=503)
        if scheduler.paused is not None:
            return Response(status_code=200)
        obj = GenerateReqInput(
            input_ids=[0],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            rid=f"HEALTH_CHECK_{time.time()}_{threading.get_ident()}",
        )
        try:
            await asyncio.wait_for(run_one(obj.normalize(engine.limits, None)[0], request), timeout=20)
        except (TimeoutError, RequestError, concurrent.futures.CancelledError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(debug_router(engine))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error(f"Internal error: {type(exc).__name__}: {exc}", 500)

    return app


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()

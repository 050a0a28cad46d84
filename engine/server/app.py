"""The engine's FastAPI app: SGLang's native routes over an :class:`~engine.runtime.engine.Engine`.

Routes (SGLang names and shapes): ``/generate`` (single or batch, SSE streaming),
``/update_weights_from_disk``, ``/update_weight_version``, ``/pause_generation``, ``/continue_generation``,
``/abort_request``, ``/flush_cache``, ``/model_info`` (+ ``/get_model_info``), ``/server_info``
(+ ``/get_server_info``), ``/get_weight_version``, ``/health``, ``/health_generate``, ``/metrics``.

Errors: a request the engine refuses (malformed JSON, wrong types, token ids outside the
vocabulary, empty input, too long a context, bad sampling parameters, a weight path without
weights) gets HTTP 400 in the shape of the SGLang step that refuses it
(:func:`core.sglang_contract.error_body`): on every route a body that is empty, malformed or of
the wrong types gets the request validation handler's ``ErrorResponse``; ``/generate``'s later
steps answer the contract gate's ``{"error": "..."}`` or ``{"error": {"message": "..."}}``; the
weight routes answer ``{"success": false, "message": "..."}`` for what they refuse themselves,
as SGLang does; and the server keeps serving.
A weight load that fails once weight files were found ends the process, as it ends SGLang's
server (docs/sglang-contract.md, row 6).

``meta_info`` per response, in the order SGLang 0.5.23 writes it as the fleet starts it (with
``--enable-metrics``; managers/tokenizer_manager.py 2506-2617, 2750-2775, 2024-2029):
``id``, ``finish_reason``, ``prompt_tokens``, ``weight_version`` (str: the version of the last
output token once finished, before that the serving version ``/model_info`` names),
``num_retractions`` (the times a ``retract`` pause put the request back to wait, as SGLang's
``Req.reset_for_retract`` counts them, managers/schedule_batch.py 2049-2052), the scheduler's
timings ``forward_entry_time`` / ``prefill_finished_time`` (wall-clock stamps, once the request
reached the forward / its first output) and ``queue_time`` (observability/req_time_stats.py
1213-1236); the log-prob and sampling-mask keys below; ``reasoning_tokens`` (always 0: SGLang
counts them only on a server started with ``--reasoning-parser``, managers/scheduler.py 940-955),
``completion_tokens``, ``cached_tokens`` (always 0: no prefix cache); once finished
``weight_versions`` (spans ``{"version", "start", "end"}``, end exclusive, over output indices;
output_streamer.py 540-554); ``cached_tokens_details`` (null: no cached tokens, output_streamer.py
102-133); ``routed_experts`` (below); ``dp_rank`` (null: one data-parallel rank, no controller,
output_streamer.py 718-723); once finished ``e2e_latency``, ``request_received_ts``,
``first_token_latency``, ``api_server_dispatch_finish_ts``, ``request_finished_ts`` and, past one
token, ``decode_throughput`` (req_time_stats.py 507-533); ``response_sent_to_client_ts`` on the
first output sent (a stream's first chunk, which its last repeats before ``request_finished_ts``).
The timings are the engine's, measured where it answers (``engine.server.response``).
With ``return_logprob``: ``input_token_logprobs`` / ``output_token_logprobs`` as
``[logprob, token_id, text_or_null]`` triples, ``output_token_logprobs_length`` (their count,
managers/tokenizer_manager.py 2868-2870), and ``*_top_logprobs`` when
``top_logprobs_num > 0``; with ``return_sampling_mask``: ``output_token_sampling_mask``
(per token the support ids ranked as SGLang's sampler packs them: by the renormalized probability
the token was drawn with, highest first, equal ones by ascending id; ``[]`` = whole vocabulary),
``output_token_sampling_logprobs`` (per token the behavior log-prob μ of the sampled token; with
``sampling_logprobs_mode: support`` per token the support's log-probs, aligned with the mask) and
``output_token_sampling_mask_length``, as SGLang sends them; with ``return_routed_experts`` on an
engine started with ``--enable-return-routed-experts``, once finished: ``routed_experts`` (base64 int32
``[seqlen - 1 - routed_experts_start_len, layers, k]``, :mod:`core.sglang_release`; without the
flag the key is absent, as in SGLang). Non-finite floats are sent as ``null``. An abort of a
request not yet decoding (waiting, retracted, mid prefill) is SGLang's abort echo instead: ``id``,
``finish_reason``, ``weight_version``, ``e2e_latency``, ``weight_versions``, the log-prob keys,
``completion_tokens``, over only what was sent (docs/sglang-contract.md row 14,
``GenerateResponse._echo_body``).

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

The routes live in ``routes_generate``, ``routes_weights``, ``routes_control`` and
``routes_info`` (module-level ``APIRouter`` each); they reach the engine at ``app.state.engine``.
``debug`` adds the routes ``mixfleet validate`` uses, which SGLang does not have
(``/debug/operator``; ``/debug/fault`` only with ``MIXFLEET_ENGINE_FAULTS=1``).

Kept apart from the CLI module (``mixfleet.engine``) so ``mixfleet --help`` does not import
FastAPI.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from core.sglang_contract import error_body
from engine.runtime.engine import ENGINE_VERSION, Engine
from engine.server import routes_control, routes_generate, routes_info, routes_weights
from engine.server.debug import debug_router
from engine.server.requests import error, validation_message

log = logging.getLogger("mixfleet.engine")


async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A parameter FastAPI refused (``/flush_cache?timeout=-1``): SGLang's request validation
    handler's 400 (entrypoints/http_server.py 635-691)."""
    return JSONResponse(error_body("parse", validation_message(exc)), status_code=400)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error")
    return error(f"Internal error: {type(exc).__name__}: {exc}", 500)


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving ``engine`` (held at ``app.state.engine``)."""
    app = FastAPI(title="mixfleet CPU engine (SGLang native API)", version=ENGINE_VERSION)
    app.state.engine = engine
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(Exception, _unexpected)
    for module in (routes_generate, routes_weights, routes_control, routes_info):
        app.include_router(module.router)
    app.include_router(debug_router(engine))
    return app

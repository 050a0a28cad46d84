"""Read-only routes: ``/model_info`` (+ ``/get_model_info``), ``/server_info``
(+ ``/get_server_info``), ``/get_weight_version``, ``/health``, ``/metrics``."""

from __future__ import annotations

import os
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.runtime.engine import ENGINE_VERSION
from engine.runtime.metrics import CONTENT_TYPE
from engine.server.requests import engine_of

router = APIRouter()


def model_info(request: Request) -> dict[str, Any]:
    """SGLang's keys in its order (entrypoints/http_server.py 812-850) for a server started as the
    fleet starts it: ``load_format`` ``"auto"`` (arg_groups/fields/model.py 58-97; an update may
    name no other here), no reasoning or tool-call parser (fields/serving.py 208, 227),
    ``disaggregation_mode`` ``"null"`` (fields/disagg.py 55-58); nothing else (the local
    engine's own facts are :func:`server_info`'s)."""
    engine = engine_of(request)
    return {
        "model_path": engine.model_path,
        "served_model_name": engine.reported_model_name,
        "tokenizer_path": engine.startup_model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(engine.reported_version),
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
    }


router.get("/model_info")(model_info)
router.get("/get_model_info")(model_info)


def server_info(request: Request) -> dict[str, Any]:
    engine = engine_of(request)
    scheduler = engine.scheduler
    return {
        "model_path": engine.startup_model_path,
        "served_model_name": engine.served_model_name,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "weight_format": engine.precision,
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
                # not SGLang's: requests its tokenizer manager holds while paused (engine.runtime.admission)
                "num_pause_waiting_reqs": engine.admission.waiting,
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


router.get("/server_info")(server_info)
router.get("/get_server_info")(server_info)


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    return {"weight_version": str(engine_of(request).reported_version)}


@router.get("/health")
async def health(request: Request) -> Response:
    return Response(status_code=200 if engine_of(request).scheduler.alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(engine_of(request).metrics.render(), media_type=CONTENT_TYPE)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()

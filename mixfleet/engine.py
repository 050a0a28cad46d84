"""Serve a model directory on the CPU over SGLang's native HTTP API (the local sampler engine).

``mixfleet engine --model DIR --port P [...]``: loads ``DIR`` (any of the four formats), then
serves it with :func:`engine.server.app.create_app` (the routes and their contract) until
stopped. A model that cannot be loaded is a one-line error, not a traceback.
"""

from __future__ import annotations

import argparse
import logging

from core.errors import UserError
from core.sglang_release import SAMPLING_MASK_MAX_TOKENS_DEFAULT
from mixfleet.argtypes import log_level, tcp_port

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (HF layout, any of the four formats)")
    parser.add_argument("--port", type=tcp_port, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3"])
    parser.add_argument("--weight-version", type=int, default=0, help="version stamped on tokens at start")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--prefill-budget", type=int, default=2048, help="prompt tokens per step at most")
    parser.add_argument("--served-model-name", default=None, help="the model_name metrics label")
    parser.add_argument(
        "--sampling-mask-max-tokens",
        type=int,
        default=SAMPLING_MASK_MAX_TOKENS_DEFAULT,
        help="largest top_k a sampling-mask request may use (SGLang's flag)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record each token's top-k experts of every MoE layer for requests that ask (SGLang's flag)",
    )
    parser.add_argument("--log-level", type=log_level, default="warning")


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from core.process import raise_open_file_limit
    from engine.runtime.engine import Engine
    from engine.server.app import create_app

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.sampling_mask_max_tokens < 2:
        raise UserError(f"--sampling-mask-max-tokens must be >= 2, got {args.sampling_mask_max_tokens}")
    if args.weight_version < 0:
        raise UserError(f"--weight-version must be >= 0, got {args.weight_version}")
    for flag, value in (
        ("--max-running-requests", args.max_running_requests),
        ("--prefill-budget", args.prefill_budget),
    ):
        if value < 1:  # 0 would take no request, and every request would wait forever
            raise UserError(f"{flag} must be >= 1, got {value}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise_open_file_limit()
    try:
        engine = Engine.load(
            args.model,
            kv_cache_dtype=args.kv_cache_dtype,
            weight_version=args.weight_version,
            max_running=args.max_running_requests,
            prefill_budget=args.prefill_budget,
            served_model_name=args.served_model_name,
            sampling_mask_max_tokens=args.sampling_mask_max_tokens,
            enable_return_routed_experts=args.enable_return_routed_experts,
        )
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot load model {args.model!r}: {exc}") from None
    app = create_app(engine)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        engine.scheduler.stop()
    return 0

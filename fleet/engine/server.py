"""Serve a model directory on the CPU over SGLang's native HTTP API (the local sampler engine).

Routes (SGLang names and shapes): ``/generate`` (single or batch, SSE streaming),
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``,
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
(per token the behavior log-prob μ of the sampled token, as upstream SGLang),
``output_token_sampling_mask_length`` and, a mixfleet extension,
``output_token_sampling_support_logprobs`` (per token the renormalized log-probs aligned with
the mask). Non-finite floats are sent as ``null``.

Weight updates: ``/update_weights_from_disk`` loads and checks the new directory completely on a
worker thread while generation goes on, then swaps it in between two decode steps (so callers
need not pause for atomicity; pausing in place first is harmless). Versions are integers here
(the fleet's versions); upstream SGLang spells span versions as strings — ``weight_version``
is a string in both.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run", "Engine"]

log = logging.getLogger("mixfleet.engine")

ENGINE_VERSION = "mixfleet-cpu-engine/0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (HF layout, any of the four formats)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3"])
    parser.add_argument("--weight-version", type=int, default=0, help="version stamped on tokens at start")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--prefill-budget", type=int, default=2048, help="prompt tokens per step at most")
    parser.add_argument("--served-model-name", default=None, help="the model_name metrics label")
    parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from weight_sync.errors import UserError

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.weight_version < 0:
        raise UserError(f"--weight-version must be >= 0, got {args.weight_version}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = Engine.load(
            args.model,
            kv_cache_dtype=args.kv_cache_dtype,
            weight_version=args.weight_version,
            max_running=args.max_running_requests,
            prefill_budget=args.prefill_budget,
            served_model_name=args.served_model_name,
        )
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot load model {args.model!r}: {exc}") from None
    from fleet.engine.http_app import create_app

    app = create_app(engine)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        engine.scheduler.stop()
    return 0


# Every model of the process (the first and each update's) is loaded on this one thread, so a
# replaced model's freed memory goes to the next update's weights. Were the first model loaded on
# another thread, its memory would sit in that thread's malloc arena and the second update would
# take fresh pages too (a page fault per 4 KiB: ~40,000 faults, 0.05-0.1 s of CPU for `small`).
LOADER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-load")


class Engine:
    """What one engine process serves: the model directory, its tokenizer and the scheduler."""

    def __init__(
        self,
        *,
        model: Any,
        model_path: str,
        kv_cache_dtype: str,
        weight_version: int,
        max_running: int,
        prefill_budget: int,
        served_model_name: str | None,
    ) -> None:
        from fleet.engine.metrics import EngineMetrics
        from fleet.engine.protocol import ModelLimits
        from fleet.engine.scheduler import Scheduler

        self.model_path = model_path
        self.kv_cache_dtype = kv_cache_dtype
        self.config = model.config
        self.precision = getattr(model, "precision", "bf16")
        self.limits = ModelLimits(
            vocab_size=self.config.vocab_size, context_len=self.config.max_position_embeddings
        )
        self.tokenizer = _load_tokenizer(Path(model_path))
        self.served_model_name = served_model_name or model_path
        self.metrics = EngineMetrics(self.served_model_name)
        self.started = time.time()
        self.update_lock = asyncio.Lock()
        self.scheduler = Scheduler(
            model,
            weight_version=weight_version,
            vocab_size=self.config.vocab_size,
            context_len=self.config.max_position_embeddings,
            eos_token_ids=frozenset(self.config.eos_token_ids),
            metrics=self.metrics,
            max_running=max_running,
            prefill_budget=prefill_budget,
        )
        self.scheduler.start()

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        kv_cache_dtype: str = "auto",
        weight_version: int = 0,
        max_running: int = 64,
        prefill_budget: int = 2048,
        served_model_name: str | None = None,
    ) -> Engine:
        from fleet.engine.model import load_model

        path = str(Path(model_path).resolve())
        model = LOADER.submit(load_model, path, kv_cache_dtype=kv_cache_dtype).result()
        return cls(
            model=model,
            model_path=path,
            kv_cache_dtype=kv_cache_dtype,
            weight_version=weight_version,
            max_running=max_running,
            prefill_budget=prefill_budget,
            served_model_name=served_model_name,
        )

    @property
    def weight_version(self) -> int:
        return self.scheduler.weight_version

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            from fleet.engine.protocol import RequestError

            raise RequestError("text input needs a tokenizer; this model directory has no tokenizer.json.")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None or not ids:
            return ""
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        except ValueError:  # ids the model has but the tokenizer does not (a padded vocabulary)
            known = []
            for i in ids:
                try:
                    self.tokenizer.decode([i])
                except ValueError:
                    continue
                known.append(i)
            return self.tokenizer.decode(known, skip_special_tokens=skip_special_tokens)

    def load_replacement(self, model_path: str) -> Any:
        """Load ``model_path`` fully and check it can replace the served model; raises ``ValueError``."""
        from fleet.engine.config import ModelConfig
        from fleet.engine.model import load_model

        path = Path(model_path)
        new_cfg = ModelConfig.from_dir(path)  # cheap checks first: missing dir, another architecture
        old = self.config
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "moe_intermediate_size",
            "num_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
        ):
            a, b = getattr(old, name), getattr(new_cfg, name)
            if a != b:
                raise ValueError(
                    f"model at {model_path!r} has another architecture than the served model: "
                    f"{name} is {b}, the served model has {a}"
                )
        return load_model(str(path.resolve()), kv_cache_dtype=self.kv_cache_dtype)


def _load_tokenizer(path: Path) -> Any:
    if not (path / "tokenizer.json").is_file():
        return None
    from fleet.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)

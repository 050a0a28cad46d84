"""What one engine process serves: the :class:`Engine` facade (model directory, tokenizer,
scheduler, metrics) and the one loader thread every model of the process is loaded on.

After :meth:`Engine.load` returns, the model is loaded (on :data:`LOADER`) and the scheduler
runs; :meth:`Engine.load_replacement` (callers run it on :data:`LOADER`) loads the tensors of a
new directory into the served configuration without touching the served model, and raises
``ValueError`` if it cannot replace it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path
from typing import Any

from core.sglang_release import SAMPLING_MASK_MAX_TOKENS_DEFAULT

__all__ = ["ENGINE_VERSION", "LOADER", "Engine", "WeightsNotFound"]

ENGINE_VERSION = "mixfleet-cpu-engine/0.1"

# Every model of the process (the first and each update's) is loaded on this one thread, so a
# replaced model's freed memory, which sits in this thread's malloc arena, holds the next update's
# weights instead of fresh pages.
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
        sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS_DEFAULT,
        enable_return_routed_experts: bool = False,
    ) -> None:
        from engine.runtime.admission import Admission
        from engine.runtime.metrics import EngineMetrics
        from engine.runtime.request import ModelLimits
        from engine.runtime.rwlock import RWLock
        from engine.runtime.scheduler import Scheduler

        self.model_path = model_path
        self.kv_cache_dtype = kv_cache_dtype
        self.config = model.config
        self.precision = getattr(model, "precision", "bf16")
        self.limits = ModelLimits(
            vocab_size=self.config.vocab_size,
            context_len=self.config.max_position_embeddings,
            sampling_mask_max_tokens=sampling_mask_max_tokens,
        )
        self.tokenizer = _load_tokenizer(Path(model_path))
        self.served_model_name = served_model_name or model_path
        # /server_info reports the start-up path and name (the resolved server args) and
        # /model_info the tokenizer's path (the start-up model path, arg_groups/serving_hook.py
        # 636-641); /model_info's model_path and served_model_name move to the path an update
        # names (tokenizer_manager.py 2365-2370).
        self.startup_model_path = model_path
        self.reported_model_name = self.served_model_name
        self.metrics = EngineMetrics(self.served_model_name)
        self.started = time.time()
        # Weight updates run one at a time; generate requests hold model_update_lock's reader side
        # and an update sent while generation is not paused its writer side (SGLang's RWLock).
        self.update_lock = asyncio.Lock()
        self.model_update_lock = RWLock()
        # Held while an update loads and swaps, which SGLang's scheduler does in its loop: a
        # /continue_generation sent meanwhile takes effect after the swap (its scheduler reads the
        # continue once the update is done), never on the old weights before it.
        self.applying = asyncio.Lock()
        # What /model_info reports: SGLang's tokenizer manager keeps it apart from the scheduler's
        # version (stamped on tokens) and moves it only on a successful update or
        # /update_weight_version (tokenizer_manager.py 2316-2322); /server_info reports the
        # start-up one (utils/common.py 3584-3593, the resolved server args).
        self.reported_version = weight_version
        self.startup_version = weight_version
        self.scheduler = Scheduler(
            model,
            weight_version=weight_version,
            vocab_size=self.config.vocab_size,
            context_len=self.config.max_position_embeddings,
            eos_token_ids=frozenset(self.config.eos_token_ids),
            metrics=self.metrics,
            max_running=max_running,
            prefill_budget=prefill_budget,
            record_routes=enable_return_routed_experts,
        )
        self.scheduler.start()
        # SGLang's tokenizer manager between the routes and the scheduler: request states, the
        # pause gate and abort-once (engine.runtime.admission)
        self.admission = Admission(self.scheduler)

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
        sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS_DEFAULT,
        enable_return_routed_experts: bool = False,
    ) -> Engine:
        from engine.model.model import load_model

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
            sampling_mask_max_tokens=sampling_mask_max_tokens,
            enable_return_routed_experts=enable_return_routed_experts,
        )

    @property
    def weight_version(self) -> int:
        """The version the scheduler stamps on the tokens it samples now."""
        return self.scheduler.weight_version

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            from engine.runtime.request import RequestError

            raise RequestError("text input needs a tokenizer; this model directory has no tokenizer.json.")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def load_replacement(self, model_path: str) -> Any:
        """The served model's replacement from the weights at ``model_path``, loaded as SGLang
        0.5.23's ``update_weights_from_disk`` loads them into the running model
        (model_executor/model_runner_components/weight_updater.py 174-260): the directory's
        ``config.json`` is not read (the served ``model_config`` is kept, 193-203), only its
        tensors count. Raises :class:`WeightsNotFound` when ``model_path`` is not a directory or
        holds no ``*.safetensors`` (SGLang's ``_prepare_weights``, model_loader/loader.py 480-580,
        refused before any weight is touched: weight_updater.py 222-227) and ``ValueError`` when a
        tensor cannot be loaded (missing, of another shape or dtype, unreadable, or one the served
        model has no place for). The served model is never touched."""
        from engine.model.loader import load_checkpoint
        from engine.model.model import Model

        path = Path(model_path)
        if not path.is_dir():
            raise WeightsNotFound(f"model path {model_path!r} does not exist")
        if not any(path.glob("*.safetensors")):
            raise WeightsNotFound(f"Cannot find any model weights with `{model_path}`")
        path = path.resolve()
        tensors = load_checkpoint(path, self.config)
        return Model(self.config, tensors, kv_cache_dtype=self.kv_cache_dtype, path=path)


class WeightsNotFound(ValueError):
    """An update's path holds no weights to load (SGLang: "Failed to get weights iterator")."""


def _load_tokenizer(path: Path) -> Any:
    if not (path / "tokenizer.json").is_file():
        return None
    from engine.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)

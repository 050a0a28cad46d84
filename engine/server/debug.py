"""Debug routes of the local engine for ``mixfleet validate`` (not part of SGLang's API).

``POST /debug/operator`` (always served; reads only): run one named linear of the served
checkpoint on a given input with the engine's own kernels, as the served model does.
Body ``{"name": "model.layers.0.mlp.experts.3.gate_proj", "input": [[float, ...], ...]}``;
answer ``{"name", "format", "shape": [N, K], "output": [[float, ...], ...]}``. The linear's
tensors are read from the directory the engine serves (``Engine.model_path``) with the engine's
loader (``engine.model.loader.load_linear``) and run through ``engine.model.layers.Linear``
(its packing, activation quantization and GEMM). It does not read the live model's packed tables
(which expert sits in which slot of a fused-MoE layer): that is what routed experts show
(validate level 5). SGLang 0.5.23 has no such route (docs/sglang-contract.md).

``POST /debug/fault`` (served only when ``MIXFLEET_ENGINE_FAULTS=1`` in the engine's
environment; tests inject faults with it): the next weight loads misbehave until cleared.
Body ``{"swap_experts": [layer, a, b]}`` (every later load swaps experts ``a`` and ``b`` of MoE
layer ``layer`` in the model's packed expert table, the files untouched), ``{"skip_install":
true}`` (every later update answers success and reports its version but keeps serving the old
weights), ``{"load_delay_s": s}`` (every later load first waits ``s`` seconds, as a large
checkpoint's load does: a sidecar's activation then keeps the engine paused that long), or ``{}``
(clear). Answer: the faults now set.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

FAULTS_ENV = "MIXFLEET_ENGINE_FAULTS"
MAX_ROWS = 256
_NAME = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj))$"
)


class OperatorRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    input: list[list[float]] = Field(min_length=1, max_length=MAX_ROWS)


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    swap_experts: tuple[int, int, int] | None = None
    skip_install: bool = False
    load_delay_s: float = Field(0.0, ge=0.0, le=60.0)


def linear_shape(config: Any, name: str) -> tuple[int, int]:
    """``[N, K]`` of the linear ``name`` under ``config`` (``engine.model.config.ModelConfig``);
    ``ValueError`` naming the linear when the model has no such linear."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a linear of a Qwen3-MoE decoder layer")
    layer, attn, dense, expert, expert_proj = int(m[1]), m[3], m[4], m[5], m[6]
    c = config
    if layer >= c.num_hidden_layers:
        raise ValueError(f"{name!r}: the model has {c.num_hidden_layers} layers")
    h, d = c.hidden_size, c.head_dim
    if attn:
        heads = c.num_attention_heads if attn in ("q_proj", "o_proj") else c.num_key_value_heads
        return (h, heads * d) if attn == "o_proj" else (heads * d, h)
    moe = c.is_moe_layer(layer)
    if (expert is not None) != moe:
        raise ValueError(f"{name!r}: layer {layer} is {'an MoE' if moe else 'a dense'} layer")
    if expert is not None and int(expert) >= c.num_experts:
        raise ValueError(f"{name!r}: the model has {c.num_experts} experts")
    inter = c.moe_intermediate_size if moe else c.intermediate_size
    proj = expert_proj or dense
    return (h, inter) if proj == "down_proj" else (inter, h)


def run_operator(model_path: str, config: Any, name: str, x: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The served checkpoint's linear ``name`` applied to ``x`` ``[M, K]`` by the engine's kernels:
    ``(format, output [M, N])``; ``ValueError`` naming the problem."""
    from engine.model.layers import Linear
    from engine.model.loader import TensorSource, load_linear

    n, k = linear_shape(config, name)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"input must be [M, {k}] for {name!r}, got {list(x.shape)}")
    w = load_linear(TensorSource(Path(model_path)), name, (n, k))
    with torch.inference_mode():
        return w.fmt, Linear.of_parts([w])(x.float().contiguous()).float()


class Faults:
    """The faults set through ``/debug/fault``; ``load`` wraps the engine's replacement loader."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.swap: tuple[int, int, int] | None = None
        self.skip_install = False
        self.load_delay_s = 0.0
        self._load = engine.load_replacement
        engine.load_replacement = self.load

    def load(self, model_path: str) -> Any:
        time.sleep(self.load_delay_s)  # on the engine's loader thread, as a load itself
        if self.skip_install:
            self._load(model_path)  # still refuses what the engine would refuse
            return self.engine.scheduler.model
        if self.swap is None:
            return self._load(model_path)
        from engine.model.config import ModelConfig
        from engine.model.loader import load_checkpoint
        from engine.model.model import Model

        self._load(model_path)  # the engine's own checks first
        path = Path(model_path).resolve()
        config = ModelConfig.from_dir(path)
        tensors = load_checkpoint(path, config)
        layer, a, b = self.swap
        experts = tensors.layers[layer].experts
        experts[a], experts[b] = experts[b], experts[a]
        return Model(config, tensors, kv_cache_dtype=self.engine.kv_cache_dtype, path=path)

    def state(self) -> dict[str, Any]:
        return {
            "swap_experts": list(self.swap) if self.swap else None,
            "skip_install": self.skip_install,
            "load_delay_s": self.load_delay_s,
        }


def debug_router(engine: Any) -> APIRouter:
    """The debug routes for ``engine`` (``/debug/fault`` only when ``MIXFLEET_ENGINE_FAULTS=1``)."""
    router = APIRouter(tags=["debug"])

    @router.post("/debug/operator")
    def operator(body: OperatorRequest) -> Any:
        x = torch.tensor(body.input, dtype=torch.float32)
        try:
            fmt, out = run_operator(engine.model_path, engine.config, body.name, x)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        return {"name": body.name, "format": fmt, "shape": [out.shape[1], x.shape[1]], "output": out.tolist()}

    if os.environ.get(FAULTS_ENV) == "1":
        faults = Faults(engine)

        @router.post("/debug/fault")
        def fault(body: FaultRequest) -> Any:
            if body.swap_experts is not None:
                layer, a, b = body.swap_experts
                c = engine.config
                if not (0 <= layer < c.num_hidden_layers and c.is_moe_layer(layer)):
                    return JSONResponse({"error": {"message": f"layer {layer} is not an MoE layer"}}, 400)
                if not (0 <= a < c.num_experts and 0 <= b < c.num_experts and a != b):
                    return JSONResponse({"error": {"message": f"experts {a}, {b}: two different ids"}}, 400)
            faults.swap = body.swap_experts
            faults.skip_install = body.skip_install
            faults.load_delay_s = body.load_delay_s
            return faults.state()

    return router

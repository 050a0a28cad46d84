"""Read a checkpoint directory in any of the four formats into float32 tensors with HF names.

The directory is an HF ``Qwen3MoeForCausalLM`` checkpoint (``*.safetensors``, optionally with
``model.safetensors.index.json``) as written by ``mixfleet init-model`` (BF16) or
``mixfleet convert`` (bf16 / fp8 / nvfp4 / mxfp4). Each linear layer's tensors are recognised by
their names and dtypes and dequantized with ``weight_sync.formats`` (the codes and scales are
the real ones a GPU group serves):

=======  ==========================================================  =========================
format   tensors of a linear ``P``                                    compute
=======  ==========================================================  =========================
bf16     ``P.weight`` (bf16/f16/f32)                                  as is
fp8      ``P.weight`` (float8_e4m3fn) + ``P.weight_scale_inv``        W8A8: activations
                                                                      quantized per token/128
nvfp4    ``P.weight`` (uint8) + ``P.weight_scale`` (fp8) +             W4A16
         ``P.weight_scale_2`` [+ ``P.input_scale``]
mxfp4    ``P.weight_blocks`` + ``P.weight_scales`` (uint8), or         W4A16
         ``P.weight`` (uint8 ``[N, K/2]``) + ``P.weight_scale`` (uint8)
=======  ==========================================================  =========================

Every problem (no safetensors, a tensor missing, a shape that does not match ``config.json``, a
tensor the model has no place for) raises ``ValueError`` naming the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fleet.engine.config import ModelConfig

FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Tensors a converted checkpoint may carry that this engine does not use.
_IGNORED_SUFFIXES = (".k_scale", ".v_scale", ".rotary_emb.inv_freq")


@dataclass(frozen=True)
class LinearWeight:
    """A dequantized linear weight ``[N, K]`` (float32) and the format its codes were stored in."""

    weight: torch.Tensor
    fmt: str

    @property
    def fp8_activations(self) -> bool:
        return self.fmt == "fp8"


def detect_format(path: Path, raw_config: dict[str, Any]) -> str:
    """The checkpoint's declared format, from ``config.json`` ``quantization_config`` or
    ``hf_quant_config.json`` (ModelOpt); ``bf16`` when neither declares one."""
    qc = raw_config.get("quantization_config")
    if isinstance(qc, dict):
        method = str(qc.get("quant_method", "")).lower()
        algo = str(qc.get("quant_algo", "")).lower()
        if method == "fp8" or algo == "fp8":
            return "fp8"
        if method in ("mxfp4",) or algo == "mxfp4":
            return "mxfp4"
        if method.startswith("modelopt") or algo == "nvfp4" or method == "nvfp4":
            return "nvfp4"
        raise ValueError(f"config.json: quantization_config quant_method {method!r} is not supported")
    hf_quant = path / "hf_quant_config.json"
    if hf_quant.is_file():
        try:
            algo = str(json.loads(hf_quant.read_text()).get("quantization", {}).get("quant_algo", ""))
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"{hf_quant}: not readable ({exc})") from None
        if algo.upper() == "NVFP4":
            return "nvfp4"
        if algo.upper() == "FP8":
            return "fp8"
        raise ValueError(f"{hf_quant}: quant_algo {algo!r} is not supported")
    return "bf16"


class TensorSource:
    """Lazy access to every tensor of a directory's safetensors files by name."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a valid safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model directory {str(path)!r} has no *.safetensors files")
        self._handles: dict[str, Any] = {}
        self.location: dict[str, str] = {}
        for name in files:
            file = path / name
            if not file.is_file():
                raise ValueError(f"model directory {str(path)!r} is missing {name} (named by its index)")
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
            self._handles[name] = handle
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                self.location[key] = name
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        self.used.add(name)
        return self._handles[self.location[name]].get_tensor(name)

    def unused(self) -> list[str]:
        return sorted(n for n in self.location if n not in self.used and not n.endswith(_IGNORED_SUFFIXES))


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}")


def load_plain(src: TensorSource, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An unquantized tensor (norm, embedding) as float32, shape-checked."""
    t = src.get(name)
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a floating-point tensor")
    _check_shape(name, t, shape)
    return t.float()


def load_linear(src: TensorSource, prefix: str, shape: tuple[int, int]) -> LinearWeight:
    """The weight of linear ``prefix`` (``[N, K]`` = ``shape``) in whichever format it is stored."""
    try:
        lw = _load_linear(src, prefix, shape)
    except ValueError as exc:
        if prefix in str(exc):
            raise
        raise ValueError(f"linear {prefix!r}: {exc}") from None
    _check_shape(f"{prefix}.weight (dequantized)", lw.weight, shape)
    return lw


def _load_linear(src: TensorSource, prefix: str, shape: tuple[int, int]) -> LinearWeight:
    name = f"{prefix}.weight"
    n, k = shape
    if f"{prefix}.weight_blocks" in src:
        from weight_sync.formats import mxfp4

        blocks = src.get(f"{prefix}.weight_blocks")
        scales = src.get(f"{prefix}.weight_scales")
        w = mxfp4.dequantize({"blocks": blocks, "scales": scales}).reshape(blocks.shape[0], -1)
        _check_shape(f"{prefix}.weight_blocks (dequantized)", w, shape)
        return LinearWeight(w, "mxfp4")
    if name not in src:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    raw = src.get(name)
    if f"{prefix}.weight_scale_inv" in src:
        if raw.dtype != torch.float8_e4m3fn:
            raise ValueError(f"tensor {name!r} has dtype {raw.dtype}; an FP8 weight must be float8_e4m3fn")
        _check_shape(name, raw, shape)
        from weight_sync.formats import fp8

        w = fp8.dequantize({"weight": raw, "weight_scale_inv": src.get(f"{prefix}.weight_scale_inv")})
        return LinearWeight(w.float(), "fp8")
    if f"{prefix}.weight_scale_2" in src:
        d = {"weight": raw, "weight_scale": src.get(f"{prefix}.weight_scale"),
             "weight_scale_2": src.get(f"{prefix}.weight_scale_2")}
        if f"{prefix}.input_scale" in src:
            d["input_scale"] = src.get(f"{prefix}.input_scale")
        _check_shape(name, raw, (n, k // 2))
        from weight_sync.formats import nvfp4

        return LinearWeight(nvfp4.dequantize(d).float(), "nvfp4")
    if raw.dtype == torch.uint8 and f"{prefix}.weight_scale" in src:
        scales = src.get(f"{prefix}.weight_scale")
        _check_shape(name, raw, (n, k // 2))
        if scales.dtype != torch.uint8:
            raise ValueError(
                f"tensor {prefix}.weight_scale has dtype {scales.dtype}; MXFP4 scales are uint8 E8M0"
            )
        from weight_sync.formats import mxfp4

        blocks = raw.reshape(n, k // 32, 16)
        w = mxfp4.dequantize({"blocks": blocks, "scales": scales.reshape(n, k // 32)}).reshape(n, k)
        return LinearWeight(w.float(), "mxfp4")
    if raw.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {raw.dtype} and no scales to dequantize it with")
    _check_shape(name, raw, shape)
    return LinearWeight(raw.float(), "bf16")


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's dequantized tensors (HF names without the ``model.layers.{i}.`` prefix)."""

    plain: dict[str, torch.Tensor]
    linears: dict[str, LinearWeight]
    experts: list[dict[str, LinearWeight]]


@dataclass(frozen=True)
class CheckpointTensors:
    """All tensors a ``Model`` needs, float32, plus the checkpoint's declared format."""

    fmt: str
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: LinearWeight
    layers: list[LayerTensors]


def load_checkpoint(path: Path, config: ModelConfig) -> CheckpointTensors:
    """Load and dequantize every tensor of ``path`` the config calls for (ValueError on any mismatch)."""
    fmt = detect_format(path, config.raw)
    src = TensorSource(path)
    c = config
    h, d = c.hidden_size, c.head_dim
    embed = load_plain(src, "model.embed_tokens.weight", (c.vocab_size, h))
    final_norm = load_plain(src, "model.norm.weight", (h,))
    if c.tie_word_embeddings and "lm_head.weight" not in src:
        lm_head = LinearWeight(embed, "bf16")
    else:
        lm_head = load_linear(src, "lm_head", (c.vocab_size, h))
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        plain = {
            "input_layernorm": load_plain(src, p + "input_layernorm.weight", (h,)),
            "post_attention_layernorm": load_plain(src, p + "post_attention_layernorm.weight", (h,)),
            "q_norm": load_plain(src, p + "self_attn.q_norm.weight", (d,)),
            "k_norm": load_plain(src, p + "self_attn.k_norm.weight", (d,)),
        }
        linears = {
            "q_proj": load_linear(src, p + "self_attn.q_proj", (c.num_attention_heads * d, h)),
            "k_proj": load_linear(src, p + "self_attn.k_proj", (c.num_key_value_heads * d, h)),
            "v_proj": load_linear(src, p + "self_attn.v_proj", (c.num_key_value_heads * d, h)),
            "o_proj": load_linear(src, p + "self_attn.o_proj", (h, c.num_attention_heads * d)),
        }
        experts: list[dict[str, LinearWeight]] = []
        if c.is_moe_layer(i):
            plain["gate"] = load_linear(src, p + "mlp.gate", (c.num_experts, h)).weight
            inter = c.moe_intermediate_size
            for e in range(c.num_experts):
                q = f"{p}mlp.experts.{e}."
                experts.append({
                    "gate_proj": load_linear(src, q + "gate_proj", (inter, h)),
                    "up_proj": load_linear(src, q + "up_proj", (inter, h)),
                    "down_proj": load_linear(src, q + "down_proj", (h, inter)),
                })
        else:
            inter = c.intermediate_size
            linears["gate_proj"] = load_linear(src, p + "mlp.gate_proj", (inter, h))
            linears["up_proj"] = load_linear(src, p + "mlp.up_proj", (inter, h))
            linears["down_proj"] = load_linear(src, p + "mlp.down_proj", (h, inter))
        layers.append(LayerTensors(plain, linears, experts))
    extra = src.unused()
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise ValueError(f"checkpoint has tensors this config has no place for: {', '.join(extra[:5])}{more}")
    return CheckpointTensors(fmt, embed, final_norm, lm_head, layers)

"""Read a checkpoint directory in any of the four formats into tensors with HF names.

The directory is an HF ``Qwen3MoeForCausalLM`` checkpoint (``*.safetensors``, optionally with
``model.safetensors.index.json``) as written by ``mixfleet init-model`` (BF16) or
``mixfleet convert`` (bf16 / fp8 / nvfp4 / mxfp4). Each linear layer's tensors are recognised by
their names and dtypes and kept as stored (the codes and scales are the real ones a GPU group
serves); ``LinearWeight.weight`` dequantizes one on request with ``weight_sync.formats``' own
dequantizers (``engine.model.dequant``):

=======  ==========================================================  =========================
format   tensors of a linear ``P``                                    compute
=======  ==========================================================  =========================
bf16     ``P.weight`` (bf16/f16/f32)                                  as is
fp8      ``P.weight`` (float8_e4m3fn) + ``P.weight_scale_inv``        W8A8: activations
                                                                      quantized per token/128
nvfp4    ``P.weight`` (uint8) + ``P.weight_scale`` (fp8) +             W4A4: activations
         ``P.weight_scale_2`` + ``P.input_scale`` (1.0 if absent)       quantized per token/16
                                                                      with ``input_scale``
mxfp4    ``P.weight_blocks`` + ``P.weight_scales`` (uint8), or         W4A16
         ``P.weight`` (uint8 ``[N, K/2]``) + ``P.weight_scale`` (uint8)
=======  ==========================================================  =========================

An fp8 checkpoint keeps SGLang's layout contract (``check_fp8_layout``): the modules its
``quantization_config`` ``ignored_layers`` skips are stored BF16 (and computed W16A16), every
other one block FP8, and no quantized merged linear or fused-MoE layer has an output size SGLang's
block-FP8 loader refuses (``weight_sync.formats.fp8_layout``).

Every problem (no safetensors, a malformed file, a tensor missing, a shape that does not match
``config.json``, a tensor the model has no place for, an fp8 layout SGLang would refuse) raises
``ValueError`` naming the file or tensor.

Speed (a weight update loads inside the engine's pause): each file's header is validated by
``weight_sync.safetensors_io.read_header`` (a file is accepted only when its tensors exactly tile
its data section) and the file is mapped once, privately (copy-on-write), so tensors are views of
page-cache pages with no read copy and no per-tensor file access; linears are handed over as
stored (validated codes and scales, see ``LinearWeight``): the model writes them once into its own
layout, and a float32 dequantized weight is only made where something asks for
``LinearWeight.weight``. A loaded ``Model`` copies what it keeps.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model import dequant
from engine.model.config import ModelConfig
from weight_sync.formats import fp8_layout
from weight_sync.safetensors_io import read_header, torch_dtype

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Tensors a converted checkpoint may carry that this engine does not use.
_IGNORED_SUFFIXES = (".k_scale", ".v_scale", ".rotary_emb.inv_freq")


@dataclass(frozen=True)
class LinearWeight:
    """A linear weight ``[N, K]`` = ``shape``, as stored: ``fmt`` and the checkpoint's tensors,
    already validated (dtypes and shapes):

    - bf16: ``(weight,)`` (bfloat16, float16 or float32);
    - fp8: ``(codes, weight_scale_inv)``;
    - nvfp4: ``(packed, weight_scale, weight_scale_2, input_scale)`` (``input_scale`` 1.0 where the
      checkpoint has none, as SGLang);
    - mxfp4: ``(packed [N, K/2], scales [N, K/32])`` (uint8).

    ``weight`` is the float tensor the engine computes with, made on first use: the checkpoint's
    bfloat16 tensor as stored (exact in float32), else float32 (dequantized codes, bit for bit
    ``weight_sync.formats``). The tensors may be views of the checkpoint file's mapping: a caller
    that keeps them copies them (``layers.pack_parts`` writes them straight into its own layout).
    """

    fmt: str
    shape: tuple[int, int]
    tensors: tuple[torch.Tensor, ...]

    @property
    def fp8_activations(self) -> bool:
        return self.fmt == "fp8"

    @property
    def nvfp4_input_scale(self) -> float | None:
        """The float32 ``input_scale`` an NVFP4 linear quantizes its input with (W4A4); None otherwise."""
        return float(self.tensors[3].item()) if self.fmt == "nvfp4" else None

    @functools.cached_property
    def weight(self) -> torch.Tensor:
        t = self.tensors
        if self.fmt == "fp8":
            return dequant.fp8(t[0], t[1])
        if self.fmt == "nvfp4":
            return dequant.nvfp4(t[0], t[1], t[2])
        if self.fmt == "mxfp4":
            n, k = self.shape
            return dequant.mxfp4(t[0].reshape(n, k // 32, 16), t[1])
        return t[0] if t[0].dtype in (torch.bfloat16, torch.float32) else t[0].float()

    @classmethod
    def plain(cls, w: torch.Tensor) -> LinearWeight:
        """An unquantized weight ``w`` ``[N, K]``."""
        return cls("bf16", (int(w.shape[0]), int(w.shape[1])), (w,))


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
    """Every tensor of a directory's safetensors files by name, as views of one private mapping per
    file (see the module docstring); each file's header is validated when the source opens."""

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
        self._entries: dict[str, tuple[torch.Tensor, torch.dtype, tuple[int, ...], int, int]] = {}
        for name in files:
            file = path / name
            if not file.is_file():
                raise ValueError(f"model directory {str(path)!r} is missing {name} (named by its index)")
            entries, _ = read_header(file)  # SafetensorsError (a ValueError) names the file
            data = _map_file(file)
            for key, e in entries.items():
                self._entries[key] = (data, torch_dtype(e.dtype), e.shape, e.start, e.start + e.nbytes)
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``: a view of its file's mapping (a caller that keeps it copies it)."""
        if name not in self._entries:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        self.used.add(name)
        data, dtype, shape, begin, end = self._entries[name]
        raw = data[begin:end]
        if begin % dtype.itemsize:
            raw = raw.clone()  # misaligned for a typed view
        return raw.view(dtype).view(shape)

    def unused(self) -> list[str]:
        return sorted(n for n in self._entries if n not in self.used and not n.endswith(_IGNORED_SUFFIXES))


def _map_file(file: Path) -> torch.Tensor:
    """The whole of ``file`` as a uint8 tensor over a private, copy-on-write mapping of it."""
    try:
        size = file.stat().st_size
        storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=size)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{file}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}")


def load_plain(src: TensorSource, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An unquantized tensor (norm, embedding) as a float32 copy, shape-checked."""
    t = src.get(name)
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a floating-point tensor")
    _check_shape(name, t, shape)
    return _float_copy(t)


def _float_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.dtype == torch.float32 else t.float()


def load_linear(src: TensorSource, prefix: str, shape: tuple[int, int]) -> LinearWeight:
    """The weight of linear ``prefix`` (``[N, K]`` = ``shape``) in whichever format it is stored,
    validated (dequantized lazily, see ``LinearWeight``)."""
    try:
        return _load_linear(src, prefix, shape)
    except ValueError as exc:
        if prefix in str(exc):
            raise
        raise ValueError(f"linear {prefix!r}: {exc}") from None


def _load_linear(src: TensorSource, prefix: str, shape: tuple[int, int]) -> LinearWeight:
    name = f"{prefix}.weight"
    n, k = shape
    if f"{prefix}.weight_blocks" in src:
        blocks, scales = src.get(f"{prefix}.weight_blocks"), src.get(f"{prefix}.weight_scales")
        dequant.check_mxfp4(blocks, scales)
        got = (blocks.shape[0], blocks.shape[1] * 32)
        if got != shape:
            raise ValueError(
                f"tensor '{prefix}.weight_blocks (dequantized)' has shape {list(got)}, "
                f"config.json implies {list(shape)}"
            )
        return LinearWeight("mxfp4", shape, (blocks.reshape(n, k // 2), scales))
    if name not in src:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    raw = src.get(name)
    if f"{prefix}.weight_scale_inv" in src:
        if raw.dtype != torch.float8_e4m3fn:
            raise ValueError(f"tensor {name!r} has dtype {raw.dtype}; an FP8 weight must be float8_e4m3fn")
        _check_shape(name, raw, shape)
        scale_inv = src.get(f"{prefix}.weight_scale_inv")
        dequant.check_fp8(raw, scale_inv)
        return LinearWeight("fp8", shape, (raw, scale_inv))
    if f"{prefix}.weight_scale_2" in src:
        _check_shape(name, raw, (n, k // 2))
        scale, ws2 = src.get(f"{prefix}.weight_scale"), src.get(f"{prefix}.weight_scale_2")
        dequant.check_nvfp4(raw, scale, ws2)
        return LinearWeight("nvfp4", shape, (raw, scale, ws2, _input_scale(src, prefix)))
    if raw.dtype == torch.uint8 and f"{prefix}.weight_scale" in src:
        scales = src.get(f"{prefix}.weight_scale")
        _check_shape(name, raw, (n, k // 2))
        if scales.dtype != torch.uint8:
            raise ValueError(
                f"tensor {prefix}.weight_scale has dtype {scales.dtype}; MXFP4 scales are uint8 E8M0"
            )
        _check_shape(f"{prefix}.weight_scale", scales, (n, k // 32))
        dequant.check_mxfp4(raw.reshape(n, k // 32, 16), scales)
        return LinearWeight("mxfp4", shape, (raw, scales))
    if raw.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {raw.dtype} and no scales to dequantize it with")
    _check_shape(name, raw, shape)
    return LinearWeight("bf16", shape, (raw,))


def _input_scale(src: TensorSource, prefix: str) -> torch.Tensor:
    """An NVFP4 linear's ``input_scale`` (one positive finite float), or 1.0 where the checkpoint has
    none: SGLang creates the parameter filled with 1.0 (``layers/quantization/modelopt_quant.py``
    1846-1852) and quantizes activations with it all the same."""
    name = f"{prefix}.input_scale"
    if name not in src:
        return torch.ones((), dtype=torch.float32)
    t = src.get(name)
    if not t.is_floating_point() or t.numel() != 1:
        raise ValueError(f"tensor {name!r} must be one float, got {t.dtype} {list(t.shape)}")
    v = float(t.reshape(()).float().item())
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"tensor {name!r} is {v!r}; an NVFP4 input_scale must be positive and finite")
    return t.reshape(()).float()


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's dequantized tensors (HF names without the ``model.layers.{i}.`` prefix)."""

    plain: dict[str, torch.Tensor]
    linears: dict[str, LinearWeight]
    experts: list[dict[str, LinearWeight]]


@dataclass(frozen=True)
class CheckpointTensors:
    """All tensors a ``Model`` needs, plus the checkpoint's declared format. Plain tensors (norms,
    embedding, router) are float32 copies; linears as ``LinearWeight`` describes."""

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
        lm_head = LinearWeight.plain(embed)
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
            plain["gate"] = _float_copy(load_linear(src, p + "mlp.gate", (c.num_experts, h)).weight)
            inter = c.moe_intermediate_size
            for e in range(c.num_experts):
                q = f"{p}mlp.experts.{e}."
                experts.append(
                    {
                        "gate_proj": load_linear(src, q + "gate_proj", (inter, h)),
                        "up_proj": load_linear(src, q + "up_proj", (inter, h)),
                        "down_proj": load_linear(src, q + "down_proj", (h, inter)),
                    }
                )
        else:
            inter = c.intermediate_size
            linears["gate_proj"] = load_linear(src, p + "mlp.gate_proj", (inter, h))
            linears["up_proj"] = load_linear(src, p + "mlp.up_proj", (inter, h))
            linears["down_proj"] = load_linear(src, p + "mlp.down_proj", (h, inter))
        layers.append(LayerTensors(plain, linears, experts))
    if fmt == "fp8":
        check_fp8_layout(config.raw.get("quantization_config") or {}, named_linears(layers))
    extra = src.unused()
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise ValueError(f"checkpoint has tensors this config has no place for: {', '.join(extra[:5])}{more}")
    return CheckpointTensors(fmt, embed, final_norm, lm_head, layers)


def named_linears(layers: list[LayerTensors]) -> dict[str, LinearWeight]:
    """Every decoder-layer linear by its HF module name (``model.layers.0.self_attn.k_proj``)."""
    out = {}
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}."
        for name, w in layer.linears.items():
            out[p + ("self_attn." if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + name] = w
        for e, expert in enumerate(layer.experts):
            out.update({f"{p}mlp.experts.{e}.{name}": w for name, w in expert.items()})
    return out


def check_fp8_layout(quantization_config: dict[str, Any], linears: dict[str, LinearWeight]) -> None:
    """Refuse (``ValueError``) an fp8 checkpoint SGLang 0.5.23 would refuse or misload
    (``weight_sync.formats.fp8_layout``): each SGLang module is unquantized exactly when
    ``ignored_layers`` skips it (a merged module listed only in part raises, as SGLang does), so
    its projections must be stored BF16, else block FP8; and a quantized merged linear or
    fused-MoE layer needs every output size a multiple of 128."""
    ignored = fp8_layout.ignored_layers(quantization_config)
    for module in fp8_layout.modules({name: w.shape[0] for name, w in linears.items()}):
        skipped = fp8_layout.is_layer_skipped(module.name, ignored)
        want = "bf16" if skipped else "fp8"
        for shard, _ in module.shards:
            if linears[shard].fmt != want:
                how = (
                    "unquantized: ignored_layers lists it"
                    if skipped
                    else "as block FP8: ignored_layers does not list it"
                )
                stored = linears[shard].fmt
                raise ValueError(
                    f"linear {shard!r} is stored as {stored}, but SGLang loads {module.name} {how}"
                )
        refused = None if skipped else fp8_layout.refusal(module)
        if refused is not None:
            raise ValueError(f"SGLang's block-FP8 loader refuses this checkpoint: {refused.reason()}")

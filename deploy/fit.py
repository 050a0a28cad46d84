"""Whether a sampler group's GPUs hold the model: its weights in the group's format plus a minimum
KV cache, within the memory SGLang 0.5.23 gives itself.

**The model** (:func:`read_model`): a BF16 HF checkpoint directory, the one the fleet publishes.
Its ``config.json`` and its shards' safetensors headers are read (``weight_sync.convert``'s
``load_source``, through the one header reader), never the tensor data, so the data may be
absent from the pages of a sparse file. Each format's weight bytes are the bytes of the tensors
the converter writes for it (:func:`weight_sync.convert.converted_tensors`: the conversion's own
plan), so they are exact for a converted checkpoint: bf16 2 bytes a parameter; fp8 1 byte plus an
F32 scale per 128x128 block; nvfp4 half a byte plus an E4M3 scale per 16 and two F32 scalars per
projection; mxfp4 (experts only) half a byte plus an E8M0 scale per 32, everything else BF16.

**Usable memory per GPU** = GPU memory (:func:`images.accelerators.memory_mib`, what
``nvidia-smi`` reports and SGLang reads) x ``--mem-fraction-static``, which SGLang defines as
(weights + KV pool) / GPU memory (``arg_groups/memory_hook.py`` 58-61). The fleet passes no
fraction (``images/sglang.py``), so SGLang 0.5.23 computes it (``memory_hook.py`` 281-327):
``round((M - R) / M, 3)`` with ``R = 512 + 1.5 * max(chunked_prefill_size, 2048) + tp / 8 * 1024
+ 2 * decode_max_bs`` MiB, at least 10 GiB when ``M`` > 60 GiB; ``chunked_prefill_size`` and the
decode CUDA-graph ``max_bs`` come from ``M``'s band (``memory_hook.py`` 90-171). Left out: the
prefill CUDA-graph term (8 MiB per captured size, ``memory_hook.py`` 386, when that backend is
on) and the post-capture sizing path (off by default: ``environ.py`` 640), so the usable figure
is at most that generous and a refusal never rests on it. A group's ``engine_args`` may set
``--mem-fraction-static`` (used as given) and ``--context-length``.

**Minimum KV cache**: one sequence of the model's full context, per GPU ``layers x 2 (K and V) x
kv_heads_per_gpu x head_dim x bytes x tokens``. Tokens: SGLang's context length (the first of
``CONTEXT_LENGTH_KEYS`` in ``config.json`` times a rope-scaling factor,
``utils/hf_transformers/common.py`` 668-694). KV heads per GPU: ``max(1, kv_heads // tp)``
(``configs/model_config.py`` 1700-1711). Bytes: 1 for ``fp8_e4m3``, 2 for ``bf16`` and for
``auto`` (the model's dtype, as the converted checkpoints declare no KV quantization:
``mem_cache/kv_cache_dtype.py`` 49-59). Why one full sequence: SGLang refuses to start only when
the pool has no token at all (``model_executor/pool_configurator.py`` 95-96), but a replica that
cannot hold one turn at the model's full context cannot serve the sessions the fleet sends it; a
smaller ``--context-length`` in ``engine_args`` lowers the minimum.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from core.errors import UserError
from fleet.specs import GroupSpec
from images.accelerators import memory_mib, parse_gpu

GIB = 1 << 30
MIB = 1 << 20
# utils/hf_transformers/common.py 668-674: the keys SGLang reads the context length from, in order.
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
KV_BYTES = {"auto": 2, "bf16": 2, "fp8_e4m3": 1}  # auto: the model's dtype, BF16 here
# memory_hook.py 90-171: (GPU MiB below, chunked_prefill_size, decode max_bs at tp < 4, at tp >= 4)
_BANDS = (
    (20 * 1024, 2048, 8, 8),
    (35 * 1024, 4096, 48, 160),
    (60 * 1024, 4096, 32, 160),
    (90 * 1024, 8192, 256, 512),
    (160 * 1024, 8192, 256, 512),
    (float("inf"), 16384, 512, 512),
)


@dataclass(frozen=True)
class Model:
    """What sizes a model on a GPU: ``config.json``'s dimensions and each format's weight bytes."""

    directory: Path
    architectures: tuple[str, ...]
    layers: int
    kv_heads: int
    head_dim: int
    context_length: int
    weight_bytes: MappingProxyType  # format -> bytes of the converted checkpoint's tensors
    vocab_size: int | None = None  # config.json's (the router refuses input ids beyond it); None: not named

    def kv_bytes_per_token(self, kv_cache_dtype: str, tp: int) -> int:
        """One token's K and V on one of ``tp`` GPUs."""
        return self.layers * 2 * max(1, self.kv_heads // tp) * self.head_dim * KV_BYTES[kv_cache_dtype]


def _int(config: dict[str, Any], key: str, path: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def context_length(config: dict[str, Any], path: Path) -> int:
    """SGLang 0.5.23's context length of the model config read from ``path`` (``get_context_length``:
    the first key present, times the rope-scaling factor unless the scaling keeps the original
    length)."""
    rope = config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{path}: rope_scaling must be an object, got {rope!r}")
    factor = rope.get("factor", 1)
    if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        factor = 1
    if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
        raise UserError(f"{path}: rope_scaling.factor must be a positive number, got {factor!r}")
    for key in CONTEXT_LENGTH_KEYS:
        if config.get(key) is not None:
            return int(factor * _int(config, key, path))
    return 2048


def read_model(checkpoint: Path, formats: Iterable[str]) -> Model:
    """The :class:`Model` of the BF16 checkpoint directory ``checkpoint`` for ``formats``; raises
    ``UserError`` naming the problem (whatever the converter would refuse, a bad dimension)."""
    from weight_sync.convert import converted_tensors, load_source

    source = load_source(Path(checkpoint))
    config, path = source.config, Path(checkpoint) / "config.json"
    heads = _int(config, "num_attention_heads", path)
    kv_heads = _int(config, "num_key_value_heads", path) if "num_key_value_heads" in config else heads
    head_dim = (
        _int(config, "head_dim", path) if "head_dim" in config else _int(config, "hidden_size", path) // heads
    )
    sizes = {f: sum(t.nbytes for t in converted_tensors(source, f)) for f in dict.fromkeys(formats)}
    return Model(
        directory=Path(checkpoint),
        architectures=tuple(config.get("architectures") or ()),
        layers=_int(config, "num_hidden_layers", path),
        kv_heads=kv_heads,
        head_dim=head_dim,
        context_length=context_length(config, path),
        weight_bytes=MappingProxyType(sizes),
        vocab_size=_int(config, "vocab_size", path) if "vocab_size" in config else None,
    )


def _engine_arg(args: tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in an SGLang argv (``--flag V`` or ``--flag=V``; the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _number(text: str, kind: type, flag: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise UserError(
            f"engine_args {flag} {text!r} is not a{'n integer' if kind is int else ' number'}"
        ) from None


def mem_fraction_static(gpu_mib: int, tp: int) -> float:
    """SGLang 0.5.23's default ``--mem-fraction-static`` on ``tp`` GPUs of ``gpu_mib`` MiB (the module
    docstring says which terms it keeps)."""
    _, chunked, max_bs_small, max_bs_large = next(b for b in _BANDS if gpu_mib < b[0])
    decode_max_bs = max_bs_small if tp < 4 else max_bs_large
    reserved = 512 + max(chunked, 2048) * 1.5 + tp / 8 * 1024 + decode_max_bs * 2
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


@dataclass(frozen=True)
class Fit:
    """A group's GPUs against the model, in bytes over all of its ``count`` GPUs."""

    group: str
    gpu: str
    count: int
    gpu_bytes: int  # one GPU
    mem_fraction: float
    weights: int
    kv_minimum: int
    kv_tokens: int
    kv_cache_dtype: str
    explicit_fraction: bool

    @property
    def usable(self) -> int:
        return int(self.gpu_bytes * self.mem_fraction) * self.count

    @property
    def fits(self) -> bool:
        return self.weights + self.kv_minimum <= self.usable

    def _figures(self) -> str:
        how = "given" if self.explicit_fraction else "SGLang's default"
        return (
            f"weights {self.weights / GIB:.1f} GiB + KV minimum {self.kv_minimum / GIB:.1f} GiB "
            f"({self.kv_tokens} tokens of {self.kv_cache_dtype}) "
            f"{'<=' if self.fits else '>'} usable {self.usable / GIB:.1f} GiB "
            f"({self.count} x {self.gpu_bytes / GIB:.1f} GiB x mem-fraction-static "
            f"{self.mem_fraction:g}, {how})"
        )

    def refusal(self) -> str:
        """The one line saying why the group's GPUs cannot hold the model."""
        return f"{self.count} x {self.gpu} cannot hold the model: {self._figures()}"

    def summary(self) -> str:
        """The dry-run line of a group that fits."""
        room = (self.usable - self.weights) // max(1, self.kv_minimum)
        return f"memory: {self._figures()}; KV room for {room} full-context sequence(s)"


def fit(g: GroupSpec, model: Model) -> Fit:
    """``g``'s GPUs (a Modal GPU string, see :func:`images.accelerators.parse_gpu`) against ``model``."""
    gpu = parse_gpu(g.accelerator)
    tp = g.gpus_per_replica
    gpu_mib = memory_mib(gpu.kind)
    given = _engine_arg(g.engine_args, "--mem-fraction-static")
    fraction = _number(given, float, "--mem-fraction-static") if given is not None else None
    if fraction is not None and not 0 < fraction <= 1:
        raise UserError(f"engine_args --mem-fraction-static {given} is not in (0, 1]")
    tokens_arg = _engine_arg(g.engine_args, "--context-length")
    tokens = _number(tokens_arg, int, "--context-length") if tokens_arg is not None else model.context_length
    if fraction is None:
        fraction = mem_fraction_static(gpu_mib, tp)
    return Fit(
        group=g.name,
        gpu=gpu.kind,
        count=tp,
        gpu_bytes=gpu_mib * MIB,
        mem_fraction=fraction,
        weights=model.weight_bytes[g.weight_format],
        kv_minimum=model.kv_bytes_per_token(g.kv_cache_dtype, tp) * tokens * tp,
        kv_tokens=tokens,
        kv_cache_dtype=g.kv_cache_dtype,
        explicit_fraction=given is not None,
    )

"""Convert an HF BF16 checkpoint directory into the directory SGLang loads for one weight format.

``convert_checkpoint(src, dst, fmt) -> Manifest``. Before: ``src`` holds ``config.json`` (a
supported architecture, no ``quantization_config``), BF16 ``*.safetensors`` shards and optionally
``model.safetensors.index.json``. After: ``dst`` holds, atomically (written into a temporary
directory beside ``dst`` and renamed at the end, so a failure or a kill never leaves a partial
``dst``): the converted shards (same file names as the source shards), ``model.safetensors.index.json``,
``config.json`` (with ``quantization_config``), ``hf_quant_config.json`` (nvfp4), every other
top-level file of ``src`` copied unchanged (tokenizer, generation config), and ``manifest.json``
(format, source checksum, digest and size of every file -- xxh3-128 by default, see
``checksum.ALGORITHMS`` -- tensor count, bytes, and the modules kept BF16 with the reason). Bad input raises
``UserError`` with one line naming the problem, before anything is written.

Which tensors are quantized (names are HF ``Qwen3MoeForCausalLM`` / ``Qwen3ForCausalLM``):

- fp8 and nvfp4: the linear projections -- ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
  dense ``model.layers.{i}.mlp.{gate,up,down}_proj.weight`` and MoE
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``.
  fp8 keeps in BF16 every SGLang module its block-FP8 loader refuses quantized at TP=1
  (``formats.fp8_layout``: a merged ``qkv_proj`` or ``gate_up_proj`` with a shard whose N is not
  a multiple of 128, e.g. the ``tiny`` preset's k/v with N = 64; a layer's fused experts whose
  intermediate size is not): all of that module's projections, listed in ``ignored_layers`` the
  way SGLang's ``Fp8Config`` skips them, and in the manifest's ``unquantized`` with the reason.
  With ``quantize_all`` such a checkpoint is refused instead, naming the tensor, its shape, the
  block size and the rule.
- mxfp4: the MoE expert projections only (SGLang's ``mxfp4`` method is MoE-only).
- Everything else stays BF16: ``model.embed_tokens``, ``lm_head``, every norm (``input_layernorm``,
  ``post_attention_layernorm``, ``self_attn.{q,k}_norm``, ``model.norm``) and the MoE router
  ``model.layers.{i}.mlp.gate``; these modules are named in the exclude list of the config.
- A NaN or Inf anywhere, in a tensor quantized or copied, is a ``UserError`` naming the tensor
  (as ``formats.bf16.quantize`` refuses one), in every format.

Tensors written per quantized projection ``P`` (``P.weight`` in the source):

======  ====================================================================================
fp8     ``P.weight`` F8_E4M3 [N, K]; ``P.weight_scale_inv`` F32 [ceil(N/128), ceil(K/128)].
        ``config.json`` ``quantization_config`` = ``{"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [128, 128], "ignored_layers": [...]}``
        (SGLang's ``Fp8Config.from_config`` reads ``ignored_layers``; a merged linear kept in
        BF16 is listed by its shards, ``...self_attn.{q,k,v}_proj``, experts by
        ``model.layers.{i}.mlp.experts``).
nvfp4   ``P.weight`` U8 [N, K/2]; ``P.weight_scale`` F8_E4M3 [N, K/16]; ``P.weight_scale_2`` F32
        0-dim; ``P.input_scale`` F32 0-dim, calibrated: SGLang runs NVFP4 W4A4 with static
        activation scales (the decision and its sources: ``weight_sync.formats.nvfp4``), so the
        BF16 source runs a fixed calibration text first (``engine.model.calibrate``) and each
        linear gets ``amax / (6 * 448)`` of its input there: one value for q/k/v, one for a
        dense MLP's gate/up, and per MoE layer one for every expert's gate/up and one for every
        expert's down (SGLang takes the maximum over the experts). SGLang's loader maps them as it
        maps the weights: ``q_proj.input_scale`` into its slot of ``qkv_proj.input_scale``
        (``models/qwen3_moe.py`` 1160-1167, ``layers/linear.py`` 880-883), and
        ``experts.{e}.{gate,up,down}_proj.input_scale`` to ``experts.w13_input_scale[e]`` /
        ``w2_input_scale[e]`` (``layers/moe/fused_moe_triton/layer.py`` 1804-1822, 1420-1443,
        1127-1133; the parameters: ``layers/quantization/modelopt_quant.py`` 2633-2648). q/k/v
        of one attention, and gate/up of one dense MLP or one expert, share one ``weight_scale_2``
        computed from their joint amax (SGLang fuses them and keeps one global scale).
        ``hf_quant_config.json`` = ``{"producer": {"name": "modelopt", ...}, "quantization":
        {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": null, "exclude_modules": [...]}}``;
        ``config.json`` gains the flat form SGLang's ``ModelOptFp4Config.from_config`` reads
        first: ``{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
        "kv_cache_quant_algo": null, "ignore": [...], "exclude_modules": [...], "producer": ...}``.
mxfp4   per expert projection: ``P.weight_blocks`` U8 [N, K/32, 16] and ``P.weight_scales`` U8
        [N, K/32] (the gpt-oss ``_blocks``/``_scales`` encoding: two E2M1 codes per byte, low
        nibble first, one E8M0 scale byte per 32 values along K). ``config.json``
        ``quantization_config`` = ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.
======  ====================================================================================

Why mxfp4 keeps Qwen3's per-expert names instead of gpt-oss's fused
``mlp.experts.gate_up_proj_blocks``: SGLang reads the fused names only in
``GptOssForCausalLM._load_mxfp4_experts_weights``, where ``gate_up`` rows are *interleaved*
(gate, up, gate, ...) for gpt-oss's clamped SwiGLU; ``Qwen3MoeForCausalLM.load_weights`` maps
checkpoint names through ``FusedMoE.make_expert_params_mapping`` (``experts.{e}.gate_proj.`` ->
``experts.w13_``) and silently skips any name it cannot map, so fused gpt-oss names would load
nothing for a Qwen3-MoE model. Per-expert ``_blocks``/``_scales`` keep the expert mapping valid
(``weight_blocks`` reshaped to ``[N, K/2]`` is exactly SGLang's ``w13_weight``/``w2_weight`` row
layout, ``weight_scales`` its ``w13_weight_scale``/``w2_weight_scale``), need no cross-expert
fusion, and carry no gpt-oss activation semantics. Stock SGLang has no mxfp4 loader for
Qwen3-MoE at all; this is the layout a loader for it would take with the least translation.

Streaming and memory: tensors are converted (or copied) in chunks of about ``CHUNK_ELEMS``
elements by a thread pool (``workers`` threads, default: torch's thread count; the quantizer
kernels and the writes release the GIL). Each chunk task reads a zero-copy view of a private
mapping of its source shard and writes its outputs straight into the output shard at their
final offsets (the layout is fixed up front; tensors kept as they are go from the mapping to the
file). The calling thread retires the tasks in order, hashing the output pieces and the source
bytes as it goes (nothing is read twice: the source shards' xxh3-128 for the source checksum
comes from the same pass) and handing back each chunk's source pages. Only a bounded window of
tasks is in flight (``2 * workers + 2``), so peak memory is a few chunks, independent of shard
and model size. Each output shard holds the converted tensors of the source shard with the same
name; an nvfp4 fusion group that straddles shards reads its other members (row chunk by row
chunk, for the joint amax only) from their own shard.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from core.errors import UserError
from core.formats import check_format
from weight_sync.checksum import ALGORITHMS, DEFAULT_ALGORITHM, file_digest, new_hasher, xxh3_file
from weight_sync.formats import fp8_layout
from weight_sync.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestError, fsync_dir, verify_dir
from weight_sync.safetensors_io import (
    DTYPES,
    LayoutWriter,
    OutTensor,
    TensorEntry,
    TensorReader,
    read_header,
)

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
INDEX_NAME = "model.safetensors.index.json"
HF_QUANT_NAME = "hf_quant_config.json"
FP8_BLOCK = fp8_layout.BLOCK_N  # the weight_block_size written, whose refusals fp8_layout states
NVFP4_GROUP = 16
MXFP4_BLOCK = 32
CHUNK_ELEMS = 1 << 20  # elements per conversion task (2 MiB of BF16: cache-friendly, little overhead)
PRODUCER = {"name": "modelopt", "version": "0.0.0+mixfleet"}
# Top-level files of the source that the converter writes itself instead of copying.
_NOT_COPIED = {"config.json", INDEX_NAME, MANIFEST_NAME, HF_QUANT_NAME}

_ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight$")
_DENSE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")
_KEEP = re.compile(
    r"^(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|model\.layers\.\d+\.self_attn\.[qk]_norm\.weight"
    r"|model\.layers\.\d+\.self_attn\.[qkvo]_proj\.bias"
    r"|model\.layers\.\d+\.mlp\.gate\.weight)$"
)


# ---------------------------------------------------------------------------------------------
# Source


@dataclass(frozen=True)
class Source:
    """A validated BF16 checkpoint: its config, every tensor's location, and the files around."""

    directory: Path
    config: dict[str, Any]
    tensors: dict[str, TensorEntry]
    shards: tuple[str, ...]  # shard file names, sorted
    extra_files: tuple[str, ...]  # other top-level files, copied as they are

    def shard_index(self, entry: TensorEntry) -> int:
        return self.shards.index(entry.file.name)


def _top_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))


def source_checksum(src: Path, known: dict[str, str] | None = None) -> str:
    """Content identity of a checkpoint directory: xxh3-128 over (name, size, xxh3-128 of the
    content) of every top-level regular file except ``manifest.json`` and hidden files.

    Two directories with the same files byte for byte get the same value, wherever they live.
    ``known``: hex xxh3-128 digests of some of the files (by name), already computed.
    """
    src = Path(src)
    known = known or {}
    h = xxhash.xxh3_128()
    for name in _top_files(src):
        if name == MANIFEST_NAME:
            continue
        p = src / name
        digest = known.get(name) or xxh3_file(p)
        h.update(f"{name}\0{p.stat().st_size}\0{digest}\n".encode())
    return "xxh3_128:" + h.hexdigest()


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist ({what} is required)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read {what} ({exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: {what} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def load_source(src: Path) -> Source:
    """Read and validate the checkpoint at ``src``; raises ``UserError`` naming the problem."""
    src = Path(src)
    if not src.is_dir():
        raise UserError(f"source checkpoint {src} is not a directory")
    config = _read_json(src / "config.json", "config.json")
    if not isinstance(config, dict):
        raise UserError(f"{src / 'config.json'}: not a JSON object")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UserError(
            f"{src / 'config.json'}: architecture {archs or config.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if config.get("quantization_config") or (src / HF_QUANT_NAME).exists():
        raise UserError(
            f"{src} is already quantized (config.json has quantization_config); need a BF16 checkpoint"
        )

    files = _top_files(src)
    index_path = src / INDEX_NAME
    if index_path.exists():
        index = _read_json(index_path, INDEX_NAME)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index_path}: no weight_map")
        shards = sorted(set(map(str, weight_map.values())))
        for s in shards:
            if "/" in s or not (src / s).is_file():
                raise UserError(f"{index_path} names shard {s!r}, which does not exist in {src}")
    else:
        weight_map = None
        shards = [f for f in files if f.endswith(".safetensors")]
        if not shards:
            raise UserError(f"{src} has no *.safetensors files")

    tensors: dict[str, TensorEntry] = {}
    for s in shards:
        entries, _meta = read_header(src / s)
        for name, e in entries.items():
            if weight_map is not None and weight_map.get(name) != s:
                raise UserError(f"{src / s}: tensor {name!r} is not mapped to this shard by {INDEX_NAME}")
            if name in tensors:
                raise UserError(f"tensor {name!r} appears in both {tensors[name].file.name} and {s}")
            if e.dtype != "BF16":
                raise UserError(f"{src / s}: tensor {name!r} is {e.dtype}, not BF16 (need a BF16 checkpoint)")
            tensors[name] = e
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise UserError(f"{index_path} lists {missing[0]!r}, which is not in {weight_map[missing[0]]}")
    if not tensors:
        raise UserError(f"{src} holds no tensors")
    extra = tuple(
        f for f in files if f not in _NOT_COPIED and f not in shards and not f.endswith(".safetensors")
    )
    return Source(src, config, tensors, tuple(shards), extra)


# ---------------------------------------------------------------------------------------------
# Plan: which output tensors each source tensor becomes, and the tasks that compute them

# Some bytes of one output tensor (an array of its item size, or a tensor of its dtype) and the
# byte offset where they start in it.
Piece = tuple["np.ndarray | torch.Tensor", int]
Task = Callable[[], "list[Piece | None]"]


@dataclass
class Job:
    """A run of output tensors laid out back to back, computed by ``tasks`` (in any order) from
    the source tensor ``source``.

    Each task returns one entry per output: a piece of that output (a tensor of its dtype and
    the byte offset where it goes) or None; the pieces of all tasks tile every output exactly,
    in task order. ``spans[t]`` is the (file offset, byte count) of the source bytes task ``t``
    reads; in task order they tile the source tensor.
    """

    outputs: list[OutTensor]
    tasks: list[Task]
    anchor: tuple[int, int]  # (shard index, source offset): output order
    source: TensorEntry
    spans: list[tuple[int, int]]


@dataclass
class Plan:
    fmt: str
    files: list[tuple[str, list[Job]]]
    quantization_config: dict[str, Any] | None
    hf_quant_config: dict[str, Any] | None
    tensor_count: int = field(init=False)

    def __post_init__(self) -> None:
        self.tensor_count = sum(len(j.outputs) for _, jobs in self.files for j in jobs)


class _GroupScales:
    """nvfp4 global scales of fusion groups, computed once each from all members (thread-safe).

    Members are read in row chunks: ``global_scale`` of a group is the maximum of the chunks'
    ``global_scale`` (division by 6*448 is monotonic, so max-of-quotients is the quotient of the
    joint amax exactly), so memory stays one chunk whatever the group's size.
    """

    def __init__(self, reader: TensorReader, chunk_elems: int) -> None:
        self._reader = reader
        self._chunk_elems = chunk_elems
        self._lock = threading.Lock()
        self._futures: dict[tuple, Future] = {}

    def _compute(self, members: list[TensorEntry]) -> np.float32:
        from weight_sync.formats import nvfp4  # torch: imported where a conversion runs, never to plan

        best = None
        for m in members:
            rows = max(1, self._chunk_elems // m.shape[1])
            for r0, r1 in _row_ranges(m.shape[0], rows):
                with _named(m):
                    gs = nvfp4.global_scale(self._reader.view_rows(m, r0, r1))
                best = gs if best is None or gs > best else best
        return np.float32(best.item())

    def get(self, key: tuple, members: list[TensorEntry]) -> np.float32:
        with self._lock:
            fut = self._futures.get(key)
            owner = fut is None
            if owner:
                fut = self._futures[key] = Future()
        if owner:
            try:
                fut.set_result(self._compute(members))
            except BaseException as exc:
                fut.set_exception(exc)
                raise
        return fut.result()


@contextlib.contextmanager
def _named(e: TensorEntry) -> Iterator[None]:
    """Turn a quantizer's ``ValueError`` (NaN/Inf weights, ...) into a ``UserError`` naming the tensor."""
    try:
        yield
    except ValueError as exc:
        raise UserError(f"{e.file}: tensor {e.name!r}: {exc}") from None


def _row_ranges(n: int, rows: int) -> Iterator[tuple[int, int]]:
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows)


def _linear_kind(name: str) -> tuple[str, tuple] | None:
    """('attn'|'dense'|'expert', fusion-group key or None) for a linear projection weight."""
    if m := _ATTN.match(name):
        layer, p = m.groups()
        return "attn", (("qkv", int(layer)) if p in "qkv" else None)
    if m := _DENSE.match(name):
        layer, p = m.groups()
        return "dense", (("mlp", int(layer)) if p in ("gate", "up") else None)
    if m := _EXPERT.match(name):
        layer, e, p = m.groups()
        return "expert", (("expert", int(layer), int(e)) if p in ("gate", "up") else None)
    return None


def _excluded_modules(source: Source) -> list[str]:
    """Modules that stay BF16 in fp8/nvfp4: embeddings, lm_head and every MoE router."""
    routers = sorted(
        {f"model.layers.{m.group(1)}.mlp.gate" for n in source.tensors if (m := _ROUTER.match(n))},
        key=lambda s: int(s.split(".")[2]),
    )
    return ["lm_head", "model.embed_tokens", *routers]


def _mxfp4_not_converted(source: Source) -> list[str]:
    """Modules that stay BF16 in mxfp4: all but the MoE experts."""
    out = ["lm_head", "model.embed_tokens"]
    layers: dict[int, set[str]] = {}
    for n in source.tensors:
        if m := _ATTN.match(n):
            layers.setdefault(int(m.group(1)), set()).add("model.layers.{i}.self_attn")
        elif m := _DENSE.match(n):
            layers.setdefault(int(m.group(1)), set()).add("model.layers.{i}.mlp." + m.group(2) + "_proj")
        elif m := _ROUTER.match(n):
            layers.setdefault(int(m.group(1)), set()).add("model.layers.{i}.mlp.gate")
    for i in sorted(layers):
        out.extend(sorted(s.format(i=i) for s in layers[i]))
    return out


def _layer_order(module: str) -> tuple[int, str]:
    """Sort key of ``model.layers.{i}.…`` names: by layer number, then by name."""
    m = re.match(r"^model\.layers\.(\d+)\.", module)
    return (int(m.group(1)) if m else -1, module)


def _quant_configs(source: Source, fmt: str, classified: Classified) -> tuple[dict | None, dict | None]:
    if fmt == "bf16":
        return None, None
    if fmt == "fp8":
        kept = sorted(classified.ignored, key=_layer_order)
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "ignored_layers": _excluded_modules(source) + kept,
        }, None
    if fmt == "nvfp4":
        excluded = _excluded_modules(source)
        hf_quant = {
            "producer": dict(PRODUCER),
            "quantization": {
                "quant_algo": "NVFP4",
                "group_size": NVFP4_GROUP,
                "kv_cache_quant_algo": None,
                "exclude_modules": excluded,
            },
        }
        qc = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": NVFP4_GROUP,
            "kv_cache_quant_algo": None,
            "exclude_modules": excluded,
            "ignore": excluded,
            "producer": dict(PRODUCER),
        }
        return qc, hf_quant
    return {"quant_method": "mxfp4", "modules_to_not_convert": _mxfp4_not_converted(source)}, None


@dataclass(frozen=True)
class Classified:
    """What each source tensor is: ``kinds[name]`` = (``attn``|``dense``|``expert``, fusion key or
    None) for linear projections; ``groups[key]`` = the members of each nvfp4 fusion group;
    ``unquantized``: the SGLang modules a quantized format keeps in BF16, each with the reason
    (fp8: those SGLang's block-FP8 loader refuses, see ``formats.fp8_layout``), and ``kept`` the
    source tensors of those modules."""

    kinds: dict[str, tuple[str, tuple | None]]
    groups: dict[tuple, list[TensorEntry]]
    unquantized: dict[str, str] = field(default_factory=dict)
    kept: frozenset[str] = frozenset()
    ignored: tuple[str, ...] = ()  # the ignored_layers entries that keep ``unquantized`` in BF16

    def quantized(self, name: str, fmt: str) -> bool:
        kind = self.kinds.get(name)
        if kind is None or fmt == "bf16" or name in self.kept:
            return False
        return fmt != "mxfp4" or kind[0] == "expert"


def _fp8_layout(
    source: Source, kinds: dict, quantize_all: bool
) -> tuple[dict[str, str], frozenset[str], tuple[str, ...]]:
    """The fp8 modules SGLang's block-FP8 loader refuses quantized (``formats.fp8_layout``), kept
    in BF16: ``Classified``'s ``unquantized``, ``kept`` and ``ignored``. With ``quantize_all``,
    a ``UserError`` naming the first offending tensor, its shape, the block size and the rule."""
    linears = {name.removesuffix(".weight"): source.tensors[name].shape[0] for name in kinds}
    unquantized: dict[str, str] = {}
    kept: set[str] = set()
    ignored: list[str] = []
    for module in fp8_layout.modules(linears):
        refused = fp8_layout.refusal(module)
        if refused is None:
            continue
        if quantize_all:
            e = source.tensors[f"{refused.shard}.weight"]
            raise UserError(
                f"{e.file}: tensor '{e.name}' of shape {list(e.shape)} cannot be block-FP8 for SGLang: "
                f"{refused.reason()} (without --quantize-all it stays BF16)"
            )
        unquantized[module.name] = refused.reason()
        kept.update(f"{shard}.weight" for shard, _ in module.shards)
        ignored.extend(fp8_layout.ignored_entries(module))
    return unquantized, frozenset(kept), tuple(ignored)


def classify(source: Source, fmt: str, *, quantize_all: bool = False) -> Classified:
    """Check that every tensor is one the converter knows and that each tensor ``fmt`` quantizes
    fits the format; raises ``UserError`` naming the tensor. Needs no torch.

    fp8: a module SGLang's block-FP8 loader refuses quantized stays BF16 (``Classified.unquantized``),
    or is refused with ``quantize_all``.
    """
    groups: dict[tuple, list[TensorEntry]] = {}
    kinds: dict[str, tuple[str, tuple | None]] = {}
    for name, e in source.tensors.items():
        kind = _linear_kind(name)
        if kind is None:
            if not _KEEP.match(name):
                raise UserError(
                    f"{e.file}: unexpected tensor {name!r} for {SUPPORTED_ARCHITECTURES[0]} "
                    "(cannot tell whether SGLang expects it quantized)"
                )
            continue
        if len(e.shape) != 2 or 0 in e.shape:
            raise UserError(f"{e.file}: linear weight {name!r} has shape {list(e.shape)}, expected [N, K]")
        kinds[name] = kind
        if kind[1] is not None:
            groups.setdefault(kind[1], []).append(e)
    layout = _fp8_layout(source, kinds, quantize_all) if fmt == "fp8" else ()
    out = Classified(kinds, groups, *layout)
    if fmt == "mxfp4" and not any(k == "expert" for k, _ in kinds.values()):
        raise UserError(f"{source.directory}: mxfp4 quantizes MoE experts only, and this checkpoint has none")
    divisor = {"nvfp4": (NVFP4_GROUP, "NVFP4 group size"), "mxfp4": (MXFP4_BLOCK, "MXFP4 block size")}.get(
        fmt
    )
    if divisor is not None:
        for name, e in source.tensors.items():
            if out.quantized(name, fmt) and e.shape[1] % divisor[0]:
                raise UserError(
                    f"{e.file}: tensor {name!r} has K={e.shape[1]}, "
                    f"not divisible by the {divisor[1]} {divisor[0]}"
                )
    return out


class _Planner:
    """The conversion's plan: the jobs writing each output shard. ``calibrate=False`` plans the
    outputs only (names, dtypes, shapes: :func:`converted_tensors`), without nvfp4's calibration
    forward; such a plan's jobs must not run."""

    def __init__(
        self,
        source: Source,
        fmt: str,
        classified: Classified,
        reader: TensorReader,
        chunk_elems: int,
        calibrate: bool = True,
    ) -> None:
        self.source = source
        self.fmt = fmt
        self.classified = classified
        self.reader = reader
        self.chunk_elems = max(1, chunk_elems)
        self.scales: _GroupScales | None = None
        self.input_scales: dict[str, np.float32] = {}
        if fmt == "nvfp4":
            self.scales = _GroupScales(reader, self.chunk_elems)
            self.input_scales = _input_scales(source, classified) if calibrate else {}

    def plan(self) -> Plan:
        src = self.source
        kinds, groups = self.classified.kinds, self.classified.groups
        jobs: dict[int, list[Job]] = {i: [] for i in range(len(src.shards))}
        for name, e in src.tensors.items():
            kind = kinds.get(name)
            anchor = (src.shard_index(e), e.start)
            if not self.classified.quantized(name, self.fmt):
                job = self._passthrough(e, anchor)
            elif self.fmt == "fp8":
                job = self._fp8(e, anchor)
            elif self.fmt == "nvfp4":
                key = kind[1] if kind[1] is not None else ("single", name)
                job = self._nvfp4(e, anchor, key, groups.get(key, [e]))
            else:
                job = self._mxfp4(e, anchor)
            jobs[anchor[0]].append(job)
        files = []
        for i, shard in enumerate(src.shards):
            if jobs[i]:
                files.append((shard, sorted(jobs[i], key=lambda j: j.anchor)))
        qc, hfq = _quant_configs(src, self.fmt, self.classified)
        return Plan(self.fmt, files, qc, hfq)

    # --- jobs ---------------------------------------------------------------------------------

    def _passthrough(self, e: TensorEntry, anchor: tuple[int, int]) -> Job:
        """Copied as it is, rows of about ``chunk_elems`` elements at a time (views of the source),
        each checked finite as the quantizers check theirs (NaN/Inf: a ``UserError`` naming it)."""
        outs = [OutTensor(e.name, e.dtype, e.shape)]

        def bits(r0: int = 0, r1: int | None = None) -> np.ndarray:
            return finite_bf16(self.reader.bits_rows(e, r0, r1), e)

        if not e.shape:
            return Job(outs, [lambda: [(bits(), 0)]], anchor, e, [(e.start, e.nbytes)])
        row_elems = math.prod(e.shape[1:])
        rows = max(1, self.chunk_elems // max(1, row_elems))

        def task(r0: int, r1: int) -> Task:
            return lambda: [(bits(r0, r1), r0 * row_elems * e.itemsize)]

        return _row_job(outs, e, anchor, rows, task)

    def _fp8(self, e: TensorEntry, anchor: tuple[int, int]) -> Job:
        n, k = e.shape
        base = e.name.removesuffix(".weight")
        kb = math.ceil(k / FP8_BLOCK)
        outs = [
            OutTensor(f"{base}.weight", "F8_E4M3", (n, k)),
            OutTensor(f"{base}.weight_scale_inv", "F32", (math.ceil(n / FP8_BLOCK), kb)),
        ]
        rows = max(FP8_BLOCK, self.chunk_elems // k // FP8_BLOCK * FP8_BLOCK)
        bits = self.reader.bits_rows

        def task(r0: int, r1: int) -> Task:
            def run() -> list[Piece | None]:
                from weight_sync.formats import fp8  # torch: only where the job runs

                with _named(e):
                    codes, scales = fp8.quantize_bits(bits(e, r0, r1), r1 - r0, k, what=_rows_of(e, r0, r1))
                return [(codes, r0 * k), (scales, r0 // FP8_BLOCK * kb * 4)]

            return run

        return _row_job(outs, e, anchor, rows, task)

    def _nvfp4(self, e: TensorEntry, anchor: tuple[int, int], key: tuple, members: list[TensorEntry]) -> Job:
        n, k = e.shape
        base = e.name.removesuffix(".weight")
        outs = [
            OutTensor(f"{base}.weight", "U8", (n, k // 2)),
            OutTensor(f"{base}.weight_scale", "F8_E4M3", (n, k // NVFP4_GROUP)),
            OutTensor(f"{base}.weight_scale_2", "F32", ()),
            OutTensor(f"{base}.input_scale", "F32", ()),
        ]
        rows = max(1, self.chunk_elems // k)
        bits = self.reader.bits_rows
        scales = self.scales
        members = sorted(members, key=lambda m: m.name)
        input_scale = self.input_scales.get(e.name, np.float32("nan"))  # nan: planned, not calibrated

        def task(r0: int, r1: int) -> Task:
            def run() -> list[Piece | None]:
                from weight_sync.formats import nvfp4  # torch: only where the job runs

                ws2 = scales.get(key, members)
                with _named(e):
                    packed, scale = nvfp4.quantize_bits(bits(e, r0, r1), ws2, what=_rows_of(e, r0, r1))
                first = r0 == 0
                return [
                    (packed, r0 * (k // 2)),
                    (scale, r0 * (k // NVFP4_GROUP)),
                    (np.array(ws2, dtype=np.float32), 0) if first else None,
                    (np.array(input_scale, dtype=np.float32), 0) if first else None,
                ]

            return run

        return _row_job(outs, e, anchor, rows, task)

    def _mxfp4(self, e: TensorEntry, anchor: tuple[int, int]) -> Job:
        n, k = e.shape
        base = e.name.removesuffix(".weight")
        outs = [
            OutTensor(f"{base}.weight_blocks", "U8", (n, k // MXFP4_BLOCK, 16)),
            OutTensor(f"{base}.weight_scales", "U8", (n, k // MXFP4_BLOCK)),
        ]
        rows = max(1, self.chunk_elems // k)
        bits = self.reader.bits_rows

        def task(r0: int, r1: int) -> Task:
            def run() -> list[Piece | None]:
                from weight_sync.formats import mxfp4  # torch: only where the job runs

                with _named(e):
                    blocks, scales = mxfp4.quantize_bits(bits(e, r0, r1), what=_rows_of(e, r0, r1))
                return [(blocks, r0 * (k // 2)), (scales, r0 * (k // MXFP4_BLOCK))]

            return run

        return _row_job(outs, e, anchor, rows, task)


def _calibration_site(name: str) -> tuple[int, str]:
    """The ``(layer, site)`` of ``engine.model.calibrate`` whose input a linear weight reads."""
    if m := _ATTN.match(name):
        return int(m.group(1)), "o_proj" if m.group(2) == "o" else "qkv"
    if m := _DENSE.match(name):
        return int(m.group(1)), "mlp_down" if m.group(2) == "down" else "mlp_gate_up"
    m = _EXPERT.match(name)
    assert m is not None, name
    return int(m.group(1)), "experts_down" if m.group(3) == "down" else "experts_gate_up"


def _input_scales(source: Source, classified: Classified) -> dict[str, np.float32]:
    """nvfp4: every quantized linear's calibrated ``input_scale`` (by weight name).

    The calibration forward is the engine's (``engine.model.calibrate``): the one Qwen3-MoE forward
    of the project, imported here only for nvfp4 (an upward import, kept to this function).
    """
    from engine.model.calibrate import input_amax
    from weight_sync.formats import nvfp4

    try:
        amax = input_amax(source.directory)
    except ValueError as exc:
        raise UserError(f"nvfp4 needs calibrated activation scales, and calibration failed: {exc}") from None
    out = {}
    for name in classified.kinds:
        site = _calibration_site(name)
        if site not in amax:
            raise UserError(f"nvfp4 calibration saw no input of {name!r} (layer {site[0]}, {site[1]})")
        out[name] = nvfp4.input_scale(amax[site])
    return out


_BF16_EXPONENT = np.uint16(0x7F80)  # all ones: Inf (mantissa 0) or NaN


def finite_bf16(bits: np.ndarray, e: TensorEntry) -> np.ndarray:
    """``bits`` (BF16 bit patterns of ``e``), or a ``UserError`` naming ``e`` if one is NaN or Inf."""
    if ((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any():
        raise UserError(f"{e.file}: tensor {e.name!r} of shape {list(e.shape)} contains NaN or Inf")
    return bits


def _rows_of(e: TensorEntry, r0: int, r1: int) -> str:
    """How a quantizer's error names rows ``[r0, r1)`` of ``e``: ``shape (rows, K) bfloat16``."""
    return f"shape {(r1 - r0, *e.shape[1:])} {DTYPES[e.dtype][0]}"


def _row_job(
    outs: list[OutTensor],
    e: TensorEntry,
    anchor: tuple[int, int],
    rows: int,
    task: Callable[[int, int], Task],
) -> Job:
    """The job converting ``e`` ``rows`` rows per task (``task(r0, r1)``)."""
    ranges = list(_row_ranges(e.shape[0], rows)) or [(0, 0)]
    row_bytes = e.nbytes // e.shape[0] if e.shape[0] else 0
    spans = [(e.start + r0 * row_bytes, (r1 - r0) * row_bytes) for r0, r1 in ranges]
    return Job(outs, [task(r0, r1) for r0, r1 in ranges], anchor, e, spans)


# ---------------------------------------------------------------------------------------------
# Execution


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _ShardDigests:
    """The digests of one output shard and of its source shard, fed task by task in order.

    ``done(job, t, pieces)`` takes task ``t`` of ``job`` (tasks in plan order): the source bytes
    it read (with whatever precedes them in the source file: its header) and the output pieces
    it wrote (output 0 at once, the job's other outputs, which follow output 0 in the file,
    after its last task). Hashes from memory: nothing is read back.
    """

    def __init__(self, header: bytes, algorithm: str, source: np.ndarray) -> None:
        self.output = new_hasher(algorithm)
        self.output.update(header)
        self._src_data = source  # uint8 view of the whole source file
        self._src = xxhash.xxh3_128()
        self._src_pos = 0
        self._tails: list[list[np.ndarray]] = []

    def done(self, job: Job, t: int, pieces: list[tuple[int, np.ndarray]]) -> None:
        start, n = job.spans[t]
        if self._src_pos < 0 or start < self._src_pos:  # not in file order: no source digest
            self._src_pos = -1
        else:
            self._src.update(self._src_data[self._src_pos : start + n])
            self._src_pos = start + n
        if t == 0:
            self._tails = [[] for _ in job.outputs[1:]]
        for i, raw in pieces:
            if i == 0:
                self.output.update(raw)
            else:
                self._tails[i - 1].append(raw)
        if t == len(job.tasks) - 1:
            for tail in self._tails:
                for raw in tail:
                    self.output.update(raw)
            self._tails = []

    def source(self) -> str | None:
        """xxh3-128 of the source file, if the tasks read all of it in order (else None)."""
        return self._src.hexdigest() if self._src_pos == self._src_data.size else None


def _write_files(
    plan: Plan, tmp: Path, reader: TensorReader, workers: int, fsync: bool, algorithm: str
) -> tuple[dict[str, FileEntry], dict[str, str]]:
    """Run the plan's tasks on ``workers`` threads, each writing its pieces straight into the
    shard files; returns the shards' manifest entries (digest by ``algorithm``) and the xxh3-128
    of every source shard the tasks read whole.

    This thread retires the tasks in order, hashing the output pieces and the source bytes each
    task read as it goes (``_ShardDigests``), and hands back a tensor's source pages once its
    last task is retired. At most ``2 * workers + 2`` tasks are queued or running at once.
    """
    window = 2 * workers + 2
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert")
    writers: list[LayoutWriter] = []
    entries: dict[str, FileEntry] = {}
    sources: dict[str, str] = {}
    pending: deque[tuple[Future, Job, int]] = deque()

    def run(task: Task, writer: LayoutWriter, first: int) -> list[tuple[int, np.ndarray]]:
        return [
            (i, writer.write_at(first + i, piece[1], piece[0]))
            for i, piece in enumerate(task())
            if piece is not None
        ]

    def retire(digests: _ShardDigests) -> None:
        fut, job, t = pending.popleft()
        digests.done(job, t, fut.result())
        reader.release(job.source.file, *job.spans[t])
        if t == len(job.tasks) - 1:
            reader.release(job.source.file, job.source.start, job.source.nbytes)

    try:
        for rel, jobs in plan.files:
            writer = LayoutWriter(tmp / rel, [o for j in jobs for o in j.outputs], {"format": "pt"})
            writers.append(writer)
            src_file = jobs[0].source.file
            digests = _ShardDigests(writer.header, algorithm, reader.file_array(src_file))
            first = 0
            for job in jobs:
                for t, task in enumerate(job.tasks):
                    while len(pending) >= window:
                        retire(digests)
                    pending.append((pool.submit(run, task, writer, first), job, t))
                first += len(job.outputs)
            while pending:  # this shard is complete once its tasks are
                retire(digests)
            writer.close(fsync=fsync)
            entries[rel] = FileEntry(
                digest=digests.output.hexdigest(), bytes=writer.size, algorithm=algorithm
            )
            if (src_digest := digests.source()) is not None:
                sources[src_file.name] = src_digest
            reader.release(src_file)
        return entries, sources
    finally:
        for fut, _, _ in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        for writer in writers:
            writer.abort()


def _write_small(path: Path, data: bytes, fsync: bool, algorithm: str) -> FileEntry:
    with open(path, "xb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return FileEntry(file_digest(path, algorithm), len(data), algorithm)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _index(plan: Plan) -> dict[str, Any]:
    weight_map = {}
    total = 0
    for rel, jobs in plan.files:
        for j in jobs:
            for o in j.outputs:
                weight_map[o.name] = rel
                total += o.nbytes
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _write_metadata(
    plan: Plan, source: Source, tmp: Path, fsync: bool, checksum: str
) -> dict[str, FileEntry]:
    """Write ``config.json`` (with the plan's quantization_config), ``hf_quant_config.json`` (if
    any), the index and copies of the source's other files into ``tmp``; their manifest entries."""
    files = {}
    config = dict(source.config)
    if plan.quantization_config is not None:
        config["quantization_config"] = plan.quantization_config
    files["config.json"] = _write_small(tmp / "config.json", _json_bytes(config), fsync, checksum)
    if plan.hf_quant_config is not None:
        files[HF_QUANT_NAME] = _write_small(
            tmp / HF_QUANT_NAME, _json_bytes(plan.hf_quant_config), fsync, checksum
        )
    files[INDEX_NAME] = _write_small(tmp / INDEX_NAME, _json_bytes(_index(plan)), fsync, checksum)
    for name in source.extra_files:
        shutil.copyfile(source.directory / name, tmp / name)
        files[name] = FileEntry(
            digest=file_digest(tmp / name, checksum), bytes=(tmp / name).stat().st_size, algorithm=checksum
        )
    return files


def _existing(dst: Path, fmt: str, src_sum: str) -> Manifest:
    """``dst`` already holds a conversion: return its manifest if it is this one, else refuse."""
    try:
        m = Manifest.read(dst)
    except ManifestError:
        raise UserError(
            f"{dst} exists and is not an empty directory or a converted checkpoint; refusing to overwrite"
        ) from None
    if m.format != fmt or m.kind != "full" or m.source_checksum != src_sum:
        held = f"format {m.format}" + (f", version {m.version}" if m.version is not None else "")
        raise UserError(
            f"{dst} already holds a different conversion ({held}, source {m.source_checksum}); "
            "refusing to overwrite"
        )
    return verify_dir(dst)


def converted_tensors(source: Source, fmt: str) -> list[OutTensor]:
    """Every tensor :func:`convert_checkpoint` writes for ``source`` in ``fmt`` (name, dtype,
    shape), from the headers alone: the outputs of the very plan the conversion runs, built
    without reading a tensor (a deploy plan sizes a group's weights from them). Raises
    ``UserError`` where the conversion would refuse ``source``."""
    check_format(fmt)
    classified = classify(source, fmt)
    with TensorReader() as reader:
        plan = _Planner(source, fmt, classified, reader, CHUNK_ELEMS, calibrate=False).plan()
    return [out for _, jobs in plan.files for job in jobs for out in job.outputs]


def convert_checkpoint(
    src: Path,
    dst: Path,
    fmt: str,
    *,
    workers: int | None = None,
    fsync: bool = False,
    chunk_elems: int = CHUNK_ELEMS,
    checksum: str = DEFAULT_ALGORITHM,
    quantize_all: bool = False,
) -> Manifest:
    """Convert the HF BF16 checkpoint ``src`` into ``dst`` in format ``fmt``; see the module doc.

    ``dst`` must not exist, be an empty directory, or already hold this very conversion (then it
    is verified and its manifest returned: idempotent). ``workers``: conversion threads (default
    torch's thread count). ``fsync``: make every file durable before the final rename (a store's
    commit does this anyway). ``chunk_elems``: elements per conversion task (the output does not
    depend on it; memory and parallelism do). ``checksum``: the manifest's per-file digest
    (``xxh3_128``, the default, or ``sha256``). ``quantize_all`` (fp8): refuse a checkpoint with a
    module SGLang's block-FP8 loader refuses quantized, instead of keeping that module in BF16.
    Returns the manifest written to ``dst/manifest.json`` (version None).
    """
    check_format(fmt)
    if checksum not in ALGORITHMS:
        raise UserError(f"unknown checksum {checksum!r} (known: {', '.join(ALGORITHMS)})")
    src, dst = Path(src), Path(dst)
    # Everything that can be wrong with the input is found before torch is even imported.
    source = load_source(src)
    classified = classify(source, fmt, quantize_all=quantize_all)
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir():
            raise UserError(f"{dst} exists and is not a directory")
        if any(dst.iterdir()):
            return _existing(dst, fmt, source_checksum(src))

    import torch

    workers = max(1, workers if workers is not None else torch.get_num_threads())
    threads_per_task = max(1, torch.get_num_threads() // workers)
    with TensorReader() as reader:
        plan = _Planner(source, fmt, classified, reader, chunk_elems).plan()

        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.parent / f".{dst.name}.converting-{os.getpid()}-{secrets.token_hex(4)}"
            tmp.mkdir()
        except OSError as exc:
            raise UserError(f"cannot create {dst}: {exc.strerror or exc}") from None
        try:
            with _torch_threads(threads_per_task):
                files, known = _write_files(plan, tmp, reader, workers, fsync, checksum)
            files.update(_write_metadata(plan, source, tmp, fsync, checksum))
            manifest = Manifest(
                version=None,
                format=fmt,
                kind="full",
                base_version=None,
                source_checksum=source_checksum(src, known),
                files=dict(sorted(files.items())),
                tensor_count=plan.tensor_count,
                total_bytes=sum(e.bytes for e in files.values()),
                unquantized=classified.unquantized,
            )
            manifest.write(tmp, fsync=fsync)
            try:
                os.rename(tmp, dst)
            except OSError as exc:
                raise UserError(f"cannot move the conversion into {dst}: {exc.strerror or exc}") from None
            if fsync:
                fsync_dir(dst.parent)
            return manifest
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

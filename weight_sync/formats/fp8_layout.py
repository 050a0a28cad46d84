"""Which linear layers SGLang 0.5.23 loads as block FP8, and which it keeps unquantized.

Pure Python (no torch): the converter decides its layout with it before anything is read, and the
local engine checks a checkpoint with it, so both keep SGLang's contract. File:line below are in
the ``sglang-0.5.23`` wheel, relative to ``sglang/srt/``.

Modules. SGLang builds a Qwen3 / Qwen3-MoE layer from these linear modules (``sglang_module``
maps an HF projection to its module):

- ``model.layers.{i}.self_attn.qkv_proj``: a ``QKVParallelLinear`` fusing ``q_proj``, ``k_proj``,
  ``v_proj`` (``models/qwen3.py`` 196-204, ``models/qwen3_moe.py`` 525-533); its
  ``output_sizes`` are the three projections' N (``layers/linear.py`` 1155-1159);
- ``model.layers.{i}.mlp.gate_up_proj``: a ``MergedColumnParallelLinear`` fusing ``gate_proj``
  and ``up_proj`` of a dense MLP (``models/qwen2.py`` 85-90);
- ``model.layers.{i}.mlp.experts``: one ``FusedMoE`` holding every expert's ``gate_proj`` /
  ``up_proj`` (``w13``) and ``down_proj`` (``w2``) (``models/qwen3_moe.py`` 265-273);
- ``o_proj`` and ``down_proj``: a ``RowParallelLinear`` each, unfused.

The rule (``refusal``), at TP=1. A block-FP8 checkpoint (``weight_block_size`` [128, 128]) is
refused at load when

- a merged linear (more than one output partition) has a shard whose N is not a multiple of
  ``block_n`` = 128: ``Fp8LinearMethod.validate_block_quant_shapes``
  (``layers/quantization/fp8.py`` 600-610: ``"Weight output_partition_size = {n} is not divisible
  by weight quantization block_n = 128."``; it runs for any TP once ``len(output_partition_sizes)
  > 1``);
- a fused-MoE layer's intermediate size (the N of every expert's ``gate_proj`` / ``up_proj``) is
  not a multiple of 128: ``Fp8MoEMethod.create_fp8_moe_weight_`` (``fp8.py`` 1584-1593:
  ``"The output_size of gate's and up's weight = {n} is not divisible by weight quantization
  block_n = 128."``; the aiter exemption at 1585 is ROCm only).

An unfused linear (``o_proj``, ``down_proj``) has no such check at TP=1 (``fp8.py`` 592-599 and
600-603 apply only when ``tp_size > 1``); its edge blocks are partial and the scale grid is
``ceil(N/128) x ceil(K/128)`` (``fp8.py`` 676-681). TP > 1 adds per-partition checks (K of row
parallel layers, N / tp of column parallel ones, the MoE intermediate / tp against ``block_k``);
the converter does not know the fleet's TP and checks TP=1 only.

Keeping a module unquantized. ``Fp8Config.from_config`` (``fp8.py`` 346-386) reads the list from
``ignored_layers``, else ``modules_to_not_convert`` (the first key present,
``layers/quantization/base_config.py`` 257-272), and keeps each entry both without and with its
``model.`` prefix. ``Fp8Config.get_quant_method`` (``fp8.py`` 389-414) gives a linear or a
``FusedMoE`` whose prefix ``is_layer_skipped`` (``layers/quantization/utils.py`` 48-125) the
unquantized method: a merged module is skipped when each of its shards matches an entry on dotted
module-path boundaries, and raises ``"Detected some but not all shards of {prefix} are
quantized. ..."`` (``utils.py`` 100-105) when only some do; a ``FusedMoE`` is skipped when an
entry matches ``model.layers.{i}.mlp.experts`` (per layer: all experts together). So every module
SGLang refuses quantized can be kept in BF16, which is what ``ignored_entries`` lists.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

BLOCK_N = 128  # weight_block_size[0], the converter's block (fp8.BLOCK)
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SRC = "layers/quantization/fp8.py"
_FUSED = re.compile(r"^(?P<base>.+)\.(?P<proj>q_proj|k_proj|v_proj|gate_proj|up_proj)$")
_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.\d+\.(gate|up|down)_proj$")


def sglang_module(hf_module: str) -> str:
    """The SGLang module an HF linear projection (``model.layers.0.self_attn.k_proj``) loads into:
    ``...self_attn.qkv_proj``, ``...mlp.gate_up_proj``, ``...mlp.experts`` or itself."""
    if m := _EXPERT.match(hf_module):
        return m["base"]
    if m := _FUSED.match(hf_module):
        fused = "qkv_proj" if m["proj"] in MERGED["qkv_proj"] else "gate_up_proj"
        return f"{m['base']}.{fused}"
    return hf_module


@dataclass(frozen=True)
class Module:
    """One SGLang linear module: ``name`` (its prefix), ``kind`` (``merged`` | ``experts`` |
    ``single``) and ``shards``: (HF projection, N) of every checkpoint projection loaded into it,
    sorted by name."""

    name: str
    kind: str
    shards: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Refusal:
    """Why SGLang's block-FP8 loader refuses ``module`` quantized: its shard ``shard`` has output
    size ``n``, not a multiple of ``BLOCK_N``; ``rule`` states the check and cites it."""

    module: str
    shard: str
    n: int
    rule: str

    def reason(self) -> str:
        """One line: the shard, its N, the block size and the rule."""
        return f"{self.shard} has N={self.n}, not a multiple of block_n={BLOCK_N}; {self.rule}"


def modules(linears: Mapping[str, int]) -> list[Module]:
    """Group HF linear projections (name -> N, e.g. ``model.layers.0.self_attn.k_proj`` -> 64) into
    the SGLang modules they load into, in order of first appearance."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, n in linears.items():
        groups.setdefault(sglang_module(name), []).append((name, int(n)))
    out = []
    for name, shards in groups.items():
        last = name.rsplit(".", 1)[-1]
        kind = "merged" if last in MERGED else "experts" if last == "experts" else "single"
        out.append(Module(name, kind, tuple(sorted(shards))))
    return out


def refusal(module: Module) -> Refusal | None:
    """Why SGLang 0.5.23 refuses ``module`` as block FP8 at TP=1, or None (see the module doc)."""
    if module.kind == "merged":
        for shard, n in module.shards:
            if n % BLOCK_N:
                rule = (
                    f"SGLang requires it of every shard of a merged linear (here {module.name}): "
                    f"{_SRC} 600-610, validate_block_quant_shapes"
                )
                return Refusal(module.name, shard, n, rule)
    elif module.kind == "experts":
        for shard, n in module.shards:
            if not shard.endswith("down_proj") and n % BLOCK_N:
                rule = (
                    f"SGLang requires it of the intermediate size of a fused-MoE layer (here "
                    f"{module.name}): {_SRC} 1584-1593, create_fp8_moe_weight_"
                )
                return Refusal(module.name, shard, n, rule)
    return None


def ignored_entries(module: Module) -> list[str]:
    """The ``ignored_layers`` entries that keep ``module`` unquantized in SGLang: every shard of a
    merged linear (all of them, or SGLang raises), the ``FusedMoE`` prefix for experts."""
    if module.kind == "merged":
        return [shard for shard, _ in module.shards]
    return [module.name]


def ignored_layers(quantization_config: Mapping[str, object]) -> list[str]:
    """The skip list as ``Fp8Config.from_config`` reads it (``fp8.py`` 354-364): ``ignored_layers``,
    else ``modules_to_not_convert``; each entry without and with its ``model.`` prefix."""
    for key in ("ignored_layers", "modules_to_not_convert"):
        if key in quantization_config:
            raw = quantization_config[key]
            break
    else:
        return []
    if not raw:
        return []
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise ValueError(f"quantization_config {key} must be a list of module names, got {raw!r}")
    out = []
    for layer in raw:
        base = layer.removeprefix("model.")
        out += [base, f"model.{base}"]
    return out


def _path_match(ignored: str, prefix: str) -> bool:
    """``utils.py`` 48-59: equal, a parent module, or a dotted-boundary substring."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


def is_layer_skipped(prefix: str, ignored: Iterable[str]) -> bool:
    """Whether SGLang keeps module ``prefix`` unquantized under ``ignored`` (as ``ignored_layers``
    returns it): ``utils.py`` 70-125 with the Qwen3 fused mapping (``models/qwen3_moe.py``
    999-1002, the same as the fallback at ``utils.py`` 64-67). ``ValueError`` (SGLang's) when only
    some shards of a merged module are listed."""
    ignored = list(ignored)
    proj = prefix.rsplit(".", 1)[-1]
    if proj in MERGED:
        base = prefix[: -len(proj)]
        skipped = {any(_path_match(i, base + shard) for i in ignored) for shard in MERGED[proj]}
        if len(skipped) > 1:
            raise ValueError(
                f"Detected some but not all shards of {prefix} are quantized. All shards of fused "
                "layers to have the same precision."
            )
        return skipped.pop()
    if any(_path_match(i, prefix) for i in ignored):
        return True
    return "experts" in prefix and any(prefix in i for i in ignored if "experts" in i)

"""fp8 conversion lays out exactly what SGLang 0.5.23's block-FP8 loader accepts.

Boundary cases (N = 128, 192, 64) for each family SGLang checks at TP=1 (a merged qkv, a dense
gate_up, a layer's fused experts) on real checkpoints: what SGLang refuses quantized stays BF16,
is listed in ``ignored_layers`` and in the manifest, and ``quantize_all`` refuses it with one line
naming the tensor, its shape, the block size and the rule. The ``tiny`` preset's config is read
back with a restatement of SGLang's ``Fp8Config.from_config`` and ``is_layer_skipped`` written
here from the source (``sglang/srt/layers/quantization/``, not imported).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from core.errors import UserError
from tests.support.checkpoints import MoESpec, write_checkpoint
from tests.support.models import make_model_dir
from tests.weight_sync.conversion_checks import check_conversion
from weight_sync.convert import convert_checkpoint
from weight_sync.manifest import Manifest
from weight_sync.safetensors_io import read_header

# Layer 0 is MoE, layer 1 dense. hidden 160: partial K blocks everywhere, and o_proj / down_proj
# (never checked at TP=1) have N = 160.
BASE = dict(
    hidden_size=160,
    head_dim=64,  # q 256, k/v 128
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    mlp_only_layers=(1,),
    num_experts=2,
    num_experts_per_tok=1,
    shards=1,
)
FAMILIES = {
    # family: (MoESpec fields giving N, the SGLang modules SGLang then refuses, first tensor named)
    "qkv": (
        lambda n: {"head_dim": n // 2},
        ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj"],
    ),
    "gate_up": (lambda n: {"intermediate_size": n}, ["model.layers.1.mlp.gate_up_proj"]),
    "experts": (lambda n: {"moe_intermediate_size": n}, ["model.layers.0.mlp.experts"]),
}
FIRST = {
    "qkv": r"model\.layers\.\d\.self_attn\.k_proj\.weight",
    "gate_up": r"model\.layers\.1\.mlp\.gate_proj\.weight",
    "experts": r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight",
}
RULE = {"qkv": "fp8.py 600-610", "gate_up": "fp8.py 600-610", "experts": "fp8.py 1584-1593"}


def _spec(family: str, n: int) -> MoESpec:
    return MoESpec(**{**BASE, **FAMILIES[family][0](n)})


@pytest.mark.parametrize("n", [128, 192, 64])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_boundary_cases(tmp_path: Path, family: str, n: int) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, _spec(family, n))
    manifest = convert_checkpoint(src, tmp_path / "out", "fp8")
    check_conversion(src, tmp_path / "out", "fp8")  # bytes, dtypes, ignored_layers, manifest
    want = [] if n == 128 else FAMILIES[family][1]
    assert sorted(manifest.unquantized) == want
    assert Manifest.read(tmp_path / "out").unquantized == manifest.unquantized
    if n == 128:
        strict = convert_checkpoint(src, tmp_path / "strict", "fp8", quantize_all=True)
        assert strict.files == manifest.files  # nothing to keep BF16: the same conversion
        return
    with pytest.raises(UserError) as err:
        convert_checkpoint(src, tmp_path / "strict", "fp8", quantize_all=True)
    msg = str(err.value)
    assert "\n" not in msg and not (tmp_path / "strict").exists()
    assert re.search(rf"tensor '{FIRST[family]}' of shape \[{n}, 160\]", msg), msg
    assert f"has N={n}, not a multiple of block_n=128" in msg and RULE[family] in msg, msg


# --- SGLang's reading of the config, restated from layers/quantization/ (0.5.23) ---------------


def _sglang_fp8_ignored_layers(qc: dict) -> list[str]:
    """``Fp8Config.from_config`` (fp8.py 346-386) and its ``__init__`` checks (264-316)."""
    quant_method = qc["quant_method"]  # get_from_keys: KeyError-like ValueError when absent
    assert "fp8" in quant_method  # is_checkpoint_fp8_serialized
    assert qc["activation_scheme"] in ("static", "dynamic")  # ACTIVATION_SCHEMES
    block = qc.get("weight_block_size")
    assert block is not None and len(block) == 2 and qc["activation_scheme"] == "dynamic"
    raw = None
    for key in ("ignored_layers", "modules_to_not_convert"):  # get_from_keys_or: the first present
        if key in qc:
            raw = qc[key]
            break
    out = []
    for layer in raw or []:
        base = layer[len("model.") :] if layer.startswith("model.") else layer
        out += [base, "model." + base]
    return out


def _match(ignored: str, prefix: str) -> bool:
    """utils.py ``_module_path_match``."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    if ignored == prefix or prefix.startswith(ignored + "."):
        return True
    return ("." + ignored + ".") in ("." + prefix + ".")


def _sglang_skipped(prefix: str, ignored: list[str]) -> bool:
    """utils.py ``is_layer_skipped`` with Qwen3-MoE's packed_modules_mapping (qwen3_moe.py 999-1002)."""
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    proj = prefix.split(".")[-1]
    if proj in fused:
        each = [any(_match(i, prefix.replace(proj, s)) for i in ignored) for s in fused[proj]]
        if len(set(each)) != 1:
            raise ValueError(f"Detected some but not all shards of {prefix} are quantized.")
        return each[0]
    skipped = any(_match(i, prefix) for i in ignored)
    if "experts" in prefix:
        skipped = skipped or any(prefix in i for i in ignored if "experts" in i)
    return skipped


def test_tiny_preset_layout_as_sglang_reads_it(model_root: Path) -> None:
    """tiny: k/v N = 64, so qkv_proj of both layers stays BF16; o_proj and the experts (N 128,
    intermediate 256) are FP8; the router, embedding and lm_head stay BF16 as before."""
    out = make_model_dir(model_root, "tiny", "fp8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    attn = [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "kqv"]
    assert qc["ignored_layers"] == [
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
        *attn,
    ]
    manifest = Manifest.read(out)
    assert sorted(manifest.unquantized) == [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.self_attn.qkv_proj",
    ]
    assert all("k_proj has N=64" in r for r in manifest.unquantized.values())
    ignored = _sglang_fp8_ignored_layers(qc)
    for i in (0, 1):
        p = f"model.layers.{i}."
        assert _sglang_skipped(p + "self_attn.qkv_proj", ignored)
        assert not _sglang_skipped(p + "self_attn.o_proj", ignored)
        assert not _sglang_skipped(p + "mlp.experts", ignored)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    (shard,) = set(index.values())
    dtypes = {name: e.dtype for name, e in read_header(out / shard)[0].items()}
    for i in (0, 1):
        p = f"model.layers.{i}."
        assert all(dtypes[f"{p}self_attn.{x}_proj.weight"] == "BF16" for x in "qkv")
        assert f"{p}self_attn.k_proj.weight_scale_inv" not in dtypes
        assert dtypes[f"{p}self_attn.o_proj.weight"] == "F8_E4M3"
        assert dtypes[f"{p}mlp.experts.0.gate_proj.weight"] == "F8_E4M3"

"""Checks that a converted directory is exactly what ``weight_sync.convert`` promises.

``check_conversion(src, dst, fmt)`` reads both directories with the real ``safetensors`` library
and checks names, dtypes and shapes of every tensor, the bytes of every quantized tensor against
the format's own ``quantize`` of the whole source tensor (so row chunking, threading and shard
straddling cannot change a byte), ``dequantize`` of the output against ``dequantize(quantize(src))``,
the fusion groups' shared nvfp4 ``weight_scale_2`` against a joint amax computed here, nvfp4
``input_scale`` against an independent calibration (transformers' forward on the converter's
calibration sequences), fp8 block scales against block amaxes computed here, the configs, the
index and the manifest.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import torch

from tests.support.checkpoints import load_all
from weight_sync.convert import source_checksum
from weight_sync.manifest import Manifest, verify_dir

LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$"
)
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


# The SGLang module a projection loads into (qkv_proj, gate_up_proj, experts, or itself).
_MODULE = (
    (re.compile(r"^(model\.layers\.\d+\.self_attn\.)[qkv]_proj$"), r"\1qkv_proj"),
    (re.compile(r"^(model\.layers\.\d+\.mlp\.)(gate|up)_proj$"), r"\1gate_up_proj"),
    (re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.\d+\.(gate|up|down)_proj$"), r"\1"),
)


def fp8_kept_in_bf16(shapes: dict[str, tuple[int, ...]]) -> dict[str, set[str]]:
    """SGLang module -> its projections (``.weight`` names) that fp8 must keep BF16, restated from
    SGLang 0.5.23 at TP=1: a merged linear (``qkv_proj``, ``gate_up_proj``) is refused when one of
    its output partitions is not a multiple of block_n = 128 (``layers/quantization/fp8.py``
    600-610), a fused-MoE layer when its intermediate size (the N of its experts' gate/up) is not
    (``fp8.py`` 1584-1593); an unfused linear is never refused at TP=1."""
    members: dict[str, set[str]] = {}
    refused: set[str] = set()
    for name, shape in shapes.items():
        if not LINEAR.match(name):
            continue
        proj = name.removesuffix(".weight")
        for pattern, repl in _MODULE:
            if pattern.match(proj):
                module = pattern.sub(repl, proj)
                members.setdefault(module, set()).add(name)
                if not proj.endswith("down_proj") and shape[0] % 128:
                    refused.add(module)
    return {m: members[m] for m in refused}


def _quantized(name: str, fmt: str, kept: frozenset[str] = frozenset()) -> bool:
    if fmt in ("fp8", "nvfp4"):
        return bool(LINEAR.match(name)) and name not in kept
    if fmt == "mxfp4":
        return bool(EXPERT.match(name))
    return False


def _nvfp4_group(name: str) -> str:
    """The fusion group a projection belongs to (itself when it fuses with nothing)."""
    base = name.removesuffix(".weight")
    for a, b in (
        ("q_proj", "qkv"),
        ("k_proj", "qkv"),
        ("v_proj", "qkv"),
        ("gate_proj", "gu"),
        ("up_proj", "gu"),
    ):
        if base.endswith(a):
            return base[: -len(a)] + b
    return base


def expected_outputs(
    name: str, shape: tuple[int, ...], fmt: str, kept: frozenset[str] = frozenset()
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    if not _quantized(name, fmt, kept):
        return {name: (torch.bfloat16, shape)}
    base = name.removesuffix(".weight")
    n, k = shape
    if fmt == "fp8":
        return {
            f"{base}.weight": (torch.float8_e4m3fn, (n, k)),
            f"{base}.weight_scale_inv": (torch.float32, (math.ceil(n / 128), math.ceil(k / 128))),
        }
    if fmt == "nvfp4":
        return {
            f"{base}.weight": (torch.uint8, (n, k // 2)),
            f"{base}.weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
            f"{base}.weight_scale_2": (torch.float32, ()),
            f"{base}.input_scale": (torch.float32, ()),
        }
    return {
        f"{base}.weight_blocks": (torch.uint8, (n, k // 32, 16)),
        f"{base}.weight_scales": (torch.uint8, (n, k // 32)),
    }


@functools.lru_cache(maxsize=4)
def _hf_input_amax(src: str) -> dict[str, float]:
    """An independent calibration: transformers' float32 forward (eager experts) of the BF16 source
    on the converter's calibration sequences; ``max |x|`` at the input of every linear weight, by
    name (a layer's experts together: the 3-D expert weights take every expert's rows)."""
    from transformers import Qwen3MoeForCausalLM

    from engine.model.calibrate import calibration_ids

    hf = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="eager").eval()
    names: dict[int, list[str]] = {}  # parameter -> the checkpoint weights it holds
    for i, layer in enumerate(hf.model.layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            names[id(getattr(layer.self_attn, f"{n}_proj").weight)] = [f"{p}self_attn.{n}_proj.weight"]
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            n_exp = mlp.experts.num_experts
            gate_up = [f"{p}mlp.experts.{e}.{n}_proj.weight" for e in range(n_exp) for n in ("gate", "up")]
            names[id(mlp.experts.gate_up_proj)] = gate_up
            names[id(mlp.experts.down_proj)] = [f"{p}mlp.experts.{e}.down_proj.weight" for e in range(n_exp)]
        else:
            for n in ("gate", "up", "down"):
                names[id(getattr(mlp, f"{n}_proj").weight)] = [f"{p}mlp.{n}_proj.weight"]
    params = [(prm, names[id(prm)]) for prm in hf.parameters() if id(prm) in names]
    amax: dict[str, float] = {}
    plain = torch.nn.functional.linear

    def observed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        for prm, held in params:
            start = prm.data_ptr()
            if start <= w.data_ptr() < start + prm.numel() * prm.element_size():
                for n in held:
                    amax[n] = max(amax.get(n, 0.0), x.abs().max().item())
        return plain(x, w, b)

    torch.nn.functional.linear = observed
    try:
        with torch.no_grad():
            for ids in calibration_ids(src):
                hf(ids[None])
    finally:
        torch.nn.functional.linear = plain
    return amax


def _check_input_scales(src: Path, out: dict[str, torch.Tensor]) -> None:
    """Every nvfp4 ``input_scale`` is ModelOpt's ``amax / (6 * 448)`` of the calibrated input range,
    one value per fusion group and per MoE layer's expert gate/up and down."""
    amax = _hf_input_amax(str(src))
    scales = {n.removesuffix(".input_scale"): t for n, t in out.items() if n.endswith(".input_scale")}
    assert {f"{b}.weight" for b in scales} == set(amax)
    for base, t in scales.items():
        assert t.dtype == torch.float32 and t.dim() == 0 and t.item() > 0, base
        want = torch.tensor(amax[f"{base}.weight"], dtype=torch.float32) / 2688.0
        torch.testing.assert_close(t, want, rtol=1e-5, atol=0, msg=base)
    for base, t in scales.items():  # shared exactly where SGLang fuses (and across a layer's experts)
        for a, b in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
            if base.endswith(a):
                assert torch.equal(t, scales[base.removesuffix(a) + b]), base
        if m := re.match(r"^(model\.layers\.\d+\.mlp\.experts\.)\d+\.(\w+)$", base):
            assert torch.equal(t, scales[f"{m.group(1)}0.{m.group(2)}"]), base


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_conversion(src: Path, dst: Path, fmt: str) -> Manifest:
    src, dst = Path(src), Path(dst)
    source = load_all(src)
    out = load_all(dst)
    bf16_modules = fp8_kept_in_bf16({n: tuple(t.shape) for n, t in source.items()}) if fmt == "fp8" else {}
    kept = frozenset(n for names in bf16_modules.values() for n in names)
    _check_names(source, out, fmt, kept)
    _check_values(src, source, out, fmt, kept)
    _check_configs(src, dst, source, fmt, kept, bf16_modules)
    _check_index(dst, out)
    return _check_copies_and_manifest(src, dst, out, fmt, bf16_modules)


def _check_names(
    source: dict[str, torch.Tensor], out: dict[str, torch.Tensor], fmt: str, kept: frozenset
) -> None:
    """Names, dtypes, shapes: exactly the expected set."""
    expected = {}
    for name, t in source.items():
        expected.update(expected_outputs(name, tuple(t.shape), fmt, kept))
    assert set(out) == set(expected), (sorted(set(out) ^ set(expected)))[:10]
    for name, (dtype, shape) in expected.items():
        assert out[name].dtype == dtype and tuple(out[name].shape) == shape, (
            name,
            out[name].dtype,
            out[name].shape,
        )


def _check_values(
    src: Path, source: dict[str, torch.Tensor], out: dict[str, torch.Tensor], fmt: str, kept: frozenset
) -> None:
    """Every tensor's bits: copied ones equal, quantized ones equal the format's quantize of the source."""
    fmod = None if fmt == "bf16" else __import__(f"weight_sync.formats.{fmt}", fromlist=[fmt])
    groups: dict[str, list[str]] = {}
    for name in source:
        if fmt == "nvfp4" and _quantized(name, fmt):
            groups.setdefault(_nvfp4_group(name), []).append(name)
    for name, w in source.items():
        if not _quantized(name, fmt, kept):
            assert torch.equal(_bits(out[name]), _bits(w)), name
            continue
        base = name.removesuffix(".weight")
        if fmt == "fp8":
            got = {"weight": out[f"{base}.weight"], "weight_scale_inv": out[f"{base}.weight_scale_inv"]}
            ref = fmod.quantize(w)
            # Independent: each block's scale is max(amax, 1e-4) / 448 (edge blocks over real elements
            # only; the 1e-4 floor is SGLang's per_block_cast_to_fp8 and DeepSeek-V3's act_quant).
            n, k = w.shape
            for bi in range(math.ceil(n / 128)):
                for bj in range(math.ceil(k / 128)):
                    amax = w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128].float().abs().amax()
                    want = amax.clamp(min=1e-4) / 448.0
                    assert got["weight_scale_inv"][bi, bj].item() == want.item(), (name, bi, bj)
        elif fmt == "nvfp4":
            members = groups[_nvfp4_group(name)]
            joint = max(source[m].float().abs().amax() for m in members)
            gs = (joint / (6.0 * 448.0)).to(torch.float32)
            assert out[f"{base}.weight_scale_2"].item() == gs.item(), (name, members)
            assert torch.equal(fmod.global_scale(*[source[m] for m in members]), gs.reshape(()))
            got = {k: out[f"{base}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
            ref = fmod.quantize(w, weight_scale_2=gs.reshape(()))
            ref.pop("input_scale")  # calibrated: checked below
        else:
            got = {"blocks": out[f"{base}.weight_blocks"], "scales": out[f"{base}.weight_scales"]}
            ref = fmod.quantize(w)
        for key, t in ref.items():
            assert torch.equal(_bits(got[key]), _bits(t)), (name, key)
        assert torch.equal(fmod.dequantize(got), fmod.dequantize(ref)), name

    if fmt == "nvfp4":
        _check_input_scales(src, out)


def _check_configs(
    src: Path, dst: Path, source: dict[str, torch.Tensor], fmt: str, kept: frozenset, bf16_modules: dict
) -> None:
    """config.json is the source's plus the format's quantization config; hf_quant_config.json for
    nvfp4 only; no quantized module listed as excluded."""
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg.pop("quantization_config", None)
    assert cfg == src_cfg
    routers = sorted(
        n.removesuffix(".weight") for n in source if re.match(r"^model\.layers\.\d+\.mlp\.gate\.weight$", n)
    )
    if fmt == "bf16":
        assert qc is None and not (dst / "hf_quant_config.json").exists()
    elif fmt == "fp8":
        assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
        # A merged linear kept BF16 is listed by each of its shards, fused experts by the layer's
        # FusedMoE prefix (what SGLang's is_layer_skipped matches: layers/quantization/utils.py 70-125).
        listed = [
            n.removesuffix(".weight")
            for m, names in bf16_modules.items()
            if "experts" not in m
            for n in names
        ]
        listed += [m for m in bf16_modules if m.endswith(".experts")]
        assert set(qc["ignored_layers"]) == {"lm_head", "model.embed_tokens", *routers, *listed}
        assert len(qc["ignored_layers"]) == len(set(qc["ignored_layers"]))
    elif fmt == "nvfp4":
        hfq = json.loads((dst / "hf_quant_config.json").read_text())
        assert hfq["producer"]["name"] == "modelopt"
        q = hfq["quantization"]
        assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and q["kv_cache_quant_algo"] is None
        assert set(q["exclude_modules"]) == {"lm_head", "model.embed_tokens", *routers}
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16
        assert qc["ignore"] == q["exclude_modules"] == qc["exclude_modules"]
    else:
        assert qc["quant_method"] == "mxfp4"
        skipped = set(qc["modules_to_not_convert"])
        assert {"lm_head", "model.embed_tokens", *routers} <= skipped
        assert not any("experts" in s for s in skipped)
        assert not (dst / "hf_quant_config.json").exists()
    # No quantized module is listed as excluded (exact names and "model."-less prefixes).
    if qc is not None:
        listed = set(
            qc.get("ignored_layers") or qc.get("exclude_modules") or qc.get("modules_to_not_convert")
        )
        for name in source:
            if _quantized(name, fmt, kept):
                assert name.removesuffix(".weight") not in listed


def _check_index(dst: Path, out: dict[str, torch.Tensor]) -> None:
    """Index: every tensor, in the file that holds it."""
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)
    from safetensors import safe_open

    total = 0
    for fname in set(index["weight_map"].values()):
        with safe_open(str(dst / fname), framework="pt") as f:
            keys = set(f.keys())
        assert keys == {k for k, v in index["weight_map"].items() if v == fname}
        total += sum(out[k].numel() * out[k].element_size() for k in keys)
    assert index["metadata"]["total_size"] == total


def _check_copies_and_manifest(
    src: Path, dst: Path, out: dict[str, torch.Tensor], fmt: str, bf16_modules: dict
) -> Manifest:
    """Copied files and the manifest."""
    for extra in ("tokenizer.json", "generation_config.json"):
        assert (dst / extra).read_bytes() == (src / extra).read_bytes()
    manifest = verify_dir(dst)
    assert manifest.format == fmt and manifest.kind == "full" and manifest.version is None
    assert set(manifest.unquantized) == set(bf16_modules)
    for module, reason in manifest.unquantized.items():
        assert reason.startswith(module.rsplit(".", 1)[0] + "."), (module, reason)  # names its shard
        assert "not a multiple of block_n=128" in reason and "layers/quantization/fp8.py" in reason, reason
    assert manifest.tensor_count == len(out)
    assert manifest.source_checksum == source_checksum(src)
    assert set(manifest.files) == {p.name for p in dst.iterdir()} - {"manifest.json"}
    return manifest

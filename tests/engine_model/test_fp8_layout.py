"""The local engine loads an fp8 checkpoint exactly when SGLang 0.5.23 would load it as laid out.

The converter keeps the tiny preset's qkv_proj (k/v N = 64) in BF16 and lists it in
``ignored_layers``; the engine computes those layers unquantized and the rest as block FP8. A
checkpoint SGLang would refuse or misload is refused with a message naming the layer: a quantized
merged shard off the 128 grid (``layers/quantization/fp8.py`` 600-610), a fused layer listed
only in part (``layers/quantization/utils.py`` 100-105), a layer stored in the other precision
than its listing makes SGLang allocate (``fp8.py`` 389-414).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.config import ModelConfig
from engine.model.loader import load_checkpoint, named_linears
from engine.model.model import load_model
from tests.support.models import make_model_dir
from weight_sync.formats import fp8

ATTN = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def tiny_fp8(model_root: Path) -> Path:
    return make_model_dir(model_root, "tiny", "fp8")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, tensors_edit=None, ignored_edit=None) -> None:
    if tensors_edit is not None:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        (shard,) = set(index["weight_map"].values())  # tiny: one shard
        tensors = load_file(path / shard)
        tensors_edit(tensors)
        save_file(tensors, str(path / shard))
        index["weight_map"] = dict.fromkeys(sorted(tensors), shard)
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if ignored_edit is not None:
        cfg = json.loads((path / "config.json").read_text())
        qc = cfg["quantization_config"]
        qc["ignored_layers"] = ignored_edit(qc["ignored_layers"])
        (path / "config.json").write_text(json.dumps(cfg))


def _quantize(*names: str):
    def edit(t: dict) -> None:
        for name in names:
            q = fp8.quantize(t.pop(f"{name}.weight"))
            t[f"{name}.weight"], t[f"{name}.weight_scale_inv"] = q["weight"], q["weight_scale_inv"]

    return edit


def test_tiny_fp8_loads_qkv_bf16_and_the_rest_fp8(tiny_fp8: Path) -> None:
    ct = load_checkpoint(tiny_fp8, ModelConfig.from_dir(tiny_fp8))
    fmts = {name: w.fmt for name, w in named_linears(ct.layers).items()}
    for i in (0, 1):
        p = f"model.layers.{i}."
        assert {fmts[f"{p}self_attn.{x}_proj"] for x in "qkv"} == {"bf16"}
        assert fmts[f"{p}self_attn.o_proj"] == "fp8"
        assert {f for n, f in fmts.items() if n.startswith(f"{p}mlp.experts.")} == {"fp8"}
    assert ct.fmt == load_model(tiny_fp8).precision == "fp8"


def test_quantized_qkv_off_the_grid_is_refused(tiny_fp8: Path, tmp_path: Path) -> None:
    """What the converter wrote before it kept SGLang's rule: k/v (N = 64) block FP8, unlisted."""
    path = _copy(tiny_fp8, tmp_path / "m")
    names = [f"{ATTN}.{x}_proj" for x in "qkv"]
    _edit(path, _quantize(*names), lambda ignored: [i for i in ignored if i not in names])
    with pytest.raises(
        ValueError, match=rf"refuses this checkpoint: {ATTN}\.k_proj has N=64, not a multiple of block_n=128"
    ):
        load_model(path)


def test_a_fused_layer_listed_in_part_is_refused(tiny_fp8: Path, tmp_path: Path) -> None:
    path = _copy(tiny_fp8, tmp_path / "m")
    _edit(path, None, lambda ignored: [i for i in ignored if i != f"{ATTN}.v_proj"])
    with pytest.raises(ValueError, match=rf"some but not all shards of {ATTN}\.qkv_proj"):
        load_model(path)


def test_listed_layer_stored_fp8_and_unlisted_layer_stored_bf16_are_refused(
    tiny_fp8: Path, tmp_path: Path
) -> None:
    listed_fp8 = _copy(tiny_fp8, tmp_path / "a")
    _edit(listed_fp8, None, lambda ignored: [*ignored, f"{ATTN}.o_proj"])
    with pytest.raises(
        ValueError, match=rf"'{ATTN}\.o_proj' is stored as fp8, but SGLang loads {ATTN}\.o_proj unquantized"
    ):
        load_model(listed_fp8)
    experts = "model.layers.0.mlp.experts"
    _edit(_copy(tiny_fp8, tmp_path / "b"), None, lambda ignored: [*ignored, experts])
    with pytest.raises(
        ValueError,
        match=rf"'{experts}\.\d+\.\w+_proj' is stored as fp8, but SGLang loads {experts} unquantized",
    ):
        load_model(tmp_path / "b")
    # o_proj stored BF16 while not listed: SGLang would allocate an FP8 weight for it.
    unlisted_bf16 = _copy(tiny_fp8, tmp_path / "c")
    bf16 = load_file(make_model_dir(tiny_fp8.parent, "tiny", "bf16") / "model.safetensors")

    def to_bf16(t: dict) -> None:
        t.pop(f"{ATTN}.o_proj.weight_scale_inv")
        t[f"{ATTN}.o_proj.weight"] = bf16[f"{ATTN}.o_proj.weight"]

    _edit(unlisted_bf16, to_bf16)
    with pytest.raises(
        ValueError, match=rf"'{ATTN}\.o_proj' is stored as bf16, but SGLang loads {ATTN}\.o_proj as block FP8"
    ):
        load_model(unlisted_bf16)
    # Listed as well, it loads: the same weights, now unquantized as SGLang would run them.
    _edit(unlisted_bf16, None, lambda ignored: [*ignored, f"{ATTN}.o_proj"])
    model = load_model(unlisted_bf16)
    ids = torch.tensor([5, 6, 7])
    assert model.forward([ids], [model.new_sequence()])[0].isfinite().all()

"""Bad directories and bad forward calls raise ValueError with a message naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.model import load_model
from weight_sync.base_model import VOCAB_SIZE


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_wrong_architecture(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*not supported"):
        load_model(path)


def test_malformed_config(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_model(path)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing field 'hidden_size'"):
        load_model(path)


def test_no_weights(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(path)


def test_missing_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"):
        load_model(path)


def test_mismatched_shape(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["moe_intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    msg = "gate_proj.weight' has shape \\[256, 128\\], config.json implies \\[128, 128\\]"
    with pytest.raises(ValueError, match=msg):
        load_model(path)


def test_unexpected_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dir, tmp_path / "m")
    extra = {"model.layers.5.extra.weight": torch.zeros(2, dtype=torch.bfloat16)}
    _edit_tensors(path, lambda t: t.update(extra))
    with pytest.raises(ValueError, match="no place for: model.layers.5.extra.weight"):
        load_model(path)


def test_bad_kv_cache_dtype(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'"):
        load_model(tiny_dir, kv_cache_dtype="fp4")


def test_forward_rejects_bad_input_and_changes_nothing(tiny_model) -> None:
    m = tiny_model
    c = m.new_sequence()
    m.forward([torch.tensor([1, 2, 3])], [c])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.forward([torch.tensor([5, VOCAB_SIZE])], [c])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.forward([torch.tensor([-1])], [c])
    with pytest.raises(ValueError, match="maximum context 2048"):
        m.forward([torch.zeros(2046, dtype=torch.long)], [c])
    with pytest.raises(ValueError, match="twice"):
        m.forward([torch.tensor([1]), torch.tensor([2])], [c, c])
    with pytest.raises(ValueError, match="1 token tensors but 2 caches"):
        m.forward([torch.tensor([1])], [c, m.new_sequence()])
    with pytest.raises(ValueError, match="1-D integer"):
        m.forward([torch.tensor([[1]])], [c])
    assert c.length == 3
    other = load_model(m.path, kv_cache_dtype="fp8_e4m3").new_sequence()
    with pytest.raises(ValueError, match="not made by a model of this shape"):
        m.forward([torch.tensor([1])], [other])
    # Exactly the max context fits.
    out = m.forward([torch.zeros(2045, dtype=torch.long)], [c])[0]
    assert out.shape == (2045, VOCAB_SIZE) and c.length == m.max_context == 2048


def _edit_quantized(path: Path, edit) -> None:
    """Apply ``edit`` to the tensors of every shard of a converted (indexed) checkpoint."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / shard)
        edit(tensors)
        save_file(tensors, str(path / shard))


def test_quantized_tensors_with_bad_scales_or_missing_parts(model_root: Path, tmp_path: Path) -> None:
    from tests.support.models import make_model_dir

    name = "model.layers.0.self_attn.o_proj"  # tiny's qkv_proj stays BF16 in fp8 (k/v N = 64)
    fp8 = _copy(make_model_dir(model_root, "tiny", "fp8"), tmp_path / "fp8")

    def bad_scale(t: dict) -> None:
        if f"{name}.weight_scale_inv" in t:
            t[f"{name}.weight_scale_inv"] = torch.ones(3, 3)

    _edit_quantized(fp8, bad_scale)
    with pytest.raises(ValueError, match=f"{name}"):
        load_model(fp8)

    expert = "model.layers.1.mlp.experts.2.down_proj"
    mx = _copy(make_model_dir(model_root, "tiny", "mxfp4"), tmp_path / "mx")
    _edit_quantized(mx, lambda t: t.pop(f"{expert}.weight_scales", None))
    with pytest.raises(ValueError, match=f"{expert}.weight_scales"):
        load_model(mx)


def test_nvfp4_input_scale_missing_defaults_to_one_and_bad_ones_are_refused(
    model_root: Path, tmp_path: Path
) -> None:
    """A linear without ``input_scale`` runs with 1.0, as SGLang fills it; a non-positive, non-finite
    or non-scalar one is refused naming the tensor."""
    from tests.support.models import make_model_dir

    name = "model.layers.0.self_attn.o_proj.input_scale"
    src = make_model_dir(model_root, "tiny", "nvfp4")
    assert load_model(src)._layers[0].o_proj.nvfp4_input_scale != 1.0  # noqa: SLF001 - calibrated
    missing = _copy(src, tmp_path / "missing")
    _edit_quantized(missing, lambda t: t.pop(name, None))
    assert load_model(missing)._layers[0].o_proj.nvfp4_input_scale == 1.0  # noqa: SLF001
    for i, bad in enumerate((torch.tensor(0.0), torch.tensor(float("nan")), torch.ones(2))):
        path = _copy(src, tmp_path / f"bad{i}")

        def put(t: dict, bad: torch.Tensor = bad) -> None:
            if name in t:
                t[name] = bad

        _edit_quantized(path, put)
        with pytest.raises(ValueError, match=name):
            load_model(path)

"""The local engine's debug routes and the QDQ reference of level 3: the operator route runs the
engine's kernels on the served checkpoint's linear; the reference's activation quantizers, written
from the formats' definitions, agree with the engine's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from engine.model.config import ModelConfig
from engine.server.debug import linear_shape, run_operator
from tests.support.engines import engine_process
from tests.support.models import make_model_dir
from validate import engine_calls, operator
from weight_sync.convert import convert_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("validate-op")
    base = make_model_dir(root, "tiny", "bf16")
    out = {"bf16": base}
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        out[fmt] = root / fmt
        convert_checkpoint(base, out[fmt], fmt, workers=1)
    return out


def test_linear_shape_names_what_the_model_lacks(models) -> None:
    c = ModelConfig.from_dir(models["bf16"])
    assert linear_shape(c, "model.layers.0.mlp.experts.3.down_proj") == (
        c.hidden_size,
        c.moe_intermediate_size,
    )
    assert linear_shape(c, "model.layers.1.self_attn.k_proj") == (
        c.num_key_value_heads * c.head_dim,
        c.hidden_size,
    )
    for bad, why in (
        ("lm_head", "not a linear"),
        ("model.layers.9.self_attn.o_proj", "2 layers"),
        ("model.layers.0.mlp.experts.99.up_proj", "8 experts"),
        ("model.layers.0.mlp.gate_proj", "an MoE layer"),
    ):
        with pytest.raises(ValueError, match=why):
            linear_shape(c, bad)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_engine_kernel_equals_the_qdq_reference(models, fmt) -> None:
    cfg = ModelConfig.from_dir(models[fmt])
    gen = torch.Generator().manual_seed(0)
    for name in operator.sample_names(json.loads((models["bf16"] / "config.json").read_text())):
        x = torch.randn(8, operator._shape(models["bf16"], name)[1], generator=gen)
        stored, bf16, qdq = operator.run_one(models[fmt], models["bf16"], name, x)
        got_fmt, out = run_operator(str(models[fmt]), cfg, name, x)
        assert got_fmt == stored
        assert operator._rel(out, qdq) < 1e-5, name  # same products, float32 rounding
        if stored != "bf16":
            assert 1e-3 < operator._rel(qdq, bf16) < 0.25, name  # quantization is visible, bounded


def test_qdq_activations_match_the_engines_quantizers() -> None:
    from engine.model import act_nvfp4
    from engine.model.layers import quantize_activations_fp8

    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(3)) * 3
    assert torch.equal(operator.qdq_fp8_activations(x), quantize_activations_fp8(x))
    scale = 0.004
    assert torch.allclose(
        operator.qdq_nvfp4_activations(x, scale), act_nvfp4.qdq(x, scale), rtol=0, atol=1e-7
    )


def test_routes_served_over_http(models) -> None:
    with engine_process(models["fp8"]) as url:
        name = "model.layers.1.mlp.experts.7.gate_proj"
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
        out = engine_calls.operator(url, name, x)
        _, ref = run_operator(str(models["fp8"]), ModelConfig.from_dir(models["fp8"]), name, x)
        assert out is not None and torch.allclose(out, ref, rtol=0, atol=1e-6)
        bad = httpx.post(url + "/debug/operator", json={"name": "lm_head", "input": [[0.0]]}, timeout=30)
        assert bad.status_code == 400 and "not a linear" in bad.json()["error"]["message"]
        short = httpx.post(url + "/debug/operator", json={"name": name, "input": [[0.0]]}, timeout=30)
        assert short.status_code == 400 and "[M, 128]" in short.json()["error"]["message"]
        # faults are off unless the engine's environment turns them on
        assert httpx.post(url + "/debug/fault", json={}, timeout=30).status_code == 404

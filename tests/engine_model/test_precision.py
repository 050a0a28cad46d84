"""Each group's precision as the engine emulates it, on directories made by the real converter.

- Per-format KL: next-token distributions of the fp8 / nvfp4 / mxfp4 checkpoints (and of the BF16
  checkpoint with an FP8 KV cache) against the BF16 engine on the same prefixes, printed, with
  the orderings the formats imply asserted (not accidental: per sequence, with margins).
- MXFP4 (W4A16) computes exactly with its dequantized weights: transformers' float32 forward
  of a checkpoint holding those weights gives the same logits.
- NVFP4 runs W4A4: transformers' forward with those weights and every quantized linear's input
  passed through an independent restatement of SGLang's activation quantizer (with the
  checkpoint's input scales, as SGLang takes them) gives the engine's logits.
- FP8 runs W8A8: activation quantization matches an independent per-token-group reference and
  changes the logits beyond what the weights alone do; the layers SGLang's block-FP8 loader
  refuses stay BF16 and compute unquantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.model.loader import load_checkpoint
from engine.model.model import load_model
from tests.support.models import make_model_dir
from weight_sync.base_model import VOCAB_SIZE

QUANTIZED = ("fp8", "nvfp4", "mxfp4")
N_SEQ, SEQ_LEN = 8, 48


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2024)
    return [torch.randint(0, 256, (SEQ_LEN,), generator=g) for _ in range(N_SEQ)]


def _logprobs(model, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Next-token log-probs ``[N_SEQ, SEQ_LEN, V]`` for every prefix of every prompt."""
    out = model.forward(prompts, [model.new_sequence() for _ in prompts])
    return torch.log_softmax(torch.stack(out).double(), dim=-1)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per sequence (mean over positions), from log-probs."""
    return (p.exp() * (p - q)).sum(-1).mean(-1)


@pytest.fixture(scope="module")
def kl_table(model_root: Path, prompts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    base_dir = make_model_dir(model_root, "tiny", "bf16")
    base = _logprobs(load_model(base_dir), prompts)
    table = {"bf16": _kl(base, _logprobs(load_model(base_dir), prompts))}
    for fmt in QUANTIZED:
        model = load_model(make_model_dir(model_root, "tiny", fmt))
        assert model.precision == fmt
        table[fmt] = _kl(base, _logprobs(model, prompts))
    table["bf16+fp8kv"] = _kl(base, _logprobs(load_model(base_dir, kv_cache_dtype="fp8_e4m3"), prompts))
    return table


def test_print_kl_table(kl_table: dict[str, torch.Tensor], capsys: pytest.CaptureFixture) -> None:
    with capsys.disabled():
        print(f"\nKL(bf16 engine || format), tiny preset, {N_SEQ} prompts x {SEQ_LEN} prefixes:")
        for name, per_seq in kl_table.items():
            print(
                f"  {name:<11} mean {per_seq.mean().item():.3e}   per-prompt min {per_seq.min().item():.3e}"
                f"  max {per_seq.max().item():.3e}"
            )
    assert set(kl_table) == {"bf16", *QUANTIZED, "bf16+fp8kv"}


def test_bf16_against_itself_is_exactly_zero(kl_table: dict[str, torch.Tensor]) -> None:
    assert torch.equal(kl_table["bf16"], torch.zeros(N_SEQ, dtype=torch.float64))


def test_every_quantized_format_differs_from_bf16(kl_table: dict[str, torch.Tensor]) -> None:
    for name in (*QUANTIZED, "bf16+fp8kv"):
        assert (kl_table[name] > 1e-7).all(), name


def test_four_bit_formats_differ_more_than_fp8(kl_table: dict[str, torch.Tensor]) -> None:
    # FP8 e4m3 (3 mantissa bits; relative rounding <= 2^-4) perturbs each weight several times
    # less than E2M1 (1 mantissa bit) with 16- (NVFP4) or 32-element (MXFP4, power-of-two scales)
    # groups, and KL grows with the square of the perturbation. FP8 also quantizes activations and
    # MXFP4 only touches the experts, so the margin is smaller than the weights alone suggest.
    # Required on every prompt (8 of 8; 1/256 by chance) and by a factor 1.5 on average.
    fp8 = kl_table["fp8"]
    for fmt in ("nvfp4", "mxfp4"):
        assert (kl_table[fmt] > fp8).all(), fmt
        assert kl_table[fmt].mean() > 1.5 * fp8.mean(), fmt


def test_fp8_kv_cache_differs_less_than_fp8_weights(kl_table: dict[str, torch.Tensor]) -> None:
    # Only K and V pass through e4m3 (values of order 1, so relative rounding ~2^-4); the weights
    # and activations of every projection stay exact.
    assert kl_table["bf16+fp8kv"].mean() < kl_table["fp8"].mean()


def _write_dequantized(src: Path, dst: Path) -> Path:
    """A float32 HF checkpoint holding the weights the engine dequantized from ``src``."""
    from safetensors.torch import save_file

    from engine.model.config import ModelConfig

    config = ModelConfig.from_dir(src)
    ct = load_checkpoint(src, config)
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": ct.embed,
        "model.norm.weight": ct.final_norm,
        "lm_head.weight": ct.lm_head.weight,
    }
    for i, layer in enumerate(ct.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = layer.plain["input_layernorm"]
        t[p + "post_attention_layernorm.weight"] = layer.plain["post_attention_layernorm"]
        t[p + "self_attn.q_norm.weight"] = layer.plain["q_norm"]
        t[p + "self_attn.k_norm.weight"] = layer.plain["k_norm"]
        for name, w in layer.linears.items():
            module = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            t[f"{p}{module}.{name}.weight"] = w.weight
        if "gate" in layer.plain:
            t[p + "mlp.gate.weight"] = layer.plain["gate"]
        for e, ex in enumerate(layer.experts):
            for name, w in ex.items():
                t[p + f"mlp.experts.{e}.{name}.weight"] = w.weight
    dst.mkdir()
    save_file({k: v.contiguous() for k, v in t.items()}, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("fmt", ["mxfp4"])
def test_w4a16_formats_compute_with_dequantized_weights(model_root: Path, tmp_path: Path, fmt: str) -> None:
    from transformers import Qwen3MoeForCausalLM

    src = make_model_dir(model_root, "tiny", fmt)
    ref_dir = _write_dequantized(src, tmp_path / "deq")
    ids = torch.randint(0, VOCAB_SIZE, (32,), generator=torch.Generator().manual_seed(3))
    hf = Qwen3MoeForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    model = load_model(src)
    out = model.forward([ids], [model.new_sequence()])[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    bf16 = load_model(make_model_dir(model_root, "tiny", "bf16"))
    assert (out - bf16.forward([ids], [bf16.new_sequence()])[0]).abs().max() > 1e-2


def _reference_act_quant(x: torch.Tensor) -> torch.Tensor:
    """Independent per-token, per-128-channel e4m3 round trip, one group at a time."""
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        for g0 in range(0, x.shape[1], 128):
            grp = x[row, g0 : g0 + 128]
            scale = max(grp.abs().max().item(), 1e-10) / 448.0
            codes = torch.clamp(grp / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
            out[row, g0 : g0 + 128] = codes.to(torch.float32) * scale
    return out


def test_fp8_activation_quantization_matches_reference() -> None:
    from engine.model.layers import quantize_activations_fp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=g) * torch.logspace(-3, 3, 384)  # groups of very different ranges
    x[2] = 0.0  # an all-zero token keeps zeros (eps scale), no NaN
    q = quantize_activations_fp8(x)
    assert torch.equal(q, _reference_act_quant(x))
    assert torch.equal(q[2], torch.zeros(384))
    assert (q - x).abs().max() > 0 and ((q - x).abs() <= x.abs() * 2**-4 + 1e-12).all()
    odd = torch.randn(3, 200, generator=g)  # a trailing partial group gets its own scale
    ref = torch.cat([_reference_act_quant(odd[:, :128]), _reference_act_quant(odd[:, 128:])], dim=1)
    assert torch.equal(quantize_activations_fp8(odd), ref)


def test_fused_fp8_activation_quantization_equals_the_torch_ops_bit_for_bit() -> None:
    """The numba pass equals the torch-ops version (float8 casts) on every finite bfloat16 bit
    pattern (all e4m3 rounding ties and the subnormal range included), on mixed ranges, partial
    groups, zeros, negative zeros, NaN and infinity."""
    from engine.model.layers import _quantize_activations_fp8_torch, quantize_activations_fp8

    g = torch.Generator().manual_seed(1)
    every = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every.reshape(-1, 128)
    every = every[every.isfinite().all(1)]
    edge = torch.randn(4, 256, generator=g)
    edge[0, 3] = float("nan")
    edge[1, :128] = 0.0
    edge[1, 130] = -0.0
    edge[2, 5] = float("inf")
    edge[3] = -0.0
    edge[3, 200] = 1e-30
    cases = [
        every,
        edge,
        torch.randn(37, 384, generator=g) * torch.logspace(-12, 3, 384),
        torch.randn(2, 5, 200, generator=g) * 1e-3,
    ]
    for x in cases:
        got, ref = quantize_activations_fp8(x), _quantize_activations_fp8_torch(x)
        assert got.shape == ref.shape
        assert torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got[~got.isnan()].view(torch.int32), ref[~ref.isnan()].view(torch.int32))


def test_fp8_engine_is_w8a8(model_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen3MoeForCausalLM

    from engine.model import layers

    src = make_model_dir(model_root, "tiny", "fp8")
    ref_dir = _write_dequantized(src, tmp_path / "deq")
    ids = torch.randint(0, VOCAB_SIZE, (32,), generator=torch.Generator().manual_seed(4))
    hf = Qwen3MoeForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        weights_only = hf(ids[None]).logits[0]
    model = load_model(src)
    w8a8 = model.forward([ids], [model.new_sequence()])[0]
    with monkeypatch.context() as m:
        m.setattr(layers, "quantize_activations_fp8", lambda x: x)
        w8a16 = model.forward([ids], [model.new_sequence()])[0]
    # Without activation quantization the engine is exactly the dequantized-weight forward...
    torch.testing.assert_close(w8a16, weights_only, atol=1e-4, rtol=0)
    # ...and with it, every position moves by an activation-rounding-sized amount (typically
    # 0.1-0.3 in logits; a position whose expert choice flips can move by more).
    per_position = (w8a8 - weights_only).abs().amax(-1)
    assert (per_position > 1e-2).all()
    assert per_position.median() < 1.0


def test_fp8_layers_sglang_refuses_stay_bf16_and_the_rest_is_w8a8(tmp_path: Path, monkeypatch) -> None:
    """Fused experts with intermediate 64 and a dense gate_up with N = 192, which SGLang's
    block-FP8 loader refuses (``layers/quantization/fp8.py`` 1584-1593, 600-610): the converter
    keeps them BF16 byte for byte, the engine computes them unquantized (no FP8 activations, as
    SGLang's unquantized methods do) and everything else W8A8; without activation quantization
    the forward is transformers' on the dequantized weights."""
    from transformers import Qwen3MoeForCausalLM

    from engine.model import layers
    from engine.model.config import ModelConfig
    from engine.model.loader import named_linears
    from tests.support.checkpoints import MoESpec, load_all, write_checkpoint
    from weight_sync.convert import convert_checkpoint

    src, out = tmp_path / "src", tmp_path / "fp8"
    spec = MoESpec(hidden_size=128, head_dim=64, intermediate_size=192, moe_intermediate_size=64, shards=1)
    write_checkpoint(src, spec)
    kept = ["model.layers.0.mlp.experts", "model.layers.1.mlp.gate_up_proj", "model.layers.2.mlp.experts"]
    assert sorted(convert_checkpoint(src, out, "fp8").unquantized) == kept
    linears = named_linears(load_checkpoint(out, ModelConfig.from_dir(out)).layers)
    source = load_all(src)
    for name, w in linears.items():
        bf16 = name.startswith((kept[0], kept[2])) or name.endswith(("mlp.gate_proj", "mlp.up_proj"))
        assert w.fmt == ("bf16" if bf16 else "fp8") and w.fp8_activations != bf16, name
        if bf16:
            assert torch.equal(w.tensors[0], source[f"{name}.weight"]), name
    ids = torch.randint(0, spec.vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    hf = Qwen3MoeForCausalLM.from_pretrained(_write_dequantized(out, tmp_path / "deq"), dtype=torch.float32)
    with torch.no_grad():
        weights_only = hf.eval()(ids[None]).logits[0]
    model = load_model(out)
    w8a8 = model.forward([ids], [model.new_sequence()])[0]
    with monkeypatch.context() as m:
        m.setattr(layers, "quantize_activations_fp8", lambda x: x)
        w8a16 = model.forward([ids], [model.new_sequence()])[0]
    torch.testing.assert_close(w8a16, weights_only, atol=1e-4, rtol=0)
    assert (w8a8 - weights_only).abs().amax(-1).min() > 1e-2


def _sglang_input_scales(src: Path, hf) -> dict[int, tuple[torch.Tensor, float]]:
    """For each quantized weight of ``hf`` (by ``data_ptr``): the parameter and the input scale SGLang
    uses for it: the maximum over fused q/k/v, over gate/up, and over a layer's experts."""
    from safetensors import safe_open

    scales: dict[str, float] = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names = [k for k in st.keys() if k.endswith(".input_scale")]  # noqa: SIM118 (safe_open has no __iter__)
            scales.update({k: st.get_tensor(k).item() for k in names})

    def most(prefixes: list[str]) -> float:
        return max(v for k, v in scales.items() if any(k.startswith(p) for p in prefixes))

    out: dict[int, tuple[torch.Tensor, float]] = {}
    for i, layer in enumerate(hf.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = most([p + "self_attn.q_proj.", p + "self_attn.k_proj.", p + "self_attn.v_proj."])
        pairs = [(attn.q_proj.weight, qkv), (attn.k_proj.weight, qkv), (attn.v_proj.weight, qkv)]
        pairs.append((attn.o_proj.weight, most([p + "self_attn.o_proj."])))
        if hasattr(mlp, "experts"):
            gate_up = [
                f"{p}mlp.experts.{e}.{n}_proj."
                for e in range(mlp.experts.num_experts)
                for n in ("gate", "up")
            ]
            down = [f"{p}mlp.experts.{e}.down_proj." for e in range(mlp.experts.num_experts)]
            pairs += [(mlp.experts.gate_up_proj, most(gate_up)), (mlp.experts.down_proj, most(down))]
        else:
            gu = most([p + "mlp.gate_proj.", p + "mlp.up_proj."])
            pairs += [(mlp.gate_proj.weight, gu), (mlp.up_proj.weight, gu)]
            pairs.append((mlp.down_proj.weight, most([p + "mlp.down_proj."])))
        out.update({w.data_ptr(): (w, s) for w, s in pairs})
    return out


def _scale_of(w: torch.Tensor, params: dict[int, tuple[torch.Tensor, float]]) -> float | None:
    """The input scale of the parameter ``w`` is (or is a slice of: one expert of a 3-D weight)."""
    for param, s in params.values():
        start = param.data_ptr()
        if start <= w.data_ptr() < start + param.numel() * param.element_size():
            return s
    return None


def test_nvfp4_engine_is_w4a4(model_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen3MoeForCausalLM

    from engine.model import act_nvfp4
    from tests.engine_model import nvfp4_reference

    src = make_model_dir(model_root, "tiny", "nvfp4")
    ref_dir = _write_dequantized(src, tmp_path / "deq")
    ids = torch.randint(0, VOCAB_SIZE, (32,), generator=torch.Generator().manual_seed(5))
    # eager experts: one F.linear per expert projection, which the hook below sees
    hf = Qwen3MoeForCausalLM.from_pretrained(
        ref_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    params = _sglang_input_scales(src, hf)
    assert len({s for _, s in params.values()}) > 4  # calibrated: the scales differ by site
    with torch.no_grad():
        weights_only = hf(ids[None]).logits[0]
        plain_linear = torch.nn.functional.linear

        def w4a4_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            s = _scale_of(w, params)
            return plain_linear(x if s is None else nvfp4_reference.qdq(x, s), w, b)

        with monkeypatch.context() as m:
            m.setattr(torch.nn.functional, "linear", w4a4_linear)
            w4a4_ref = hf(ids[None]).logits[0]
    model = load_model(src)
    w4a4 = model.forward([ids], [model.new_sequence()])[0]
    with monkeypatch.context() as m:
        m.setattr(act_nvfp4, "qdq", lambda x, s: x)
        w4a16 = model.forward([ids], [model.new_sequence()])[0]
    # Without activation quantization the engine is exactly the dequantized-weight forward...
    torch.testing.assert_close(w4a16, weights_only, atol=1e-4, rtol=0)
    # ...with it, it is the reference W4A4 forward: equal to float32 rounding at most positions;
    # where a rounding difference upstream moves an activation across an E2M1 decision boundary,
    # by a fraction of what activation rounding itself moves.
    per_position = (w4a4 - w4a4_ref).abs().amax(-1)
    moved = (w4a4 - weights_only).abs().amax(-1)
    print(
        f"\nnvfp4 W4A4 vs reference per position: max {per_position.max().item():.2e}, median "
        f"{per_position.median().item():.2e}, {(per_position < 1e-4).sum().item()}/{len(ids)} under 1e-4; "
        f"activation rounding moves them by median {moved.median().item():.3f}"
    )
    assert (per_position < 1e-4).float().mean() >= 0.75
    assert per_position.max() < 0.1 * moved.median()
    assert (moved > 1e-2).all()

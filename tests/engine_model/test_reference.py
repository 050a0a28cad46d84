"""The engine's forward pass against transformers' ``Qwen3MoeForCausalLM`` and against itself.

Tolerances: the BF16 checkpoint's weights are exact in float32 and both sides compute in float32,
so the only differences are float32 summation order (SDPA kernels, matmul blocking for different
batch shapes). Logits have a spread of ~3; 30 float32 ulps of values ~10 is ~2e-5, so 1e-4 leaves
room for kernel choice and still catches any real bug (a wrong norm, RoPE or routing detail
moves logits by >1e-2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.model import load_model
from mixfleet.init_model import PRESETS, Preset, write_model
from weight_sync.base_model import VOCAB_SIZE

ATOL = 1e-4


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def _ids(n: int, seed: int, vocab: int = VOCAB_SIZE) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# A `small`-shaped model (hidden 512, 8x64 heads, GQA 4:1) cut to 3 layers and 4 experts, with a
# dense MLP layer (mlp_only_layers) and a sparse step of 2, so every HF code path is compared.
REDUCED_SMALL = Preset(
    hidden_size=512,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    intermediate_size=256,
    max_position_embeddings=512,
    shards=2,
    mlp_only_layers=(2,),
)


@pytest.fixture(scope="module")
def reduced_small_dir(model_root: Path) -> Path:
    path = model_root / "reduced-small"
    if not path.is_dir():
        write_model(path, REDUCED_SMALL, seed=7)
        # decoder_sparse_step=2 makes layer 0 dense and layer 1 sparse; layer 2 is in mlp_only_layers.
        import json

        cfg = json.loads((path / "config.json").read_text())
        assert cfg["mlp_only_layers"] == [2]
    return path


def test_full_sequence_logits_match_transformers_tiny(tiny_dir: Path, tiny_model) -> None:
    ids = _ids(48, 0)
    ref = _hf_logits(tiny_dir, ids)
    out = tiny_model.forward([ids], [tiny_model.new_sequence()])[0]
    assert out.dtype == torch.float32 and out.shape == (48, VOCAB_SIZE)
    assert ref.std() > 1.0  # a non-degenerate distribution, not near-uniform logits
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_full_sequence_logits_match_transformers_reduced_small(reduced_small_dir: Path) -> None:
    model = load_model(reduced_small_dir)
    assert [model.config.is_moe_layer(i) for i in range(3)] == [True, True, False]
    ids = _ids(40, 1)
    ref = _hf_logits(reduced_small_dir, ids)
    out = model.forward([ids], [model.new_sequence()])[0]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_sparse_step_and_dense_layers_match_transformers(model_root: Path) -> None:
    path = model_root / "sparse-step"
    if not path.is_dir():
        write_model(path, REDUCED_SMALL, seed=8)
        import json

        cfg = json.loads((path / "config.json").read_text())
        cfg.update(decoder_sparse_step=2, mlp_only_layers=[])
        (path / "config.json").write_text(json.dumps(cfg))
        # Layer 0 and 2 become dense under decoder_sparse_step=2: rewrite their MLP tensors.
        from safetensors.torch import load_file, save_file

        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        tensors = {}
        for f in files:
            tensors.update(load_file(path / f))
            (path / f).unlink()
        g = torch.Generator().manual_seed(9)
        for layer in (0, 2):
            p = f"model.layers.{layer}.mlp."
            for name in [n for n in tensors if n.startswith(p)]:
                del tensors[name]
            h, inter = REDUCED_SMALL.hidden_size, REDUCED_SMALL.intermediate_size
            for n, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                tensors[f"{p}{n}.weight"] = (torch.randn(shape, generator=g) / shape[1] ** 0.5).bfloat16()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "model.safetensors.index.json").unlink()
    model = load_model(path)
    assert [model.config.is_moe_layer(i) for i in range(3)] == [False, True, False]
    ids = _ids(24, 2)
    torch.testing.assert_close(
        model.forward([ids], [model.new_sequence()])[0], _hf_logits(path, ids), atol=ATOL, rtol=0
    )


def test_incremental_decoding_matches_full_recomputation(tiny_model) -> None:
    ids = _ids(40, 3)
    full = tiny_model.forward([ids], [tiny_model.new_sequence()])[0]
    cache = tiny_model.new_sequence()
    parts = [tiny_model.forward([ids[:7]], [cache])[0]]  # prefill
    parts.append(tiny_model.forward([ids[7:19]], [cache])[0])  # a second prefill chunk after a prefix
    for t in ids[19:]:
        parts.append(tiny_model.forward([t.reshape(1)], [cache])[0])  # decode steps
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(parts), full, atol=ATOL, rtol=0)


def test_batched_forward_matches_one_at_a_time(tiny_model) -> None:
    lengths = [1, 5, 17, 2, 9]
    prefixes = [0, 3, 0, 11, 6]
    seqs = [_ids(p + n, 10 + i) for i, (p, n) in enumerate(zip(prefixes, lengths, strict=True))]
    alone, caches = [], []
    for seq, p in zip(seqs, prefixes, strict=True):
        c = tiny_model.new_sequence()
        if p:
            tiny_model.forward([seq[:p]], [c])
        alone.append(tiny_model.forward([seq[p:]], [c])[0])
        c2 = tiny_model.new_sequence()
        if p:
            tiny_model.forward([seq[:p]], [c2])
        caches.append(c2)
    batched = tiny_model.forward([s[p:] for s, p in zip(seqs, prefixes, strict=True)], caches)
    for a, b, n, p, c in zip(alone, batched, lengths, prefixes, caches, strict=True):
        assert b.shape == (n, VOCAB_SIZE)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        assert c.length == p + n
    # Then 5 decode steps of all sequences together equal decoding each alone.
    nxt = [b[-1].argmax().reshape(1) for b in batched]
    step = tiny_model.forward(nxt, caches)
    for i, seq in enumerate(seqs):
        c = tiny_model.new_sequence()
        ref = tiny_model.forward([torch.cat([seq, nxt[i]])], [c])[0][-1]
        torch.testing.assert_close(step[i][0], ref, atol=ATOL, rtol=0)


def test_cache_truncate_and_free(tiny_model) -> None:
    ids = _ids(20, 4)
    c = tiny_model.new_sequence()
    first = tiny_model.forward([ids], [c])[0]
    c.truncate(12)
    again = tiny_model.forward([ids[12:]], [c])[0]
    torch.testing.assert_close(again, first[12:], atol=ATOL, rtol=0)
    c.free()
    assert c.length == 0
    torch.testing.assert_close(tiny_model.forward([ids[:4]], [c])[0], first[:4], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="truncate"):
        c.truncate(5)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bf16"])
def test_low_precision_kv_cache_is_consistent_and_differs_from_auto(tiny_dir: Path, kv: str) -> None:
    model = load_model(tiny_dir, kv_cache_dtype=kv)
    assert model.new_sequence().pool is None
    ids = _ids(30, 5)
    full = model.forward([ids], [model.new_sequence()])[0]
    c = model.new_sequence()
    parts = [model.forward([ids[:10]], [c])[0]] + [model.forward([t.reshape(1)], [c])[0] for t in ids[10:]]
    assert c.pool.kv.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}[kv]
    torch.testing.assert_close(torch.cat(parts), full, atol=ATOL, rtol=0)
    base = load_model(tiny_dir)
    exact = base.forward([ids], [base.new_sequence()])[0]
    assert (full - exact).abs().max() > 1e-4  # the cache really stores through the low precision


def test_small_preset_shape() -> None:
    p = PRESETS["small"]
    for dim in (
        p.hidden_size,
        p.moe_intermediate_size,
        p.intermediate_size,
        p.num_attention_heads * p.head_dim,
        p.num_key_value_heads * p.head_dim,
    ):
        assert dim % 128 == 0


def test_empty_token_tensors_are_allowed_and_change_nothing(tiny_model) -> None:
    ids = _ids(6, 6)
    a, b = tiny_model.new_sequence(), tiny_model.new_sequence()
    tiny_model.forward([ids[:3]], [a])
    out = tiny_model.forward([torch.empty(0, dtype=torch.long), ids[3:5]], [a, b])
    assert out[0].shape == (0, VOCAB_SIZE) and a.length == 3 and b.length == 2
    step = tiny_model.forward([ids[3:4], torch.empty(0, dtype=torch.long)], [a, b])
    assert step[1].shape == (0, VOCAB_SIZE) and a.length == 4 and b.length == 2
    c = tiny_model.new_sequence()
    torch.testing.assert_close(step[0][0], tiny_model.forward([ids[:4]], [c])[0][-1], atol=ATOL, rtol=0)

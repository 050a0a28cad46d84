"""``formats.fp8_layout``: SGLang 0.5.23's block-FP8 load checks at TP=1 and its skip-list rules.

Every expectation is restated here from the SGLang source (file:line in the 0.5.23 wheel,
relative to ``sglang/srt/``), not derived from the module under test.
"""

from __future__ import annotations

import pytest

from mixfleet.init_model import PRESETS
from weight_sync.formats import fp8_layout
from weight_sync.formats.fp8_layout import Module, ignored_layers, is_layer_skipped, modules, refusal

L0 = "model.layers.0"


def _attn(q: int, kv: int) -> dict[str, int]:
    return {f"{L0}.self_attn.q_proj": q, f"{L0}.self_attn.k_proj": kv, f"{L0}.self_attn.v_proj": kv}


def _one(linears: dict[str, int]) -> Module:
    (m,) = modules(linears)
    return m


@pytest.mark.parametrize(
    ("n", "refused"), [(128, False), (192, True), (64, True), (256, False), (384, False)]
)
def test_merged_qkv_shards_must_be_multiples_of_128(n: int, refused: bool) -> None:
    """``layers/quantization/fp8.py`` 600-610: with more than one output partition (q, k, v of a
    ``QKVParallelLinear``, ``layers/linear.py`` 1155-1159) each must divide by block_n = 128."""
    m = _one(_attn(256, n))
    assert (m.name, m.kind) == (f"{L0}.self_attn.qkv_proj", "merged")
    r = refusal(m)
    assert (r is not None) == refused
    if refused:
        assert (r.shard, r.n) == (f"{L0}.self_attn.k_proj", n)  # the first offending shard by name
        assert f"has N={n}, not a multiple of block_n=128" in r.reason()
        assert "layers/quantization/fp8.py 600-610" in r.reason()


@pytest.mark.parametrize("n", [192, 64])
def test_a_query_shard_off_the_grid_is_refused_too(n: int) -> None:
    r = refusal(_one(_attn(n, 128)))
    assert r is not None and (r.shard, r.n) == (f"{L0}.self_attn.q_proj", n)


@pytest.mark.parametrize(("n", "refused"), [(128, False), (192, True), (64, True)])
def test_dense_gate_up_must_be_multiples_of_128(n: int, refused: bool) -> None:
    m = _one({f"{L0}.mlp.gate_proj": n, f"{L0}.mlp.up_proj": n})
    assert (m.name, m.kind) == (f"{L0}.mlp.gate_up_proj", "merged")
    assert (refusal(m) is not None) == refused


@pytest.mark.parametrize(("n", "refused"), [(128, False), (192, True), (64, True)])
def test_fused_moe_intermediate_must_be_a_multiple_of_128(n: int, refused: bool) -> None:
    """``fp8.py`` 1584-1593: the experts' gate/up N (the intermediate size); down_proj's N (the
    hidden size, 160 here) is not checked at TP=1."""
    linears = {}
    for e in range(3):
        p = f"{L0}.mlp.experts.{e}"
        linears |= {f"{p}.gate_proj": n, f"{p}.up_proj": n, f"{p}.down_proj": 160}
    m = _one(linears)
    assert (m.name, m.kind, len(m.shards)) == (f"{L0}.mlp.experts", "experts", 9)
    r = refusal(m)
    assert (r is not None) == refused
    if refused:
        assert r.shard == f"{L0}.mlp.experts.0.gate_proj" and "fp8.py 1584-1593" in r.reason()


def test_unfused_linears_are_never_refused_at_tp1() -> None:
    """``fp8.py`` 592-603: the row- and column-parallel checks of a single partition need
    ``tp_size > 1``."""
    for name in (f"{L0}.self_attn.o_proj", f"{L0}.mlp.down_proj"):
        m = _one({name: 64})
        assert m.kind == "single" and refusal(m) is None


def test_ignored_entries_list_every_shard_or_the_fused_moe_prefix() -> None:
    qkv = _one(_attn(128, 64))
    assert fp8_layout.ignored_entries(qkv) == [f"{L0}.self_attn.{p}_proj" for p in "kqv"]
    experts = _one({f"{L0}.mlp.experts.0.gate_proj": 64, f"{L0}.mlp.experts.0.up_proj": 64})
    assert fp8_layout.ignored_entries(experts) == [f"{L0}.mlp.experts"]


def test_skip_list_is_read_as_fp8_config_from_config_reads_it() -> None:
    """``fp8.py`` 354-364 with ``base_config.py`` 257-272: ``ignored_layers`` first, else
    ``modules_to_not_convert``; each entry with and without ``model.``."""
    assert ignored_layers({"ignored_layers": ["model.a", "b"], "modules_to_not_convert": ["c"]}) == [
        "a",
        "model.a",
        "b",
        "model.b",
    ]
    assert ignored_layers({"modules_to_not_convert": ["c"]}) == ["c", "model.c"]
    assert ignored_layers({"ignored_layers": None, "modules_to_not_convert": ["c"]}) == []  # first key wins
    assert ignored_layers({}) == []
    with pytest.raises(ValueError, match="must be a list"):
        ignored_layers({"ignored_layers": "lm_head"})


def test_is_layer_skipped_follows_sglang() -> None:
    """``layers/quantization/utils.py`` 48-125."""
    qkv = f"{L0}.self_attn.qkv_proj"
    shards = [f"{L0}.self_attn.{p}_proj" for p in "qkv"]
    assert is_layer_skipped(qkv, ignored_layers({"ignored_layers": shards}))
    assert is_layer_skipped(
        qkv, ignored_layers({"ignored_layers": [s.removeprefix("model.") for s in shards]})
    )
    assert is_layer_skipped(qkv, ignored_layers({"ignored_layers": [f"{L0}.self_attn"]}))  # a parent module
    assert not is_layer_skipped(qkv, ignored_layers({"ignored_layers": ["lm_head"]}))
    with pytest.raises(ValueError, match="some but not all shards of model.layers.0.self_attn.qkv_proj"):
        is_layer_skipped(qkv, ignored_layers({"ignored_layers": shards[:2]}))
    # Dotted boundaries: the MoE router "mlp.gate" does not skip "mlp.gate_up_proj", layer 1 not layer 11.
    assert not is_layer_skipped(
        f"{L0}.mlp.gate_up_proj", ignored_layers({"ignored_layers": [f"{L0}.mlp.gate"]})
    )
    one = ignored_layers({"ignored_layers": ["model.layers.1.self_attn.o_proj"]})
    assert is_layer_skipped("model.layers.1.self_attn.o_proj", one)
    assert not is_layer_skipped("model.layers.11.self_attn.o_proj", one)
    # FusedMoE: per layer, by its prefix or by any entry naming one of its experts.
    moe = ignored_layers({"ignored_layers": [f"{L0}.mlp.experts"]})
    assert is_layer_skipped(f"{L0}.mlp.experts", moe)
    assert not is_layer_skipped("model.layers.1.mlp.experts", moe)
    assert is_layer_skipped(
        f"{L0}.mlp.experts", ignored_layers({"ignored_layers": [f"{L0}.mlp.experts.3.up_proj"]})
    )


def _preset_linears(name: str) -> dict[str, int]:
    p = PRESETS[name]
    out = {}
    for i in range(p.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        out |= {a + "q_proj": p.num_attention_heads * p.head_dim, a + "o_proj": p.hidden_size}
        out |= {
            a + "k_proj": p.num_key_value_heads * p.head_dim,
            a + "v_proj": p.num_key_value_heads * p.head_dim,
        }
        if i in p.mlp_only_layers or p.num_experts == 0:
            m = f"model.layers.{i}.mlp."
            out |= {m + "gate_proj": p.intermediate_size, m + "up_proj": p.intermediate_size}
            out[m + "down_proj"] = p.hidden_size
        for e in range(p.num_experts if i not in p.mlp_only_layers else 0):
            x = f"model.layers.{i}.mlp.experts.{e}."
            out |= {x + "gate_proj": p.moe_intermediate_size, x + "up_proj": p.moe_intermediate_size}
            out[x + "down_proj"] = p.hidden_size
    return out


def test_presets() -> None:
    """``tiny``'s k/v have N = 2 x 32 = 64, so SGLang refuses its qkv_proj as block FP8 in every
    layer; ``small``'s every merged shard and expert intermediate (512, 128, 384) fits."""
    tiny = {m.name: refusal(m) for m in modules(_preset_linears("tiny"))}
    assert {name for name, r in tiny.items() if r is not None} == {
        f"model.layers.{i}.self_attn.qkv_proj" for i in range(PRESETS["tiny"].num_hidden_layers)
    }
    assert all(r.n == 64 for r in tiny.values() if r is not None)
    assert all(refusal(m) is None for m in modules(_preset_linears("small")))

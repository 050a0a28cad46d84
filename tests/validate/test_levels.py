"""Levels 1 and 2 and the ladder's inputs, on real converted checkpoints (no fleet)."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.errors import UserError
from core.formats import FORMATS
from tests.support.models import make_model_dir
from validate import contract, converter
from validate.reference import Forward
from validate.run import read_prompts
from validate.scoring import FixedPrefix, measure
from validate.target import GroupTarget
from validate.thresholds import RATIONALE, Bounds, bounds, table
from weight_sync.convert import convert_checkpoint
from weight_sync.manifest import Manifest
from weight_sync.store.local import LocalStore
from weight_sync.types import VersionRef


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The tiny model committed as version 1 of a store in every format (as a publish leaves it)."""
    root = tmp_path_factory.mktemp("validate-levels")
    base = make_model_dir(root, "tiny", "bf16")
    store = LocalStore(root / "store")
    out = {"bf16": base}
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        ref = VersionRef("run", fmt, 1)
        staged = store.staging_dir(ref)
        convert_checkpoint(base, staged, fmt, workers=1)
        store.commit(ref, staged)
        out[fmt] = Path(store.version_dir(ref))
    return out


def _target(models, fmt: str, version_dir: Path | None = None, accelerator: str = "cpu") -> GroupTarget:
    d = version_dir or models[fmt]
    return GroupTarget(
        f"g-{fmt}", fmt, accelerator, "auto", "run", Manifest.read(d).version, (), d, models["bf16"], None
    )


def test_one_table_covers_every_format_and_field() -> None:
    assert set(table()) == set(FORMATS)
    assert set(RATIONALE) == {f.name for f in dataclasses.fields(Bounds)}
    for fmt in FORMATS:
        b = bounds(fmt)
        assert 0 < b.weight_rel_err <= b.qdq_rel_err and 0 < b.support_min < 1 and 0 < b.route_agree_min < 1


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_clean_conversion_passes_levels_1_and_2(models, fmt) -> None:
    one = contract.check(_target(models, fmt))
    assert one.ok, one.failures
    assert any("does not run natively on cpu" in n for n in one.notes)
    two = converter.check(_target(models, fmt))
    assert two.ok, two.failures
    worst = two.details["worst"]["rel_err"]
    assert 0.01 < worst <= bounds(fmt).weight_rel_err


def test_contract_states_the_allowed_staleness(models) -> None:
    bounded = contract.check(dataclasses.replace(_target(models, "fp8"), staleness=2))
    assert bounded.details["allowed_staleness"] == 2
    assert not any("staleness" in n for n in bounded.notes)
    unbounded = contract.check(_target(models, "fp8"))
    assert any("allowed staleness: unbounded" in n for n in unbounded.notes)


def test_native_formats() -> None:
    assert contract.native("nvfp4", "B200") and not contract.native("nvfp4", "H100!")
    assert contract.native("fp8", "H100!") and not contract.native("fp8", "A100-80GB")
    assert contract.native("bf16", "cpu")


def test_contract_names_a_format_the_checkpoint_does_not_declare(models) -> None:
    t = dataclasses.replace(_target(models, "nvfp4"), format="fp8")
    res = contract.check(t)
    assert not res.ok
    assert any("manifest format nvfp4 != the group's fp8" in f for f in res.failures)
    assert any("config.json declares nvfp4" in f for f in res.failures)


def test_level_2_names_a_corrupted_scale_and_swapped_codes(models, tmp_path) -> None:
    bad = tmp_path / "nvfp4"
    shutil.copytree(models["nvfp4"], bad)  # level 2 reads tensors, not the manifest's digests
    shard = bad / "model.safetensors"
    t = load_file(str(shard))
    scale = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    t[scale] = (t[scale].float() * 2).to(torch.float8_e4m3fn)
    a, b = "model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"
    t[a], t[b] = t[b], t[a]
    save_file(t, str(shard))
    res = converter.check(_target(models, "nvfp4", bad))
    assert not res.ok
    text = "\n".join(res.failures)
    assert f"tensor {scale} (scales)" in text
    assert f"tensor {a} (packed codes)" in text and f"tensor {b} (packed codes)" in text
    assert "model.layers.0.mlp.experts.1.up_proj: reconstructed weight relative error" in text
    assert res.details["differing"] == {"scales": 1, "packed codes": 2}


def test_level_2_needs_the_bf16_weights(models) -> None:
    res = converter.check(dataclasses.replace(_target(models, "fp8"), bf16_dir=None))
    assert not res.ok and "BF16 weights of version 1" in res.summary and "pass --checkpoint" in res.summary


def test_read_prompts(tmp_path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text('[1, 2, 3]\n\n{"input_ids": [4, 5]}\n')
    assert read_prompts(p) == [(1, 2, 3), (4, 5)]
    for text, why in (("[1, -2]", "line 1: expected"), ("{oops", "line 1: not JSON"), ("\n", "no prompts")):
        p.write_text(text)
        with pytest.raises(UserError, match=why):
            read_prompts(p)
    with pytest.raises(UserError, match="No such file"):
        read_prompts(tmp_path / "missing.jsonl")


def test_fixed_prefix_k3_is_not_negative_when_the_scores_agree_but_for_rounding() -> None:
    """Level 4's mean k3 over sampled tokens whose group log-prob differs from the reference's by
    d = 2e-12, -3e-12, -1e-10 (e^d - 1 - d in doubles: about -4e-17 each) is e^d - 1 - d
    (d^2 / 2 + d^3 / 6 to float64 precision), never negative."""
    ds = torch.tensor([2e-12, -3e-12, -1e-10], dtype=torch.float64)
    seq = (0, 1, 2, 3)
    logp = torch.log_softmax(
        torch.tensor([[0.5, 1.0, 0.0, 0.1], [0.0, 0.3, 2.0, 0.4], [1.0, 0.0, 0.2, 0.7]], dtype=torch.float64),
        1,
    )
    ref = Forward(logp, {})
    group = logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0] - ds  # d = ref - group
    fp = FixedPrefix((seq,), (1,), (), {"r0": [group]}, (ref,))
    got = measure(fp, top_p=1.0)["r0"]["k3_mean"]
    d = (logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0] - group).tolist()
    want = sum(x * x / 2 + x**3 / 6 for x in d) / 3
    assert got >= 0.0 and math.isclose(got, want, rel_tol=1e-3), (got, want)

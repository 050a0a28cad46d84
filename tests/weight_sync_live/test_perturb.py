"""The verify perturbation is exact in every format: swapping two lm_head rows swaps exactly
those two tokens' log-probs (the engine's own forward on converted checkpoints)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from core.errors import UserError
from weight_sync.convert import convert_checkpoint
from weight_sync.perturb import swap_output_rows

T, S = 140, 150
PREFIX = [72, 101, 108, 108, 111, 44, 32]


def test_swap_changes_only_the_two_rows(tmp_path, tiny_base) -> None:
    out = tmp_path / "swapped"
    assert swap_output_rows(tiny_base, out, T, S) == "lm_head.weight"
    before = load_file(str(tiny_base / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    for name, w in before.items():
        if name != "lm_head.weight":
            assert torch.equal(w, after[name]), name
    w, v = before["lm_head.weight"], after["lm_head.weight"]
    assert torch.equal(v[T], w[S]) and torch.equal(v[S], w[T])
    keep = [i for i in range(w.shape[0]) if i not in (T, S)]
    assert torch.equal(v[keep], w[keep])
    with pytest.raises(UserError, match="two different token ids"):
        swap_output_rows(tiny_base, tmp_path / "bad", T, 10**6)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])  # bf16: covered end to end by verify
def test_logprob_effect_is_known_in_every_format(tmp_path, tiny_base, fmt) -> None:
    from engine.model.model import load_model

    swapped = tmp_path / "swapped"
    swap_output_rows(tiny_base, swapped, T, S)
    logp = {}
    for name, src in (("before", tiny_base), ("after", swapped)):
        dst = tmp_path / f"{name}-{fmt}"
        convert_checkpoint(src, dst, fmt, workers=1)
        model = load_model(str(dst))
        (logits,) = model.forward([torch.tensor(PREFIX)], [model.new_sequence()])
        logp[name] = torch.log_softmax(logits[-1].double(), dim=-1)
    before, after = logp["before"], logp["after"]
    assert abs(after[T] - before[S]) < 1e-5 and abs(after[S] - before[T]) < 1e-5
    others = [i for i in range(before.numel()) if i not in (T, S)]
    assert torch.allclose(after[others], before[others], atol=1e-5, rtol=0)
    assert abs(before[S] - before[T]) > 0.1  # the swap is visible

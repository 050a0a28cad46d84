"""NVFP4 activation quantization (``engine.model.act_nvfp4``) byte for byte against the
independent scalar restatement in ``nvfp4_reference``: ties, saturation, underflow, zeros, every
bfloat16 value."""

from __future__ import annotations

import pytest
import torch

from engine.model import act_nvfp4
from tests.engine_model import nvfp4_reference


def _check(x: torch.Tensor, input_scale: float) -> None:
    values, scales = act_nvfp4.quantize(x, input_scale)
    ref_values, ref_scales = nvfp4_reference.quantize(x, input_scale)
    assert torch.equal(scales.view(torch.uint8), ref_scales)  # byte for byte
    assert torch.equal(values, ref_values)  # element values (+0 and -0 are one E2M1 value)
    # The fused round trip is those values times their block scale and input_scale, bit for bit.
    qdq, want = act_nvfp4.qdq(x, input_scale), nvfp4_reference.qdq(x, input_scale)
    assert torch.equal(qdq.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("input_scale", [1.0, 0.0123, 3.7e-4, 2.0**-12])
def test_matches_reference_on_mixed_ranges(input_scale: float) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 256, generator=g) * torch.logspace(-5, 2, 256)  # blocks of very different ranges
    x[3] = 0.0  # an all-zero token: scale 0, values 0
    x[5, :16] = -0.0
    _check(x, input_scale)


def test_rounding_ties_go_to_even() -> None:
    # input_scale 1 and a block amax of 6: sf = 6 * float32(1/6) rounds to 1.0, so the codes see
    # the values themselves; the ties sit exactly between two E2M1 values.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    row = torch.tensor(ties + [-t for t in ties])
    row[7] = 6.0
    x = torch.stack([row, row.flip(0)])
    values, scales = act_nvfp4.quantize(x, 1.0)
    assert torch.equal(scales.view(torch.uint8), torch.full((2, 1), 0x38, dtype=torch.uint8))  # 1.0
    even = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    assert torch.equal(values[0], torch.cat([even, -even]))
    _check(x, 1.0)


def test_saturation_and_underflow() -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(8, 64, generator=g)
    # A scale far below the data's range: every block scale saturates at 448 and large values clip.
    values, scales = act_nvfp4.quantize(x, 1e-6)
    assert torch.equal(scales.view(torch.uint8), torch.full((8, 4), 0x7E, dtype=torch.uint8))  # 448
    assert values.abs().max() == 6.0
    _check(x, 1e-6)
    # A scale far above it: block scales in the e4m3 subnormal range, then zero.
    for input_scale in (30.0, 1e4):
        _check(x, input_scale)
    assert torch.equal(act_nvfp4.qdq(x, 1e4), torch.zeros_like(x))


def test_every_bfloat16_value() -> None:
    every = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every.reshape(-1, 256)
    every = every[every.isfinite().all(1)]
    every = every[(every.abs() < 1e30).all(1)]  # keep gs * amax finite
    _check(every[::7], 1.0)
    _check(every[3::11], 2.0**-20)


def test_shapes_and_bad_input() -> None:
    x = torch.randn(2, 3, 32)
    assert act_nvfp4.qdq(x, 0.01).shape == (2, 3, 32)
    values, scales = act_nvfp4.quantize(x, 0.01)
    assert values.shape == (2, 3, 32) and scales.shape == (2, 3, 2) and scales.dtype == torch.float8_e4m3fn
    assert act_nvfp4.qdq(torch.empty(0, 32), 0.01).shape == (0, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        act_nvfp4.qdq(torch.randn(2, 40), 0.01)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="input_scale"):
            act_nvfp4.qdq(x, bad)


def test_a_nan_poisons_its_block_only() -> None:
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(9))
    x[1, 20] = float("nan")
    out = act_nvfp4.qdq(x, 0.01)
    assert out[1, 16:32].isnan().all() and not out[1, :16].isnan().any() and not out[1, 32:].isnan().any()
    assert torch.equal(out[0], act_nvfp4.qdq(x[:1], 0.01)[0]) and torch.equal(
        out[1, :16], act_nvfp4.qdq(x[1:, :16], 0.01)[0]
    )

"""mxfp4 (OCP MX, torchao FLOOR rule, gpt-oss layout) against the scalar reference, byte for byte."""

from __future__ import annotations

import math

import pytest
import torch

from tests.formats import cases
from tests.formats import reference as ref
from weight_sync.formats import mxfp4


def _assert_matches_reference(w: torch.Tensor) -> dict[str, torch.Tensor]:
    d = mxfp4.quantize(w)
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    assert d["blocks"].dtype == torch.uint8 and tuple(d["blocks"].shape) == (*lead, k // 32, 16)
    assert d["scales"].dtype == torch.uint8 and tuple(d["scales"].shape) == (*lead, k // 32)
    r = ref.mxfp4(w)
    assert d["scales"].reshape(-1).tolist() == r["scales"]
    assert d["blocks"].reshape(-1).tolist() == r["blocks"]
    return d


@pytest.mark.parametrize(
    ("shape", "dtype", "seed"),
    [
        ((16, 128), torch.bfloat16, 0),
        ((5, 96), torch.bfloat16, 1),
        ((1, 32), torch.bfloat16, 2),
        ((2, 4, 64), torch.bfloat16, 3),  # stacked experts
        ((8, 64), torch.float16, 4),
        ((8, 64), torch.float32, 5),
    ],
)
def test_random_weights_match_reference(shape, dtype, seed):
    _assert_matches_reference(cases.weights(shape, dtype, seed))


def test_planted_ties_signed_zero_and_saturation():
    w = torch.zeros(3, 32, dtype=torch.bfloat16)
    # amax 4 (or 5): e = floor(log2 amax) - 2 = 0, so each code is the E2M1 rounding of x itself.
    w[0, :16] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -0.25, -0.75, -1.25, -1.75, -2.5,
                              -3.5, -0.0, 0.0, -0.1])  # fmt: skip
    w[1, :4] = torch.tensor([5.0, -5.0, 7.5, -7.0])  # 5 ties down to 4; 7.5 and 7 saturate at 6
    d = _assert_matches_reference(w)
    assert d["scales"][:2, 0].tolist() == [127, 127]
    codes = [c for b in d["blocks"][0, 0, :8].tolist() for c in (b & 0xF, b >> 4)]
    assert codes == [6, 0, 2, 2, 4, 4, 6, 8, 10, 10, 12, 12, 14, 8, 0, 8]  # -0.0 -> 0x8
    assert [c for b in d["blocks"][1, 0, :2].tolist() for c in (b & 0xF, b >> 4)] == [6, 14, 7, 15]
    assert d["scales"][2, 0].item() == 0 and d["blocks"][2].eq(0).all()  # all-zero block: byte 0


def test_tiny_and_huge_blocks():
    w = torch.zeros(4, 64, dtype=torch.bfloat16)
    # amax 2**-125: e = -127, the clamp floor (byte 0); x * 2**127 is exact, 2**-125 -> 4.0
    w[0, :4] = torch.tensor([2.0**-125, 2.0**-128, -(2.0**-127), 3 * 2.0**-129])
    w[1, :2] = torch.tensor([1e-39, -3e-40])  # subnormal amax: below the clamp floor
    w[2, :3] = torch.tensor([3e38, -1.0, 2.0**120])  # e = 125, byte 252
    w[3, 32:34] = torch.tensor([2.0**-126, 2.0**-127])  # amax 2**-126: e = -128 -> clamped to -127
    d = _assert_matches_reference(w)
    assert d["scales"][:, 0].tolist() == [0, 0, 252, 0] and d["scales"][3, 1].item() == 0
    first = [c for b in d["blocks"][0, 0, :2].tolist() for c in (b & 0xF, b >> 4)]
    assert first == [6, 1, 10, 2]  # 4, 0.5, -1, 0.75 -> 1 (tie to even code 2)
    assert d["blocks"][3, 1, 0].item() == 0x4 | 0x2 << 4  # 2**-126 -> 2.0, 2**-127 -> 1.0
    assert mxfp4.dequantize(d)[0, :4].tolist() == [2.0**-125, 2.0**-128, -(2.0**-127), 2.0**-127]


def test_dequantize_is_exact_power_of_two_scaling():
    w = cases.weights((6, 128), torch.bfloat16, seed=6)
    d = mxfp4.quantize(w)
    out = mxfp4.dequantize(d)
    assert out.dtype == torch.float32 and tuple(out.shape) == (6, 128)
    scales = d["scales"].reshape(-1).tolist()
    codes = [c for b in d["blocks"].reshape(-1).tolist() for c in (b & 0xF, b >> 4)]
    want = [ref.e2m1_value(c) * 2.0 ** (scales[i // 32] - 127) for i, c in enumerate(codes)]
    assert out.reshape(-1).tolist() == want


def test_dequantize_special_scale_bytes():
    blocks = torch.full((3, 16), 0x21, dtype=torch.uint8)  # codes 1 (0.5) and 2 (1.0)
    out = mxfp4.dequantize({"blocks": blocks, "scales": torch.tensor([0, 254, 255], dtype=torch.uint8)})
    assert tuple(out.shape) == (96,)
    out = out.view(3, 32)
    assert out[0, :2].tolist() == [2.0**-128, 2.0**-127]
    assert out[1, :2].tolist() == [2.0**126, 2.0**127]
    assert all(math.isnan(v) for v in out[2].tolist())


def test_bad_inputs_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match=r"\(3, 48\).*32"):
        mxfp4.quantize(torch.ones(3, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\(\).*32"):
        mxfp4.quantize(torch.tensor(1.0, dtype=torch.bfloat16))
    for bad in (float("nan"), float("-inf")):
        w = torch.ones(2, 32, dtype=torch.bfloat16)
        w[0, 7] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            mxfp4.quantize(w)
    d = mxfp4.quantize(torch.ones(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize({"blocks": d["blocks"], "scales": d["scales"][:, :1]})
    with pytest.raises(ValueError, match=r"\[\.\.\., K/32, 16\]"):
        mxfp4.dequantize({"blocks": d["blocks"][..., :8], "scales": d["scales"]})
    with pytest.raises(ValueError, match="missing"):
        mxfp4.dequantize({"blocks": d["blocks"]})

"""fp8 (128x128 block, DeepSeek-V3 rule) against the scalar reference, byte for byte."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.formats import cases
from tests.formats import reference as ref
from weight_sync.formats import fp8


def _assert_matches_reference(w: torch.Tensor) -> dict[str, torch.Tensor]:
    d = fp8.quantize(w)
    n, k = w.shape
    assert d["weight"].dtype == torch.float8_e4m3fn and tuple(d["weight"].shape) == (n, k)
    assert d["weight_scale_inv"].dtype == torch.float32
    assert tuple(d["weight_scale_inv"].shape) == (math.ceil(n / 128), math.ceil(k / 128))
    codes, scales = ref.fp8(w)
    assert d["weight_scale_inv"].tolist() == scales
    assert d["weight"].view(torch.uint8).tolist() == codes
    return d


@pytest.mark.parametrize(
    ("shape", "dtype", "seed"),
    [
        ((130, 260), torch.bfloat16, 0),  # edge blocks in both dimensions
        ((256, 128), torch.bfloat16, 1),
        ((1, 1), torch.bfloat16, 2),
        ((129, 1), torch.bfloat16, 3),
        ((5, 300), torch.bfloat16, 4),
        ((70, 200), torch.float16, 5),
        ((70, 200), torch.float32, 6),
    ],
)
def test_random_weights_match_reference(shape, dtype, seed):
    _assert_matches_reference(cases.weights(shape, dtype, seed))


def test_planted_ties_saturation_and_signed_zero():
    # amax 448 makes s exactly 1.0, so each code is the e4m3 rounding of x itself.
    vals = [448.0, -448.0, 1.0625, -1.0625, 1.1875, -1.1875, 432.0, 400.0, -432.0,
            2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, -(2.0**-10), 0.0, -0.0, 2.0**-9]  # fmt: skip
    w = torch.zeros(3, 140, dtype=torch.bfloat16)
    w[1, : len(vals)] = torch.tensor(vals)
    d = _assert_matches_reference(w)
    row = d["weight"].view(torch.uint8)[1, : len(vals)].tolist()
    assert d["weight_scale_inv"][0, 0].item() == 1.0
    assert row[:6] == [0x7E, 0xFE, 0x38, 0xB8, 0x3A, 0xBA]
    assert row[6:9] == [0x7E, 0x7C, 0xFE]  # 432 ties up to 448 (even), 400 ties down to 384
    assert row[9:16] == [0x00, 0x02, 0x02, 0x80, 0x00, 0x80, 0x01]


def test_zero_tiny_and_huge_blocks():
    w = torch.zeros(256, 384, dtype=torch.bfloat16)
    w[0:128, 128:256] = 1e-38  # tiny block: amax floored at 1e-4
    w[0, 130] = -3e-39  # bf16 subnormal
    w[128:256, 0:128] = 3e38  # huge block
    w[200, 5] = -3.3e38
    w[130:140, 300:310] = 5e-5  # below the floor: codes land in e4m3's normal range below 448
    d = _assert_matches_reference(w)
    floor_scale = ref.f32(ref.FP8_AMAX_FLOOR / 448.0)
    assert d["weight_scale_inv"][0, 0].item() == floor_scale  # all-zero block
    assert d["weight_scale_inv"][0, 1].item() == floor_scale
    assert not d["weight"].view(torch.uint8)[0:128, 0:128].any()  # zeros -> code 0
    assert d["weight_scale_inv"][1, 0].item() == ref.f32(ref.values_of(w[200, 5:6])[0] * -1 / 448.0)


def test_codes_equal_torch_cast_of_numpy_quotients():
    """Independent route: numpy float32 division, torch's own e4m3 cast."""
    w = cases.weights((384, 520), torch.bfloat16, seed=7)
    d = fp8.quantize(w)
    x = w.float().numpy()
    n, k = x.shape
    s = np.empty((3, 5), dtype=np.float32)
    for bi in range(3):
        for bj in range(5):
            blk = x[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            s[bi, bj] = np.float32(max(np.abs(blk).max(), np.float32(1e-4))) / np.float32(448.0)
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]
    q = np.clip(x / full, np.float32(-448), np.float32(448))
    want = torch.from_numpy(q).to(torch.float8_e4m3fn)
    assert np.array_equal(d["weight_scale_inv"].numpy(), s)
    assert torch.equal(d["weight"].view(torch.uint8), want.view(torch.uint8))


def test_dequantize_is_code_times_block_scale():
    w = cases.weights((200, 300), torch.bfloat16, seed=8)
    d = fp8.quantize(w)
    out = fp8.dequantize(d)
    assert out.dtype == torch.float32 and tuple(out.shape) == (200, 300)
    codes = d["weight"].view(torch.uint8).tolist()
    s = d["weight_scale_inv"].tolist()
    want = [
        [ref.f32(ref.e4m3_value(codes[r][c]) * s[r // 128][c // 128]) for c in range(300)] for r in range(200)
    ]
    assert out.tolist() == want


def test_dequantize_hand_values():
    weight = torch.tensor([[0x38, 0xC0, 0x01, 0x7E]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = fp8.dequantize({"weight": weight, "weight_scale_inv": torch.tensor([[0.5]])})
    assert out.tolist() == [[0.5, -1.0, 2.0**-10, 224.0]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(bad):
    w = torch.ones(4, 4, dtype=torch.bfloat16)
    w[2, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8.quantize(w)


def test_bad_inputs_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match=r"2-D .*\(2, 3, 4\)"):
        fp8.quantize(torch.ones(2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float64"):
        fp8.quantize(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="torch.Tensor"):
        fp8.quantize([[1.0]])
    good = fp8.quantize(torch.ones(130, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8.dequantize({"weight": good["weight"], "weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.dequantize({"weight": torch.ones(2, 2), "weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match="missing"):
        fp8.dequantize({"weight": good["weight"]})


def test_empty_weight():
    d = fp8.quantize(torch.ones(0, 5, dtype=torch.bfloat16))
    assert tuple(d["weight"].shape) == (0, 5) and tuple(d["weight_scale_inv"].shape) == (0, 1)

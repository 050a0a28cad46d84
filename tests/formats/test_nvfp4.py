"""nvfp4 (ModelOpt NVFP4) against the scalar reference, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.formats import cases
from tests.formats import reference as ref
from weight_sync.formats import nvfp4


def _assert_matches_reference(w: torch.Tensor, ws2=None) -> dict[str, torch.Tensor]:
    d = nvfp4.quantize(w) if ws2 is None else nvfp4.quantize(w, weight_scale_2=ws2)
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    assert d["weight"].dtype == torch.uint8 and tuple(d["weight"].shape) == (*lead, k // 2)
    assert d["weight_scale"].dtype == torch.float8_e4m3fn
    assert tuple(d["weight_scale"].shape) == (*lead, k // 16)
    assert d["weight_scale_2"].dtype == torch.float32 and d["weight_scale_2"].dim() == 0
    assert d["input_scale"].dtype == torch.float32 and d["input_scale"].dim() == 0
    assert d["input_scale"].item() == 1.0
    r = ref.nvfp4(w, None if ws2 is None else float(ws2))
    assert d["weight_scale_2"].item() == r["weight_scale_2"]
    assert d["weight_scale"].view(torch.uint8).reshape(-1).tolist() == r["weight_scale"]
    assert d["weight"].reshape(-1).tolist() == r["weight"]
    return d


@pytest.mark.parametrize(
    ("shape", "dtype", "seed"),
    [
        ((24, 64), torch.bfloat16, 0),
        ((7, 160), torch.bfloat16, 1),
        ((1, 16), torch.bfloat16, 2),
        ((3, 2, 48), torch.bfloat16, 3),
        ((16, 64), torch.float16, 4),
        ((16, 64), torch.float32, 5),
    ],
)
def test_random_weights_match_reference(shape, dtype, seed):
    _assert_matches_reference(cases.weights(shape, dtype, seed))


def test_moderate_weights_match_reference():
    """Typical weights (no planted extremes), where every scale is a normal e4m3 number."""
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(9)) * 0.02).to(torch.bfloat16)
    _assert_matches_reference(w)


def test_planted_ties_signed_zero_and_saturation():
    # Global amax 2688 = 6 * 448 gives weight_scale_2 = 1.0; a group with amax 6 gets scale 1.0,
    # so each code is the E2M1 rounding of x itself.
    w = torch.zeros(4, 32, dtype=torch.bfloat16)
    w[0, 0] = 2688.0
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
    w[1, :16] = torch.tensor(ties)
    # 6.375 / 6 = 1.0625 ties down to scale 1.0, so 6.375 saturates
    w[2, :16] = torch.tensor([6.375, -6.375, 0.1, -0.1] + [0.0] * 12)
    d = _assert_matches_reference(w)
    assert d["weight_scale_2"].item() == 1.0
    assert d["weight_scale"].float()[1, 0].item() == 1.0 and d["weight_scale"].float()[2, 0].item() == 1.0
    codes = [b & 0xF for b in d["weight"][1, :8].tolist() for b in (b, b >> 4)]
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]  # -0.0 -> 0x0
    assert d["weight"][2, :2].tolist() == [0x7 | 0xF << 4, 0x0 | 0x8 << 4]  # saturation; -0.1 -> sign only


def test_zero_groups_tiny_groups_and_huge_range():
    w = torch.zeros(6, 64, dtype=torch.bfloat16)
    w[0, 0] = 3e38  # weight_scale_2 ~ 1.1e35
    w[1, :16] = 1e-12  # amax_g / (6 * ws2) underflows to 0: scale becomes 1.0 (ModelOpt)
    w[1, 1] = -1e-12  # x / ws2 underflows to -0.0: no sign bit (ModelOpt: q < 0 is false)
    w[2, 16:32] = 1e30  # scale clamped up to 2**-9
    w[3, :] = -0.0
    w[4, 5] = -2e-39  # bf16 subnormal
    d = _assert_matches_reference(w)
    assert d["weight_scale"].float()[1, 0].item() == 1.0
    assert d["weight_scale"].float()[2, 1].item() == 2.0**-9
    assert d["weight_scale"].float()[0, 1].item() == 1.0  # all-zero group
    assert not d["weight"][3].any()  # -0.0 -> 0x0


def test_all_zero_tensor_is_well_defined():
    w = torch.zeros(2, 32, dtype=torch.bfloat16)
    w[1, 3] = -0.0
    d = _assert_matches_reference(w)
    assert d["weight_scale_2"].item() == 0.0
    assert d["weight_scale"].float().eq(1.0).all() and not d["weight"].any()
    assert not nvfp4.dequantize(d).any()


def test_tiny_tensor_subnormal_scales():
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 1e-38).to(torch.bfloat16)
    _assert_matches_reference(w)


def test_global_scale_is_joint_amax_and_shared_scale_matches_reference():
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(32, 64, generator=g) * 0.02).to(torch.bfloat16)
    k = (torch.randn(16, 64, generator=g) * 0.5).to(torch.bfloat16)
    v = (torch.randn(16, 64, generator=g) * 0.1).to(torch.bfloat16)
    gs = nvfp4.global_scale(q, k, v)
    joint = max(abs(x) for t in (q, k, v) for x in ref.values_of(t))
    assert gs.dtype == torch.float32 and gs.dim() == 0
    assert gs.item() == ref.f32(joint / 2688.0)
    for t in (q, k, v):
        d = _assert_matches_reference(t, gs)
        assert d["weight_scale_2"].item() == gs.item()
    assert nvfp4.global_scale(k).item() == nvfp4.quantize(k)["weight_scale_2"].item()


def test_scales_equal_torch_cast_of_numpy_quotients():
    """Independent route for the group scales: numpy float32 arithmetic, torch's e4m3 cast."""
    w = cases.weights((64, 256), torch.bfloat16, seed=12, specials=False)
    d = nvfp4.quantize(w)
    x = w.float().numpy().reshape(-1, 16)
    amax_g = np.abs(x).max(axis=1)
    ws2 = np.float32(np.abs(x).max()) / np.float32(2688.0)
    s = amax_g / (np.float32(6.0) * ws2)
    s[s == 0] = 1.0
    s = np.maximum(s, np.float32(2.0**-9))
    want = torch.from_numpy(s).to(torch.float8_e4m3fn).view(torch.uint8)
    assert d["weight_scale_2"].item() == float(ws2)
    assert torch.equal(d["weight_scale"].view(torch.uint8).reshape(-1), want)


def test_dequantize_matches_modelopt_order():
    w = cases.weights((8, 64), torch.bfloat16, seed=13)
    d = nvfp4.quantize(w)
    out = nvfp4.dequantize(d)
    assert out.dtype == torch.float32 and tuple(out.shape) == (8, 64)
    ws2 = d["weight_scale_2"].item()
    scales = [ref.e4m3_value(b) for b in d["weight_scale"].view(torch.uint8).reshape(-1).tolist()]
    packed = d["weight"].reshape(-1).tolist()
    codes = [c for b in packed for c in (b & 0xF, b >> 4)]
    want = [ref.f32(ref.e2m1_value(c) * ref.f32(scales[i // 16] * ws2)) for i, c in enumerate(codes)]
    assert out.reshape(-1).tolist() == want


def test_dequantize_hand_values():
    d = {
        "weight": torch.tensor([[0x71, 0xF8] + [0] * 6], dtype=torch.uint8),
        "weight_scale": torch.tensor([[2.0]]).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(0.5),
        "input_scale": torch.tensor(1.0),
    }
    out = nvfp4.dequantize(d)
    assert out[0, :4].tolist() == [0.5, 6.0, -0.0, -6.0]


def test_bad_inputs_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match=r"\(4, 20\).*16"):
        nvfp4.quantize(torch.ones(4, 20, dtype=torch.bfloat16))
    for bad in (float("nan"), float("inf")):
        w = torch.ones(2, 16, dtype=torch.bfloat16)
        w[1, 1] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            nvfp4.quantize(w)
        with pytest.raises(ValueError, match="NaN or Inf"):
            nvfp4.global_scale(w)
    w = torch.ones(2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="smaller than amax"):
        nvfp4.quantize(w, weight_scale_2=torch.tensor(1.0 / 2689))
    with pytest.raises(ValueError, match="finite non-negative"):
        nvfp4.quantize(w, weight_scale_2=-1.0)
    with pytest.raises(ValueError, match="finite non-negative"):
        nvfp4.quantize(w, weight_scale_2=torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="one-element"):
        nvfp4.quantize(w, weight_scale_2=torch.ones(2))
    with pytest.raises(ValueError, match="int64"):
        nvfp4.quantize(torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least one"):
        nvfp4.global_scale()
    d = nvfp4.quantize(w)
    with pytest.raises(ValueError, match="does not match"):
        nvfp4.dequantize({**d, "weight_scale": d["weight_scale"][:, :0]})
    with pytest.raises(ValueError, match="missing"):
        nvfp4.dequantize({"weight": d["weight"]})


def test_input_scale_is_modelopt_activation_scaling_factor() -> None:
    """``amax.float() / (6 * 448)`` (ModelOpt ``NVFP4QTensor.get_activation_scaling_factor``), one
    float32 division, for amaxes across the float32 range; 0 gives 1.0; bad amaxes are refused."""
    g = torch.Generator().manual_seed(11)
    amaxes = torch.cat([torch.rand(500, generator=g) * 10.0 ** torch.randint(-30, 30, (500,), generator=g),
                        torch.tensor([1.0, 2688.0, 3.0e38, 1e-45])])  # fmt: skip
    for a in amaxes.tolist():
        want = torch.tensor(a, dtype=torch.float32) / 2688.0
        got = nvfp4.input_scale(a)
        assert isinstance(got, np.float32) and float(got) == want.item(), a
    assert nvfp4.input_scale(0.0) == np.float32(1.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="amax"):
            nvfp4.input_scale(bad)

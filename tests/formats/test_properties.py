"""Property tests: dequantize(quantize(x)) stays within the format's rounding bound; scale rules hold."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tests.formats import reference as ref
from weight_sync.formats import fp4, fp8, mxfp4, nvfp4

SETTINGS = settings(max_examples=60, deadline=None)
MAGNITUDES = [1e-38, 1e-20, 1e-6, 1e-2, 1.0, 1e3, 1e20, 1e35]


@st.composite
def weights(draw, k_unit: int, max_k_units: int, max_rows: int = 6) -> torch.Tensor:
    rows = draw(st.integers(1, max_rows))
    cols = k_unit * draw(st.integers(1, max_k_units))
    base = draw(arrays(np.float32, (rows, cols), elements=st.floats(-1000, 1000, width=32)))
    scale = draw(st.sampled_from(MAGNITUDES))
    return torch.from_numpy(base.astype(np.float64) * scale).to(torch.bfloat16)


def _half_step(a: np.ndarray) -> np.ndarray:
    """Largest E2M1 rounding error for a scaled magnitude ``a`` (saturation above 6 included)."""
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, np.maximum(1.0, a - 6.0)))


@st.composite
def large_weights(draw) -> torch.Tensor:
    """Up to 140 x 260 (edge blocks both ways): Gaussian rows of drawn magnitudes, drawn values planted."""
    rows, cols = draw(st.integers(1, 140)), draw(st.integers(1, 260))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    spread = draw(st.floats(0.0, 8.0))
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * draw(st.sampled_from(MAGNITUDES))
    x *= torch.exp(torch.randn(rows, 1, generator=g, dtype=torch.float64) * spread)
    planted = draw(st.lists(st.floats(-3e38, 3e38, allow_nan=False, allow_infinity=False), max_size=8))
    for v in planted:
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] = v
    return x.clamp(-3e38, 3e38).to(torch.bfloat16)


@SETTINGS
@given(large_weights())
def test_fp8_round_trip_within_half_an_e4m3_step(w):
    d = fp8.quantize(w)
    x = w.double().numpy()
    n, k = x.shape
    s = d["weight_scale_inv"].double().numpy()
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            amax = np.abs(x[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]).max()
            assert s[bi, bj] == ref.f32(max(amax, ref.FP8_AMAX_FLOOR) / 448.0)
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]
    err = np.abs(fp8.dequantize(d).double().numpy() - x)
    bound = np.maximum(np.abs(x) * 2.0**-4, full * 2.0**-10) * (1 + 2.0**-20) + np.abs(x) * 2.0**-22
    assert (err <= bound).all()


@SETTINGS
@given(weights(k_unit=16, max_k_units=8))
def test_nvfp4_round_trip_within_half_an_e2m1_step_of_the_group_scale(w):
    d = nvfp4.quantize(w)
    x = w.double().numpy().reshape(-1, 16)
    ws2 = d["weight_scale_2"].item()
    assert ws2 == ref.f32(np.abs(x).max() / 2688.0)
    s8 = d["weight_scale"].double().numpy().reshape(-1, 1)
    if ws2 > 0:
        ideal = np.abs(x).max(axis=1, keepdims=True) / (6.0 * ws2)
        cap = np.maximum(np.maximum(ideal * (1 + 2.0**-4), ideal + 2.0**-10), 2.0**-9) * (1 + 2.0**-20)
        assert ((s8 <= cap) | ((ideal < 2.0**-140) & (s8 == 1.0))).all()
    dg = np.array([ref.f32(v * ws2) for v in s8.reshape(-1)]).reshape(-1, 1)
    err = np.abs(nvfp4.dequantize(d).double().numpy().reshape(-1, 16) - x)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(dg > 0, np.abs(x) / np.where(dg > 0, dg, 1.0), 0.0)
    bound = dg * _half_step(a) * (1 + 2.0**-20) + np.abs(x) * 2.0**-21 + 2.0**-149
    assert (err <= bound).all()


@SETTINGS
@given(weights(k_unit=32, max_k_units=4))
def test_mxfp4_round_trip_within_half_an_e2m1_step_of_the_block_scale(w):
    d = mxfp4.quantize(w)
    x = w.double().numpy().reshape(-1, 32)
    e = d["scales"].numpy().reshape(-1).astype(np.int64) - 127
    for i, blk in enumerate(x):
        amax = float(np.abs(blk).max())
        want = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
        assert e[i] == want
    p = np.ldexp(1.0, e).reshape(-1, 1)
    err = np.abs(mxfp4.dequantize(d).double().numpy().reshape(-1, 32) - x)
    assert (err <= p * _half_step(np.abs(x) / p)).all()


@SETTINGS
@given(arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 8).map(lambda n: 2 * n)),
              elements=st.integers(0, 15)))  # fmt: skip
def test_pack_unpack_round_trip(codes):
    t = torch.from_numpy(codes)
    assert torch.equal(fp4.unpack(fp4.pack(t)), t)

"""The quantizers against the whole-tensor torch oracle, byte for byte, on inputs too large for the
scalar reference: big random tensors over many magnitudes, every finite bfloat16 bit pattern,
random float32 bit patterns, ragged shapes (so every kernel's partial blocks and batches run)."""

from __future__ import annotations

import pytest
import torch

from tests.formats import cases
from tests.formats import torch_oracle as oracle
from weight_sync.formats import fp4, fp8, mxfp4, nvfp4


def _finite_random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Uniformly random bit patterns of ``dtype`` with the non-finite ones replaced by +-0/1."""
    g = torch.Generator().manual_seed(seed)
    itype, width = (torch.int16, 16) if dtype == torch.bfloat16 else (torch.int32, 32)
    raw = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), shape, generator=g, dtype=torch.int64)
    w = raw.to(itype).view(dtype)
    return torch.where(torch.isfinite(w), w, torch.ones((), dtype=dtype))


def _all_finite_bf16() -> torch.Tensor:
    w = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return w[torch.isfinite(w)]


def _inputs():
    yield "gaussian wide range", cases.weights((384, 2080), torch.bfloat16, seed=41)
    yield "random bf16 bits", _finite_random_bits((300, 1056), torch.bfloat16, seed=42)
    yield "random f32 bits", _finite_random_bits((130, 544), torch.float32, seed=43)
    yield "f16", cases.weights((129, 320), torch.float16, seed=44)
    every = _all_finite_bf16()  # 65280 values
    yield "every finite bf16, in order", every.reshape(68, 960)
    perm = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(45))
    yield "every finite bf16, shuffled", every[perm].reshape(68, 960)


@pytest.mark.parametrize(("name", "w"), list(_inputs()), ids=lambda v: v if isinstance(v, str) else "")
def test_quantizers_match_the_torch_oracle(name, w):
    codes, scales = oracle.fp8(w)
    d = fp8.quantize(w)
    assert torch.equal(d["weight"].view(torch.uint8), codes), name
    assert torch.equal(d["weight_scale_inv"], scales), name

    for ws2 in (None, nvfp4.global_scale(w) * 4):
        want = oracle.nvfp4(w, ws2)
        d = nvfp4.quantize(w, weight_scale_2=ws2)
        assert torch.equal(d["weight"].reshape(-1), want["weight"]), name
        assert torch.equal(d["weight_scale"].view(torch.uint8).reshape(-1), want["weight_scale"]), name

    want = oracle.mxfp4(w)
    d = mxfp4.quantize(w)
    assert torch.equal(d["blocks"].reshape(-1), want["blocks"]), name
    assert torch.equal(d["scales"].reshape(-1), want["scales"]), name


def test_fp8_codes_of_every_bf16_value_up_to_448():
    """With 448 in every block the scale is exactly 1, so each code is the e4m3 rounding of x."""
    v = _all_finite_bf16()
    v = v[v.float().abs() <= 448.0]
    rows = -(-v.numel() // 127)
    body = torch.zeros(rows * 127, dtype=torch.bfloat16)
    body[: v.numel()] = v
    w = torch.cat([body.reshape(rows, 127), torch.full((rows, 1), 448.0, dtype=torch.bfloat16)], dim=1)
    d = fp8.quantize(w)
    assert bool((d["weight_scale_inv"] == 1.0).all())
    assert torch.equal(d["weight"].view(torch.uint8), w.float().to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("negative_zero_sign", [False, True])
def test_e2m1_encode_of_every_bf16_value(negative_zero_sign):
    q = _all_finite_bf16().float()
    sign = torch.signbit(q) if negative_zero_sign else q < 0
    want = oracle.e2m1_magnitude(q.abs()) | torch.where(sign, 8, 0)
    assert torch.equal(fp4.encode(q, negative_zero_sign=negative_zero_sign).long(), want)

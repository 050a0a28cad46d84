"""The engine's dequantizers (engine.model.dequant: 2-D layouts as the loader holds them) equal
weight_sync.formats' dequantizers bit for bit: every code byte, NaN codes and scales, subnormal
scales, edge blocks; bad shapes are refused with a message."""

from __future__ import annotations

import pytest
import torch

from engine.model import dequant
from weight_sync.formats import fp8, mxfp4, nvfp4


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_kind = a.shape == b.shape and a.dtype == b.dtype == torch.float32
    return same_kind and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _bytes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize(("n", "k"), [(256, 512), (130, 200), (1, 128), (128, 1), (0, 128)])
def test_fp8_matches_the_format_module(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    codes = _bytes(gen, n, k).view(torch.float8_e4m3fn)  # every byte, NaN codes included
    nb, kb = -(-n // 128), -(-k // 128)
    scale = torch.randn(nb, kb, generator=gen).abs() * 1e-2
    if scale.numel():
        scale.view(-1)[0] = 2.0**-140  # a subnormal scale
        scale.view(-1)[-1] = float("nan")
    ref = fp8.dequantize({"weight": codes, "weight_scale_inv": scale})
    assert _bits_equal(dequant.fp8(codes, scale), ref)


@pytest.mark.parametrize(("n", "k"), [(64, 512), (3, 32), (0, 16)])
def test_nvfp4_matches_the_format_module(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    packed = _bytes(gen, n, k // 2)
    scale = _bytes(gen, n, k // 16).view(torch.float8_e4m3fn)  # NaN and subnormal scales included
    for ws2 in (torch.tensor(0.0123), torch.tensor([3.5e-39]), torch.tensor(1.0, dtype=torch.bfloat16)):
        ref = nvfp4.dequantize({"weight": packed, "weight_scale": scale, "weight_scale_2": ws2})
        assert _bits_equal(dequant.nvfp4(packed, scale, ws2), ref)


@pytest.mark.parametrize(("n", "k"), [(64, 512), (5, 32), (0, 64)])
def test_mxfp4_matches_the_format_module(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    blocks = _bytes(gen, n, k // 32, 16)
    scales = _bytes(gen, n, k // 32)  # every E8M0 byte: 0 (subnormal), 255 (NaN)
    if scales.numel():
        scales.view(-1)[:2] = torch.tensor([0, 255], dtype=torch.uint8)
    ref = mxfp4.dequantize({"blocks": blocks, "scales": scales}).reshape(n, k)
    assert _bits_equal(dequant.mxfp4(blocks, scales), ref)


def test_bad_shapes_and_dtypes_are_refused() -> None:
    w = torch.zeros(256, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequant.fp8(w, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"expected float32 \[2, 2\]"):
        dequant.fp8(w.view(torch.float8_e4m3fn), torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"expected float8_e4m3fn \[256, 32\]"):
        dequant.nvfp4(w, torch.ones(256, 16).to(torch.float8_e4m3fn), torch.tensor(1.0))
    with pytest.raises(ValueError, match="one float"):
        dequant.nvfp4(w, torch.ones(256, 32).to(torch.float8_e4m3fn), torch.ones(2))
    with pytest.raises(ValueError, match="uint8 \\[N, K/32, 16\\]"):
        dequant.mxfp4(w, torch.zeros(256, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        dequant.mxfp4(w.view(256, 16, 16), torch.zeros(256, 8, dtype=torch.uint8))

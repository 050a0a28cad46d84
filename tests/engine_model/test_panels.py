"""Checkpoint weights packed straight into the kernel's panels (``engine.kernels.panels`` through
``layers.pack_parts``): the stored bfloat16 values and scales reproduce ``weight_sync.formats``'
dequantized weights, and the products equal a float64 reference of ``x @ dequantize(W).T``, for
single and fused (q/k/v-like) weights, aligned or not, and in grouped (expert) calls."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import gemm
from engine.model import layers
from engine.model.loader import LinearWeight
from weight_sync.formats import fp8, mxfp4, nvfp4


def _unpack(p: gemm.PackedBf16) -> torch.Tensor:
    """The float32 ``[n, k]`` that ``p`` stands for: panel values times their scales."""
    w = p.rows().float()
    if p.scales is not None:
        rows = torch.arange(w.shape[0]) // gemm.PANEL
        cols = torch.arange(p.k) // (p.kblock or p.k)
        w = w * p.scales.reshape(-1)[rows[:, None] * p.ldk + cols[None, :]]
    return w


def _quantized(fmt: str, w: torch.Tensor, ws2: float | None = None) -> tuple[LinearWeight, torch.Tensor]:
    """``w`` in ``fmt`` as the loader hands it over, and its dequantized value (the format module's)."""
    n, k = w.shape
    if fmt == "bf16":
        b = w.bfloat16()
        return LinearWeight("bf16", (n, k), (b,)), b.float()
    if fmt == "fp8":
        d = fp8.quantize(w)
        return LinearWeight("fp8", (n, k), (d["weight"], d["weight_scale_inv"])), fp8.dequantize(d)
    if fmt == "nvfp4":
        d = nvfp4.quantize(w, ws2)
        lw = LinearWeight(
            "nvfp4", (n, k), (d["weight"], d["weight_scale"], d["weight_scale_2"], d["input_scale"])
        )
        return lw, nvfp4.dequantize(d)
    d = mxfp4.quantize(w)
    lw = LinearWeight("mxfp4", (n, k), (d["blocks"].reshape(n, k // 2), d["scales"]))
    return lw, mxfp4.dequantize(d)


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows", [[96], [200], [256, 64, 64], [96, 40, 72]])
def test_packed_linear_equals_float64_reference_of_dequantized_weight(fmt: str, rows: list[int]) -> None:
    """Single and fused weights (parts of 32-row multiples or not: unaligned scaled parts fall
    back to the float32 path) multiply like their dequantized, concatenated values."""
    g = torch.Generator().manual_seed(sum(rows) + len(fmt))
    k = 384
    parts, deq = [], []
    for n in rows:
        lw, d = _quantized(fmt, torch.randn(n, k, generator=g) * 0.05, ws2=None)
        parts.append(lw)
        deq.append(d)
    w = torch.cat(deq)
    packed = layers.pack_parts(parts)
    x = torch.randn(13, k, generator=g)
    got = layers.linear(x, packed)
    ref = _ref(x, w)
    # float32 products of K=384 terms of size ~0.05 x 1: a few ulps of the partial sums
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    if isinstance(packed, gemm.PackedBf16):
        if fmt == "nvfp4":
            # the 4-bit codes times E4M3 scales are stored, weight_scale_2 scales the output: the
            # product's rounding differs from dequantize's (code x (scale x ws2)) by <= 1 ulp
            torch.testing.assert_close(_unpack(packed), w, atol=0, rtol=2.0**-23)
        else:
            assert torch.equal(_unpack(packed), w)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_scaled_formats_go_to_the_kernel_with_exact_bf16_values(fmt: str) -> None:
    """FP8 codes and NVFP4 ``code x E4M3 scale`` are stored as exact bfloat16 values, the scales in
    the kernel's table; the NVFP4 values times ``weight_scale_2`` reproduce ``dequantize``, exactly
    wherever the 4-bit value is a power of two (``code x (scale x ws2)`` then rounds once)."""
    g = torch.Generator().manual_seed(7)
    lw, deq = _quantized(fmt, torch.randn(256, 512, generator=g))
    packed = layers.pack_parts([lw])
    assert isinstance(packed, gemm.PackedBf16) and packed.scales is not None
    stored = packed.rows().float()
    if fmt == "fp8":
        assert torch.equal(stored, lw.tensors[0].float())
        assert packed.kblock == 128 and packed.scales.shape == (8, 4)
        assert torch.equal(_unpack(packed), deq)
        return
    codes = torch.stack([lw.tensors[0] & 15, lw.tensors[0] >> 4], dim=-1).reshape(256, 512).long()
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    group_scale = lw.tensors[1].float().repeat_interleave(16, dim=1)
    assert torch.equal(stored, e2m1 * group_scale)  # exact: 2 x 4 significant bits
    ws2 = lw.tensors[2].float()
    assert packed.scales.tolist() == [ws2.item()] and packed.ldk == 0
    scaled = stored * ws2
    pow2 = (e2m1.abs() != 1.5) & (e2m1.abs() != 3) & (e2m1.abs() != 6)
    assert torch.equal(scaled[pow2], deq[pow2])
    torch.testing.assert_close(scaled, deq, atol=0, rtol=2.0**-23)


def test_nvfp4_parts_with_different_global_scales() -> None:
    """Fused NVFP4 parts that do not share ``weight_scale_2`` get one scale per panel."""
    g = torch.Generator().manual_seed(3)
    a, da = _quantized("nvfp4", torch.randn(64, 256, generator=g), ws2=2.0**-7)
    b, db = _quantized("nvfp4", torch.randn(96, 256, generator=g), ws2=3 * 2.0**-8)
    packed = layers.pack_parts([a, b])
    assert isinstance(packed, gemm.PackedBf16) and packed.ldk == 1
    assert packed.scales.tolist() == pytest.approx([2.0**-7] * 2 + [3 * 2.0**-8] * 3)
    x = torch.randn(5, 256, generator=g)
    torch.testing.assert_close(layers.linear(x, packed), _ref(x, torch.cat([da, db])), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_grouped_scaled_experts_equal_one_at_a_time(fmt: str) -> None:
    """Expert weights with scale tables in one grouped call equal the products one at a time, bit for
    bit, and the dequantized reference to float32 rounding."""
    g = torch.Generator().manual_seed(11)
    lws, deq = zip(
        *[_quantized(fmt, torch.randn(128, 256, generator=g) * 0.1) for _ in range(5)], strict=True
    )
    packed = [layers.pack_parts([lw]) for lw in lws]
    group = gemm.PackedGroup.of(packed)
    counts = [4, 0, 9, 1, 6]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    x = torch.randn(sum(counts), 256, generator=g)
    out = gemm.grouped(x, offsets, group, torch.empty(sum(counts), 128))
    spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
    alone = torch.cat([gemm.linear(x[a:b], p) for p, (a, b) in zip(packed, spans, strict=True)])
    assert torch.equal(out, alone)
    ref = torch.cat([_ref(x[a:b], w) for w, (a, b) in zip(deq, spans, strict=True)])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_mixed_scale_layouts_are_refused_by_a_group() -> None:
    g = torch.Generator().manual_seed(5)
    plain = layers.pack_parts([_quantized("bf16", torch.randn(64, 256, generator=g))[0]])
    scaled = layers.pack_parts([_quantized("fp8", torch.randn(64, 256, generator=g))[0]])
    with pytest.raises(ValueError, match="scale layout"):
        gemm.PackedGroup.of([plain, scaled])


def test_scaled_kernel_with_power_of_two_scales_equals_the_unscaled_kernel() -> None:
    """A scale table of 1 or 2 (one K block, per-panel or one for all) gives the unscaled result
    exactly (times 2): the kernel runs the same summation."""
    g = torch.Generator().manual_seed(2)
    p = gemm.pack(torch.randn(96, 200, generator=g).bfloat16())
    x = torch.randn(17, 200, generator=g)
    plain = gemm.linear(x, p)
    one = gemm.PackedBf16(p.weight, p.n, p.k, torch.ones(1))
    two = gemm.PackedBf16(p.weight, p.n, p.k, torch.full((3, 1), 2.0), ldk=1)
    assert torch.equal(gemm.linear(x, one), plain)
    assert torch.equal(gemm.linear(x, two), 2 * plain)
    with pytest.raises(ValueError, match="kblock"):
        gemm.PackedBf16(p.weight, p.n, p.k, torch.ones(1), kblock=96)

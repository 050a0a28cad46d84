"""The bf16-weight GEMM kernel (``engine.kernels.gemm``) against float64 references.

Bound: float32 products summed in float32 err by at most about (terms summed in one chain) x 2^-24
x sum|x_k w_k|; the kernel sums K in chunks of 64 (chains of 64, then one per chunk), so on
these shapes its error is a few such units (2^-24 x sum|x_k w_k|), like a blocked BLAS GEMM's;
the test allows 16 (a plain K-long sequential sum would reach about sqrt(K) ~ 22 units typically
and K worst case).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import gemm, threads
from engine.model.model import load_model
from tests.support.models import make_model_dir


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 512, 768),
        (8, 512, 768),
        (12, 512, 768),
        (13, 384, 512),
        (30, 100, 259),
        (7, 1, 32),
        (25, 129, 40),
        (3, 64, 33),
        (100, 65, 96),
    ],
)
def test_matches_a_float64_product(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g)
    y = gemm.linear(x, gemm.pack(w))
    assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
    ref = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    err = (y.double() - ref).abs()
    assert (err <= 16 * 2.0**-24 * scale).all(), float((err / scale).max() / 2.0**-24)


def test_shapes_and_float_weights_exact_in_bf16() -> None:
    w = torch.randn(40, 24).bfloat16().float()  # float32 holding bfloat16 values
    p = gemm.pack(w)
    assert p.shape == (40, 24) and p.weight.shape == (2, 24, 32) and p.weight.dtype == torch.bfloat16
    assert torch.equal(p.rows(), w.bfloat16())
    x = torch.randn(2, 3, 24)
    y = gemm.linear(x, p)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, x @ w.t(), atol=1e-5, rtol=0)
    assert gemm.linear(torch.empty(0, 24), p).shape == (0, 40)
    strided = torch.randn(24, 5).t()  # non-contiguous rows
    torch.testing.assert_close(gemm.linear(strided, p), strided @ w.t(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="float32"):
        gemm.linear(torch.randn(2, 24, dtype=torch.float64), p)


def test_exact_in_bf16() -> None:
    w = torch.randn(100, 100).bfloat16()
    assert gemm.exact_in_bf16(w) and gemm.exact_in_bf16(w.float())
    late = w.float().clone()
    late[-1, -1] += 2.0**-20  # past the 4096-element head check
    assert not gemm.exact_in_bf16(late)
    assert not gemm.exact_in_bf16(torch.randn(10, 10))


@pytest.mark.parametrize(
    ("fmt", "scaled"), [("bf16", False), ("mxfp4", False), ("fp8", True), ("nvfp4", True)]
)
def test_every_format_uses_the_kernel(model_root: Path, fmt: str, scaled: bool) -> None:
    """BF16 and MXFP4 (2-bit significands times powers of two) weights are exact in bfloat16; FP8
    codes and NVFP4 codes times their E4M3 group scales are too, with the 128x128 block scales
    (FP8) or ``weight_scale_2`` (NVFP4) in the kernel's scale table. All run through the kernel,
    the experts as grouped calls."""
    model = load_model(make_model_dir(model_root, "tiny", fmt))
    layer = model._layers[0]
    weights = [layer.o_proj.weight, *layer.experts.gate_up, *layer.experts.down]
    assert all(isinstance(w, gemm.PackedBf16) and (w.scales is not None) == scaled for w in weights)
    # tiny's q/k/v (N = 64) stay BF16 in fp8, as SGLang's block-FP8 loader refuses them: no scales
    qkv_scaled = scaled and fmt != "fp8"
    qkv = [q.weight for q in layer.qkv]
    assert all(isinstance(w, gemm.PackedBf16) and (w.scales is not None) == qkv_scaled for w in qkv)
    assert layer.experts.groups is not None


def test_writes_into_a_block_of_rows() -> None:
    w = torch.randn(64, 48).bfloat16()
    x = torch.randn(5, 48)
    big = torch.full((9, 64), float("nan"))
    res = gemm.linear(x, gemm.pack(w), out=big[2:7])
    assert res.data_ptr() == big[2:7].data_ptr()
    torch.testing.assert_close(big[2:7], x @ w.float().t(), atol=1e-5, rtol=0)
    assert big[:2].isnan().all() and big[7:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        gemm.linear(x, gemm.pack(w[:40]), out=torch.empty(5, 41))


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_grouped_products_and_thread_splits_are_exact(
    monkeypatch: pytest.MonkeyPatch, n_threads: int
) -> None:
    """Rows sorted by group (empty groups included) times each group's weight equal the products
    one at a time, bit for bit, however the work is split over threads (each output element is
    computed by the same code either way)."""
    g = torch.Generator().manual_seed(n_threads)
    weights = [torch.randn(64, 48, generator=g).bfloat16() for _ in range(6)]
    group = gemm.PackedGroup.of([gemm.pack(w) for w in weights])
    counts = [3, 0, 14, 1, 0, 9]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    x = torch.randn(sum(counts), 48, generator=g)
    alone = torch.cat(
        [
            gemm.linear(x[a:b], gemm.pack(w))
            for w, a, b in zip(weights, offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
        ]
    )
    monkeypatch.setattr(threads, "PARALLEL_MIN_WORK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        out = gemm.grouped(x, offsets, group, torch.empty(sum(counts), 64))
        wide = gemm.pack(torch.randn(200, 48, generator=g).bfloat16())
        split = gemm.linear(x, wide)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, alone)
    assert torch.equal(split, gemm.linear(x, wide))
    ref = torch.cat(
        [
            x[a:b] @ w.float().t()
            for w, a, b in zip(weights, offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
        ]
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

"""Results do not depend on how the quantizers chunk their work (forced tiny chunks, ragged ends)."""

from __future__ import annotations

import pytest
import torch

from tests.formats import cases
from tests.formats import reference as ref
from weight_sync.formats import _common, fp4, fp8, mxfp4, nvfp4


@pytest.mark.parametrize("chunk", [1, 96, 1000])
def test_small_chunks_give_reference_bytes(monkeypatch, chunk):
    monkeypatch.setattr(_common, "CHUNK_ELEMENTS", chunk)
    w = cases.weights((20, 288), torch.bfloat16, seed=21)  # 5760 elements: many chunks, ragged ends
    codes, scales = ref.fp8(w)
    d = fp8.quantize(w)
    assert d["weight"].view(torch.uint8).tolist() == codes and d["weight_scale_inv"].tolist() == scales
    r = ref.nvfp4(w)
    d = nvfp4.quantize(w)
    assert d["weight"].reshape(-1).tolist() == r["weight"]
    assert d["weight_scale"].view(torch.uint8).reshape(-1).tolist() == r["weight_scale"]
    assert nvfp4.global_scale(w).item() == r["weight_scale_2"]
    r = ref.mxfp4(w)
    d = mxfp4.quantize(w)
    assert d["blocks"].reshape(-1).tolist() == r["blocks"] and d["scales"].reshape(-1).tolist() == r["scales"]
    q = torch.linspace(-7, 7, 1001)
    assert fp4.encode(q, negative_zero_sign=True).tolist() == [
        ref.e2m1_magnitude(abs(v)) | (8 if v < 0 else 0) for v in q.tolist()
    ]


def test_large_tensor_default_chunks_match_small_chunks(monkeypatch):
    """A tensor bigger than one default chunk, against the same quantizers run in tiny chunks."""
    w = (torch.randn(1200, 1024, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16)
    assert w.numel() > _common.CHUNK_ELEMENTS
    big = (fp8.quantize(w), nvfp4.quantize(w), mxfp4.quantize(w))
    monkeypatch.setattr(_common, "CHUNK_ELEMENTS", 4096)
    small = (fp8.quantize(w), nvfp4.quantize(w), mxfp4.quantize(w))
    for a, b in zip(big, small, strict=True):
        for key in a:
            got, want = a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)
            assert torch.equal(got, want), key

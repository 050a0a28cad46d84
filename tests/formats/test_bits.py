"""The array-level quantizers (``quantize_bits``, what the converter calls) give ``quantize``'s
bytes, write into given arrays, and refuse NaN/Inf and a too-small nvfp4 scale by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.formats import cases
from weight_sync.formats import fp8, mxfp4, nvfp4


def _bits(w: torch.Tensor) -> np.ndarray:
    return w.reshape(-1).view(torch.int16).numpy().view(np.uint16)


def test_bits_paths_equal_the_tensor_paths():
    w = cases.weights((300, 544), torch.bfloat16, seed=51)
    d = fp8.quantize(w)
    codes, scales = fp8.quantize_bits(_bits(w), 300, 544)
    assert np.array_equal(codes, d["weight"].view(torch.uint8).reshape(-1).numpy())
    assert np.array_equal(scales, d["weight_scale_inv"].reshape(-1).numpy())

    gs = nvfp4.global_scale(w)
    d = nvfp4.quantize(w, weight_scale_2=gs)
    packed = np.full(w.numel() // 2, 0xAA, dtype=np.uint8)
    scale = np.full(w.numel() // 16, 0xAA, dtype=np.uint8)
    got = nvfp4.quantize_bits(_bits(w), np.float32(gs.item()), packed, scale)
    assert got[0] is packed and got[1] is scale  # written in place
    assert np.array_equal(packed, d["weight"].reshape(-1).numpy())
    assert np.array_equal(scale, d["weight_scale"].view(torch.uint8).reshape(-1).numpy())

    d = mxfp4.quantize(w)
    blocks, sc = mxfp4.quantize_bits(_bits(w))
    assert np.array_equal(blocks, d["blocks"].reshape(-1).numpy())
    assert np.array_equal(sc, d["scales"].reshape(-1).numpy())


def test_bits_paths_refuse_bad_input_by_name():
    w = torch.ones(128, 64, dtype=torch.bfloat16)
    w[5, 7] = float("inf")
    with pytest.raises(ValueError, match="fp8.quantize: tensor of rows 0-127 contains NaN or Inf"):
        fp8.quantize_bits(_bits(w), 128, 64, what="rows 0-127")
    with pytest.raises(ValueError, match="mxfp4.quantize: tensor of W contains NaN or Inf"):
        mxfp4.quantize_bits(_bits(w), what="W")
    with pytest.raises(ValueError, match="nvfp4.quantize: tensor of W contains NaN or Inf"):
        nvfp4.quantize_bits(_bits(w), np.float32(1.0), what="W")
    w[5, 7] = 448.0 * 6 * 2  # amax / 2688 = 2 > the given 1.0
    with pytest.raises(ValueError, match="smaller than amax/\\(6\\*448\\)=2.0 of the tensor of W"):
        nvfp4.quantize_bits(_bits(w), np.float32(1.0), what="W")
    with pytest.raises(ValueError, match="smaller than amax"):
        nvfp4.quantize_bits(_bits(w), np.float32(0.0), what="W")  # zero scale for a non-zero tensor

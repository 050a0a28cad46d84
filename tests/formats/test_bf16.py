"""bf16: the identity format."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from core.errors import UserError
from core.formats import FORMATS, QUANTIZED, WeightFormat, check_format
from weight_sync.formats import bf16


def test_quantize_keeps_the_tensor_and_dequantize_widens_exactly():
    w = torch.randn(5, 7).to(torch.bfloat16)
    d = bf16.quantize(w)
    assert set(d) == {"weight"} and d["weight"].dtype == torch.bfloat16
    assert torch.equal(d["weight"].view(torch.int16), w.view(torch.int16))
    out = bf16.dequantize(d)
    assert out.dtype == torch.float32 and torch.equal(out, w.float())


def test_bad_inputs():
    with pytest.raises(ValueError, match="not bfloat16"):
        bf16.quantize(torch.ones(2, 2))
    w = torch.ones(2, 2, dtype=torch.bfloat16)
    w[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        bf16.quantize(w)
    with pytest.raises(ValueError, match="weight"):
        bf16.dequantize({})


def test_format_names():
    assert FORMATS == ("bf16", "fp8", "nvfp4", "mxfp4")
    assert QUANTIZED == ("fp8", "nvfp4", "mxfp4")
    assert get_args(WeightFormat) == FORMATS and check_format("nvfp4") == "nvfp4"
    with pytest.raises(UserError, match=r"unknown weight format 'int3' \(known: bf16, fp8, nvfp4, mxfp4\)"):
        check_format("int3")

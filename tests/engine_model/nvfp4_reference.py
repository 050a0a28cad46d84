"""An independent restatement of SGLang's NVFP4 activation quantizer, for tests.

Written from the published semantics of FlashInfer's ``fp4_quantize`` (its tests'
``ref_fp4_quant``; vLLM's ``ref_nvfp4_quant``), one 16-element block at a time in plain Python on
float32 scalars (``numpy.float32`` arithmetic is IEEE float32), with torch's own float8_e4m3fn
cast for the block scale and E2M1 rounding by its decision thresholds. It shares no code with the
engine (``engine.model.act_nvfp4``).
"""

from __future__ import annotations

import numpy as np
import torch

F32 = np.float32


def e2m1(q: float) -> float:
    """FlashInfer's ``cast_to_fp4`` thresholds (ties to even) on a value clamped to +-6."""
    a = abs(q)
    for bound, value, inclusive in (
        (0.25, 0.0, True),
        (0.75, 0.5, False),
        (1.25, 1.0, True),
        (1.75, 1.5, False),
        (2.5, 2.0, True),
        (3.5, 3.0, False),
        (5.0, 4.0, True),
    ):
        if a < bound or (inclusive and a == bound):
            return -value if q < 0 else value
    return -6.0 if q < 0 else 6.0


def quantize(x: torch.Tensor, input_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E2M1 values [M, K], e4m3 scale bytes [M, K/16])`` of ``x`` ``[M, K]``, block by block."""
    gs = F32(1.0) / F32(input_scale)  # SGLang: input_scale_inv = (1 / input_scale).to(float32)
    m, k = x.shape
    values = torch.empty(m, k)
    scales = torch.empty(m, k // 16, dtype=torch.uint8)
    xs = x.detach().float().numpy()
    for r in range(m):
        for b in range(k // 16):
            block = [F32(v) for v in xs[r, 16 * b : 16 * b + 16]]
            vec_max = max(abs(v) for v in block)
            sf = gs * (vec_max * F32(1.0 / 6.0))
            sf = min(sf, F32(448.0))  # the kernel's satfinite cast
            sf8 = torch.tensor(float(sf)).to(torch.float8_e4m3fn)
            scales[r, b] = sf8.view(torch.uint8)
            s = F32(sf8.item())
            out_scale = F32(0.0) if s == 0 else F32(1.0) / (s * (F32(1.0) / gs))
            for c, v in enumerate(block):
                q = min(max(v * out_scale, F32(-6.0)), F32(6.0))
                values[r, 16 * b + c] = e2m1(float(q))
    return values, scales


def qdq(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """What the FP4 GEMM multiplies, in float32: ``E2M1 * block scale * input_scale``, shape of ``x``."""
    flat = x.reshape(-1, x.shape[-1])
    values, scales = quantize(flat, input_scale)
    m, k = flat.shape
    sf = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    out = (values.view(m, k // 16, 16) * sf).view(m, k) * torch.tensor(input_scale, dtype=torch.float32)
    return out.view(x.shape)

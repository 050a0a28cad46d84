"""Plain torch re-statements of the format rules (tests only): fast enough for large tensors.

A second oracle beside the scalar ``reference``: the rules written as whole-tensor torch ops,
one block at a time where blocks are 2-D, with no attempt at speed. It shares no code with the
quantizers and takes its roundings from elsewhere: e4m3 from torch's own float32 ->
float8_e4m3fn cast, E2M1 as the nearest grid value by distance (in float64) with ties to the
even code, MXFP4's exponent from ``torch.frexp`` and its scaling as a float64 division rounded
once to float32.
"""

from __future__ import annotations

import math

import torch

_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
_EVEN_BONUS = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.int64)


def e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """Codes 0..7 (int64) of float32 ``a >= 0``: nearest grid value, ties to the even code."""
    d = (a.double().clamp(max=6.0).unsqueeze(-1) - _E2M1_GRID).abs()
    nearest = d == d.min(dim=-1, keepdim=True).values
    # among the nearest (two only at a tie: neighbours, one code even), take the even one
    return (nearest.long() * (2 + _EVEN_BONUS)).argmax(dim=-1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the flat order, element ``2i`` in the low nibble."""
    c = codes.reshape(-1).to(torch.uint8)
    return c[0::2] | (c[1::2] << 4)


def fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K], scales float32 [ceil(N/128), ceil(K/128)]) of 2-D ``w``."""
    x = w.float()
    n, k = x.shape
    codes = torch.empty((n, k), dtype=torch.uint8)
    scales = torch.empty((math.ceil(n / 128), math.ceil(k / 128)), dtype=torch.float32)
    for bi, r0 in enumerate(range(0, n, 128)):
        for bj, c0 in enumerate(range(0, k, 128)):
            blk = x[r0 : r0 + 128, c0 : c0 + 128]
            s = torch.clamp(blk.abs().amax(), min=1e-4) / 448.0
            scales[bi, bj] = s
            q = (blk / s).clamp(-448.0, 448.0)
            codes[r0 : r0 + 128, c0 : c0 + 128] = q.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scales


def nvfp4(w: torch.Tensor, ws2: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Packed codes (flat uint8), e4m3 scale bytes (flat uint8) and ``weight_scale_2`` of ``w``."""
    x = w.float().reshape(-1, 16)
    if ws2 is None:
        ws2 = x.abs().max() / (6.0 * 448.0)
    ws2 = ws2.float().reshape(())
    if float(ws2) == 0.0:
        s8 = torch.ones(x.shape[0]).to(torch.float8_e4m3fn)
        return {
            "weight": torch.zeros(x.numel() // 2, dtype=torch.uint8),
            "weight_scale": s8.view(torch.uint8),
        }
    s = x.abs().amax(dim=1) / (6.0 * ws2)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp(2.0**-9, 448.0)
    s8 = s.to(torch.float8_e4m3fn)
    q = x / (s8.float() * ws2).unsqueeze(1)
    codes = e2m1_magnitude(q.abs()) | torch.where(q < 0, 8, 0)
    return {"weight": pack(codes), "weight_scale": s8.view(torch.uint8), "weight_scale_2": ws2}


def mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Packed codes (flat uint8) and E8M0 scale bytes (flat uint8) of ``w``, FLOOR rule."""
    x = w.float().reshape(-1, 32)
    amax = x.abs().amax(dim=1)
    _, ex = torch.frexp(amax)  # amax = m * 2**ex with 0.5 <= m < 1
    e = torch.where(amax == 0, -127, (ex.long() - 1 - 2).clamp(-127, 127))
    q = (x.double() / torch.exp2(e.double()).unsqueeze(1)).float()
    codes = e2m1_magnitude(q.abs()) | torch.where(torch.signbit(q), 8, 0)
    return {"blocks": pack(codes), "scales": (e + 127).to(torch.uint8)}

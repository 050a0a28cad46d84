"""Block FP8 weights (DeepSeek-V3 style) as SGLang's ``fp8`` method with ``weight_block_size`` loads them.

Per 128x128 block of ``W [N, K]``, over the block's real elements only (edge blocks are smaller;
nothing is padded into the statistics):

- ``amax = max(max |x|, 1e-4)`` in float32 (DeepSeek-V3 ``inference/kernel.py`` and SGLang's
  ``per_block_cast_to_fp8`` floor the amax at 1e-4, so an all-zero block gets a tiny scale and
  zero codes rather than 0/0),
- ``s = amax / 448`` (float32 division),
- ``codes = float8_e4m3fn(x.float() / s)`` rounded to nearest even. ``|x| <= amax`` keeps
  ``|x / s| <= 448 * (1 + 2**-22) < 464``, which rounds to 448, so clamping to +-448 before the
  cast would change nothing (and torch >= 2.13 saturates the cast anyway).

Stored: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32
``[ceil(N/128), ceil(K/128)]``, the dequantization multiplier ``s``.
"""

from __future__ import annotations

import math

import torch

from weight_sync.formats import _common

BLOCK = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def _check_2d(w: torch.Tensor, where: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{where}: expected a 2-D weight [N, K], got a tensor of {_common.describe(w)}")


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block-FP8 tensors of ``w`` ``[N, K]`` (bf16, f16 or f32; any N, K).

    Returns ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32
    ``[ceil(N/128), ceil(K/128)]``, bit-exact to the rules in the module docstring. Non-2-D
    tensors, other dtypes and NaN/Inf raise ``ValueError``.
    """
    where = "fp8.quantize"
    w = _common.check_weight(w, where)
    _check_2d(w, where)
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    weight = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale = torch.empty((nb, kb), dtype=torch.float32)
    if n == 0 or k == 0:
        return {"weight": weight, "weight_scale_inv": scale}
    itype = _common.int_view(w.dtype)
    k_full = (k // BLOCK) * BLOCK
    band_abs = torch.empty(min(n, BLOCK) * k, dtype=itype)
    seg_max = torch.empty((min(n, BLOCK), kb), dtype=itype)
    rows_per_step = max(1, min(BLOCK, _common.CHUNK_ELEMENTS // k))
    q = torch.empty(rows_per_step * k, dtype=torch.float32)
    top = torch.zeros((), dtype=itype)
    for bi in range(nb):
        r0, r1 = bi * BLOCK, min(n, (bi + 1) * BLOCK)
        rb = r1 - r0
        band = w[r0:r1]
        ab = _common.abs_bits(band, out=band_abs[: rb * k].view(rb, k))
        sm = seg_max[:rb]
        if k_full:
            torch.amax(ab[:, :k_full].view(rb, k_full // BLOCK, BLOCK), dim=2, out=sm[:, : k_full // BLOCK])
        if k_full < k:
            torch.amax(ab[:, k_full:], dim=1, out=sm[:, kb - 1])
        block_max = sm.amax(dim=0)
        top = torch.maximum(top, block_max.max())
        amax = _common.bits_to_float(block_max, w.dtype).clamp_(min=AMAX_FLOOR)
        s = amax / FP8_MAX
        scale[bi] = s
        for s0 in range(r0, r1, rows_per_step):
            s1 = min(r1, s0 + rows_per_step)
            rr = s1 - s0
            qv = q[: rr * k].view(rr, k)
            qv.copy_(w[s0:s1])  # exact widening to float32
            if k_full:
                full = qv[:, :k_full].view(rr, k_full // BLOCK, BLOCK)
                torch.div(full, s[: k_full // BLOCK, None], out=full)
            if k_full < k:
                tail = qv[:, k_full:]
                torch.div(tail, s[kb - 1 :], out=tail)  # s[kb-1:] is [1], float32 like the rest
            weight[s0:s1].copy_(qv)
    _common.raise_if_nonfinite(top.view(1), w.dtype, w, where)
    return {"weight": weight, "weight_scale_inv": scale}


def dequantize(d: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 ``[N, K]``: each code's value times its block's ``weight_scale_inv`` (one float32 product).

    Wrong dtypes or shapes raise ``ValueError``.
    """
    where = "fp8.dequantize"
    try:
        weight, scale = d["weight"], d["weight_scale_inv"]
    except KeyError as e:
        raise ValueError(f"{where}: missing tensor {e.args[0]!r}") from None
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{where}: weight must be float8_e4m3fn [N, K], got {_common.describe(weight)}")
    n, k = weight.shape
    expected = (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(
            f"{where}: weight_scale_inv {_common.describe(scale)} does not match weight "
            f"{_common.describe(weight)} (expected float32 of shape {expected})"
        )
    full = scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    return weight.float() * full

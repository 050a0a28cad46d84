"""Block FP8 weights (DeepSeek-V3 style) as SGLang's ``fp8`` method with ``weight_block_size`` loads them.

Per 128x128 block of ``W [N, K]``, over the block's real elements only (edge blocks are smaller;
nothing is padded into the statistics):

- ``amax = max(max |x|, 1e-4)`` in float32 (DeepSeek-V3 ``inference/kernel.py`` and SGLang's
  ``per_block_cast_to_fp8`` floor the amax at 1e-4, so an all-zero block gets a tiny scale and
  zero codes rather than 0/0),
- ``s = amax / 448`` (float32 division),
- ``codes = float8_e4m3fn(x.float() / s)`` rounded to nearest even. ``|x| <= amax`` keeps
  ``|x / s| <= 448 * (1 + 2**-22) < 464``, which rounds to 448, so clamping to +-448 before the
  cast would change nothing (and the e4m3 conversion saturates anyway).

Stored: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32
``[ceil(N/128), ceil(K/128)]``, the dequantization multiplier ``s``.

Divisions are IEEE float32 divisions (DeepSeek's Triton kernels divide with the GPU's fast
float32 division, which is not correctly rounded and cannot be reproduced bit for bit on CPU).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from weight_sync.formats import _common

BLOCK = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def _check_2d(w: torch.Tensor, where: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{where}: expected a 2-D weight [N, K], got a tensor of {_common.describe(w)}")


def quantize(w: torch.Tensor, *, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Block-FP8 tensors of ``w`` ``[N, K]`` (bf16, f16 or f32; any N, K).

    Returns ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32
    ``[ceil(N/128), ceil(K/128)]``, bit-exact to the rules in the module docstring; written into
    ``out``'s tensors of those names when given (then returned). Non-2-D tensors, other dtypes,
    a mismatched ``out`` and NaN/Inf raise ``ValueError``.
    """
    where = "fp8.quantize"
    w = _common.check_weight(w, where)
    _check_2d(w, where)
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    res = _common.outputs(
        out, where, {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale_inv": ((nb, kb), torch.float32)}
    )
    if n and k:
        quantize_bits(
            _common.bits(w),
            n,
            k,
            _common.as_array(res["weight"]),
            _common.as_array(res["weight_scale_inv"]),
            what=_common.describe(w),
        )
    return res


def quantize_bits(
    x: np.ndarray,
    n: int,
    k: int,
    codes: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    *,
    what: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``quantize`` on bits: the array-level path (no torch), for callers that hold the weights'
    bits already (the converter).

    ``x``: the flat float bit patterns of a row-major ``[n, k]`` weight (``uint16`` bfloat16 or
    ``uint32`` float32, see ``_common.bits``). Returns ``codes`` (uint8 ``[n * k]``: the
    float8_e4m3fn bytes) and ``scales`` (float32 ``[ceil(n/128) * ceil(k/128)]``), written into
    the arrays given or fresh ones. NaN/Inf raise ``ValueError`` naming the tensor as ``what``.
    """
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    codes = np.empty(n * k, dtype=np.uint8) if codes is None else codes
    scales = np.empty(nb * kb, dtype=np.float32) if scales is None else scales
    if n == 0 or k == 0:
        return codes, scales
    kernel = _common.kernels().fp8_rows
    bands = max(1, _common.CHUNK_ELEMENTS // (BLOCK * k))  # 128-row bands per task

    def task(b0: int, b1: int) -> int:
        r0, r1 = b0 * BLOCK, min(n, b1 * BLOCK)
        return kernel(x[r0 * k : r1 * k], r1 - r0, k, codes[r0 * k : r1 * k], scales[b0 * kb : b1 * kb])

    top = max(_common.WORKERS.run_ranges(nb, bands, task))
    _common.check_finite(int(top), "fp8.quantize", what or f"shape ({n}, {k})")
    return codes, scales


def check_layout(weight: torch.Tensor, weight_scale_inv: torch.Tensor, where: str) -> None:
    """``ValueError`` (its message starting with ``where``) unless ``weight`` is float8_e4m3fn
    ``[N, K]`` and ``weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{where}: weight must be float8_e4m3fn [N, K], got {_common.describe(weight)}")
    n, k = weight.shape
    expected = [math.ceil(n / BLOCK), math.ceil(k / BLOCK)]
    if weight_scale_inv.dtype != torch.float32 or list(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"{where}: weight_scale_inv {_common.describe(weight_scale_inv)} does not match weight "
            f"{_common.describe(weight)} (expected float32 {expected})"
        )


def dequantize(d: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 ``[N, K]``: each code's value times its block's ``weight_scale_inv`` (one float32 product).

    Wrong dtypes or shapes raise ``ValueError``.
    """
    where = "fp8.dequantize"
    weight, scale = _common.tensors(d, ("weight", "weight_scale_inv"), where)
    check_layout(weight, scale, where)
    n, k = weight.shape
    out = torch.empty((n, k), dtype=torch.float32)
    if n == 0 or k == 0:
        return out
    k_full, kbf = (k // BLOCK) * BLOCK, k // BLOCK
    codes = weight.contiguous().view(torch.uint8)

    def band(bi: int) -> None:
        r0, r1 = bi * BLOCK, min(n, (bi + 1) * BLOCK)
        o, s = out[r0:r1], scale[bi]
        # e4m3 -> float32 by lookup in a 256-entry table of the codes' exact values
        idx = codes[r0:r1].to(torch.int32)
        torch.index_select(_E4M3_VALUES, 0, idx.view(-1), out=o.view(-1))
        if k_full:
            full = o[:, :k_full].view(r1 - r0, kbf, BLOCK)
            full.mul_(s[:kbf, None])
        if k_full < k:
            o[:, k_full:].mul_(s[kbf:])

    _common.WORKERS.run([lambda bi=bi: band(bi) for bi in range(math.ceil(n / BLOCK))])
    return out


# Float32 value of every float8_e4m3fn byte (0x7F and 0xFF are NaN).
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()

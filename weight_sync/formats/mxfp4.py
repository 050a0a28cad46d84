"""MXFP4 (OCP Microscaling v1.0) weights in the gpt-oss layout that SGLang's ``mxfp4`` loads.

Per 32 consecutive elements along the last dim (torchao ``to_mx`` with ``ScaleCalculationMode.FLOOR``):

- ``e = floor(log2(amax)) - 2`` (2 = floor(log2(6)), the largest E2M1 power of two), clamped to
  [-127, 127]; the E8M0 scale byte is ``e + 127`` (an all-zero block has amax 0, exponent field
  0, so byte 0). The exponent is read from the float32 bits of ``amax`` with integer operations
  (torch's float32 -> float8_e8m0fnu cast rounds up, which is not the floor rule).
- elements: ``x / 2**e`` (exact: a power of two), E2M1 round to nearest even, saturating at 6;
  the sign bit is the float's sign bit, so ``-0.0`` encodes as 0x8.
- stored as ``blocks`` uint8 ``[..., K/32, 16]`` (element ``2i`` in the low nibble) and
  ``scales`` uint8 ``[..., K/32]``.
"""

from __future__ import annotations

import numpy as np
import torch

from weight_sync.formats import _common

BLOCK = 32
E2M1_MAX_POW2 = 2
E8M0_BIAS = 127


def quantize(w: torch.Tensor, *, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """MXFP4 tensors of ``w`` (``[..., K]``, K a multiple of 32; bf16, f16 or f32).

    Returns ``blocks`` uint8 ``[..., K/32, 16]`` and ``scales`` uint8 ``[..., K/32]``, bit-exact to
    the rules in the module docstring; written into ``out``'s tensors of those names when given.
    Bad shapes, dtypes, a mismatched ``out`` or NaN/Inf raise ``ValueError``.
    """
    where = "mxfp4.quantize"
    w = _common.check_weight(w, where)
    _common.check_groups(w, BLOCK, where)
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    res = _common.outputs(
        out,
        where,
        {
            "blocks": ((*lead, k // BLOCK, BLOCK // 2), torch.uint8),
            "scales": ((*lead, k // BLOCK), torch.uint8),
        },
    )
    quantize_bits(
        _common.bits(w),
        _common.as_array(res["blocks"]),
        _common.as_array(res["scales"]),
        what=_common.describe(w),
    )
    return res


def quantize_bits(
    x: np.ndarray,
    blocks: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    *,
    what: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``quantize`` on bits: the array-level path (no torch), for callers that hold the weights'
    bits already (the converter).

    ``x``: flat float bit patterns (``uint16`` bfloat16 or ``uint32`` float32, see
    ``_common.bits``), a multiple of 32 of them. Returns ``blocks`` (uint8 ``[len/2]``) and
    ``scales`` (uint8 ``[len/32]``), written into the arrays given or fresh ones. NaN/Inf raise
    ``ValueError`` naming the tensor as ``what``.
    """
    blocks = np.empty(x.size // 2, dtype=np.uint8) if blocks is None else blocks
    scales = np.empty(x.size // BLOCK, dtype=np.uint8) if scales is None else scales
    kernel = _common.kernels().mxfp4_blocks
    step = max(1, _common.CHUNK_ELEMENTS // BLOCK)  # blocks per task

    def task(b0: int, b1: int) -> int:
        return kernel(x[b0 * BLOCK : b1 * BLOCK], blocks[b0 * 16 : b1 * 16], scales[b0:b1])

    top = max(_common.WORKERS.run_ranges(x.size // BLOCK, step, task), default=0)
    _common.check_finite(int(top), "mxfp4.quantize", what or f"{x.size} values")
    return blocks, scales


def scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``2**(byte - 127)`` of E8M0 bytes (byte 0 is the subnormal 2**-127, 255 is NaN)."""
    b = scales.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def check_layout(blocks: torch.Tensor, scales: torch.Tensor, where: str) -> None:
    """``ValueError`` (its message starting with ``where``) unless ``blocks`` is uint8
    ``[..., K/32, 16]`` and ``scales`` uint8 ``[..., K/32]``."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"{where}: blocks must be uint8 [..., K/32, 16], got {_common.describe(blocks)}")
    if scales.dtype != torch.uint8 or list(scales.shape) != list(blocks.shape[:-1]):
        raise ValueError(
            f"{where}: scales {_common.describe(scales)} do not match blocks {_common.describe(blocks)} "
            f"(expected uint8 {list(blocks.shape[:-1])})"
        )


def dequantize(d: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 ``[..., K]`` from ``{"blocks", "scales"}``: ``E2M1(code) * 2**(scale - 127)`` (exact).

    Wrong dtypes or shapes raise ``ValueError``.
    """
    from weight_sync.formats.fp4 import decode_packed

    where = "mxfp4.dequantize"
    blocks, scales = _common.tensors(d, ("blocks", "scales"), where)
    check_layout(blocks, scales, where)
    values = decode_packed(blocks.contiguous())  # [..., K/32, 32]
    out = values.mul_(scale_factors(scales).unsqueeze(-1))
    return out.view(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)

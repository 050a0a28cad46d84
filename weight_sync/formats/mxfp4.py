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

import torch

from weight_sync.formats import _common, _parallel
from weight_sync.formats.fp4 import Encoder

BLOCK = 32
E2M1_MAX_POW2 = 2
E8M0_BIAS = 127


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 tensors of ``w`` (``[..., K]``, K a multiple of 32; bf16, f16 or f32).

    Returns ``blocks`` uint8 ``[..., K/32, 16]`` and ``scales`` uint8 ``[..., K/32]``, bit-exact to
    the rules in the module docstring. Bad shapes, dtypes or NaN/Inf raise ``ValueError``.
    """
    where = "mxfp4.quantize"
    w = _common.check_weight(w, where)
    _common.check_groups(w, BLOCK, where)
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    x = w.view(-1, BLOCK)
    n_blocks = x.shape[0]
    blocks = torch.empty((n_blocks, BLOCK // 2), dtype=torch.uint8)
    scales = torch.empty(n_blocks, dtype=torch.uint8)

    step = max(1, _common.CHUNK_ELEMENTS // BLOCK)
    cap = min(n_blocks, step)

    def task(b0: int, b1: int) -> torch.Tensor:
        enc = _parallel.scratch("e2m1", cap * BLOCK, Encoder)
        nb, m = b1 - b0, (b1 - b0) * BLOCK
        q = enc.q[:m].view(nb, BLOCK)
        q.copy_(x[b0:b1])  # exact widening to float32
        enc.sign_from_q_(m, negative_zero_sign=True)  # x / 2**e keeps x's sign bit, -0.0 included
        amax = torch.amax(q, dim=1)  # exact, NaN-propagating
        # biased E8M0 byte = e + 127 = exponent field of float32(amax) - 2, clamped to [0, 254]
        eb = amax.view(torch.int32).bitwise_right_shift(23)
        eb.sub_(E2M1_MAX_POW2).clamp_(0, 2 * E8M0_BIAS)
        scales[b0:b1].copy_(eb)
        # 2**-e = float32 bits (254 - byte) << 23, always a normal number
        inv = torch.sub(2 * E8M0_BIAS, eb).bitwise_left_shift_(23).view(torch.float32)
        q.mul_(inv[:, None])  # |x| / 2**e, exact
        enc.codes_(m)
        enc.pack_(m, blocks[b0:b1])
        return amax.max()

    tops = _parallel.run_ranges(n_blocks, step, task)
    if not all(bool(torch.isfinite(t)) for t in tops):
        raise ValueError(f"{where}: tensor of {_common.describe(w)} contains NaN or Inf")
    return {
        "blocks": blocks.view(*lead, k // BLOCK, BLOCK // 2),
        "scales": scales.view(*lead, k // BLOCK),
    }


def scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``2**(byte - 127)`` of E8M0 bytes (byte 0 is the subnormal 2**-127, 255 is NaN)."""
    b = scales.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def dequantize(d: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 ``[..., K]`` from ``{"blocks", "scales"}``: ``E2M1(code) * 2**(scale - 127)`` (exact).

    Wrong dtypes or shapes raise ``ValueError``.
    """
    from weight_sync.formats.fp4 import decode_packed

    where = "mxfp4.dequantize"
    try:
        blocks, scales = d["blocks"], d["scales"]
    except KeyError as e:
        raise ValueError(f"{where}: missing tensor {e.args[0]!r}") from None
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"{where}: blocks must be uint8 [..., K/32, 16], got {_common.describe(blocks)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{where}: scales {_common.describe(scales)} do not match blocks {_common.describe(blocks)} "
            f"(expected uint8 of shape {tuple(blocks.shape[:-1])})"
        )
    values = decode_packed(blocks.contiguous())  # [..., K/32, 32]
    out = values.mul_(scale_factors(scales).unsqueeze(-1))
    return out.view(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)

"""BF16 weights: stored as they are (the identity format)."""

from __future__ import annotations

import torch

from weight_sync.formats import _common


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"weight": w}`` for a bfloat16 tensor ``w`` (contiguous, same values and bits).

    Other dtypes (a cast would round) and NaN/Inf raise ``ValueError``.
    """
    where = "bf16.quantize"
    w = _common.check_weight(w, where)
    if w.dtype != torch.bfloat16:
        raise ValueError(f"{where}: tensor of {_common.describe(w)} is not bfloat16 (converting would round)")
    _common.raise_if_nonfinite(_common.abs_max_bits(w), w, where)
    return {"weight": w}


def dequantize(d: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight as float32 (exact). A missing or non-float ``weight`` raises ``ValueError``."""
    w = d.get("weight") if isinstance(d, dict) else None
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError("bf16.dequantize: expected {'weight': floating-point tensor}")
    return w.float()

"""Dequantize one 2-D linear weight held by the engine's loader: the layout checks and the values
of ``weight_sync.formats``' own (one definition of each format's layout and numbers); the engine
adds only that a linear's weight is 2-D.

The loader checks every quantized linear when it loads (``check_*``: a mismatch raises
``ValueError`` naming what was expected) but dequantizes only when asked
(``weights.LinearWeight.weight``): the engine's GEMM reads the stored codes themselves
(``engine.kernels.panels``), so float32 weights are built only on the fallback paths.
"""

from __future__ import annotations

import torch

from weight_sync.formats import fp8 as formats_fp8
from weight_sync.formats import mxfp4 as formats_mxfp4
from weight_sync.formats import nvfp4 as formats_nvfp4


def check_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> None:
    """``ValueError`` unless ``weight`` is float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32
    ``[ceil(N/128), ceil(K/128)]``."""
    formats_fp8.check_layout(weight, weight_scale_inv, "fp8")


def fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of block-FP8 ``weight`` (float8_e4m3fn ``[N, K]``) and its float32
    ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``; ``ValueError`` as :func:`check_fp8`."""
    return formats_fp8.dequantize({"weight": weight, "weight_scale_inv": weight_scale_inv})


def check_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> None:
    """``ValueError`` unless ``weight`` is uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn
    ``[N, K/16]`` and ``weight_scale_2`` one float."""
    if weight.dim() != 2:
        raise ValueError(f"nvfp4 weight must be uint8 [N, K/2], got {weight.dtype} {list(weight.shape)}")
    formats_nvfp4.check_layout(weight, weight_scale, weight_scale_2, "nvfp4")


def nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of NVFP4 ``weight`` (uint8 ``[N, K/2]``), ``weight_scale`` (float8_e4m3fn
    ``[N, K/16]``) and the one-element ``weight_scale_2``; ``ValueError`` as :func:`check_nvfp4`."""
    check_nvfp4(weight, weight_scale, weight_scale_2)
    return formats_nvfp4.dequantize(
        {"weight": weight, "weight_scale": weight_scale, "weight_scale_2": weight_scale_2}
    )


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """``ValueError`` unless ``blocks`` is uint8 ``[N, K/32, 16]`` and ``scales`` uint8 ``[N, K/32]``."""
    if blocks.dim() != 3:
        raise ValueError(f"mxfp4 blocks must be uint8 [N, K/32, 16], got {blocks.dtype} {list(blocks.shape)}")
    formats_mxfp4.check_layout(blocks, scales, "mxfp4")


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of MXFP4 ``blocks`` (uint8 ``[N, K/32, 16]``) and E8M0 ``scales`` (uint8
    ``[N, K/32]``); ``ValueError`` as :func:`check_mxfp4`."""
    check_mxfp4(blocks, scales)
    return formats_mxfp4.dequantize({"blocks": blocks, "scales": scales})

"""Dequantize one 2-D linear weight held by the engine's loader: its layout checks, and the
values of ``weight_sync.formats``' own dequantizers (one definition of each format's numbers).

The loader checks every quantized linear when it loads (``check_*``: a mismatch raises
``ValueError`` naming what was expected) but dequantizes only when asked
(``weights.LinearWeight.weight``): the engine's GEMM reads the stored codes themselves
(``engine.kernels.panels``), so float32 weights are built only on the fallback paths.
"""

from __future__ import annotations

import math

import torch

from weight_sync.formats import fp8 as formats_fp8
from weight_sync.formats import mxfp4 as formats_mxfp4
from weight_sync.formats import nvfp4 as formats_nvfp4

FP8_BLOCK = formats_fp8.BLOCK
NVFP4_GROUP = formats_nvfp4.GROUP
MXFP4_BLOCK = formats_mxfp4.BLOCK


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


def check_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> None:
    """``ValueError`` unless ``weight`` is float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32
    ``[ceil(N/128), ceil(K/128)]``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"fp8 weight must be float8_e4m3fn [N, K], got {_describe(weight)}")
    n, k = weight.shape
    expected = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if weight_scale_inv.dtype != torch.float32 or tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv {_describe(weight_scale_inv)} does not match weight {_describe(weight)} "
            f"(expected float32 {list(expected)})"
        )


def fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of block-FP8 ``weight`` (float8_e4m3fn ``[N, K]``) and its float32
    ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``."""
    check_fp8(weight, weight_scale_inv)
    return formats_fp8.dequantize({"weight": weight, "weight_scale_inv": weight_scale_inv})


def check_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> None:
    """``ValueError`` unless ``weight`` is uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn
    ``[N, K/16]`` and ``weight_scale_2`` one float."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"nvfp4 weight must be uint8 [N, K/2], got {_describe(weight)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    expected = (n, k // NVFP4_GROUP)
    if k % NVFP4_GROUP or weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != expected:
        raise ValueError(
            f"weight_scale {_describe(weight_scale)} does not match weight {_describe(weight)} "
            f"(expected float8_e4m3fn {list(expected)})"
        )
    if not weight_scale_2.is_floating_point() or weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be one float, got {_describe(weight_scale_2)}")


def nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of NVFP4 ``weight`` (uint8 ``[N, K/2]``), ``weight_scale`` (float8_e4m3fn
    ``[N, K/16]``) and the one-element ``weight_scale_2``."""
    check_nvfp4(weight, weight_scale, weight_scale_2)
    return formats_nvfp4.dequantize(
        {"weight": weight, "weight_scale": weight_scale, "weight_scale_2": weight_scale_2}
    )


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """``ValueError`` unless ``blocks`` is uint8 ``[N, K/32, 16]`` and ``scales`` uint8 ``[N, K/32]``."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != MXFP4_BLOCK // 2:
        raise ValueError(f"mxfp4 blocks must be uint8 [N, K/32, 16], got {_describe(blocks)}")
    n, nb = blocks.shape[0], blocks.shape[1]
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (n, nb):
        raise ValueError(
            f"scales {_describe(scales)} do not match blocks {_describe(blocks)} (expected uint8 {[n, nb]})"
        )


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of MXFP4 ``blocks`` (uint8 ``[N, K/32, 16]``) and E8M0 ``scales`` (uint8
    ``[N, K/32]``)."""
    check_mxfp4(blocks, scales)
    return formats_mxfp4.dequantize({"blocks": blocks, "scales": scales})

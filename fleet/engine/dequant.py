"""Dequantize one 2-D linear weight for the engine's loader, with ``weight_sync.formats`` semantics
bit for bit, in one fused pass (numba, compiled once and cached on disk).

Each value is a table lookup of its code (exact in float32) times its block's float32 factor, one
IEEE float32 product, exactly as the format modules compute it:

- fp8: ``E4M3(code) * weight_scale_inv[r // 128, c // 128]``;
- nvfp4: ``E2M1(code) * (E4M3(weight_scale[r, c // 16]) * weight_scale_2)`` (the group factor
  is itself one float32 product, ModelOpt's order; low nibble first);
- mxfp4: ``E2M1(code) * 2**(scale - 127)`` (E8M0, byte 0 the subnormal 2**-127, 255 NaN).

The format modules' own dequantizers make several passes over a float32 intermediate (index
selects, then a scale product); this reads each code once and writes each value once, which
matters when a weight update loads inside an engine's pause. Shapes and dtypes are checked
first: a mismatch raises ``ValueError`` naming what was expected.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from weight_sync.formats.fp4 import E2M1_VALUES
from weight_sync.formats.mxfp4 import scale_factors

FP8_BLOCK = 128
NVFP4_GROUP = 16
MXFP4_BLOCK = 32
_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy", "boundscheck": False}

_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_E2M1 = np.array(E2M1_VALUES, dtype=np.float32)
_E8M0 = scale_factors(torch.arange(256, dtype=torch.int32).to(torch.uint8)).numpy()


@njit(**_JIT)
def _fp8_kernel(codes, scale, table, out):  # pragma: no cover - compiled
    n, k = codes.shape
    for r in range(n):
        srow = scale[r // 128]
        for c0 in range(0, k, 128):
            s = srow[c0 // 128]
            for c in range(c0, min(k, c0 + 128)):
                out[r, c] = table[codes[r, c]] * s


@njit(**_JIT)
def _nvfp4_kernel(packed, scale, ws2, e4m3, e2m1, out):  # pragma: no cover - compiled
    n, half = packed.shape
    for r in range(n):
        for g in range(half // 8):
            f = e4m3[scale[r, g]] * ws2
            for j in range(g * 8, g * 8 + 8):
                b = packed[r, j]
                out[r, 2 * j] = e2m1[b & 15] * f
                out[r, 2 * j + 1] = e2m1[b >> 4] * f


@njit(**_JIT)
def _mxfp4_kernel(blocks, scales, e8m0, e2m1, out):  # pragma: no cover - compiled
    n, nb, _ = blocks.shape
    for r in range(n):
        for b in range(nb):
            f = e8m0[scales[r, b]]
            base = b * 32
            for j in range(16):
                v = blocks[r, b, j]
                out[r, base + 2 * j] = e2m1[v & 15] * f
                out[r, base + 2 * j + 1] = e2m1[v >> 4] * f


def _codes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


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
    out = torch.empty(weight.shape)
    if out.numel():
        _fp8_kernel(_codes(weight), weight_scale_inv.contiguous().numpy(), _E4M3, out.numpy())
    return out


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
    out = torch.empty(weight.shape[0], weight.shape[1] * 2)
    if out.numel():
        ws2 = np.float32(weight_scale_2.reshape(()).float().item())
        _nvfp4_kernel(_codes(weight), _codes(weight_scale), ws2, _E4M3, _E2M1, out.numpy())
    return out


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
    out = torch.empty(blocks.shape[0], blocks.shape[1] * MXFP4_BLOCK)
    if out.numel():
        _mxfp4_kernel(_codes(blocks), _codes(scales), _E8M0, _E2M1, out.numpy())
    return out

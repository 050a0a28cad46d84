"""Write checkpoint weights straight into ``engine.kernels.gemm``' layout, one pass per part.

Each writer here takes one stored linear (bf16 rows, FP8 codes, or 4-bit codes with their byte
scales) and writes its rows ``row0 .. row0 + n`` of a bfloat16 ``[N, K]`` row-major tensor,
reading each stored byte once: no float32 intermediate, no concatenation of fused weights (q/k/v,
gate/up: each part is written straight into its rows); ``finish`` then lays the rows out as the
kernel's panels (one copy).
This matters because a weight update loads while the engine serves, on one thread.

The values written are exact bfloat16 values (checked when the tables are built):

- bf16: the stored bits;
- fp8: ``E4M3(code)`` (4 significant bits); the 128x128 block scale is applied by the GEMM to
  each 128-wide K block's partial sums (``gemm``'s per-panel scale table), as DeepGEMM does;
- nvfp4: ``E2M1(code) * E4M3(weight_scale)`` (2 x 4 significant bits: exact); the per-tensor
  ``weight_scale_2`` is applied by the GEMM to the output (as the real NVFP4 GEMM's ``alpha``);
- mxfp4: ``E2M1(code) * 2**(scale - 127)``: the dequantized value itself.

Numba kernels, compiled once and cached on disk; they release the GIL.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from core.numba_options import NJIT as _JIT
from engine.kernels import gemm
from weight_sync.formats.fp4 import E2M1_VALUES
from weight_sync.formats.mxfp4 import scale_factors


def _bf16_bits(values: torch.Tensor) -> np.ndarray:
    """The bfloat16 bit patterns (int16) of float32 ``values``; raises if one is not exact."""
    values = values.float().contiguous()
    bits = values.view(torch.int32)
    exact = ((bits & 0xFFFF) == 0) | values.isnan()
    if not bool(exact.all()):
        raise AssertionError("table values are not exact in bfloat16")
    return values.to(torch.bfloat16).view(torch.int16).numpy().copy()


_E4M3_F32 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
_E2M1_F32 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# [scale byte, code] -> bfloat16 bits of E2M1(code) * factor(scale byte)
FP8_TABLE = _bf16_bits(_E4M3_F32)
NVFP4_TABLE = _bf16_bits(_E4M3_F32[:, None] * _E2M1_F32[None, :]).reshape(-1)
MXFP4_TABLE = _bf16_bits(
    scale_factors(torch.arange(256, dtype=torch.int32).to(torch.uint8))[:, None] * _E2M1_F32[None, :]
).reshape(-1)


@njit(**_JIT)
def _fp8_rows(codes, table, dst):  # pragma: no cover - compiled
    n, k = codes.shape
    for r in range(n):
        for c in range(k):
            dst[r, c] = table[codes[r, c]]


@njit(**_JIT)
def _fp4_rows(packed, scales, group_bytes, table, dst):  # pragma: no cover - compiled
    n, half = packed.shape
    for r in range(n):
        for b in range(half):
            v = packed[r, b]
            base = scales[r, b // group_bytes] * 16
            dst[r, 2 * b] = table[base + (v & 15)]
            dst[r, 2 * b + 1] = table[base + (v >> 4)]


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def empty(n: int, k: int) -> torch.Tensor:
    """Uninitialised rows (int16 bits) for ``n`` rows of ``k``; ``finish`` gives them as bfloat16."""
    return torch.empty(n, k, dtype=torch.int16)


def finish(dst: torch.Tensor, n: int) -> torch.Tensor:
    """``dst`` (``n`` rows, all written) as the kernel's bfloat16 panels (``gemm.panels_of``)."""
    assert dst.shape[0] == n
    return gemm.panels_of(dst.view(torch.bfloat16))


def write_bf16(dst: torch.Tensor, row0: int, w: torch.Tensor) -> None:
    """Rows ``row0 ..`` of ``dst`` = bfloat16 ``w`` ``[n, K]``."""
    dst[row0 : row0 + w.shape[0]] = w.contiguous().view(torch.int16)


def write_fp8(dst: torch.Tensor, row0: int, codes: torch.Tensor) -> None:
    """Rows ``row0 ..`` of ``dst`` = ``E4M3(codes)`` for float8_e4m3fn ``codes`` ``[n, K]``."""
    _fp8_rows(_u8(codes), FP8_TABLE, dst[row0 : row0 + codes.shape[0]].numpy())


def write_nvfp4(dst: torch.Tensor, row0: int, packed: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Rows ``row0 ..`` of ``dst`` = ``E2M1(code) * E4M3(weight_scale)`` (no ``weight_scale_2``)
    for uint8 ``packed`` ``[n, K/2]`` (low nibble first) and ``weight_scale`` ``[n, K/16]``."""
    _fp4_rows(_u8(packed), _u8(weight_scale), 8, NVFP4_TABLE, dst[row0 : row0 + packed.shape[0]].numpy())


def write_mxfp4(dst: torch.Tensor, row0: int, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Rows ``row0 ..`` of ``dst`` = ``E2M1(code) * 2**(scale - 127)`` for uint8 ``packed``
    ``[n, K/2]`` and E8M0 ``scales`` ``[n, K/32]``."""
    _fp4_rows(_u8(packed), _u8(scales), 16, MXFP4_TABLE, dst[row0 : row0 + packed.shape[0]].numpy())

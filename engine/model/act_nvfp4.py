"""NVFP4 activation quantization as SGLang 0.5.23's W4A4 ModelOpt path runs it before each FP4 GEMM.

Where SGLang does it (paths relative to ``sglang/srt`` of the 0.5.23 wheel):

- dense linears: ``ModelOptFp4LinearMethod`` runs ``quant_mode = "w4a4"`` unless
  ``SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16`` is set with the cutedsl GEMM backend
  (``layers/quantization/modelopt_quant.py`` 1785-1794); ``process_weights_after_loading`` takes
  ``input_scale.max()`` over the fused shards and keeps ``input_scale_inv = 1 / input_scale``
  and ``alpha = input_scale * weight_scale_2`` (1886-1914); ``apply`` quantizes every input with
  ``fp4_quantize(x, layer.input_scale_inv)`` (2094-2107) and the GEMM multiplies by ``alpha``.
- MoE experts (the default backend of a Qwen3-MoE model on SM100, i.e. B200/B300, is
  ``flashinfer_trtllm``: ``arg_groups/model_overrides/qwen3_moe.py`` 41, 78-90): one scale per
  layer, ``w13_input_scale.max()`` and ``w2_input_scale.max()`` over all experts
  (``modelopt_quant.py`` 2768-2770); the hidden states go through ``fp4_quantize(x,
  1 / w13_input_scale)`` (``layers/moe/moe_runner/flashinfer_trtllm.py`` 1371-1400, 1506-1508)
  and the SwiGLU output is requantized inside the kernel with the global scale
  ``1 / w2_input_scale`` (``g1_scale_c``, 587-610).

The quantizer: SGLang's ``fp4_quantize`` is FlashInfer's ``fp4_quantize`` (its ``cute-dsl`` backend
on SM100, ``layers/quantization/fp4_utils.py`` 22-49), whose published Python reference is
``ref_fp4_quant`` in FlashInfer's tests (vLLM's ``ref_nvfp4_quant`` in ``nvfp4_emulation_utils.py``
is the same); per row and per 16 consecutive elements along K, with the global scale
``gs = float32(1 / input_scale)``:

- ``sf = gs * (amax16 * float32(1/6))``, clamped to 448 (the kernel's ``satfinite`` cast), rounded
  to float8 e4m3 (nearest, ties to even): the block scale ``sf8``;
- ``out_scale = 1 / (sf8 * float32(1 / gs))`` (0 where ``sf8 == 0``);
- each element ``q = x * out_scale``, clamped to +-6, rounded to E2M1 (nearest, ties to even).

The FP4 GEMM then sees ``E2M1(q) * sf8`` and applies ``input_scale`` in ``alpha``; ``qdq`` returns
``E2M1(q) * sf8 * input_scale`` (``E2M1 * e4m3`` is exact in float32, the last product rounds
once: the same value as the GEMM's to float32 rounding). All arithmetic is IEEE float32, as in
the reference (the GPU kernels may use approximate reciprocals, which can differ in the last bit).
Activations larger than the calibrated range saturate (``sf8 = 448``), tiny ones underflow to 0:
the real behaviour of a static-scale W4A4 group.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit

from core.numba_options import NJIT

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

_NO_SCALES = np.empty((0, 0), dtype=np.uint8)


def global_scale(input_scale: float) -> np.float32:
    """``float32(1 / input_scale)``: SGLang's ``input_scale_inv`` (``ValueError`` unless positive, finite)."""
    return _scales(float(input_scale))[0]


@functools.lru_cache(maxsize=4096)
def _scales(input_scale: float) -> tuple[np.float32, np.float32]:
    """``(global_scale, float32(input_scale))``, checked once per value."""
    s = np.float32(input_scale)
    if not (np.isfinite(s) and s > 0):
        raise ValueError(f"nvfp4 input_scale must be a positive finite float32, got {input_scale!r}")
    return np.float32(np.float32(1.0) / s), s


def _rows(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    if k % GROUP:
        raise ValueError(f"nvfp4 activations need K a multiple of {GROUP}, got shape {tuple(x.shape)}")
    flat = x.reshape(-1, k)
    return flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float().contiguous()


def quantize(x: torch.Tensor, input_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``x`` ``[..., K]`` (K a multiple of 16): the E2M1 element values as
    float32 ``[..., K]`` (one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) and the block scales as
    float8_e4m3fn ``[..., K/16]``, per the module docstring."""
    gs, _ = _scales(float(input_scale))
    flat = _rows(x)
    values = torch.empty_like(flat)
    scales = torch.empty(flat.shape[0], flat.shape[1] // GROUP, dtype=torch.uint8)
    if flat.numel():
        _kernel(flat.numpy(), gs, np.float32(1.0), values.numpy(), scales.numpy(), True)
    lead = tuple(x.shape[:-1])
    return values.view(*lead, x.shape[-1]), scales.view(torch.float8_e4m3fn).view(*lead, -1)


def qdq(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """``x`` ``[..., K]`` after the round trip: ``E2M1(q) * sf8 * input_scale`` in float32, one
    fused pass (the values ``quantize`` returns, times their block scale and ``input_scale``)."""
    gs, s = _scales(float(input_scale))
    flat = _rows(x)
    out = torch.empty_like(flat)
    if flat.numel():
        _kernel(flat.numpy(), gs, s, out.numpy(), _NO_SCALES, False)
    return out.view(x.shape)


@njit(**NJIT)
def _e4m3(v, buf):  # pragma: no cover - compiled
    """float32 ``0 <= v <= 448`` rounded to the nearest e4m3 value (ties to even), and its
    float8_e4m3fn byte; ``buf`` is a float32 scratch array of one element."""
    if v >= np.float32(2.0**-6):  # normal: round the float32 mantissa to 3 bits
        buf[0] = v
        bits = buf.view(np.uint32)
        b = bits[0]
        b = (b + np.uint32(0x7FFFF) + ((b >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
        bits[0] = b
        exp = ((b >> np.uint32(23)) & np.uint32(0xFF)) - np.uint32(127 - 7)
        return buf[0], np.uint8((exp << np.uint32(3)) | ((b >> np.uint32(20)) & np.uint32(7)))
    magic = np.float32(2.0**14)  # float32 spacing at 2**14 is 2**-9, the e4m3 subnormal step
    r = np.float32(np.float32(v + magic) - magic)
    return r, np.uint8(int(r * np.float32(2.0**9)))


@njit(**NJIT)
def _kernel(x, gs, input_scale, out, scales, values):  # pragma: no cover - compiled
    """Every row of ``x`` ``[rows, K]``: ``out`` gets the E2M1 values (``values``, with ``scales`` the
    e4m3 bytes ``[rows, K/16]``) or ``E2M1 * sf8 * input_scale``; a block holding a NaN gives NaNs.
    Per row, a first pass gives every element its block's ``out_scale`` and factor; the second is
    branch-free: adding and subtracting ``m`` rounds ``|q|`` to a multiple of the float32 spacing at
    ``m`` (ties to even), which is E2M1's step there (0.5 below 2, 1 below 4, 2 above)."""
    rows, k = x.shape
    rgs = np.float32(np.float32(1.0) / gs)
    six, nsix, zero = np.float32(E2M1_MAX), np.float32(-E2M1_MAX), np.float32(0.0)
    m2, m4, m6 = np.float32(2.0**22), np.float32(2.0**23), np.float32(2.0**24)
    buf = np.empty(1, dtype=np.float32)
    bits = buf.view(np.uint32)
    xb = x.view(np.uint32)
    osc = np.empty(k, dtype=np.float32)
    fac = np.empty(k, dtype=np.float32)
    for r in range(rows):
        xr = x[r]
        orow = out[r]
        br = xb[r]
        for g in range(k // GROUP):
            top = np.uint32(0)  # max |x| on the bit patterns: integer order is value order, NaN on top
            for c in range(GROUP):
                b = br[g * GROUP + c] & np.uint32(0x7FFFFFFF)
                top = b if b > top else top
            nan = top > np.uint32(0x7F800000)
            bits[0] = top
            sf = np.float32(gs * np.float32(buf[0] * np.float32(1.0 / 6.0)))
            sf8, byte = _e4m3(min(sf, np.float32(E4M3_MAX)), buf)
            if values:
                scales[r, g] = byte
            o = zero if sf8 == 0 else np.float32(np.float32(1.0) / np.float32(sf8 * rgs))
            f = np.float32(1.0) if values else sf8
            f = np.float32(np.nan) if nan else f
            for c in range(GROUP):
                osc[g * GROUP + c] = o
                fac[g * GROUP + c] = f
        for j in range(k):
            q = xr[j] * osc[j]
            q = q if q < six else six
            q = q if q > nsix else nsix
            a = abs(q)
            m = m2 if a < np.float32(2.0) else m4
            m = m if a < np.float32(4.0) else m6
            e = (a + m) - m
            e = -e if q < zero else e
            orow[j] = (e * fac[j]) * input_scale

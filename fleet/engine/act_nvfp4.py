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

The quantizer (``fp4_quantize`` = FlashInfer's ``cvt_warp_fp16_to_fp4``; its published Python
reference is ``ref_fp4_quant`` in FlashInfer's tests and ``ref_nvfp4_quant`` in vLLM's
``nvfp4_emulation_utils.py``), per row and per 16 consecutive elements along K, with the global
scale ``gs = float32(1 / input_scale)``:

- ``sf = gs * (amax16 * float32(1/6))``, clamped to 448 (the kernel's ``satfinite`` cast), rounded
  to float8 e4m3 (nearest, ties to even): the block scale ``sf8``;
- ``out_scale = 1 / (sf8 * float32(1 / gs))`` (0 where ``sf8 == 0``);
- each element ``q = x * out_scale``, clamped to +-6, rounded to E2M1 (nearest, ties to even).

The FP4 GEMM then sees ``E2M1(q) * sf8`` and applies ``input_scale`` in ``alpha``; ``qdq`` returns
``E2M1(q) * sf8 * input_scale`` (``E2M1 * e4m3`` is exact in float32, the last product rounds
once: the same value as the GEMM's to float32 rounding). All arithmetic is IEEE float32 (the
CUDA kernel uses approximate reciprocals, ``rcp.approx.ftz``, which can differ in the last bit).
Activations larger than the calibrated range saturate (``sf8 = 448``), tiny ones underflow to 0:
the real behaviour of a static-scale W4A4 group.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

_NJIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy", "boundscheck": False}


def global_scale(input_scale: float) -> np.float32:
    """``float32(1 / input_scale)``: SGLang's ``input_scale_inv`` (``ValueError`` unless positive, finite)."""
    s = np.float32(input_scale)
    if not (np.isfinite(s) and s > 0):
        raise ValueError(f"nvfp4 input_scale must be a positive finite float32, got {input_scale!r}")
    return np.float32(np.float32(1.0) / s)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % GROUP:
        raise ValueError(f"nvfp4 activations need K a multiple of {GROUP}, got shape {tuple(x.shape)}")
    return x.float().reshape(-1, x.shape[-1]).contiguous()


def quantize(x: torch.Tensor, input_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``x`` ``[..., K]`` (K a multiple of 16): the E2M1 element values as
    float32 ``[..., K]`` (one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) and the block scales as
    float8_e4m3fn ``[..., K/16]``, per the module docstring."""
    flat = _rows(x)
    values = torch.empty_like(flat)
    scales = torch.empty(flat.shape[0], flat.shape[1] // GROUP, dtype=torch.uint8)
    if flat.numel():
        gs = global_scale(input_scale)
        _kernel(flat.numpy(), gs, np.float32(1.0), values.numpy(), scales.numpy(), False)
    lead = tuple(x.shape[:-1])
    return values.view(*lead, x.shape[-1]), scales.view(torch.float8_e4m3fn).view(*lead, -1)


def qdq(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """``x`` ``[..., K]`` after the round trip: ``E2M1(q) * sf8 * input_scale`` in float32, one
    fused pass (the values ``quantize`` returns, times their block scale and ``input_scale``)."""
    flat = _rows(x)
    out = torch.empty_like(flat)
    if flat.numel():
        gs = global_scale(input_scale)
        dummy = np.empty((0, 0), dtype=np.uint8)
        _kernel(flat.numpy(), gs, np.float32(input_scale), out.numpy(), dummy, True)
    return out.view(x.shape)


@njit(**_NJIT)
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


@njit(**_NJIT)
def _e2m1(q):  # pragma: no cover - compiled
    """``|q| <= 6`` rounded to the nearest E2M1 magnitude (ties to even), sign kept."""
    a = abs(q)
    if a < np.float32(2.0):
        r = np.float32(np.rint(a * np.float32(2.0)) * np.float32(0.5))
    elif a < np.float32(4.0):
        r = np.float32(np.rint(a))
    else:
        r = np.float32(np.rint(a * np.float32(0.5)) * np.float32(2.0))
    return -r if q < 0 else r


@njit(**_NJIT)
def _kernel(x, gs, input_scale, out, scales, dequantize):  # pragma: no cover - compiled
    rows, k = x.shape
    rcp6 = np.float32(1.0 / 6.0)
    rgs = np.float32(np.float32(1.0) / gs)
    six = np.float32(E2M1_MAX)
    buf = np.empty(1, dtype=np.float32)
    for r in range(rows):
        for g in range(k // GROUP):
            c0 = g * GROUP
            amax = np.float32(0.0)
            nan = False
            for c in range(GROUP):
                a = abs(x[r, c0 + c])
                nan |= a != a
                amax = a if a > amax else amax
            sf = np.float32(gs * np.float32(amax * rcp6))
            sf8, byte = _e4m3(min(sf, np.float32(E4M3_MAX)), buf)
            osc = np.float32(0.0) if sf8 == 0 else np.float32(np.float32(1.0) / np.float32(sf8 * rgs))
            if not dequantize:
                scales[r, g] = byte
            for c in range(GROUP):
                v = x[r, c0 + c]
                if nan:
                    out[r, c0 + c] = np.float32(np.nan)
                    continue
                q = _e2m1(min(max(np.float32(v * osc), -six), six))
                out[r, c0 + c] = np.float32(np.float32(q * sf8) * input_scale) if dequantize else q

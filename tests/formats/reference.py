"""Slow, obviously-correct scalar references for the weight formats (tests only).

One element at a time, in plain Python floats: every float32 operation is the exact double
result rounded once to float32 with ``struct`` (for +, -, *, / of float32 operands the double
result rounds to the same float32 as the exact one, since 53 >= 2*24 + 2). Rounding to a small
format picks the nearest representable value by direct comparison, ties to the even code. Shares
no code with ``weight_sync.formats``; the rules are the published ones:

- fp8: DeepSeek-V3 ``inference/kernel.py`` (amax floored at 1e-4, ``s = amax / 448``, ``x / s``)
  over 128x128 blocks of real elements.
- nvfp4: NVIDIA ModelOpt ``NVFP4QTensor`` (``weight_scale_2``, per-16 e4m3 scales, ``_cast_fp4``).
- mxfp4: torchao ``to_mx`` with FLOOR scaling and ``f32_to_f4_unpacked``.
"""

from __future__ import annotations

import bisect
import math
import struct

import torch


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even, subnormals kept)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def values_of(t: torch.Tensor) -> list[float]:
    """The exact values of a bf16/f16/f32 tensor, decoded from its bits with struct."""
    flat = t.contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        bits = flat.view(torch.int16).tolist()
        return [struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0] for b in bits]
    if t.dtype == torch.float16:
        bits = flat.view(torch.int16).tolist()
        return [struct.unpack("<e", struct.pack("<H", b & 0xFFFF))[0] for b in bits]
    if t.dtype == torch.float32:
        bits = flat.view(torch.int32).tolist()
        return [struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0] for b in bits]
    raise TypeError(t.dtype)


# --- float8 e4m3fn: bias 7, 3 mantissa bits, no inf, 0x7F/0xFF NaN, max 448 ------------------


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


_E4M3 = sorted((e4m3_value(c), c) for c in range(0x7F))  # the finite non-negative codes
_E4M3_VALS = [v for v, _ in _E4M3]
_E4M3_CODES = [c for _, c in _E4M3]


def _nearest_even(a: float, vals: list[float], codes: list[int]) -> int:
    i = bisect.bisect_left(vals, a)
    if i < len(vals) and vals[i] == a:
        return codes[i]
    lo, hi = i - 1, i
    d_lo, d_hi = a - vals[lo], vals[hi] - a  # exact: neighbours within a factor of two
    if d_lo < d_hi:
        return codes[lo]
    if d_hi < d_lo:
        return codes[hi]
    return codes[lo] if codes[lo] % 2 == 0 else codes[hi]


def e4m3_code(v: float) -> int:
    """float8_e4m3fn byte of ``v``: round to nearest even, saturating at +-448; -0.0 -> 0x80."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a >= 448.0:
        return sign | 0x7E
    return sign | _nearest_even(a, _E4M3_VALS, _E4M3_CODES)


# --- FP4 e2m1 ---------------------------------------------------------------------------------

E2M1_POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_magnitude(a: float) -> int:
    """Magnitude code 0..7 of ``a >= 0``: nearest, ties to the even code, saturating at 6."""
    if a >= 6.0:
        return 7
    return _nearest_even(a, E2M1_POS, list(range(8)))


def e2m1_value(code: int) -> float:
    v = E2M1_POS[code & 7]
    return -v if code & 8 else v


def pack(codes: list[int]) -> list[int]:
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


# --- formats ----------------------------------------------------------------------------------

FP8_AMAX_FLOOR = f32(1e-4)


def fp8(t: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """(codes [N][K], scales [ceil(N/128)][ceil(K/128)]) of a 2-D tensor."""
    n, k = t.shape
    flat = values_of(t)
    x = [flat[r * k : (r + 1) * k] for r in range(n)]
    codes = [[0] * k for _ in range(n)]
    scales = []
    for bi in range(0, n, 128):
        row = []
        for bj in range(0, k, 128):
            rows, cols = range(bi, min(n, bi + 128)), range(bj, min(k, bj + 128))
            amax = max(abs(x[r][c]) for r in rows for c in cols)
            s = f32(max(amax, FP8_AMAX_FLOOR) / 448.0)
            row.append(s)
            for r in rows:
                for c in cols:
                    v = max(-448.0, min(448.0, f32(x[r][c] / s)))
                    codes[r][c] = e4m3_code(v)
        scales.append(row)
    return codes, scales


def nvfp4(t: torch.Tensor, weight_scale_2: float | None = None) -> dict:
    """ModelOpt NVFP4 of ``t`` ``[..., K]``: packed bytes, e4m3 scale bytes, weight_scale_2."""
    x = values_of(t)
    amax = max((abs(v) for v in x), default=0.0)
    ws2 = f32(amax / (6.0 * 448.0)) if weight_scale_2 is None else weight_scale_2
    six_ws2 = f32(6.0 * ws2)
    codes, scale_bytes = [], []
    for g in range(0, len(x), 16):
        grp = x[g : g + 16]
        amax_g = max(abs(v) for v in grp)
        if ws2 == 0.0:  # all-zero tensor (defined behaviour beyond ModelOpt's 0/0)
            scale_bytes.append(e4m3_code(1.0))
            codes += [0] * 16
            continue
        s = f32(amax_g / six_ws2)
        if s == 0.0:
            s = 1.0
        s = min(max(s, 2.0**-9), 448.0)
        sb = e4m3_code(s)
        scale_bytes.append(sb)
        d = f32(e4m3_value(sb) * ws2)
        for v in grp:
            q = f32(v / d)
            codes.append(e2m1_magnitude(abs(q)) | (8 if q < 0 else 0))
    return {"weight": pack(codes), "weight_scale": scale_bytes, "weight_scale_2": ws2}


def mxfp4(t: torch.Tensor) -> dict:
    """torchao FLOOR MXFP4 of ``t`` ``[..., K]``: packed bytes (flat) and E8M0 bytes."""
    x = values_of(t)
    blocks, scales = [], []
    for g in range(0, len(x), 32):
        blk = x[g : g + 32]
        amax = max(abs(v) for v in blk)
        if amax == 0.0:
            e = -127
        else:
            _, ex = math.frexp(amax)  # amax = m * 2**ex, 0.5 <= m < 1
            e = max(-127, min(127, (ex - 1) - 2))
        scales.append(e + 127)
        codes = []
        for v in blk:
            q = f32(v * 2.0**-e)
            codes.append(e2m1_magnitude(abs(q)) | (8 if math.copysign(1.0, q) < 0 else 0))
        blocks += pack(codes)
    return {"blocks": blocks, "scales": scales}

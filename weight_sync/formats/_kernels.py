"""Fused quantizer kernels (numba, compiled once and cached on disk): one pass over the input.

Each kernel reads a flat run of weights as the bit patterns of their floats (``uint16`` for
bfloat16, ``uint32`` for float32; callers widen float16 to float32 first), computes a block's
statistics and its codes while the block is in cache, and writes into caller-owned numpy
arrays. All arithmetic is integer bit manipulation or IEEE float32 (``fastmath`` off, so every
division is a correctly rounded float32 division and subnormals are kept), which is what makes
the results bit-identical to the scalar rules in the format modules. Every kernel returns the
largest ``|x|`` it saw as a float32 bit pattern (``>= 0x7F800000`` means NaN or Inf), so callers
refuse non-finite input after the fact. Kernels release the GIL (``nogil``) and are single
threaded: callers run disjoint slices on their own threads.

Keep every piece of kernel code (helpers, intrinsics, constants) in this file: numba's on-disk
cache of a kernel is invalidated by changes to the file that defines it, not to files it uses.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from core.numba_options import NJIT as _JIT

ABS_MASK = 0x7FFFFFFF
INF_BITS = 0x7F800000

# float32 constants (a bare Python float would make numba compute in float64)
_F448 = np.float32(448.0)
_ONE = np.float32(1.0)
_NV_SCALE_MIN = np.float32(2.0**-9)
_FP8_AMAX_FLOOR = np.float32(1e-4)
_DENORM_ADD = np.float32(2.0**14)  # ulp(2**14) in float32 is 2**-9, the e4m3 subnormal step

_E4M3_DENORM_BITS = 141 << 23  # float32 bits of 2**14
_E4M3_MIN_NORMAL_BITS = 121 << 23  # float32 bits of 2**-6
_E4M3_MAX_BITS = 0x43E00000  # float32 bits of 448
_F32_1_BITS = 0x3F800000  # float32 bits of 1.0
_F32_8_BITS = 0x41000000  # float32 bits of 8.0


# --- bit casts -------------------------------------------------------------------------------


@intrinsic
def _i2f(typingctx, bits):
    """float32 whose bit pattern is the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if bits.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif bits.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f2i(typingctx, x):
    """The bit pattern of float32 ``x`` as a non-negative int64."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(x), codegen


def _f32_bits(v):  # pragma: no cover - replaced by the overload inside kernels
    raise NotImplementedError


@overload(_f32_bits, inline="always")
def _f32_bits_impl(v):
    """float32 bit pattern (int64) of one input element: bfloat16 bits widen by a shift."""
    if v == types.uint16:
        return lambda v: np.int64(v) << 16
    if v == types.uint32:
        return lambda v: np.int64(v)
    return None


def _abs_max_start(x):  # pragma: no cover - replaced by the overload inside kernels
    raise NotImplementedError


def _abs_max_step(m, v):  # pragma: no cover - replaced by the overload inside kernels
    raise NotImplementedError


def _abs_max_bits(m):  # pragma: no cover - replaced by the overload inside kernels
    raise NotImplementedError


@intrinsic
def _umax_abs16(typingctx, m, v):
    """``max(m, v & 0x7FFF)`` in 16 bits (a bfloat16 |x| running maximum, 32 lanes per vector)."""
    if m != types.uint16 or v != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        a = builder.and_(args[1], ir.Constant(ir.IntType(16), 0x7FFF))
        return builder.select(builder.icmp_unsigned(">", a, args[0]), a, args[0])

    return types.uint16(m, v), codegen


@overload(_abs_max_start, inline="always")
def _abs_max_start_impl(x):
    """Running |x| maximum of an input array: 0 in its element width (uint16) or int64."""
    if x.dtype == types.uint16:
        return lambda x: np.uint16(0)
    return lambda x: np.int64(0)


@overload(_abs_max_step, inline="always")
def _abs_max_step_impl(m, v):
    if v == types.uint16:
        return lambda m, v: _umax_abs16(m, v)
    return lambda m, v: max(m, np.int64(v) & ABS_MASK)


@overload(_abs_max_bits, inline="always")
def _abs_max_bits_impl(m):
    """A running maximum as the float32 bit pattern (int64) of its value."""
    if m == types.uint16:
        return lambda m: np.int64(m) << 16
    return lambda m: m


# --- element codes: written as 32-bit LLVM operations ----------------------------------------
# (numba widens every integer operation to 64 bits, which halves the vector width; these keep
# the e4m3/e2m1 conversions at 32-bit width.)

_I8, _I32, _F32T = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _c32(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


@intrinsic
def _e4m3(typingctx, q):
    """float8_e4m3fn byte (uint8) of float32 ``q``: round to nearest even, saturating at +-448.

    torch's (c10) float32 -> e4m3fn conversion with a clamp in front, sign bit kept (so -0.0
    and negatives that round to zero give 0x80): below 2**-6 the float32 sum ``|q| + 2**14``
    rounds ``|q|`` to the subnormal step 2**-9 with the FPU's ties-to-even and the sum's low
    bits are the code; above, adding ``0x7FFFF`` plus the mantissa's lowest kept bit rounds the
    mantissa to 3 bits, ties to even, and re-biasing the exponent (127 -> 7) yields the code.
    """
    if not (isinstance(q, types.Float) and q.bitwidth == 32):
        return None

    def codegen(context, builder, sig, args):
        b = builder
        u = b.bitcast(args[0], _I32)
        sign = b.and_(b.lshr(u, _c32(24)), _c32(0x80))
        a = b.and_(u, _c32(ABS_MASK))
        a = b.select(b.icmp_unsigned("<", a, _c32(_E4M3_MAX_BITS)), a, _c32(_E4M3_MAX_BITS))
        summed = b.fadd(b.bitcast(a, _F32T), ir.Constant(_F32T, float(_DENORM_ADD)))
        sub = b.sub(b.bitcast(summed, _I32), _c32(_E4M3_DENORM_BITS))
        odd = b.and_(b.lshr(a, _c32(20)), _c32(1))
        nrm = b.lshr(b.add(b.add(a, _c32(((7 - 127) << 23) + 0x7FFFF)), odd), _c32(20))
        r = b.select(b.icmp_unsigned("<", a, _c32(_E4M3_MIN_NORMAL_BITS)), sub, nrm)
        return b.trunc(b.or_(r, sign), _I8)

    return types.uint8(q), codegen


def _e2m1_codegen(negative_zero_sign: bool):
    """E2M1 by one float32 addition: with ``2**E`` the power of two at or below ``a = min(|q|, 8)``
    (at least 1), ``C = 2**(22 + E)`` has an ulp of ``2**(E - 1)``, the E2M1 spacing around ``a``
    (0.5 below 2, 1 in [2, 4), 2 in [4, 8)), so ``a + C`` rounds ``a`` to the grid with the FPU's
    ties-to-even; its bits minus ``C``'s count the ``k`` grid steps, the code is ``k + 2E``
    (same parity as ``k``: the even code wins a tie), clamped to 7 (6.0) from above."""

    def codegen(context, builder, sig, args):
        b = builder
        u = b.bitcast(args[0], _I32)
        a = b.and_(u, _c32(ABS_MASK))
        a = b.select(b.icmp_unsigned("<", a, _c32(_F32_8_BITS)), a, _c32(_F32_8_BITS))
        e = b.and_(a, _c32(INF_BITS))
        e = b.select(b.icmp_unsigned("<", e, _c32(_F32_1_BITS)), _c32(_F32_1_BITS), e)  # 2**E
        c = b.add(e, _c32(22 << 23))  # 2**(22 + E)
        total = b.bitcast(b.fadd(b.bitcast(a, _F32T), b.bitcast(c, _F32T)), _I32)
        code = b.add(b.sub(total, c), b.sub(b.lshr(e, _c32(22)), _c32(254)))  # k + 2E
        code = b.select(b.icmp_signed("<", code, _c32(7)), code, _c32(7))
        if negative_zero_sign:
            neg = b.icmp_signed("<", u, _c32(0))  # the sign bit
        else:
            neg = b.fcmp_ordered("<", args[0], ir.Constant(_F32T, 0.0))
        code = b.or_(code, b.select(neg, _c32(8), _c32(0)))
        return b.trunc(code, _I8)

    return codegen


@intrinsic
def _e2m1_nv(typingctx, q):
    """E2M1 code (uint8 0..15) of float32 ``q``: nearest, ties to the even code, saturating at 6;
    sign bit iff ``q < 0`` (NVFP4 / ModelOpt: -0.0 gives 0x0)."""
    if not (isinstance(q, types.Float) and q.bitwidth == 32):
        return None
    return types.uint8(q), _e2m1_codegen(False)


@intrinsic
def _e2m1_mx(typingctx, q):
    """As ``_e2m1_nv`` but the sign bit is the float's (MXFP4 / torchao: -0.0 gives 0x8)."""
    if not (isinstance(q, types.Float) and q.bitwidth == 32):
        return None
    return types.uint8(q), _e2m1_codegen(True)


@njit(inline="always")
def _e4m3_value(code):
    """float32 value of a non-negative, non-NaN e4m3fn byte (exact)."""
    c = np.int64(code)
    e, m = c >> 3, c & 7
    normal = _i2f(((e + 120) << 23) | (m << 20))
    sub = np.float32(m) * _NV_SCALE_MIN
    return normal if e > 0 else sub


# --- kernels ---------------------------------------------------------------------------------
# Indices are cast to unsigned (``_u``): numba then skips its negative-index wraparound, which
# otherwise keeps LLVM from vectorizing the inner loops.

_u = np.uint64


@njit(**_JIT)
def abs_max_bits(x):
    """Largest ``|x|`` of the flat array ``x`` as a float32 bit pattern (0 when empty)."""
    m = _abs_max_start(x)
    for i in range(x.size):
        m = _abs_max_step(m, x[_u(i)])
    return _abs_max_bits(m)


@njit(**_JIT)
def fp8_rows(x, n, k, codes, scales):
    """Block FP8 of the ``[n, k]`` row-major weights ``x`` (flat): 128x128 blocks.

    ``codes``: uint8 ``[n * k]``; ``scales``: float32 ``[ceil(n/128) * ceil(k/128)]`` row-major.
    Per block: ``s = max(amax, 1e-4) / 448``, codes ``e4m3(x / s)``. Each 128-row band is read
    twice, row after row (memory order, which the prefetchers follow; the second time from
    cache): first for every block's amax, then for the codes.
    """
    kb = (k + 127) // 128
    top = np.int64(0)
    amax = np.empty(kb, dtype=np.int64)
    band_scales = np.empty(kb, dtype=np.float32)
    for bi in range((n + 127) // 128):
        r0 = bi * 128
        r1 = min(n, r0 + 128)
        for bj in range(kb):
            amax[_u(bj)] = 0
        for r in range(r0, r1):
            for bj in range(kb):
                mb = _abs_max_start(x)
                for i in range(r * k + bj * 128, r * k + min(k, bj * 128 + 128)):
                    mb = _abs_max_step(mb, x[_u(i)])
                amax[_u(bj)] = max(amax[_u(bj)], _abs_max_bits(mb))
        for bj in range(kb):
            m = amax[_u(bj)]
            top = max(top, m)
            s = max(_i2f(m), _FP8_AMAX_FLOOR) / _F448
            scales[_u(bi * kb + bj)] = s
            band_scales[_u(bj)] = s
        for r in range(r0, r1):
            for bj in range(kb):
                s = band_scales[_u(bj)]
                for i in range(r * k + bj * 128, r * k + min(k, bj * 128 + 128)):
                    codes[_u(i)] = _e4m3(_i2f(_f32_bits(x[_u(i)])) / s)
    return top


_BATCH = 256  # groups whose scales are computed together (a few KiB of input: stays in L1)


@njit(**_JIT)
def nvfp4_groups(x, six_ws2, ws2, packed, scales):
    """NVFP4 of the flat weights ``x`` (``len % 16 == 0``) given ``weight_scale_2 = ws2``.

    ``six_ws2`` is the float32 product ``6 * ws2``. Per 16-group: ``s = amax / six_ws2``, 1.0 if
    zero, clamped to [2**-9, 448], e4m3 byte into ``scales`` (uint8 ``[len/16]``); values
    ``x / (e4m3(s) * ws2)`` as E2M1 codes (sign iff < 0), two per byte into ``packed``
    (uint8 ``[len/2]``, even element in the low nibble).
    """
    n_groups = x.size // 16
    top = np.int64(0)
    amax = np.empty(_BATCH, dtype=np.int64)
    div = np.empty(_BATCH, dtype=np.float32)
    codes = np.empty(_BATCH * 16, dtype=np.uint8)
    for g0 in range(0, n_groups, _BATCH):
        nb = min(n_groups - g0, _BATCH)
        xb = x[g0 * 16 : (g0 + nb) * 16]
        for g in range(nb):
            m = np.int64(0)  # (64-bit lanes: faster than 16-bit ones for 16-element groups)
            for i in range(16):
                m = max(m, _f32_bits(xb[_u(g * 16 + i)]) & ABS_MASK)
            amax[_u(g)] = m
        for g in range(nb):
            m = amax[_u(g)]
            top = max(top, m)
            s = _i2f(m) / six_ws2
            s = _ONE if s == 0 else s
            code = _e4m3(min(max(s, _NV_SCALE_MIN), _F448))
            scales[_u(g0 + g)] = code
            div[_u(g)] = _e4m3_value(code) * ws2
        for g in range(nb):
            d = div[_u(g)]
            for i in range(16):
                codes[_u(g * 16 + i)] = _e2m1_nv(_i2f(_f32_bits(xb[_u(g * 16 + i)])) / d)
        _pack(codes, nb * 8, packed[g0 * 8 : (g0 + nb) * 8])
    return top


@njit(inline="always")
def _pack(codes, n, out):
    """``out[j] = codes[2j] | codes[2j + 1] << 4`` for ``j < n``."""
    for j in range(n):
        out[_u(j)] = codes[_u(2 * j)] | (codes[_u(2 * j + 1)] << np.uint8(4))


@njit(**_JIT)
def mxfp4_blocks(x, blocks, scales):
    """MXFP4 of the flat weights ``x`` (``len % 32 == 0``), floor rule.

    Per 32-block: scale byte = clamp(exponent field of amax - 2, 0, 254) into ``scales`` (uint8
    ``[len/32]``); values ``x * 2**-e`` as E2M1 codes with the float's sign bit, two per byte
    into ``blocks`` (uint8 ``[len/2]``, even element in the low nibble).
    """
    n_blocks = x.size // 32
    top = np.int64(0)
    for b in range(n_blocks):
        mb = _abs_max_start(x)
        for i in range(b * 32, b * 32 + 32):
            mb = _abs_max_step(mb, x[_u(i)])
        m = _abs_max_bits(mb)
        top = max(top, m)
        eb = min(max((m >> 23) - 2, 0), 254)
        scales[_u(b)] = np.uint8(eb)
        inv = _i2f((254 - eb) << 23)  # 2**-e, a normal float32: the product is the exact quotient
        for j in range(b * 16, b * 16 + 16):
            q0 = _i2f(_f32_bits(x[_u(2 * j)])) * inv
            q1 = _i2f(_f32_bits(x[_u(2 * j + 1)])) * inv
            blocks[_u(j)] = _e2m1_mx(q0) | (_e2m1_mx(q1) << np.uint8(4))
    return top


@njit(**_JIT)
def e2m1_codes(q, negative_zero_sign, out):
    """E2M1 codes (one per byte) of the float32 values ``q`` into ``out``; returns max |q| bits.

    ``negative_zero_sign``: the sign bit is the float's (MXFP4) rather than ``q < 0`` (NVFP4).
    """
    top = np.int64(0)
    for i in range(q.size):
        v = q[_u(i)]
        top = max(top, _f2i(v) & ABS_MASK)
        out[_u(i)] = _e2m1_mx(v) if negative_zero_sign else _e2m1_nv(v)
    return top

"""``y = x @ W.T`` in float32 with ``W`` stored as bfloat16: a numba kernel.

Why: decoding runs products with few rows (about 8 tokens per expert at 32 running requests),
which are bound by reading the weight. torch has no CPU product of float32 activations with
bfloat16 weights (``mm`` wants one dtype; a bf16 product rounds the activations), so a BF16
checkpoint's weights would have to be widened to float32 (twice the bytes read per step). This
kernel reads the bfloat16 weight and widens each value as it multiplies (a bfloat16 is the top
half of a float32: shift left by 16, exactly), then multiplies in float32 with fused
multiply-adds, so the result is a float32 product of the same values: it differs from
``x @ W.float().T`` only by float32 summation order.

Layout: ``PackedBf16.weight`` is ``W`` ``[n, k]`` bfloat16, row-major. The kernel computes tiles
of 4 rows of ``x`` times 4 rows of ``W`` (16 dot products sharing their loads; LLVM vectorizes
the K loop into lane-wise partial sums, ``FASTMATH_DOT``), one K block at a time: each block's
sums are multiplied by a float32 scale from a per-panel (32 rows of ``W``), per-K-block table
(``PackedBf16.scales``) and added to the result. FP8's 128x128 block scales and NVFP4's
``weight_scale_2`` this way multiply partial sums of exact bfloat16 values (codes, codes times
E4M3 group scales), as the GPU kernels do; unscaled weights use the table ``[1.0]`` and one
block (``x 1.0`` is exact).

Large products are split over ``torch.get_num_threads()`` threads by ``engine.kernels.threads``
(the kernels release the GIL).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numba import njit

from core.numba_options import FASTMATH_DOT, NJIT
from engine.kernels import threads

PANEL = 32  # rows of W sharing one scale per K block; threads split W at multiples of it
TILE = 4  # rows of x and of W per register tile
NO_BLOCK_SHIFT = 62  # the K-block shift of a weight with one scale for all of K
ONE = torch.ones(1)  # the scale table of unscaled weights (x 1.0 is exact)

_DOT = {**NJIT, "fastmath": set(FASTMATH_DOT)}


@dataclass(frozen=True)
class PackedBf16:
    """A weight ``W`` ``[n, k]`` for ``linear``: ``weight`` bfloat16 ``[n, k]``, optionally times
    float32 scales: ``W[r, c] = weight[r, c] * s`` with ``s = scales[(r // 32) * ldk + c // kblock]``
    (``kblock`` a power of two >= 64; 0: one block for all of K). The kernel applies ``s`` to each
    K block's partial sums (FP8's 128x128 block scales, NVFP4's per-tensor ``weight_scale_2``).
    ``scales`` None: no scaling (``ONE``)."""

    weight: torch.Tensor
    n: int
    k: int
    scales: torch.Tensor | None = None
    ldk: int = 0
    kblock: int = 0
    args: tuple[Any, ...] = field(init=False, repr=False, compare=False)  # the kernel's operands

    def __post_init__(self) -> None:
        if self.kblock and (self.kblock < 64 or self.kblock & (self.kblock - 1)):
            raise ValueError(f"kblock must be a power of two >= 64, got {self.kblock}")
        scales, ldk, kshift = self.scale_args()
        object.__setattr__(self, "args", (_bits(self.weight), scales.numpy(), ldk, kshift))

    def scale_args(self) -> tuple[torch.Tensor, int, int]:
        """``(scales, ldk, log2(kblock))`` as the kernel takes them."""
        if self.scales is None:
            return ONE, 0, NO_BLOCK_SHIFT
        shift = self.kblock.bit_length() - 1 if self.kblock else NO_BLOCK_SHIFT
        return self.scales.reshape(-1).contiguous(), self.ldk, shift

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


def exact_in_bf16(w: torch.Tensor) -> bool:
    """Whether every value of ``w`` is a bfloat16 value (all of a BF16 checkpoint, and dequantized
    MXFP4 weights: 2-bit significands times powers of two)."""
    if w.dtype == torch.bfloat16:
        return True
    flat = w.reshape(-1)
    head = flat[:4096]  # a dequantized FP8 / NVFP4 weight fails here, without converting all of it
    if not torch.equal(head.to(torch.bfloat16).to(w.dtype), head):
        return False
    return torch.equal(flat.to(torch.bfloat16).to(w.dtype), flat)


def pack(w: torch.Tensor) -> PackedBf16:
    """``w`` ``[N, K]`` (bfloat16, or float values exact in bfloat16) for ``linear``."""
    n, k = w.shape
    return PackedBf16(w.to(torch.bfloat16).contiguous(), n, k)


def _bits(w: torch.Tensor) -> np.ndarray:
    return w.view(torch.uint16).numpy()


def linear(x: torch.Tensor, w: PackedBf16, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` float32 ``[..., n]`` for ``x`` ``[..., k]`` float32.

    ``out``: write the result there instead (``[rows, n]`` float32 with unit column stride, e.g. a
    block of rows of a larger tensor) and return it. Large products are split by rows of ``W``
    (whole panels) over ``torch.get_num_threads()`` threads.
    """
    if x.dtype != torch.float32 or x.shape[-1] != w.k:
        raise ValueError(f"linear: x must be float32 [..., {w.k}], got {x.dtype} {list(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()
    m = x2.shape[0]
    if out is not None:
        if out.dtype != torch.float32 or tuple(out.shape) != (m, w.n) or (m > 1 and out.stride(1) != 1):
            raise ValueError(f"linear: out must be float32 [{m}, {w.n}] with unit column stride")
        res = out
    else:
        res = torch.empty(m, w.n)
    if m:
        bits, scales, ldk, kshift = w.args
        args = (x2.numpy(), bits, res.numpy(), scales, ldk, kshift)
        n_panels = -(-w.n // PANEL)
        parts = threads.parts(m * w.k * w.n, n_panels)
        calls = [
            (_gemm, (*args, a * PANEL, min(w.n, b * PANEL))) for a, b in threads.split(n_panels, parts)
        ]
        threads.run(calls)
    return res if out is not None else res.view(*lead, w.n)


@dataclass(frozen=True)
class PackedGroup:
    """Weights of the same shape ``[n, k]`` and scale layout, stacked for ``grouped``:
    ``stack`` ``[E, n, k]`` bfloat16, ``scale_stack`` ``[E, S]`` float32; ``weights`` are views of
    the stack (hold these, not the inputs, to keep one copy)."""

    weights: tuple[PackedBf16, ...]
    stack: torch.Tensor
    scale_stack: torch.Tensor
    n: int
    k: int
    ldk: int
    kshift: int

    @classmethod
    def of(cls, weights: list[PackedBf16]) -> PackedGroup:
        n, k = weights[0].shape
        scale_args = [w.scale_args() for w in weights]
        ldk, kshift = scale_args[0][1:]
        sizes = {a[0].numel() for a in scale_args}
        if any(w.shape != (n, k) for w in weights) or any(a[1:] != (ldk, kshift) for a in scale_args):
            raise ValueError("a packed group needs weights of one shape and one scale layout")
        if len(sizes) != 1:
            raise ValueError("a packed group needs scale tables of one size")
        stack = torch.stack([w.weight for w in weights])
        scale_stack = torch.stack([a[0] for a in scale_args]).contiguous()
        views = tuple(
            PackedBf16(stack[e], n, k, w.scales, w.ldk, w.kblock) for e, w in enumerate(weights)
        )
        return cls(views, stack, scale_stack, n, k, ldk, kshift)


def grouped(x: torch.Tensor, offsets: torch.Tensor, group: PackedGroup, out: torch.Tensor) -> torch.Tensor:
    """For every weight ``e`` of ``group``: ``out[a:b] = x[a:b] @ W_e.T`` with ``a, b = offsets[e],
    offsets[e+1]`` (rows sorted by weight, e.g. tokens by expert). ``x`` ``[rows, k]`` and ``out``
    ``[rows, n]`` contiguous float32, ``offsets`` int64 ``[len(group.weights) + 1]`` nondecreasing
    from 0 to ``rows``. Split by weights (balancing rows) over ``torch.get_num_threads()`` threads.
    """
    rows = x.shape[0]
    e = len(group.weights)
    if (
        x.dtype != torch.float32
        or out.dtype != torch.float32
        or not x.is_contiguous()
        or not out.is_contiguous()
        or x.shape != (rows, group.k)
        or out.shape != (rows, group.n)
        or offsets.dtype != torch.int64
        or offsets.shape != (e + 1,)
        or not offsets.is_contiguous()
    ):
        raise ValueError("grouped: x [rows, k], out [rows, n] contiguous float32, offsets int64 [E + 1]")
    args = (
        x.numpy(),
        offsets.numpy(),
        _bits(group.stack),
        out.numpy(),
        group.scale_stack.numpy(),
        group.ldk,
        group.kshift,
    )
    parts = threads.parts(rows * group.k * group.n, e)
    if parts == 1:
        threads.run([(_grouped, (*args, 0, e))])
        return out
    # Cut the weights where the running row count crosses each 1/parts of the rows.
    offs = offsets.tolist()
    bounds = [0, *(bisect.bisect_left(offs, rows * i / parts) for i in range(1, parts)), e]
    threads.run([(_grouped, (*args, a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if a < b])
    return out


# ----------------------------------------------------------------------------- numba kernels


@njit(inline="always")
def _f32(b):  # pragma: no cover - compiled
    """The float32 of bfloat16 bits ``b`` (uint16): the top half of its bits."""
    return np.uint32(np.uint32(b) << np.uint32(16)).view(np.float32)


@njit(**_DOT)
def _gemm(x, w, out, scales, ldk, kshift, n0, n1):  # pragma: no cover - compiled
    """``out[:, n0:n1] = x @ W[n0:n1].T`` (``n0`` a multiple of ``PANEL``): 4 x 4 tiles, the last
    ones clamped (repeated rows / columns are computed and not stored)."""
    m = x.shape[0]
    if kshift >= NO_BLOCK_SHIFT:
        _whole(x, w, out, scales, ldk, n0, n1)
        return
    for n in range(n0, n1, TILE):
        for r in range(0, m, TILE):
            if m - r == 1:
                _tile1(x, w, out, scales, ldk, kshift, r, n, n1)
            else:
                _tile4(x, w, out, scales, ldk, kshift, r, n, m, n1)


@njit(**_DOT)
def _grouped(x, offs, stack, out, scales, ldk, kshift, e0, e1):  # pragma: no cover - compiled
    """``_gemm`` of rows ``offs[e] .. offs[e+1]`` with weight ``e`` for ``e`` in ``[e0, e1)``."""
    n = stack.shape[1]
    for e in range(e0, e1):
        a, b = offs[e], offs[e + 1]
        if b > a:
            _gemm(x[a:b], stack[e], out[a:b], scales[e], ldk, kshift, 0, n)


@njit(inline="always")
def _block(k, kshift):  # pragma: no cover - compiled
    """The K block of a scale table: all of K, or ``2**kshift``."""
    return k if kshift >= NO_BLOCK_SHIFT else 1 << kshift


@njit(inline="always")
def _dot4x4(xa, xb, xc, xd, w0, w1, w2, w3):  # pragma: no cover - compiled
    """The 16 dot products of 4 float32 rows with 4 bfloat16 rows (all of one length)."""
    z = np.float32(0.0)
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = z
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = z
    for c in range(xa.shape[0]):
        f0, f1, f2, f3 = _f32(w0[c]), _f32(w1[c]), _f32(w2[c]), _f32(w3[c])
        p, q, u, v = xa[c], xb[c], xc[c], xd[c]
        a00 += p * f0
        a01 += p * f1
        a02 += p * f2
        a03 += p * f3
        a10 += q * f0
        a11 += q * f1
        a12 += q * f2
        a13 += q * f3
        a20 += u * f0
        a21 += u * f1
        a22 += u * f2
        a23 += u * f3
        a30 += v * f0
        a31 += v * f1
        a32 += v * f2
        a33 += v * f3
    return (a00, a01, a02, a03), (a10, a11, a12, a13), (a20, a21, a22, a23), (a30, a31, a32, a33)


@njit(inline="always")
def _dot1x4(xa, w0, w1, w2, w3):  # pragma: no cover - compiled
    """The 4 dot products of a float32 row with 4 bfloat16 rows (all of one length)."""
    z = np.float32(0.0)
    a0 = a1 = a2 = a3 = z
    for c in range(xa.shape[0]):
        p = xa[c]
        a0 += p * _f32(w0[c])
        a1 += p * _f32(w1[c])
        a2 += p * _f32(w2[c])
        a3 += p * _f32(w3[c])
    return a0, a1, a2, a3


@njit(inline="always")
def _axpy4(t, p, s):  # pragma: no cover - compiled
    """``t + p * s`` for 4-tuples ``t``, ``p``."""
    return t[0] + p[0] * s, t[1] + p[1] * s, t[2] + p[2] * s, t[3] + p[3] * s


@njit(inline="always")
def _tile4(x, w, out, scales, ldk, kshift, r, n, m, n1):  # pragma: no cover - compiled
    """``out[r:r+4, n:n+4]`` (rows below ``m``, columns below ``n1``), K block by K block (the
    dot products run over slices: a loop from 0 vectorizes)."""
    k = x.shape[1]
    ra, rb, rc, rd = r, min(r + 1, m - 1), min(r + 2, m - 1), min(r + 3, m - 1)
    c0, c1, c2, c3 = n, min(n + 1, n1 - 1), min(n + 2, n1 - 1), min(n + 3, n1 - 1)
    srow = (n // PANEL) * ldk
    block = _block(k, kshift)
    z = np.float32(0.0)
    t0 = t1 = t2 = t3 = (z, z, z, z)
    if block == k:  # one block: whole rows
        p0, p1, p2, p3 = _dot4x4(x[ra], x[rb], x[rc], x[rd], w[c0], w[c1], w[c2], w[c3])
        s = scales[srow]
        t0, t1, t2, t3 = _axpy4(t0, p0, s), _axpy4(t1, p1, s), _axpy4(t2, p2, s), _axpy4(t3, p3, s)
        block = k + 1  # skip the loop below
    for k0 in range(0, k if block <= k else 0, block):
        k1 = min(k, k0 + block)
        p0, p1, p2, p3 = _dot4x4(
            x[ra, k0:k1], x[rb, k0:k1], x[rc, k0:k1], x[rd, k0:k1],
            w[c0, k0:k1], w[c1, k0:k1], w[c2, k0:k1], w[c3, k0:k1],
        )  # fmt: skip
        s = scales[srow + (k0 >> kshift)]
        t0, t1, t2, t3 = _axpy4(t0, p0, s), _axpy4(t1, p1, s), _axpy4(t2, p2, s), _axpy4(t3, p3, s)
    _store4(out, r, n, m, n1, t0)
    _store4(out, r + 1, n, m, n1, t1)
    _store4(out, r + 2, n, m, n1, t2)
    _store4(out, r + 3, n, m, n1, t3)


@njit(inline="always")
def _tile1(x, w, out, scales, ldk, kshift, r, n, n1):  # pragma: no cover - compiled
    """``out[r, n:n+4]`` (columns below ``n1``)."""
    k = x.shape[1]
    c0, c1, c2, c3 = n, min(n + 1, n1 - 1), min(n + 2, n1 - 1), min(n + 3, n1 - 1)
    srow = (n // PANEL) * ldk
    block = _block(k, kshift)
    z = np.float32(0.0)
    t = (z, z, z, z)
    for k0 in range(0, k, block):
        k1 = min(k, k0 + block)
        p = _dot1x4(x[r, k0:k1], w[c0, k0:k1], w[c1, k0:k1], w[c2, k0:k1], w[c3, k0:k1])
        t = _axpy4(t, p, scales[srow + (k0 >> kshift)])
    _store4(out, r, n, r + 1, n1, t)


@njit(inline="always")
def _store4(out, r, n, m, n1, v):  # pragma: no cover - compiled
    """``out[r, n:n+4] = v`` where ``r < m`` and the column is below ``n1``."""
    if r < m:
        for j in range(4):
            if n + j < n1:
                out[r, n + j] = v[j]


@njit(inline="always")
def _whole(x, w, out, scales, ldk, n0, n1):  # pragma: no cover - compiled
    """``_gemm`` of a weight with one scale per panel for all of K (one K block)."""
    m, k = x.shape
    for n in range(n0, n1, TILE):
        w0, w1, w2, w3 = w[n], w[min(n + 1, n1 - 1)], w[min(n + 2, n1 - 1)], w[min(n + 3, n1 - 1)]
        s = scales[(n // PANEL) * ldk]
        for r in range(0, m, TILE):
            if m - r == 1:
                _store4(out, r, n, m, n1, _scale4(_dot1x4(x[r], w0, w1, w2, w3), s))
                continue
            p0, p1, p2, p3 = _dot4x4(
                x[r], x[min(r + 1, m - 1)], x[min(r + 2, m - 1)], x[min(r + 3, m - 1)], w0, w1, w2, w3
            )
            _store4(out, r, n, m, n1, _scale4(p0, s))
            _store4(out, r + 1, n, m, n1, _scale4(p1, s))
            _store4(out, r + 2, n, m, n1, _scale4(p2, s))
            _store4(out, r + 3, n, m, n1, _scale4(p3, s))


@njit(inline="always")
def _scale4(p, s):  # pragma: no cover - compiled
    """``p * s`` for a 4-tuple ``p`` (as ``0 + p * s``: one rounding)."""
    return p[0] * s, p[1] * s, p[2] * s, p[3] * s

"""``y = x @ W.T`` in float32 with ``W`` stored as bfloat16: a numba kernel.

Why: decoding runs products with few rows (about 8 tokens per expert at 32 running requests),
which are bound by reading the weight. torch has no CPU product of float32 activations with
bfloat16 weights (``mm`` wants one dtype; a bf16 product rounds the activations), so a BF16
checkpoint's weights would have to be widened to float32 (twice the bytes read per step). This
kernel reads the bfloat16 weight and widens each value as it multiplies (a bfloat16 is the top
half of a float32: shift left by 16, exactly), then multiplies in float32 with fused
multiply-adds, so the result is a float32 product of the same values: it differs from
``x @ W.float().T`` only by float32 summation order.

Layout: ``PackedBf16.weight`` is ``W`` ``[n, k]`` as panels ``[ceil(n/32), k, 32]`` bfloat16 (32
rows of ``W`` per panel, the last zero-padded), so a register tile of 4 rows of ``x`` times one
panel reads the panel as one contiguous stream, 64 bytes per K step. The tile's 4 x 32 sums are
16-lane tuples (one vector register each once LLVM's SLP vectorizer packs them: the kernels are
compiled with ``NUMBA_SLP_VECTORIZE=1``, numba's documented switch, set here unless the
environment sets it). Each K step asks the CPU for the stream's line ``PREFETCH`` elements ahead
(``llvm.prefetch``, emitted through ``numba.extending.intrinsic``): the panels of one weight, and
the weights of a group, are contiguous, so the hint runs on into the next panel.

Summation order, the same for every tile, thread split and call: for each output, each 64-wide K
chunk is summed in K order with fused multiply-adds (``contract`` only, no reassociation), and
each chunk's sum ``p`` is added to the total as ``t + s * p`` (one fused multiply-add) in chunk
order, with ``s`` a float32 scale from a per-panel, per-K-block table (``PackedBf16.scales``):
FP8's 128x128 block scales and NVFP4's ``weight_scale_2`` this way multiply partial sums of exact
bfloat16 values (codes, codes times E4M3 group scales), as the GPU kernels do; unscaled weights
use the table ``[1.0]`` (``0 + 1 * p`` is exact).

Large products are split over ``torch.get_num_threads()`` threads by ``engine.kernels.threads``
(the kernels release the GIL).
"""

from __future__ import annotations

import bisect
import functools
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from core.numba_options import NJIT
from core.parallel import split
from engine.kernels import threads

# numba reads its environment again before each compilation (numba.core.config.reload_config)
os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")

PANEL = 32  # rows of W per panel (one scale per K block each); threads split W at panels
TILE = 4  # rows of x per register tile
CHUNK = 64  # K steps summed in registers before a chunk's sum is added to the total
NO_BLOCK_SHIFT = 62  # the K-block shift of a weight with one scale for all of K
PREFETCH = 2048  # elements (4 KB) ahead in a panel's stream: the line the tile asks the CPU for
ONE = torch.ones(1)  # the scale table of unscaled weights (x 1.0 is exact)

_TILE = {**NJIT, "fastmath": {"contract"}}


def panels_of(rows: torch.Tensor) -> torch.Tensor:
    """Bfloat16 ``rows`` ``[n, k]`` as panels ``[ceil(n/32), k, 32]`` (the last zero-padded)."""
    n, k = rows.shape
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        rows = torch.cat([rows, rows.new_zeros(padded - n, k)])
    return rows.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class PackedBf16:
    """A weight ``W`` ``[n, k]`` for ``linear``: ``weight`` bfloat16 panels ``[ceil(n/32), k, 32]``
    (``panels_of``), optionally times float32 scales: ``W[r, c] = weight[r // 32, c, r % 32] * s``
    with ``s = scales[(r // 32) * ldk + c // kblock]``
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

    def rows(self) -> torch.Tensor:
        """The stored bfloat16 values as ``[n, k]`` rows (unscaled; a copy)."""
        return self.weight.transpose(1, 2).reshape(-1, self.k)[: self.n].clone()


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
    return PackedBf16(panels_of(w.to(torch.bfloat16)), n, k)


def _bits(w: torch.Tensor) -> np.ndarray:
    return w.view(torch.uint16).numpy()


def _transposed(x: torch.Tensor) -> np.ndarray:
    """``x`` ``[m, k]`` as the kernels read it: ``x.T`` ``[k, m + 3]`` (3 zero columns: a tile of 4
    rows reads 4 adjacent values of a column, and stores only the rows it has)."""
    m, k = x.shape
    xt = np.zeros((k, m + TILE - 1), np.float32)
    xt[:, :m] = x.numpy().T
    return xt


def linear(x: torch.Tensor, w: PackedBf16, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` float32 ``[..., n]`` for ``x`` ``[..., k]`` float32.

    ``out``: write the result there instead (``[rows, n]`` float32 with unit column stride, e.g. a
    block of rows of a larger tensor) and return it. Large products are split by panels of ``W``
    over ``torch.get_num_threads()`` threads.
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
        args = (_transposed(x2), 0, m, bits, res.numpy(), scales, ldk, kshift)
        n_panels = -(-w.n // PANEL)
        parts = threads.parts(m * w.k * w.n, n_panels)
        threads.WORKERS.run([functools.partial(_gemm, *args, a, b) for a, b in split(n_panels, parts)])
    return res if out is not None else res.view(*lead, w.n)


@dataclass(frozen=True)
class PackedGroup:
    """Weights of the same shape ``[n, k]`` and scale layout, stacked for ``grouped``:
    ``stack`` ``[E, ceil(n/32), k, 32]`` bfloat16 panels, ``scale_stack`` ``[E, S]`` float32;
    ``weights`` are views of the stack (hold these, not the inputs, to keep one copy)."""

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
        views = tuple(PackedBf16(stack[e], n, k, w.scales, w.ldk, w.kblock) for e, w in enumerate(weights))
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
        _transposed(x),
        offsets.numpy(),
        _bits(group.stack),
        out.numpy(),
        group.scale_stack.numpy(),
        group.ldk,
        group.kshift,
    )
    parts = threads.parts(rows * group.k * group.n, e)
    if parts == 1:
        _grouped(*args, 0, e)
        return out
    # Cut the weights where the running row count crosses each 1/parts of the rows.
    offs = offsets.tolist()
    bounds = [0, *(bisect.bisect_left(offs, rows * i / parts) for i in range(1, parts)), e]
    cuts = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if a < b]
    threads.WORKERS.run([functools.partial(_grouped, *args, a, b) for a, b in cuts])
    return out


# ----------------------------------------------------------------------------- numba kernels


@njit(inline="always")
def _f32(b):  # pragma: no cover - compiled
    """The float32 of bfloat16 bits ``b`` (uint16): the top half of its bits."""
    return np.uint32(np.uint32(b) << np.uint32(16)).view(np.float32)


@njit(**_TILE)
def _gemm(xt, r0, r1, w, out, scales, ldk, kshift, p0, p1):  # pragma: no cover - compiled
    """``out[r0:r1, 32 p0 : 32 p1] = x[r0:r1] @ W[32 p0 : 32 p1].T`` (columns below ``out``'s
    width) from ``xt = x.T`` ``[K, >= r1 + 3]`` and panels ``w`` ``[P, K, 32]``: tiles of 4 rows
    (one for a last single row) x 32 columns."""
    for t in range(p0, p1):
        for r in range(r0, r1, TILE):
            if r1 - r == 1:
                _tile1(xt, w[t], out, scales, t * ldk, kshift, r, t * PANEL)
            else:
                _tile4(xt, w[t], out, scales, t * ldk, kshift, r, r1, t * PANEL)


@njit(**_TILE)
def _grouped(xt, offs, stack, out, scales, ldk, kshift, e0, e1):  # pragma: no cover - compiled
    """``_gemm`` of rows ``offs[e] .. offs[e+1]`` with weight ``e`` for ``e`` in ``[e0, e1)``."""
    p = stack.shape[1]
    for e in range(e0, e1):
        if offs[e + 1] > offs[e]:
            _gemm(xt, offs[e], offs[e + 1], stack[e], out, scales[e], ldk, kshift, 0, p)


@njit(inline="always")
def _tile4(xt, w, out, scales, srow, kshift, r, r1, n):  # pragma: no cover - compiled
    """``out[r:r+4, n:n+32]`` (rows below ``r1``, columns below ``out``'s width) from one panel
    ``w`` ``[K, 32]``: chunk sums in registers, added to the totals times the chunk's scale."""
    k = xt.shape[0]
    u, one = np.uint64(r), np.uint64(1)  # unsigned: no negative-index check, adjacent loads
    z = _zero16()
    ta = tb = tc = td = te = tf = tg = th = z
    for k0 in range(0, k, CHUNK):
        pa = pb = pc = pd = pe = pf = pg = ph = z
        wk, xk = w[k0 : k0 + CHUNK], xt[k0 : k0 + CHUNK]  # from 0: no negative-index checks
        for c in range(wk.shape[0]):
            _prefetch(wk, c * PANEL + PREFETCH)
            lo, hi = _load16(wk[c], 0), _load16(wk[c], 16)
            v = xk[c]
            xa, xb, xc, xd = v[u], v[u + one], v[u + np.uint64(2)], v[u + np.uint64(3)]
            pa, pb = _fma16(pa, xa, lo), _fma16(pb, xa, hi)
            pc, pd = _fma16(pc, xb, lo), _fma16(pd, xb, hi)
            pe, pf = _fma16(pe, xc, lo), _fma16(pf, xc, hi)
            pg, ph = _fma16(pg, xd, lo), _fma16(ph, xd, hi)
        s = scales[srow + (k0 >> kshift)]
        ta, tb, tc, td = _fma16(ta, s, pa), _fma16(tb, s, pb), _fma16(tc, s, pc), _fma16(td, s, pd)
        te, tf, tg, th = _fma16(te, s, pe), _fma16(tf, s, pf), _fma16(tg, s, pg), _fma16(th, s, ph)
    _store(out, r, r1, n, ta, tb)
    _store(out, r + 1, r1, n, tc, td)
    _store(out, r + 2, r1, n, te, tf)
    _store(out, r + 3, r1, n, tg, th)


@njit(inline="always")
def _tile1(xt, w, out, scales, srow, kshift, r, n):  # pragma: no cover - compiled
    """``out[r, n:n+32]`` (columns below ``out``'s width): ``_tile4`` of one row."""
    k = xt.shape[0]
    z = _zero16()
    ta = tb = z
    for k0 in range(0, k, CHUNK):
        pa = pb = z
        for c in range(k0, min(k, k0 + CHUNK)):
            xa = xt[c, r]
            pa, pb = _fma16(pa, xa, _load16(w[c], 0)), _fma16(pb, xa, _load16(w[c], 16))
        s = scales[srow + (k0 >> kshift)]
        ta, tb = _fma16(ta, s, pa), _fma16(tb, s, pb)
    _store(out, r, r + 1, n, ta, tb)


@intrinsic
def _prefetch(typingctx, arr, offset):  # pragma: no cover - compiled
    """Ask the CPU to start loading the cache line of element ``offset`` of ``arr``'s data (counted
    from its first element; past the end is allowed: ``llvm.prefetch`` never faults)."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.gep(data, [args[1]])
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.void(arr, offset), codegen


@njit(inline="always")
def _zero16():  # pragma: no cover - compiled
    z = np.float32(0.0)
    return (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)


@njit(inline="always")
def _load16(v, j):  # pragma: no cover - compiled
    """The float32 of bfloat16 bits ``v[j : j + 16]``."""
    return (
        _f32(v[j]), _f32(v[j + 1]), _f32(v[j + 2]), _f32(v[j + 3]),
        _f32(v[j + 4]), _f32(v[j + 5]), _f32(v[j + 6]), _f32(v[j + 7]),
        _f32(v[j + 8]), _f32(v[j + 9]), _f32(v[j + 10]), _f32(v[j + 11]),
        _f32(v[j + 12]), _f32(v[j + 13]), _f32(v[j + 14]), _f32(v[j + 15]),
    )  # fmt: skip


@njit(inline="always")
def _fma16(a, p, f):  # pragma: no cover - compiled
    """``a + p * f`` lane by lane (one rounding: ``contract``) for 16-tuples ``a``, ``f``."""
    return (
        a[0] + p * f[0], a[1] + p * f[1], a[2] + p * f[2], a[3] + p * f[3],
        a[4] + p * f[4], a[5] + p * f[5], a[6] + p * f[6], a[7] + p * f[7],
        a[8] + p * f[8], a[9] + p * f[9], a[10] + p * f[10], a[11] + p * f[11],
        a[12] + p * f[12], a[13] + p * f[13], a[14] + p * f[14], a[15] + p * f[15],
    )  # fmt: skip


@njit(inline="always")
def _store(out, r, r1, n, lo, hi):  # pragma: no cover - compiled
    """``out[r, n:n+32] = lo + hi`` (concatenated) where ``r < r1`` and the columns are in ``out``."""
    if r >= r1:
        return
    width = out.shape[1]
    if n + 32 <= width:  # a whole panel: lane by lane, in order
        _put16(out[r], n, lo)
        _put16(out[r], n + 16, hi)
    else:
        for j in range(16):
            if n + j < width:
                out[r, n + j] = lo[j]
            if n + 16 + j < width:
                out[r, n + 16 + j] = hi[j]


@njit(inline="always")
def _put16(o, n, v):  # pragma: no cover - compiled
    """``o[n : n + 16] = v``."""
    o[n], o[n + 1], o[n + 2], o[n + 3] = v[0], v[1], v[2], v[3]
    o[n + 4], o[n + 5], o[n + 6], o[n + 7] = v[4], v[5], v[6], v[7]
    o[n + 8], o[n + 9], o[n + 10], o[n + 11] = v[8], v[9], v[10], v[11]
    o[n + 12], o[n + 13], o[n + 14], o[n + 15] = v[12], v[13], v[14], v[15]

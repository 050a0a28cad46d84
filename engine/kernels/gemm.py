"""``y = x @ W.T`` in float32 with ``W`` stored as bfloat16: a small GEMM kernel JIT-compiled by LLVM.

Why: decoding runs products with few rows (about 8 tokens per expert at 32 running requests), which
are bound by reading the weight and by the GEMM's small-M efficiency. torch has no CPU product of
float32 activations with bfloat16 weights (``mm`` wants one dtype; oneDNN's bf16 path rounds the
activations), so a BF16 checkpoint's weights would have to be widened to float32 (twice the bytes
read per step). This kernel reads the bfloat16 weight and widens it in registers (a bfloat16 is
the top half of a float32: shift left by 16, exactly), then multiplies in float32 with fused
multiply-adds, so the result is a float32 product of the same values: it differs from
``x @ W.float().T`` only by float32 summation order.

Layout: ``pack(W)`` stores ``W`` ``[N, K]`` as panels ``[ceil(N/32), K, 32]`` bfloat16 (32 output
columns per panel, zero-padded to a multiple of 32), so the kernel streams each panel once.
The kernel keeps a tile of up to 12 rows x 32 columns of accumulators in registers and sums K in
chunks of 64 (each chunk's sum is added to the output), which keeps float32 rounding close to a
blocked GEMM's. Each chunk's sum is multiplied by a float32 scale first, from a per-panel, per-K-
block table (``PackedBf16.scales``): FP8's 128x128 block scales and NVFP4's ``weight_scale_2``
this way multiply partial sums of exact bfloat16 values (codes, codes times E4M3 group scales),
as the GPU kernels do; unscaled weights use the table ``[1.0]`` (the product is exact, so their
results are unchanged bit for bit).

Each K step prefetches the weight line 2 KB ahead (the panels of one weight are contiguous, so
this runs on into the next panel).

The kernel is written in LLVM IR and compiled for the host CPU by ``engine.kernels.threads`` on first
use (both variants); where that is impossible ``available()`` is False and callers use their
float32 path. Large products are split over ``torch.get_num_threads()`` threads (``threads.run``).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels import threads

log = logging.getLogger("mixfleet.engine.kernels")

PANEL = 32  # output columns per panel: two 16-float vectors
MAX_ROWS = 12  # rows per register tile: 24 accumulators + 2 weight vectors + 1 broadcast <= 32
K_CHUNK = 64  # K steps summed in registers before they are added to the output
NO_BLOCK_SHIFT = 62  # the K-block shift of a weight with one scale for all of K
ONE = torch.ones(1)  # the scale table of unscaled weights (x 1.0 is exact)
PREFETCH_BYTES = 2048  # prefetch distance in the weight stream (one line per K step)


@dataclass(frozen=True)
class PackedBf16:
    """A weight ``W`` ``[n, k]`` packed for ``linear``: ``panels`` ``[ceil(n/32), k, 32]`` bfloat16,
    optionally times float32 scales: ``W[r, c] = panels[r // 32, c, r % 32] * s`` with
    ``s = scales[(r // 32) * ldk + c // kblock]`` (``kblock`` a power of two >= 64; 0: one block
    for all of K). The kernel applies ``s`` to each 64-wide K chunk's partial sums (one scale per
    panel and K block: FP8's 128x128 block scales, NVFP4's per-tensor ``weight_scale_2``).
    ``scales`` None: no scaling (``ONE``)."""

    panels: torch.Tensor
    n: int
    k: int
    scales: torch.Tensor | None = None
    ldk: int = 0
    kblock: int = 0

    def __post_init__(self) -> None:
        if self.kblock and (self.kblock < K_CHUNK or self.kblock & (self.kblock - 1)):
            raise ValueError(f"kblock must be a power of two >= {K_CHUNK}, got {self.kblock}")

    def scale_args(self) -> tuple[int, int, int]:
        """``(scales pointer, ldk, log2(kblock))`` as the kernel takes them."""
        if self.scales is None:
            return ONE.data_ptr(), 0, NO_BLOCK_SHIFT
        shift = self.kblock.bit_length() - 1 if self.kblock else NO_BLOCK_SHIFT
        return self.scales.data_ptr(), self.ldk, shift

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
    """``w`` ``[N, K]`` (bfloat16, or float values exact in bfloat16) as panels; see the module doc."""
    n, k = w.shape
    padded = -(-n // PANEL) * PANEL
    b = w.to(torch.bfloat16)
    if padded != n:
        b = torch.cat([b, b.new_zeros(padded - n, k)])
    panels = b.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()
    return PackedBf16(panels, n, k)


def linear(x: torch.Tensor, w: PackedBf16, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` float32 ``[..., n]`` for ``x`` ``[..., k]`` float32 (``available()`` must be True).

    ``out``: write the result there instead (``[rows, n]`` float32 with unit column stride, e.g. a
    block of rows of a larger tensor; ``n`` must then be a multiple of 32) and return it.
    Large products are split by output columns over ``torch.get_num_threads()`` threads.
    """
    fns = _kernel()
    assert fns is not None, "the bf16-weight kernel is not available"
    if x.dtype != torch.float32 or x.shape[-1] != w.k:
        raise ValueError(f"linear: x must be float32 [..., {w.k}], got {x.dtype} {list(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()
    m = x2.shape[0]
    n_panels = w.panels.shape[0]
    padded = n_panels * PANEL
    if out is not None:
        if (
            out.dtype != torch.float32
            or tuple(out.shape) != (m, w.n)
            or padded != w.n
            or (m > 1 and out.stride(1) != 1)
        ):
            raise ValueError(f"linear: out must be float32 [{m}, {w.n}] rows, n a multiple of {PANEL}")
        res, ldo = out, out.stride(0)
    else:
        res, ldo = torch.empty(m, padded), padded
    if m:
        args = (x2.data_ptr(), m, w.k, w.panels.data_ptr(), ldo, res.data_ptr(), *w.scale_args())
        parts = threads.parts(m * w.k * padded, n_panels)
        fn = fns.gemm if w.scales is None else fns.gemm_scaled
        threads.run([(fn, (*args, a, b)) for a, b in threads.split(n_panels, parts)])
    if out is not None:
        return out
    if padded != w.n:
        res = res[:, : w.n].contiguous()
    return res.view(*lead, w.n)


@dataclass(frozen=True)
class PackedGroup:
    """Weights of the same shape ``[n, k]`` (``n`` a multiple of 32), packed, with a table of their
    panels' addresses for ``grouped`` (the tensors are kept alive here)."""

    weights: tuple[PackedBf16, ...]
    table: torch.Tensor  # int64 [len(weights)]: panel data pointers
    n: int
    k: int
    scale_table: torch.Tensor  # int64 [len(weights)]: scale table pointers (all share ldk, kshift)
    ldk: int
    kshift: int
    scaled: bool  # some weight has a scale table (the scaled kernel runs)

    @classmethod
    def of(cls, weights: list[PackedBf16]) -> PackedGroup:
        n, k = weights[0].shape
        scale_args = [w.scale_args() for w in weights]
        ldk, kshift = scale_args[0][1:]
        if (
            any(w.shape != (n, k) for w in weights)
            or n % PANEL
            or any(a[1:] != (ldk, kshift) for a in scale_args)
        ):
            raise ValueError(
                f"a packed group needs weights of one shape with n a multiple of {PANEL} and one scale layout"
            )
        table = torch.tensor([w.panels.data_ptr() for w in weights], dtype=torch.int64)
        scale_table = torch.tensor([a[0] for a in scale_args], dtype=torch.int64)
        scaled = any(w.scales is not None for w in weights)
        return cls(tuple(weights), table, n, k, scale_table, ldk, kshift, scaled)


def grouped(x: torch.Tensor, offsets: torch.Tensor, group: PackedGroup, out: torch.Tensor) -> torch.Tensor:
    """For every weight ``e`` of ``group``: ``out[a:b] = x[a:b] @ W_e.T`` with ``a, b = offsets[e],
    offsets[e+1]`` (rows sorted by weight, e.g. tokens by expert). ``x`` ``[rows, k]`` and ``out``
    ``[rows, n]`` contiguous float32, ``offsets`` int64 ``[len(group.weights) + 1]`` nondecreasing
    from 0 to ``rows``. Split by weights (balancing rows) over ``torch.get_num_threads()`` threads.
    """
    fns = _kernel()
    assert fns is not None, "the bf16-weight kernel is not available"
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
        x.data_ptr(),
        offsets.data_ptr(),
        group.table.data_ptr(),
        group.k,
        group.n,
        out.data_ptr(),
        group.n // PANEL,
        group.scale_table.data_ptr(),
        group.ldk,
        group.kshift,
    )
    parts = threads.parts(rows * group.k * group.n, e)
    fn = fns.grouped_scaled if group.scaled else fns.grouped
    if parts == 1:
        threads.run([(fn, (*args, 0, e))])
        return out
    # Cut the weights where the running row count crosses each 1/parts of the rows.
    offs = offsets.tolist()
    bounds = [0, *(bisect.bisect_left(offs, rows * i / parts) for i in range(1, parts)), e]
    threads.run([(fn, (*args, a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if a < b])
    return out


def available() -> bool:
    """Whether the kernel compiled on this machine (compiles it on the first call)."""
    return _kernel() is not None


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _kernel() -> Any:
    if "fn" in _state:
        return _state["fn"]
    with _lock:
        if "fn" not in _state:
            try:
                _state["engine"], _state["fn"] = _compile()
            except Exception as exc:  # no llvmlite, an LLVM too old for the IR, an odd target
                log.warning("bf16-weight GEMM kernel unavailable, using float32 weights: %s", exc)
                _state["fn"] = None
    return _state["fn"]


def _compile() -> tuple[threads.Compiled, _Fns]:
    mod = threads.compile_ir(_ir())
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    gemm = (ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64)
    grouped = (ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64)
    return mod, _Fns(
        mod.function("gemm_bf16w", *gemm),
        mod.function("gemm_grouped", *grouped),
        mod.function("gemm_bf16w_s", *gemm),
        mod.function("gemm_grouped_s", *grouped),
    )


@dataclass(frozen=True)
class _Fns:
    gemm: Any
    grouped: Any
    gemm_scaled: Any
    grouped_scaled: Any


def _tile(rows: int, scaled: bool) -> str:
    """``@tile{rows}(x, ldx, w, kc, out, ldo, add, s)``: ``out[r, 0:32] (+)= sum_{k < kc} x[r, k] *
    w[k, 0:32]`` for ``r < rows``; ``w`` points into a panel (32 bfloat16 per k). ``scaled``:
    ``@stile{rows}``, which multiplies the sum by ``s`` first (the unscaled tile ignores ``s``: no
    multiply in the loop's store phase of unscaled weights)."""
    idx = ", ".join
    lo = idx(f"i32 {i}" for i in range(16))
    hi = idx(f"i32 {i}" for i in range(16, 32))
    sixteen = idx("i32 16" for _ in range(32))
    s = [
        f"define internal void @{'s' if scaled else ''}tile{rows}(ptr noalias %x, i64 %ldx, "
        "ptr noalias %w, i64 %kc, ptr noalias %out, i64 %ldo, i1 %add, float %s) alwaysinline {",
        "entry:",
        "  %sv = insertelement <16 x float> poison, float %s, i32 0",
        "  %sb = shufflevector <16 x float> %sv, <16 x float> poison, <16 x i32> zeroinitializer",
        "  br label %loop",
        "loop:",
        "  %k = phi i64 [0, %entry], [%k1, %loop]",
    ]
    for r in range(rows):
        for h in range(2):
            s.append(f"  %a{r}_{h} = phi <16 x float> [zeroinitializer, %entry], [%n{r}_{h}, %loop]")
    s += [
        "  %wo = mul i64 %k, 32",
        "  %wp = getelementptr i16, ptr %w, i64 %wo",
        "  %wv = load <32 x i16>, ptr %wp, align 2",
        f"  %pf = getelementptr i8, ptr %wp, i64 {PREFETCH_BYTES}",
        "  call void @llvm.prefetch.p0(ptr %pf, i32 0, i32 3, i32 1)",
        "  %wz = zext <32 x i16> %wv to <32 x i32>",
        f"  %ws = shl <32 x i32> %wz, <{sixteen}>",
        "  %wf = bitcast <32 x i32> %ws to <32 x float>",
        f"  %w0 = shufflevector <32 x float> %wf, <32 x float> poison, <16 x i32> <{lo}>",
        f"  %w1 = shufflevector <32 x float> %wf, <32 x float> poison, <16 x i32> <{hi}>",
    ]
    for r in range(rows):
        s += [
            f"  %xr{r} = mul i64 %ldx, {r}",
            f"  %xi{r} = add i64 %xr{r}, %k",
            f"  %xp{r} = getelementptr float, ptr %x, i64 %xi{r}",
            f"  %xs{r} = load float, ptr %xp{r}, align 4",
            f"  %xv{r} = insertelement <16 x float> poison, float %xs{r}, i32 0",
            f"  %xb{r} = shufflevector <16 x float> %xv{r}, <16 x float> poison, <16 x i32> zeroinitializer",
        ]
        for h in range(2):
            s.append(
                f"  %n{r}_{h} = call <16 x float> @llvm.fma.v16f32(<16 x float> %xb{r}, "
                f"<16 x float> %w{h}, <16 x float> %a{r}_{h})"
            )
    s += [
        "  %k1 = add i64 %k, 1",
        "  %done = icmp eq i64 %k1, %kc",
        "  br i1 %done, label %store, label %loop",
        "store:",
    ]
    for r in range(rows):
        for h in range(2):
            s += [
                f"  %or{r}_{h} = mul i64 %ldo, {r}",
                f"  %oi{r}_{h} = add i64 %or{r}_{h}, {16 * h}",
                f"  %op{r}_{h} = getelementptr float, ptr %out, i64 %oi{r}_{h}",
                f"  %old{r}_{h} = load <16 x float>, ptr %op{r}_{h}, align 4",
            ]
            if scaled:
                s.append(f"  %sc{r}_{h} = fmul <16 x float> %n{r}_{h}, %sb")
            v = f"%sc{r}_{h}" if scaled else f"%n{r}_{h}"
            s += [
                f"  %sum{r}_{h} = fadd <16 x float> %old{r}_{h}, {v}",
                f"  %res{r}_{h} = select i1 %add, <16 x float> %sum{r}_{h}, <16 x float> {v}",
                f"  store <16 x float> %res{r}_{h}, ptr %op{r}_{h}, align 4",
            ]
    s += ["  ret void", "}"]
    return "\n".join(s)


def _ir() -> str:
    """The module: ``_gemm_ir`` for unscaled weights (``@gemm_bf16w``, ``@gemm_grouped``, over
    ``@tile1`` .. ``@tile12``) and for scaled ones (``@gemm_bf16w_s``, ``@gemm_grouped_s``, over
    ``@stile1`` .. ``@stile12``): the same code, but bf16 weights skip the scale load and multiply.
    """
    s = [
        "declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
        "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
    ]
    s += [_tile(r, scaled) for scaled in (False, True) for r in range(1, MAX_ROWS + 1)]
    s += [_gemm_ir(False), _gemm_ir(True)]
    return "\n".join(s)


def _gemm_ir(scaled: bool) -> str:
    """(suffix ``_s`` where ``scaled``)

    - ``@gemm_bf16w(x, M, K, panels, ldo, out, scales, ldk, kshift, p0, p1)``: output columns
      ``[32 p0, 32 p1)`` of ``x @ W.T`` (``M, K >= 1``; ``x`` ``[M, K]`` row-major float32;
      ``out`` float32 with row stride ``ldo``, column ``32 p`` of panel ``p`` at ``out + 32 p``;
      the chunk at ``k0`` of panel ``p`` scaled by ``scales[p * ldk + (k0 >> kshift)]``);
    - ``@gemm_grouped(x, offs, panel_ptrs, K, ldo, out, np, scale_ptrs, ldk, kshift, e0, e1)``: for
      each group ``e`` in ``[e0, e1)``, rows ``offs[e] .. offs[e+1]`` of ``x`` times group ``e``'s
      weight (``np`` panels, its scale table) into the same rows of ``out``.
    """
    cases = " ".join(f"i64 {r}, label %t{r}" for r in range(1, MAX_ROWS + 1))
    sfx, tile = ("_s", "stile") if scaled else ("", "tile")
    if scaled:
        load_scale = """  %kb = lshr i64 %k0, %kshift
  %si = add i64 %srow, %kb
  %sptr = getelementptr float, ptr %sp, i64 %si
  %sc = load float, ptr %sptr, align 4"""
    else:
        load_scale = "  %sc = fadd float 1.0, 0.0"
    s = []
    s.append(f"""define void @gemm_bf16w{sfx}(ptr %x, i64 %M, i64 %K, ptr %w, i64 %ldo, ptr %out,
                        ptr %sp, i64 %ldk, i64 %kshift, i64 %p0, i64 %p1) {{
entry:
  %pstride = mul i64 %K, 32
  br label %panel
panel:
  %p = phi i64 [%p0, %entry], [%pn, %panel_next]
  %wofs = mul i64 %p, %pstride
  %wpanel = getelementptr i16, ptr %w, i64 %wofs
  %ocol = mul i64 %p, 32
  %srow = mul i64 %p, %ldk
  br label %rows
rows:
  %m0 = phi i64 [0, %panel], [%m1, %rows_next]
  %rem = sub i64 %M, %m0
  %short = icmp ult i64 %rem, {MAX_ROWS}
  %mr = select i1 %short, i64 %rem, i64 {MAX_ROWS}
  %xofs = mul i64 %m0, %K
  %xrow = getelementptr float, ptr %x, i64 %xofs
  %oofs0 = mul i64 %m0, %ldo
  %oofs = add i64 %oofs0, %ocol
  %orow = getelementptr float, ptr %out, i64 %oofs
  br label %chunk
chunk:
  %k0 = phi i64 [0, %rows], [%k1, %chunk_next]
  %kleft = sub i64 %K, %k0
  %kshort = icmp ult i64 %kleft, {K_CHUNK}
  %kc = select i1 %kshort, i64 %kleft, i64 {K_CHUNK}
  %add = icmp ne i64 %k0, 0
  %xk = getelementptr float, ptr %xrow, i64 %k0
  %wk0 = mul i64 %k0, 32
  %wk = getelementptr i16, ptr %wpanel, i64 %wk0
{load_scale}
  switch i64 %mr, label %chunk_next [ {cases} ]""")
    for r in range(1, MAX_ROWS + 1):
        s.append(
            f"t{r}:\n  call void @{tile}{r}(ptr %xk, i64 %K, ptr %wk, i64 %kc, ptr %orow, i64 %ldo, "
            "i1 %add, float %sc)\n  br label %chunk_next"
        )
    s.append("""chunk_next:
  %k1 = add i64 %k0, %kc
  %kdone = icmp uge i64 %k1, %K
  br i1 %kdone, label %rows_next, label %chunk
rows_next:
  %m1 = add i64 %m0, %mr
  %mdone = icmp uge i64 %m1, %M
  br i1 %mdone, label %panel_next, label %rows
panel_next:
  %pn = add i64 %p, 1
  %pdone = icmp uge i64 %pn, %p1
  br i1 %pdone, label %exit, label %panel
exit:
  ret void
}""")
    s.append(f"""define void @gemm_grouped{sfx}(ptr %x, ptr %offs, ptr %ws, i64 %K, i64 %ldo, ptr %out,
                          i64 %np, ptr %sps, i64 %ldk, i64 %kshift, i64 %e0, i64 %e1) {{
entry:
  %none = icmp uge i64 %e0, %e1
  br i1 %none, label %exit, label %expert
expert:
  %e = phi i64 [%e0, %entry], [%en, %next]
  %ap = getelementptr i64, ptr %offs, i64 %e
  %a = load i64, ptr %ap, align 8
  %en = add i64 %e, 1
  %bp = getelementptr i64, ptr %offs, i64 %en
  %b = load i64, ptr %bp, align 8
  %m = sub i64 %b, %a
  %empty = icmp sle i64 %m, 0
  br i1 %empty, label %next, label %run
run:
  %wpp = getelementptr ptr, ptr %ws, i64 %e
  %w = load ptr, ptr %wpp, align 8
  %spp = getelementptr ptr, ptr %sps, i64 %e
  %sp = load ptr, ptr %spp, align 8
  %xofs = mul i64 %a, %K
  %xe = getelementptr float, ptr %x, i64 %xofs
  %oofs = mul i64 %a, %ldo
  %oe = getelementptr float, ptr %out, i64 %oofs
  call void @gemm_bf16w{sfx}(ptr %xe, i64 %m, i64 %K, ptr %w, i64 %ldo, ptr %oe, ptr %sp, i64 %ldk,
                        i64 %kshift, i64 0, i64 %np)
  br label %next
next:
  %done = icmp uge i64 %en, %e1
  br i1 %done, label %exit, label %expert
exit:
  ret void
}}""")
    return "\n".join(s)

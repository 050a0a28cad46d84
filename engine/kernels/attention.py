"""Attention of decoding sequences stored in one KV pool: a native kernel (LLVM IR, ``jit``).

``attend(q, store, lengths, out)``: for every slot ``s`` with ``lengths[s] > 0`` and KV head
``h``, the ``G`` query rows ``q[s, h]`` (the query heads sharing KV head ``h``) attend over the
first ``lengths[s]`` keys and values of slot ``s`` in ``store`` (one layer of a ``KVPool``:
``[slots, 2 * kv_heads, capacity, head_dim]``, K heads then V heads, float32):

    out[s, h, i] = sum_t softmax_t(q[s, h, i] . K[s, h, t] / sqrt(head_dim)) V[s, h, t]

Slots with ``lengths[s] == 0`` are skipped (``out`` there is left as it was).

Why not SDPA: torch's fused CPU attention handles a decode step (4 query rows per KV head, a few
hundred keys) as many tiny blocked GEMMs; this kernel reads each key and value row once, in
order, with prefetch, three passes per (slot, head): scores (dot products) and their maximum,
then ``exp`` and the sum, then the weighted sum of values, normalized at the end (exactly the
softmax, no online rescaling). Float32 throughout; against a float64 reference its error is that of SDPA
(dot products summed as a tree, ``exp`` a degree-6 polynomial after range reduction, within 2 ulp).

Compiled per (G, head_dim) on first use (head_dim a multiple of 16); ``available`` says whether
that worked (else callers use SDPA).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from collections.abc import Callable

import torch

from engine.kernels import threads

log = logging.getLogger("mixfleet.engine.decode_attention")

PREFETCH_ROWS = 8  # key / value rows ahead of the current one

_lock = threading.Lock()
_compiled: dict[tuple[int, int], tuple[threads.Compiled, Callable[..., None]] | None] = {}


def available(group: int, head_dim: int) -> bool:
    """Whether the kernel for ``group`` query rows per KV head and ``head_dim`` is usable here."""
    return _kernel(group, head_dim) is not None


def attend(q: torch.Tensor, store: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """See the module doc. ``q`` and ``out`` ``[S, kv_heads, G, head_dim]`` contiguous float32,
    ``store`` ``[>= S, 2 * kv_heads, capacity, head_dim]`` contiguous float32, ``lengths`` int64
    ``[S]`` with ``0 <= lengths[s] <= capacity``. Splits slots over ``torch.get_num_threads()``."""
    n_slots, nkv, group, d = q.shape
    fn = _kernel(group, d)
    if fn is None:
        raise RuntimeError(f"decode attention kernel unavailable for G={group}, head_dim={d}")
    cap = store.shape[2]
    if (q.dtype != torch.float32 or out.dtype != torch.float32 or store.dtype != torch.float32
            or not (q.is_contiguous() and out.is_contiguous() and store.is_contiguous())
            or out.shape != q.shape or store.shape[1:] != (2 * nkv, cap, d) or store.shape[0] < n_slots
            or lengths.dtype != torch.int64 or lengths.shape != (n_slots,) or not lengths.is_contiguous()):
        raise ValueError("attend: q / out [S, kv_heads, G, d], store [slots, 2 * kv_heads, cap, d] "
                         "contiguous float32, lengths int64 [S]")
    longest = int(lengths.max()) if n_slots else 0
    if longest > cap or int(lengths.min()) < 0:
        raise ValueError(f"attend: lengths must be in [0, {cap}]")
    if longest == 0:
        return out
    k = threads.parts(n_slots * nkv * group * d * longest * 2, n_slots)
    ranges = threads.split(n_slots, k)
    scratch = torch.empty(len(ranges), group * longest)
    scale = d**-0.5
    threads.run([
        (fn, (q.data_ptr(), store.data_ptr(), cap, nkv, lengths.data_ptr(), out.data_ptr(),
              scratch[i].data_ptr(), a, b, scale))
        for i, (a, b) in enumerate(ranges)
    ])
    return out


def _kernel(group: int, head_dim: int) -> Callable[..., None] | None:
    key = (group, head_dim)
    if key in _compiled:
        entry = _compiled[key]
        return None if entry is None else entry[1]
    with _lock:
        if key not in _compiled:
            entry = None
            if head_dim % 16 == 0 and group >= 1:
                try:
                    mod = threads.compile_ir(_ir(group, head_dim))
                    i64, ptr = ctypes.c_int64, ctypes.c_void_p
                    entry = (mod, mod.function("attend", ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64,
                                               ctypes.c_float))
                except Exception as exc:  # no llvmlite, an LLVM too old for the IR
                    log.warning("decode attention kernel unavailable, using SDPA: %s", exc)
            _compiled[key] = entry
    entry = _compiled[key]
    return None if entry is None else entry[1]


# ----------------------------------------------------------------------------- IR

V16 = "<16 x float>"


def _f(v: float) -> str:
    """A float32 constant as LLVM IR writes it (the double of the same value, in hex)."""
    single = struct.unpack("<f", struct.pack("<f", v))[0]
    return f"0x{struct.unpack('<Q', struct.pack('<d', single))[0]:016X}"


def _splat(ty: str, v: str) -> str:
    return "<" + ", ".join(f"{ty} {v}" for _ in range(16)) + ">"


def _exp16() -> str:
    """``exp`` of 16 floats (Cephes ``expf``: ``x = n ln2 + r``, ``e^r`` by a degree-6 polynomial,
    ``2^n`` through the exponent bits); inputs below -87.3 give ~1e-38, NaN stays NaN."""
    def c(v: float) -> str:
        return _splat("float", _f(v))

    def fma(a: str, b: str, acc: str) -> str:
        return f"call {V16} @llvm.fma.v16f32({V16} {a}, {V16} {b}, {V16} {acc})"

    return f"""define internal {V16} @exp16({V16} %x) alwaysinline {{
  %lo = fcmp olt {V16} %x, {c(-87.3)}
  %xc = select <16 x i1> %lo, {V16} {c(-87.3)}, {V16} %x
  %fx = fmul {V16} %xc, {c(1.44269504088896341)}
  %n = call {V16} @llvm.rint.v16f32({V16} %fx)
  %r1 = {fma("%n", c(-0.693359375), "%xc")}
  %r = {fma("%n", c(2.12194440e-4), "%r1")}
  %p0 = {fma("%r", c(1.9875691500e-4), c(1.3981999507e-3))}
  %p1 = {fma("%p0", "%r", c(8.3334519073e-3))}
  %p2 = {fma("%p1", "%r", c(4.1665795894e-2))}
  %p3 = {fma("%p2", "%r", c(1.6666665459e-1))}
  %p4 = {fma("%p3", "%r", c(5.0000001201e-1))}
  %r2 = fmul {V16} %r, %r
  %p5 = {fma("%p4", "%r2", "%r")}
  %p6 = fadd {V16} %p5, {c(1.0)}
  %ni = fptosi {V16} %n to <16 x i32>
  %e = add <16 x i32> %ni, {_splat("i32", "127")}
  %sh = shl <16 x i32> %e, {_splat("i32", "23")}
  %pw = bitcast <16 x i32> %sh to {V16}
  %res = fmul {V16} %p6, %pw
  ret {V16} %res
}}"""


def _ir(group: int, d: int) -> str:
    """``@attend(q, store, cap, nkv, lengths, out, scratch, s0, s1, scale)`` over slots ``[s0, s1)``;
    ``scratch`` holds ``group * max(lengths)`` floats (one row of scores per query row)."""
    chunks = d // 16
    pf = PREFETCH_ROWS * d
    s: list[str] = []
    a = s.append

    def bcast(name: str, scalar: str) -> None:
        a(f"  %{name}_ = insertelement {V16} poison, float {scalar}, i32 0")
        a(f"  %{name} = shufflevector {V16} %{name}_, {V16} poison, <16 x i32> zeroinitializer")

    def prefetch(name: str, base: str, offset: int) -> None:
        a(f"  %{name} = getelementptr float, ptr {base}, i64 {offset}")
        a(f"  call void @llvm.prefetch.p0(ptr %{name}, i32 0, i32 3, i32 1)")

    a("define void @attend(ptr noalias %q, ptr noalias %kv, i64 %cap, i64 %nkv, ptr noalias %lens, "
      "ptr noalias %out, ptr noalias %scr, i64 %s0, i64 %s1, float %scale) {")
    a("entry:")
    a(f"  %hd = mul i64 %cap, {d}")
    a("  %two = shl i64 %nkv, 1")
    a("  %none = icmp uge i64 %s0, %s1")
    a("  br i1 %none, label %exit, label %slot")
    a("slot:")
    a("  %s = phi i64 [%s0, %entry], [%sn, %slot_next]")
    a("  %lp = getelementptr i64, ptr %lens, i64 %s")
    a("  %L = load i64, ptr %lp, align 8")
    a("  %skip = icmp sle i64 %L, 0")
    a("  br i1 %skip, label %slot_next, label %head")
    a("head:")
    a("  %h = phi i64 [0, %slot], [%hn, %head_next]")
    a("  %s2 = mul i64 %s, %two")
    a("  %kh = add i64 %s2, %h")
    a("  %ko = mul i64 %kh, %hd")
    a("  %kb = getelementptr float, ptr %kv, i64 %ko")
    a("  %vh = add i64 %kh, %nkv")
    a("  %vo = mul i64 %vh, %hd")
    a("  %vb = getelementptr float, ptr %kv, i64 %vo")
    a("  %sq = mul i64 %s, %nkv")
    a("  %qh = add i64 %sq, %h")
    a(f"  %qo = mul i64 %qh, {group * d}")
    a("  %qb = getelementptr float, ptr %q, i64 %qo")
    a("  %ob = getelementptr float, ptr %out, i64 %qo")
    for i in range(group):
        for c in range(chunks):
            a(f"  %qp{i}_{c} = getelementptr float, ptr %qb, i64 {i * d + c * 16}")
            a(f"  %q{i}_{c} = load {V16}, ptr %qp{i}_{c}, align 4")
        a(f"  %row{i} = mul i64 %L, {i}")
        a(f"  %rp{i} = getelementptr float, ptr %scr, i64 %row{i}")
    a("  br label %scores")
    # Pass 1: scores of every key for every query row, and each row's maximum; values prefetched.
    a("scores:")
    a("  %t = phi i64 [0, %head], [%tn, %scores]")
    for i in range(group):
        a(f"  %m{i} = phi float [0xFFF0000000000000, %head], [%mn{i}, %scores]")
    a(f"  %to = mul i64 %t, {d}")
    a("  %kt = getelementptr float, ptr %kb, i64 %to")
    a("  %vt1 = getelementptr float, ptr %vb, i64 %to")
    for j in range(0, d, 16):
        prefetch(f"kpf{j}", "%kt", pf + j)
        prefetch(f"vpf{j}", "%vt1", pf + j)
    for c in range(chunks):
        a(f"  %kp{c} = getelementptr float, ptr %kt, i64 {c * 16}")
        a(f"  %k{c} = load {V16}, ptr %kp{c}, align 4")
    for i in range(group):
        a(f"  %x{i}_0 = fmul {V16} %q{i}_0, %k0")
        for c in range(1, chunks):
            a(f"  %x{i}_{c} = call {V16} @llvm.fma.v16f32({V16} %q{i}_{c}, {V16} %k{c}, {V16} %x{i}_{c - 1})")
        a(f"  %dot{i} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, "
          f"{V16} %x{i}_{chunks - 1})")
        a(f"  %sc{i} = fmul float %dot{i}, %scale")
        a(f"  %sp{i} = getelementptr float, ptr %rp{i}, i64 %t")
        a(f"  store float %sc{i}, ptr %sp{i}, align 4")
        a(f"  %mn{i} = call float @llvm.maximum.f32(float %m{i}, float %sc{i})")
    a("  %tn = add i64 %t, 1")
    a("  %scores_done = icmp eq i64 %tn, %L")
    a("  br i1 %scores_done, label %softmax, label %scores")
    # Pass 2, per row: p = exp(score - max) in place, 16 at a time then one by one; their sum.
    a("softmax:")
    a("  %nch = lshr i64 %L, 4")
    a("  %full = shl i64 %nch, 4")
    a("  %anych = icmp ugt i64 %nch, 0")
    a("  %anytail = icmp ult i64 %full, %L")
    prev = "softmax"
    for i in range(group):
        bcast(f"mb{i}", f"%mn{i}")
        a(f"  br i1 %anych, label %ex{i}, label %ex{i}_done")
        a(f"ex{i}:")
        a(f"  %j{i} = phi i64 [0, %{prev}], [%jn{i}, %ex{i}]")
        a(f"  %vs{i} = phi {V16} [zeroinitializer, %{prev}], [%vsn{i}, %ex{i}]")
        a(f"  %jo{i} = shl i64 %j{i}, 4")
        a(f"  %ep{i} = getelementptr float, ptr %rp{i}, i64 %jo{i}")
        a(f"  %ev{i} = load {V16}, ptr %ep{i}, align 4")
        a(f"  %ez{i} = fsub {V16} %ev{i}, %mb{i}")
        a(f"  %ee{i} = call {V16} @exp16({V16} %ez{i})")
        a(f"  store {V16} %ee{i}, ptr %ep{i}, align 4")
        a(f"  %vsn{i} = fadd {V16} %vs{i}, %ee{i}")
        a(f"  %jn{i} = add i64 %j{i}, 1")
        a(f"  %jd{i} = icmp eq i64 %jn{i}, %nch")
        a(f"  br i1 %jd{i}, label %ex{i}_done, label %ex{i}")
        a(f"ex{i}_done:")
        a(f"  %vsf{i} = phi {V16} [zeroinitializer, %{prev}], [%vsn{i}, %ex{i}]")
        a(f"  %vsum{i} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, {V16} %vsf{i})")
        a(f"  br i1 %anytail, label %tail{i}, label %tail{i}_done")
        a(f"tail{i}:")
        a(f"  %u{i} = phi i64 [%full, %ex{i}_done], [%un{i}, %tail{i}]")
        a(f"  %ts{i} = phi float [%vsum{i}, %ex{i}_done], [%tsn{i}, %tail{i}]")
        a(f"  %up{i} = getelementptr float, ptr %rp{i}, i64 %u{i}")
        a(f"  %uv{i} = load float, ptr %up{i}, align 4")
        a(f"  %uz{i} = fsub float %uv{i}, %mn{i}")
        a(f"  %ub{i} = insertelement {V16} zeroinitializer, float %uz{i}, i32 0")
        a(f"  %ue{i} = call {V16} @exp16({V16} %ub{i})")
        a(f"  %ux{i} = extractelement {V16} %ue{i}, i32 0")
        a(f"  store float %ux{i}, ptr %up{i}, align 4")
        a(f"  %tsn{i} = fadd float %ts{i}, %ux{i}")
        a(f"  %un{i} = add i64 %u{i}, 1")
        a(f"  %ud{i} = icmp eq i64 %un{i}, %L")
        a(f"  br i1 %ud{i}, label %tail{i}_done, label %tail{i}")
        a(f"tail{i}_done:")
        a(f"  %sum{i} = phi float [%vsum{i}, %ex{i}_done], [%tsn{i}, %tail{i}]")
        prev = f"tail{i}_done"
    a("  br label %values")
    # Pass 3: sum_t p[i, t] V[t] for all rows at once, then divided by the row's sum.
    a("values:")
    a(f"  %t3 = phi i64 [0, %{prev}], [%t3n, %values]")
    for i in range(group):
        for c in range(chunks):
            a(f"  %acc{i}_{c} = phi {V16} [zeroinitializer, %{prev}], [%accn{i}_{c}, %values]")
    a(f"  %vo3 = mul i64 %t3, {d}")
    a("  %vt = getelementptr float, ptr %vb, i64 %vo3")
    for j in range(0, d, 16):
        prefetch(f"wpf{j}", "%vt", pf + j)
    for c in range(chunks):
        a(f"  %vp{c} = getelementptr float, ptr %vt, i64 {c * 16}")
        a(f"  %v{c} = load {V16}, ptr %vp{c}, align 4")
    for i in range(group):
        a(f"  %pp{i} = getelementptr float, ptr %rp{i}, i64 %t3")
        a(f"  %pv{i} = load float, ptr %pp{i}, align 4")
        bcast(f"pb{i}", f"%pv{i}")
        for c in range(chunks):
            a(f"  %accn{i}_{c} = call {V16} @llvm.fma.v16f32({V16} %pb{i}, {V16} %v{c}, {V16} %acc{i}_{c})")
    a("  %t3n = add i64 %t3, 1")
    a("  %values_done = icmp eq i64 %t3n, %L")
    a("  br i1 %values_done, label %store, label %values")
    a("store:")
    for i in range(group):
        a(f"  %inv{i} = fdiv float 1.0, %sum{i}")
        bcast(f"ib{i}", f"%inv{i}")
        for c in range(chunks):
            a(f"  %res{i}_{c} = fmul {V16} %accn{i}_{c}, %ib{i}")
            a(f"  %op{i}_{c} = getelementptr float, ptr %ob, i64 {i * d + c * 16}")
            a(f"  store {V16} %res{i}_{c}, ptr %op{i}_{c}, align 4")
    a("  br label %head_next")
    a("head_next:")
    a("  %hn = add i64 %h, 1")
    a("  %heads_done = icmp eq i64 %hn, %nkv")
    a("  br i1 %heads_done, label %slot_next, label %head")
    a("slot_next:")
    a("  %sn = add i64 %s, 1")
    a("  %slots_done = icmp uge i64 %sn, %s1")
    a("  br i1 %slots_done, label %exit, label %slot")
    a("exit:")
    a("  ret void")
    a("}")
    decls = "\n".join([
        f"declare {V16} @llvm.fma.v16f32({V16}, {V16}, {V16})",
        f"declare {V16} @llvm.rint.v16f32({V16})",
        f"declare float @llvm.vector.reduce.fadd.v16f32(float, {V16})",
        "declare float @llvm.maximum.f32(float, float)",
        "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
    ])
    return "\n".join([decls, _exp16(), *s])

"""The building blocks of the Qwen3-MoE forward pass, as plain torch functions on float32.

Each function's numerics follow HF ``modeling_qwen3_moe`` (RMSNorm in float32, RoPE with
``rotate_half``, softmax routing with optional top-k renormalization, SwiGLU experts).
Linear layers whose checkpoint weights are FP8 additionally quantize their input the way
SGLang's blockwise FP8 kernels do (see ``quantize_activations_fp8``); NVFP4 ones the way SGLang's
W4A4 ModelOpt path does, with the checkpoint's static ``input_scale`` (``engine.model.act_nvfp4``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from core.numba_options import NJIT
from engine.kernels import gemm, panels
from engine.model import act_nvfp4
from engine.model.loader import LinearWeight

FP8_MAX = 448.0
FP8_GROUP = 128
FP8_EPS = 1e-10


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim (HF ``Qwen3MoeRMSNorm``); ``weight``
    ``[d]``, or ``[..., d]`` broadcast against ``x`` (per-head weights).

    torch's fused ``rms_norm``: one pass, bit-identical to HF's ``pow / mean / rsqrt / mul``
    sequence.
    """
    d = x.shape[-1]
    if weight.dim() == 1:
        return F.rms_norm(x, (d,), weight, eps)
    return F.rms_norm(x, (d,), None, eps) * weight


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``[length, head_dim]`` for positions ``0 .. length-1`` (HF default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(length, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, head_dim]`` by per-token ``cos``/``sin`` ``[N, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def quantize_activations_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round-trip ``x`` ``[..., K]`` through float8_e4m3fn with one scale per token per 128 channels.

    As SGLang's ``per_token_group_quant_fp8``: ``scale = max(amax, 1e-10) / 448``,
    ``q = clamp(x / scale, -448, 448)`` cast to e4m3; returns ``q * scale`` in float32 (what the
    FP8 GEMM multiplies). A trailing partial group (K not a multiple of 128) gets its own scale.

    One fused pass (numba) over float32 ``x``, bit for bit ``_quantize_activations_fp8_torch``:
    the e4m3 rounding is done on the float32 bits (3 mantissa bits, ties to even; below 2**-6 by
    adding and subtracting 2**14, which rounds to multiples of 2**-9), vectorizable.
    """
    if x.dtype != torch.float32:
        return _quantize_activations_fp8_torch(x)
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(flat)
    if flat.numel():
        _act_quant_kernel(flat.numpy(), out.numpy())
    return out.view(shape)


@njit(**NJIT)
def _act_quant_kernel(x, out):  # pragma: no cover - compiled
    rows, k = x.shape
    buf = np.empty(FP8_GROUP, dtype=np.float32)
    bits = buf.view(np.uint32)
    magic = np.float32(2.0**14)  # (a + 2**14) - 2**14 rounds a < 2**-6 to a multiple of 2**-9, ties even
    for r in range(rows):
        for g0 in range(0, k, FP8_GROUP):
            n = min(k, g0 + FP8_GROUP) - g0
            amax = np.float32(0.0)
            nan = False
            for c in range(n):
                a = abs(x[r, g0 + c])
                amax = a if a > amax else amax
                nan |= a != a
            if nan:
                amax = np.float32(np.nan)
            elif amax < np.float32(FP8_EPS):
                amax = np.float32(FP8_EPS)
            scale = np.float32(amax / np.float32(FP8_MAX))
            for c in range(n):
                v = np.float32(x[r, g0 + c] / scale)
                v = min(max(v, np.float32(-FP8_MAX)), np.float32(FP8_MAX)) if v == v else v
                buf[c] = v
            for c in range(n):
                b = bits[c]
                sign = b & np.uint32(0x80000000)
                mag = b & np.uint32(0x7FFFFFFF)
                # normal range: round to 3 mantissa bits, ties to even
                normal = (mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) & np.uint32(
                    0xFFF00000
                )
                bits[c] = mag
                sub = np.float32(np.float32(buf[c] + magic) - magic)
                buf[c] = sub
                sub_bits = bits[c]
                bits[c] = sign | (normal if mag >= np.uint32(0x3C800000) else sub_bits)  # 2**-6
            for c in range(n):
                out[r, g0 + c] = np.float32(buf[c] * scale)


def _quantize_activations_fp8_torch(x: torch.Tensor) -> torch.Tensor:
    """``quantize_activations_fp8`` in torch ops (the reference of the fused kernel)."""
    shape = x.shape
    k = shape[-1]
    pad = (-k) % FP8_GROUP
    flat = x.reshape(-1, k)
    if pad:
        flat = F.pad(flat, (0, pad))
    groups = flat.reshape(flat.shape[0], -1, FP8_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_EPS)
    scale = amax / FP8_MAX
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = (q.float() * scale).reshape(flat.shape[0], -1)
    if pad:
        out = out[:, :k]
    return out.reshape(shape)


Packed = gemm.PackedBf16 | torch.Tensor


def pack(w: torch.Tensor) -> Packed:
    """A checkpoint weight ``w`` ``[N, K]`` (any float dtype) as the weight operand of ``linear``,
    with the same values.

    Weights exact in bfloat16 stay bfloat16 for ``kernels``' GEMM, which widens them as it
    multiplies (half the bytes to read per product); others become float32 for ``F.linear``.
    Checkpoint linears go through ``pack_parts``, which uses this only where it cannot write
    bfloat16 rows.
    """
    w = w.contiguous()
    if gemm.exact_in_bf16(w):
        return gemm.pack(w)
    return w.float()


def pack_parts(parts: list[LinearWeight]) -> Packed:
    """The checkpoint linears ``parts`` (one K), their rows concatenated in order (fused q/k/v or
    gate/up), as the weight operand of ``linear``.

    Every format goes to the bf16-weight kernel when the parts allow (see ``_panels``): each part's
    stored values are written straight into its rows (``engine.kernels.panels``: one pass, no
    float32 intermediate), exact bfloat16 values, and the format's scales (FP8's 128x128 blocks,
    NVFP4's ``weight_scale_2``) go to the kernel's scale table. Otherwise ``pack`` of the
    dequantized, concatenated weight.
    """
    packed = _panels(parts)
    if packed is not None:
        return packed
    return pack(parts[0].weight if len(parts) == 1 else torch.cat([p.weight for p in parts]))


def _panels(parts: list[LinearWeight]) -> gemm.PackedBf16 | None:
    """``parts`` packed by ``panels`` with their scale table, or None where that does not apply: mixed
    formats or K, float16/float32 weights, or (where scales differ between parts) a part other
    than the last whose rows are not a multiple of 32 (a panel would need two scales)."""
    fmt = parts[0].fmt
    k = parts[0].shape[1]
    if any(p.fmt != fmt or p.shape[1] != k for p in parts):
        return None
    if fmt == "bf16" and any(p.tensors[0].dtype != torch.bfloat16 for p in parts):
        return None
    aligned = all(p.shape[0] % gemm.PANEL == 0 for p in parts[:-1])
    scales, ldk, kblock = None, 0, 0
    if fmt == "fp8":
        if not aligned:
            return None
        # per panel: its rows' 128-row block of each part's weight_scale_inv (panels never straddle)
        rows = [p.tensors[1][torch.arange(0, p.shape[0], gemm.PANEL) // FP8_GROUP] for p in parts]
        scales = torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()
        ldk, kblock = scales.shape[1], FP8_GROUP
    elif fmt == "nvfp4":
        ws2 = [float(p.tensors[2].item()) for p in parts]
        if all(v == ws2[0] for v in ws2):
            scales = torch.tensor(ws2[:1])
        elif aligned:
            scales = torch.tensor(
                [v for p, v in zip(parts, ws2, strict=True) for _ in range(-(-p.shape[0] // gemm.PANEL))]
            )
            ldk = 1
        else:
            return None
    n = sum(p.shape[0] for p in parts)
    dst = panels.empty(n, k)
    row = 0
    for p in parts:
        t = p.tensors
        if fmt == "bf16":
            panels.write_bf16(dst, row, t[0])
        elif fmt == "fp8":
            panels.write_fp8(dst, row, t[0])
        elif fmt == "nvfp4":
            panels.write_nvfp4(dst, row, t[0], t[1])
        else:
            panels.write_mxfp4(dst, row, t[0], t[1])
        row += p.shape[0]
    return gemm.PackedBf16(panels.finish(dst, n), n, k, scales, ldk, kblock)


Tap = Callable[[torch.Tensor], None]


def nvfp4_input_scale(parts: list[LinearWeight]) -> float | None:
    """The one ``input_scale`` of linears SGLang fuses (``input_scale.max()`` over the shards,
    ``layers/quantization/modelopt_quant.py`` 1887; MoE ``w13/w2_input_scale.max()`` over the
    experts, 2768-2770); None unless every part is NVFP4."""
    scales = [p.nvfp4_input_scale for p in parts]
    return None if any(v is None for v in scales) else max(scales)


def quantize_input(x: torch.Tensor, fp8: bool, nvfp4_scale: float | None) -> torch.Tensor:
    """A linear's input as its GEMM sees it: FP8 per token per 128 channels, NVFP4 per token per 16
    channels with the static ``nvfp4_scale``, or as is."""
    if fp8:
        return quantize_activations_fp8(x)
    if nvfp4_scale is not None:
        return act_nvfp4.qdq(x, nvfp4_scale)
    return x


def linear(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """``x @ W.T`` (float32) for ``w`` = ``pack(W)``; ``x`` ``[..., K]`` float32."""
    if isinstance(w, gemm.PackedBf16):
        return gemm.linear(x, w)
    return F.linear(x, w)


@dataclass(frozen=True)
class Linear:
    """``y = x @ W.T`` for a dequantized checkpoint weight ``W`` ``[N, K]``, held as ``pack(W)``.

    ``fp8_activations``: quantize ``x`` per token per 128 channels first (W8A8 blockwise FP8);
    ``nvfp4_input_scale``: quantize ``x`` to NVFP4 with that static scale first (W4A4). ``tap``,
    if given, sees every input before quantization (calibration).
    """

    weight: Packed
    fp8_activations: bool = False
    nvfp4_input_scale: float | None = None
    tap: Tap | None = None

    @classmethod
    def of(cls, w: torch.Tensor, fp8_activations: bool = False) -> Linear:
        return cls(pack(w), fp8_activations)

    @classmethod
    def of_parts(cls, parts: list[LinearWeight], tap: Tap | None = None) -> Linear:
        """One linear over the rows of ``parts`` (which share activation handling), see ``pack_parts``."""
        return cls(pack_parts(parts), parts[0].fp8_activations, nvfp4_input_scale(parts), tap)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tap is not None:
            self.tap(x)
        return linear(quantize_input(x, self.fp8_activations, self.nvfp4_input_scale), self.weight)


@dataclass(frozen=True)
class Experts:
    """E SwiGLU experts: per expert ``gate_up[e]`` = ``pack([gate; up])`` (``[2I, H]``, gate rows
    first) and ``down[e]`` = ``pack(down)`` (``[H, I]``); ``inter`` = I. Where every weight went
    to the bf16 kernel, ``groups`` holds them as two ``gemm.PackedGroup`` (gate/up, down), and
    each projection of all experts is one native call. ``nvfp4_input_scales``: the static scales
    of the gate/up and down inputs of every expert (NVFP4 W4A4; None: not NVFP4). ``taps``: see the
    gate/up input (every token) and the down input (every routed row) before quantization
    (calibration)."""

    gate_up: list[Packed]
    down: list[Packed]
    inter: int
    fp8_activations: bool = False
    groups: tuple[gemm.PackedGroup, gemm.PackedGroup] | None = None
    nvfp4_input_scales: tuple[float | None, float | None] = (None, None)
    taps: tuple[Tap, Tap] | None = None

    @classmethod
    def of(
        cls,
        gate_up: list[list[LinearWeight]],
        down: list[LinearWeight],
        fp8_activations: bool,
        taps: tuple[Tap, Tap] | None = None,
    ) -> Experts:
        """From the checkpoint's per-expert ``[gate, up]`` (``[I, H]`` each) and ``down`` ``[H, I]``."""
        gu, dn = [pack_parts(parts) for parts in gate_up], [pack_parts([w]) for w in down]
        groups = None
        if all(isinstance(w, gemm.PackedBf16) for w in gu + dn):
            try:
                groups = (gemm.PackedGroup.of(gu), gemm.PackedGroup.of(dn))
            except ValueError:  # experts with different scale layouts: one call per expert
                groups = None
            else:  # hold the stacked copies only
                gu, dn = list(groups[0].weights), list(groups[1].weights)
        scales = (nvfp4_input_scale([w for parts in gate_up for w in parts]), nvfp4_input_scale(down))
        return cls(gu, dn, down[0].shape[1], fp8_activations, groups, scales, taps)

    def __call__(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Weighted sum over each token's selected experts.

        ``x`` ``[N, H]``; ``top_idx`` / ``top_w`` ``[N, k]``.
        """
        n, k = top_idx.shape
        n_experts = len(self.gate_up)
        flat_idx = top_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        token_of = torch.div(order, k, rounding_mode="floor")
        offsets = torch.zeros(n_experts + 1, dtype=torch.long)
        torch.cumsum(torch.bincount(flat_idx, minlength=n_experts), 0, out=offsets[1:])
        if self.taps is not None:
            self.taps[0](x)
        # Quantized per token, so quantizing each token once equals quantizing its routed copies.
        xq = quantize_input(x, self.fp8_activations, self.nvfp4_input_scales[0])
        xs = xq[token_of]  # rows sorted by expert: expert e's are offsets[e] .. offsets[e + 1]
        inter = self.inter
        gu = torch.empty(n * k, 2 * inter)
        out = torch.empty(n * k, x.shape[1])
        spans = None
        if self.groups is not None:
            gemm.grouped(xs, offsets, self.groups[0], gu)
        else:
            offs = offsets.tolist()
            spans = [(e, offs[e], offs[e + 1]) for e in range(n_experts) if offs[e + 1] > offs[e]]
            for e, a, b in spans:
                gu[a:b] = linear(xs[a:b], self.gate_up[e])
        h = torch.mul(F.silu(gu[:, :inter], inplace=True), gu[:, inter:])
        if self.taps is not None:
            self.taps[1](h)
        h = quantize_input(h, self.fp8_activations, self.nvfp4_input_scales[1])
        if spans is None:
            gemm.grouped(h, offsets, self.groups[1], out)
        else:
            for e, a, b in spans:
                out[a:b] = linear(h[a:b], self.down[e])
        out.mul_(top_w.reshape(-1)[order, None])
        result = torch.zeros_like(x)
        result.index_add_(0, token_of, out)
        return result


def route(
    x: torch.Tensor, gate: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``Qwen3MoeTopKRouter``: softmax over router logits (float32), top-k, optional renormalization.

    Returns ``(indices [N, k], weights [N, k])``.
    """
    logits = F.linear(x, gate)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_idx, top_w


def swiglu(x: torch.Tensor, gate_up: Callable[[torch.Tensor], torch.Tensor], down: Linear) -> torch.Tensor:
    """Dense SwiGLU MLP with a fused gate/up projection (gate rows first)."""
    gu = gate_up(x)
    inter = gu.shape[-1] // 2
    return down(F.silu(gu[..., :inter]) * gu[..., inter:])

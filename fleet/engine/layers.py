"""The building blocks of the Qwen3-MoE forward pass, as plain torch functions on float32.

Each function's numerics follow HF ``modeling_qwen3_moe`` (RMSNorm in float32, RoPE with
``rotate_half``, softmax routing with optional top-k renormalization, SwiGLU experts).
Linear layers whose checkpoint weights are FP8 additionally quantize their input the way
SGLang's blockwise FP8 kernels do (see ``quantize_activations_fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
FP8_GROUP = 128
FP8_EPS = 1e-10


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim (HF ``Qwen3MoeRMSNorm``)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


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
    """
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


def compact(w: torch.Tensor) -> torch.Tensor:
    """``w`` (float32) stored as bfloat16 when that is exact (every BF16 checkpoint weight), else as is.

    Halves memory and memory traffic; ``Scratch.widen`` restores the identical float32 values.
    """
    b = w.to(torch.bfloat16)
    return b if torch.equal(b.float(), w) else w


class Scratch:
    """A reusable float32 buffer into which a compactly stored weight is widened right before its
    matmul. One per model: the forward pass is single-threaded and uses one weight at a time."""

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def widen(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` as float32: itself if float32, else a view of the buffer (valid until the next call)."""
        if w.dtype == torch.float32:
            return w
        n = w.numel()
        if self._buf.numel() < n:
            self._buf = torch.empty(n)
        out = self._buf[:n].view(w.shape)
        out.copy_(w)
        return out


def transposed(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[..., N, K]`` as a contiguous, compact ``[..., K, N]`` (``x @ result`` == ``x @ w.T``;
    row-major ``[K, N]`` is the faster operand for the small-M products of decoding)."""
    return compact(w.transpose(-2, -1).contiguous())


@dataclass(frozen=True)
class Linear:
    """``y = x @ weight_t`` where ``weight_t`` ``[K, N]`` is the transposed dequantized checkpoint
    weight (float32, or bfloat16 where exact and widened through ``scratch``; see ``transposed``).

    ``fp8_activations``: quantize ``x`` per token per 128 channels first (W8A8 blockwise FP8).
    """

    weight_t: torch.Tensor
    fp8_activations: bool = False
    scratch: Scratch | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_activations:
            x = quantize_activations_fp8(x)
        w = self.weight_t.float() if self.scratch is None else self.scratch.widen(self.weight_t)
        return x @ w


@dataclass(frozen=True)
class Experts:
    """E SwiGLU experts, transposed (see ``transposed``): ``gate_up_t`` ``[E, H, 2I]`` (gate columns
    first), ``down_t`` ``[E, I, H]``; float32, or bfloat16 where exact, widened through ``scratch``."""

    gate_up_t: torch.Tensor
    down_t: torch.Tensor
    fp8_activations: bool = False
    scratch: Scratch | None = None

    def __call__(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Weighted sum over each token's selected experts.

        ``x`` ``[N, H]``; ``top_idx`` / ``top_w`` ``[N, k]``.
        """
        n, k = top_idx.shape
        flat_idx = top_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        token_of = order // k
        counts = torch.bincount(flat_idx, minlength=self.gate_up_t.shape[0]).tolist()
        xs = x[token_of]
        if self.fp8_activations:
            xs = quantize_activations_fp8(xs)
        inter = self.down_t.shape[1]
        out = torch.empty(xs.shape[0], x.shape[1], dtype=x.dtype)
        widen = self.scratch.widen if self.scratch is not None else _as_float
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            end = start + c
            gu = xs[start:end] @ widen(self.gate_up_t[e])
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            if self.fp8_activations:
                h = quantize_activations_fp8(h)
            out[start:end] = h @ widen(self.down_t[e])
            start = end
        out.mul_(top_w.reshape(-1)[order, None])
        result = torch.zeros_like(x)
        result.index_add_(0, token_of, out)
        return result


def _as_float(w: torch.Tensor) -> torch.Tensor:
    return w.float()


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int, norm_topk_prob: bool
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


def swiglu(x: torch.Tensor, gate_up: Linear, down: Linear) -> torch.Tensor:
    """Dense SwiGLU MLP with a fused gate/up projection (gate rows first)."""
    gu = gate_up(x)
    inter = gu.shape[-1] // 2
    return down(F.silu(gu[..., :inter]) * gu[..., inter:])

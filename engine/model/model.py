"""A Qwen3-MoE decoder in plain torch, for the local CPU sampler engine.

``load_model(path, kv_cache_dtype)`` reads an HF ``Qwen3MoeForCausalLM`` directory in any of the
four group formats (bf16 / fp8 / nvfp4 / mxfp4, see ``engine.model.loader``) and returns a
``Model``. ``Model.forward(tokens, caches)`` runs any mix of prefill chunks and decode tokens of
several sequences in one step: the token-wise work (projections, norms, experts, LM head) runs
once on all tokens concatenated; attention runs against each sequence's ``SequenceCache`` (one
batched call for all decoding sequences of a cache pool, one call per prefill chunk).

Precision (a decision, documented here):
- Compute is float32 on dequantized weights. The BF16 checkpoint's weights are exact in
  float32, so the bf16 engine reproduces ``transformers``' float32 forward of the same
  directory to float32 rounding. We do not round activations to bf16 in any format: that
  rounding is common to every GPU group, and leaving it out makes the difference between
  the formats exactly the formats' own effect. (Weights exact in bfloat16 are stored as
  bfloat16 for speed, see below, and widened exactly: the arithmetic stays float32.)
- fp8 (W8A8 blockwise, as SGLang's ``Fp8LinearMethod``/fused MoE with ``weight_block_size``):
  weights are the real e4m3 codes times their 128x128 block scales; the input of every FP8
  linear (attention projections, experts' gate/up and down) is quantized per token per 128
  channels to e4m3 with scale amax/448 first. The block scales multiply each 64-wide K chunk's
  partial sums of codes (as DeepGEMM applies them), not the weights: the same values to float32
  rounding of the order.
- nvfp4 runs W4A4, as SGLang's ``modelopt_fp4`` does on B200/B300 with the fleet's flags: the
  input of every NVFP4 linear (attention projections, dense MLP, experts' gate/up and down) is
  quantized per token per 16 channels with the checkpoint's static ``input_scale``
  (``engine.model.act_nvfp4``; one scale per fused q/k/v or gate/up, and per MoE layer the
  maximum over its experts, as SGLang takes them). NVFP4's ``weight_scale_2`` multiplies the
  output of the product with ``E2M1(code) * E4M3(scale)`` (exact in bfloat16), as the real NVFP4
  GEMM's ``alpha`` does; the weight that stands for differs from ``dequantize``'s (which rounds
  ``scale * weight_scale_2`` first) by at most one float32 ulp.
- mxfp4 runs W4A16: dequantized 4-bit weights, unquantized activations.
- Linears stored unquantized in a converted checkpoint (router, LM head, whatever the converter
  excluded) run as bf16 ones do.
- ``kv_cache_dtype="fp8_e4m3"``: K and V go through float8_e4m3fn (scale 1.0, clamped to +-448)
  when written to the cache, and attention always reads them back from the cache, for the new
  tokens too, so prefill and incremental decoding see the same values (not the same
  computation: attention over a different number of rows differs in the last bits, as SGLang's
  does outside its deterministic mode). ``"bf16"`` stores them
  through bfloat16 (an SGLang BF16 group's cache); ``"auto"`` keeps float32.

Speed (decode of many sequences is bound by reading expert weights and by small-M matmuls):
every format's linears run through a numba GEMM on bfloat16 weights that widens them
in registers (``engine.kernels.gemm``: half the bytes read, float32 arithmetic), with FP8 block
and NVFP4 global scales applied to partial sums; the weights are written into its layout straight
from the checkpoint's codes (``layers.pack_parts``; float32 for ``F.linear`` only where that is
impossible); NVFP4's activation quantization is one fused numba pass per projection input (the
experts' gate/up input once per token, before the routed copies are gathered); the
experts run once per step over the tokens routed to them (tokens sorted by expert); the decoding
sequences' attention is one call per cache pool (see ``engine.model.cache``) with the query heads
of a KV head as its query rows, so each stored key and value is read once per step (torch's
``scaled_dot_product_attention`` with a mask per slot).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.cache import KVPool, SequenceCache, storage_dtype, to_storage
from engine.model.config import ARCHITECTURE, ModelConfig
from engine.model.layers import (
    Experts,
    Linear,
    Tap,
    apply_rope,
    rms_norm,
    rope_tables,
    route,
    swiglu,
)
from engine.model.loader import CheckpointTensors, LayerTensors, LinearWeight, load_checkpoint

__all__ = ["Model", "ModelConfig", "SequenceCache", "load_model"]


def _fuse(parts: list[LinearWeight], tap: Tap | None = None) -> list[Linear]:
    """One ``Linear`` over the concatenated rows when all parts share activation handling (all
    FP8, all NVFP4 or neither), else one ``Linear`` per part."""
    if len({(p.fp8_activations, p.nvfp4_input_scale is None) for p in parts}) == 1:
        return [Linear.of_parts(parts, tap)]
    return [_linear(p, tap) for p in parts]


def _linear(w: LinearWeight, tap: Tap | None = None) -> Linear:
    return Linear.of_parts([w], tap)


# Calibration: ``observer(layer, site, x)`` sees the input of every quantizable projection, with
# ``site`` one of SITES (the experts' sites see the rows routed to any expert).
Observer = Callable[[int, str, torch.Tensor], None]
SITES = ("qkv", "o_proj", "mlp_gate_up", "mlp_down", "experts_gate_up", "experts_down")


def _tap(observer: Observer | None, layer: int, site: str) -> Tap | None:
    return None if observer is None else functools.partial(observer, layer, site)


def _apply(linears: list[Linear], x: torch.Tensor) -> torch.Tensor:
    if len(linears) == 1:
        return linears[0](x)
    return torch.cat([lin(x) for lin in linears], dim=-1)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qk_norm: torch.Tensor  # [q heads + kv heads, head_dim]: q_norm rows, then k_norm rows
    qkv: list[Linear]
    o_proj: Linear
    router: torch.Tensor | None
    experts: Experts | None
    mlp_gate_up: list[Linear] | None
    mlp_down: Linear | None


def _layer(config: ModelConfig, i: int, lt: LayerTensors, observer: Observer | None) -> _Layer:
    lin = lt.linears
    experts = None
    if lt.experts:
        kinds = {(w.fp8_activations, w.nvfp4_input_scale is None) for e in lt.experts for w in e.values()}
        if len(kinds) != 1:
            raise ValueError("experts of one layer mix FP8, NVFP4 and other weights; not supported")
        taps = None if observer is None else (_tap(observer, i, SITES[4]), _tap(observer, i, SITES[5]))
        experts = Experts.of(
            [[e["gate_proj"], e["up_proj"]] for e in lt.experts],
            [e["down_proj"] for e in lt.experts],
            kinds.pop()[0],
            taps,
        )
    dense = "gate_proj" in lin
    return _Layer(
        input_norm=lt.plain["input_layernorm"],
        post_norm=lt.plain["post_attention_layernorm"],
        qk_norm=torch.cat(
            [
                lt.plain["q_norm"].expand(config.num_attention_heads, -1),
                lt.plain["k_norm"].expand(config.num_key_value_heads, -1),
            ]
        ),
        qkv=_fuse([lin["q_proj"], lin["k_proj"], lin["v_proj"]], _tap(observer, i, SITES[0])),
        o_proj=_linear(lin["o_proj"], _tap(observer, i, SITES[1])),
        router=lt.plain.get("gate"),
        experts=experts,
        mlp_gate_up=_fuse([lin["gate_proj"], lin["up_proj"]], _tap(observer, i, SITES[2])) if dense else None,
        mlp_down=_linear(lin["down_proj"], _tap(observer, i, SITES[3])) if dense else None,
    )


class Model:
    """A loaded model. ``forward`` is not thread-safe; call it from one thread at a time.

    Attributes: ``config`` (``ModelConfig``), ``architecture`` (``"Qwen3MoeForCausalLM"``),
    ``max_context`` (longest sequence a cache may hold), ``precision`` (the checkpoint's format:
    bf16 / fp8 / nvfp4 / mxfp4), ``kv_cache_dtype`` (auto / bf16 / fp8_e4m3), ``path``.
    ``observer`` (calibration, see ``Observer``) sees every projection's input.
    """

    architecture = ARCHITECTURE

    def __init__(
        self,
        config: ModelConfig,
        tensors: CheckpointTensors,
        kv_cache_dtype: str = "auto",
        path: Path | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.config = config
        self.path = path
        self.precision = tensors.fmt
        self.kv_cache_dtype = kv_cache_dtype
        self._kv_storage = storage_dtype(kv_cache_dtype)
        self.max_context = config.max_position_embeddings
        self._embed = tensors.embed
        self._final_norm = tensors.final_norm
        self._lm_head = _linear(tensors.lm_head)
        self._layers = [_layer(config, i, lt, observer) for i, lt in enumerate(tensors.layers)]
        self._cos = torch.empty(0, config.head_dim)
        self._sin = torch.empty(0, config.head_dim)
        self._geometry = (
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            self._kv_storage,
            self.max_context,
        )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_sequence(self) -> SequenceCache:
        """An empty KV cache (``length == 0``) for one sequence of this model."""
        c = self.config
        return SequenceCache(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            self._kv_storage,
            self.max_context,
            self._geometry,
        )

    def _rope(self, end: int) -> None:
        if self._cos.shape[0] < end:
            length = min(self.max_context, max(end, 2 * self._cos.shape[0], 256))
            self._cos, self._sin = rope_tables(self.config.head_dim, self.config.rope_theta, length)

    def _validate(self, tokens: list[torch.Tensor], caches: list[SequenceCache]) -> torch.Tensor:
        """Check a forward call's arguments (ValueError naming the problem); returns all ids concatenated."""
        if len(tokens) != len(caches):
            raise ValueError(f"forward got {len(tokens)} token tensors but {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("the same SequenceCache appears twice in one forward call")
        for i, (t, c) in enumerate(zip(tokens, caches, strict=True)):
            if not isinstance(c, SequenceCache) or c.geometry != self._geometry:
                raise ValueError(f"cache {i} was not made by a model of this shape and kv_cache_dtype")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"tokens[{i}] must be a 1-D integer tensor")
            if c.length + t.numel() > self.max_context:
                raise ValueError(
                    f"sequence {i} would reach {c.length + t.numel()} tokens, over the maximum context "
                    f"{self.max_context}"
                )
        ids = torch.cat([t.long() for t in tokens]) if tokens else torch.empty(0, dtype=torch.long)
        vocab = self.config.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = next(i for i, t in enumerate(tokens) if t.numel() and (t.min() < 0 or t.max() >= vocab))
            raise ValueError(f"tokens[{bad}] has ids outside the vocabulary [0, {vocab})")
        return ids

    def forward(self, tokens: list[torch.Tensor], caches: list[SequenceCache]) -> list[torch.Tensor]:
        """Append ``tokens[i]`` to sequence ``caches[i]`` for every i, in one batched step.

        Before: each ``caches[i]`` holds ``caches[i].length`` positions of this model's geometry;
        ids are in ``[0, vocab)``; no sequence exceeds ``max_context``; no cache appears twice
        (else ``ValueError`` and nothing changes). After: ``caches[i].length`` grew by
        ``len(tokens[i])``; returns float32 logits ``[len(tokens[i]), vocab]`` for each new
        position (the next-token distribution after that position).
        """
        return self._run(tokens, caches, None)

    def forward_routed(
        self, tokens: list[torch.Tensor], caches: list[SequenceCache]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`forward`, plus per sequence the routed experts of its new positions: int32
        ``[len(tokens[i]), num_hidden_layers, num_experts_per_tok]``, each row the top-k expert ids
        of that position in that layer in descending router probability (``torch.topk`` order);
        a dense layer's rows are 0, as SGLang's zero-initialised capture buffer leaves them
        (``state_capturer/base.py`` 38-40)."""
        routes: list[torch.Tensor] = []
        logits = self._run(tokens, caches, routes)
        return logits, routes

    @torch.inference_mode()
    def _run(
        self, tokens: list[torch.Tensor], caches: list[SequenceCache], routes: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """The step of :meth:`forward`; when ``routes`` is a list, appends the per-sequence routes
        :meth:`forward_routed` describes."""
        ids = self._validate(tokens, caches)
        lens = [int(t.numel()) for t in tokens]
        starts = [c.length for c in caches]
        total = sum(lens)
        vocab = self.config.vocab_size
        if total == 0:
            if routes is not None:
                k = max(self.config.num_experts_per_tok, 1)
                routes.extend(torch.zeros(0, len(self._layers), k, dtype=torch.int32) for _ in tokens)
            return [torch.empty(0, vocab) for _ in tokens]
        for c, s, n in zip(caches, starts, lens, strict=True):
            c.reserve(s + n)
        self._rope(max(s + n for s, n in zip(starts, lens, strict=True)))
        if all(n == 1 for n in lens):  # one new token per sequence: decoding
            positions = torch.tensor(starts)
        else:
            positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
        cos, sin = self._cos[positions], self._sin[positions]
        c = self.config
        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        attention = _Attention(caches, starts, lens, nh, nkv, d, self._kv_storage)
        x = self._embed[ids]
        k = max(c.num_experts_per_tok, 1)
        captured = torch.zeros(total, len(self._layers), k, dtype=torch.int32) if routes is not None else None
        for li, layer in enumerate(self._layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = _apply(layer.qkv, h)
            # q and k heads together: per-head RMSNorm (q_norm on q heads, k_norm on k heads), RoPE.
            qk = qkv[:, : (nh + nkv) * d].view(total, nh + nkv, d)
            qk = apply_rope(rms_norm(qk, layer.qk_norm, c.rms_norm_eps), cos, sin)
            v = qkv[:, (nh + nkv) * d :].view(total, nkv, d)
            x = x + layer.o_proj(attention(li, qk, v))
            h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
            if layer.experts is not None:
                top_idx, top_w = route(h, layer.router, c.num_experts_per_tok, c.norm_topk_prob)
                if captured is not None:
                    captured[:, li] = top_idx
                x = x + layer.experts(h, top_idx, top_w)
            else:
                x = x + swiglu(h, _Fused(layer.mlp_gate_up), layer.mlp_down)
        x = rms_norm(x, self._final_norm, c.rms_norm_eps)
        logits = self._lm_head(x).float()
        for cache, n in zip(caches, lens, strict=True):
            cache.length += n
        if routes is not None:
            routes.extend(captured.split(lens))
        return list(logits.split(lens))


@dataclass(frozen=True)
class _DecodeGroup:
    """The decoding sequences (one new token each) of one forward step that live in one pool."""

    pool: KVPool
    rows: torch.Tensor  # their tokens' rows in the step
    slots: torch.Tensor  # their slots in the pool
    positions: torch.Tensor  # their new tokens' positions
    span: int  # slots [0, span) take part in the batched call (the others' results are dropped)
    window: int  # positions [0, window) are read
    mask: torch.Tensor  # [span, 1, 1, window]: each slot's positions up to its new token
    lengths: torch.Tensor  # [span] int64: each slot's positions to attend over (0: not in the step)
    all_rows: bool  # rows == 0 .. N-1: the whole step, in order
    identity: bool  # all_rows, and row i is slot i (no scatter / gather around the call)


class _Attention:
    """Attention of one forward step over the caches' stored and new keys and values.

    Decoding sequences of one pool run as one SDPA call over the pool's slots ``[0, span)``
    and positions ``[0, window)``, masked to each slot's length (the query heads that share a KV
    head are that call's query rows, so each stored key is read once); a sequence with several
    new tokens (a prefill chunk) runs one call of its own on views of its slot.
    """

    def __init__(
        self,
        caches: list[SequenceCache],
        starts: list[int],
        lens: list[int],
        nh: int,
        nkv: int,
        d: int,
        storage: torch.dtype,
    ) -> None:
        self.nh, self.nkv, self.d, self.storage = nh, nkv, d, storage
        self.gqa = nh != nkv
        self.singles: list[tuple[SequenceCache, int, int, int, torch.Tensor | None]] = []
        decoding: dict[int, tuple[KVPool, list[int], list[int], list[int]]] = {}
        off = 0
        for cache, s, n in zip(caches, starts, lens, strict=True):
            if n == 1:
                assert cache.pool is not None
                group = decoding.setdefault(id(cache.pool), (cache.pool, [], [], []))
                group[1].append(off)
                group[2].append(cache.slot)
                group[3].append(s)
            elif n > 1:
                self.singles.append((cache, s, n, off, _mask(s, n)))
            off += n
        self.groups: list[_DecodeGroup] = []
        for pool, rows, slots, positions in decoding.values():
            span, window = max(slots) + 1, max(positions) + 1
            last = torch.zeros(span, dtype=torch.long)  # slots not in the step see position 0 only
            last[slots] = torch.tensor(positions)
            mask = (torch.arange(window)[None, :] <= last[:, None])[:, None, None, :]
            lengths = torch.zeros(span, dtype=torch.long)
            lengths[slots] = torch.tensor(positions) + 1
            all_rows = rows == list(range(off))
            self.groups.append(
                _DecodeGroup(
                    pool,
                    torch.tensor(rows),
                    torch.tensor(slots),
                    torch.tensor(positions),
                    span,
                    window,
                    mask,
                    lengths,
                    all_rows,
                    all_rows and slots == list(range(span)),
                )
            )

    def __call__(self, layer: int, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the step's keys and values in the caches' ``layer`` and attend: ``qk``
        ``[N, nh + nkv, d]`` (normed, rotated q heads then k heads), ``v`` ``[N, nkv, d]``;
        returns ``[N, nh * d]``."""
        nh, nkv, d = self.nh, self.nkv, self.d
        total = qk.shape[0]
        q = qk[:, :nh]
        kv = torch.cat([qk[:, nh:], v], dim=1)  # [N, 2 * nkv, d]: K heads then V heads, as stored
        out = torch.empty(total, nh, d)
        for g in self.groups:
            assert g.pool.kv is not None
            store = g.pool.kv[layer]  # [slots, 2 * nkv, capacity, d]
            n = g.rows.numel()
            new = kv if g.all_rows else kv[g.rows]
            store[g.slots, :, g.positions] = to_storage(new, self.storage)
            group = nh // nkv
            if g.identity:
                queries = q.reshape(n, nkv, group, d)
            else:
                queries = torch.zeros(g.span, nkv, group, d)
                queries[g.slots] = (q if g.all_rows else q[g.rows]).reshape(n, nkv, group, d)
            stored = store[: g.span, :, : g.window]
            if self.storage != torch.float32:
                stored = stored.float()
            res = F.scaled_dot_product_attention(queries, stored[:, :nkv], stored[:, nkv:], attn_mask=g.mask)
            res = res.reshape(n, nh, d) if g.identity else res[g.slots].view(n, nh, d)
            if g.all_rows:
                out = res
            else:
                out[g.rows] = res
        # 4-D head-major [1, heads, n, d] views (SDPA's layout; 3-D inputs would take its math
        # fallback).
        for cache, s, n, off, mask in self.singles:
            end = off + n
            cache.write(layer, s, kv[off:end].transpose(0, 1)[None])
            kk, vv = cache.read(layer, s + n)
            qq = q[off:end].transpose(0, 1)[None]
            res = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=mask, is_causal=s == 0, enable_gqa=self.gqa
            )
            out[off:end] = res[0].transpose(0, 1)
        return out.view(total, nh * d)


@dataclass(frozen=True)
class _Fused:
    parts: list[Linear]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(self.parts, x)


def _mask(start: int, n: int) -> torch.Tensor | None:
    """Boolean attention mask ``[n, start+n]`` for ``n`` new queries after ``start`` cached
    positions (None where SDPA's own handling suffices: one query, or ``is_causal`` from 0)."""
    if n <= 1 or start == 0:
        return None
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(start + n)[None, :]
    return k_pos <= q_pos


def load_model(path: str | Path, kv_cache_dtype: str = "auto", observer: Observer | None = None) -> Model:
    """Load the checkpoint directory ``path`` (any of the four formats); ``observer``: see ``Model``.

    Raises ``ValueError`` with a message naming the problem when the directory is missing, is
    not a ``Qwen3MoeForCausalLM`` checkpoint, or has tensors missing or of the wrong shape, or
    when ``kv_cache_dtype`` is not one of auto / bf16 / fp8_e4m3.
    """
    storage_dtype(kv_cache_dtype)
    path = Path(path)
    config = ModelConfig.from_dir(path)
    tensors = load_checkpoint(path, config)
    return Model(config, tensors, kv_cache_dtype=kv_cache_dtype, path=path, observer=observer)

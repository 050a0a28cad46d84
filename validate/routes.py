"""Level 5, routes and request state, on level 4's fixed sequences.

- Routes: every replica of the group returns, per token and per MoE layer, the top-k expert ids
  its router chose (SGLang 0.5.23's ``return_routed_experts``; the local engine with
  ``--enable-return-routed-experts``); per layer, the share of tokens whose top-k id set equals the
  BF16 reference's. The first layer below the bound is where the routes diverge: its router's
  input already differs, so the cause lies after the last agreeing layer's routing (that
  layer's experts: their weights, packing, expert order) or in the diverging layer's attention.
- Request state: the log-probs the group reported while decoding its sampled tokens (one at a
  time, through its KV cache) against the scores of the same tokens computed in one prefill: their
  mean ``|d log p|`` per token is judged (single tokens may jump where a quantized activation or a
  near-tie top-k rounds the other way: ``validate.thresholds``' ``context_dlogp``), its maximum
  reported; and the mean ``|d log p|`` against BF16 per position bucket (level 4) shows whether the
  mismatch grows with context length (reported, not judged: growth alone is not a fault).
"""

from __future__ import annotations

from typing import Any

import torch

from validate import engine_calls
from validate.level import LevelResult
from validate.scoring import FixedPrefix
from validate.target import GroupTarget
from validate.thresholds import bounds


def route_agreement(engine: list[torch.Tensor], fp: FixedPrefix, layers: list[int]) -> dict[int, float]:
    """Per MoE layer, the share of tokens whose sorted top-k ids equal the reference's."""
    same = dict.fromkeys(layers, 0)
    total = 0
    for got, ref in zip(engine, fp.reference, strict=True):
        n = got.shape[0]
        total += n
        for layer in layers:
            mine = torch.sort(got[:, layer, :], dim=-1).values
            same[layer] += int((mine == ref.routes[layer][:n]).all(dim=-1).sum())
    return {layer: same[layer] / max(total, 1) for layer in layers}


def cache_gap(fp: FixedPrefix, rep: str) -> dict[str, float]:
    """Replica ``rep``'s decode-time log-probs against its prefill scores of the same tokens:
    ``mean`` and ``max`` of ``|d log p|`` over every sampled token, and their count ``tokens``."""
    gaps = [
        (torch.tensor(s.decode_logp, dtype=torch.float64) - grp[start - 1 :]).abs()
        for s, start, grp in zip(fp.samples, fp.starts, fp.scores[rep], strict=True)
    ]
    d = torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.float64)
    if not d.numel():
        return {"mean": 0.0, "max": 0.0, "tokens": 0}
    return {"mean": float(d.mean()), "max": float(d.max()), "tokens": int(d.numel())}


def check(
    target: GroupTarget, fp: FixedPrefix, layers: list[int], num_layers: int, top_k: int
) -> LevelResult:
    """Level 5 of ``target`` on ``fp`` (``layers``: the MoE layers; ``num_layers``, ``top_k``: the
    shape of the engine's routed-experts answer)."""
    b = bounds(target.format)
    failures, notes = [], []
    agreement: dict[str, dict[int, float]] = {}
    first: dict[str, Any] = {}
    for r in target.replicas:
        got = engine_calls.routed_experts(r.url, fp.seqs, num_layers, top_k)
        if got is None:
            notes.append(
                f"{r.replica_id}: the engine returns no routed experts (start it with "
                "--enable-return-routed-experts); routes not compared"
            )
            continue
        agree = route_agreement(got, fp, layers)
        agreement[r.replica_id] = agree
        bad = [layer for layer in layers if agree[layer] < b.route_agree_min]
        if bad:
            layer = bad[0]
            before = [x for x in layers if x < layer]
            where = (
                f"routes of layer {before[-1]} agree ({agree[before[-1]]:.0%}): the difference enters after "
                f"layer {before[-1]}'s routing (its experts: weights, packing, order) or in layer "
                f"{layer}'s attention"
                if before
                else "the first MoE layer: its router input (embedding, attention) differs"
            )
            first[r.replica_id] = {"layer": layer, "last_agreeing": before[-1] if before else None}
            failures.append(
                f"{r.replica_id}: routes first diverge at layer {layer} ({agree[layer]:.0%} of tokens keep "
                f"BF16's top-{top_k} < {b.route_agree_min:.0%}); {where}"
            )
    gaps = {}
    for rep in fp.scores:
        gaps[rep] = gap = cache_gap(fp, rep)
        if not gap["mean"] <= b.context_dlogp:
            failures.append(
                f"{rep}: decode-time log-probs differ from the prefill scores of the same tokens by "
                f"{gap['mean']:.3g} per token on average > {b.context_dlogp:.3g} (KV-cache history; "
                f"largest {gap['max']:.3g})"
            )
    parts = []
    if agreement:
        worst = min(min(a.values()) for a in agreement.values())
        parts.append(
            f"routes: worst layer keeps {worst:.0%} of BF16's top-{top_k} (bound {b.route_agree_min:.0%})"
        )
    worst_gap = max(gaps.values(), key=lambda g: g["mean"], default={"mean": 0.0, "max": 0.0})
    parts.append(
        f"decode vs prefill |d log p| mean {worst_gap['mean']:.2g} (bound {b.context_dlogp:.2g}), "
        f"largest {worst_gap['max']:.2g}"
    )
    return LevelResult.checked(
        5,
        "; ".join(parts),
        failures,
        tuple(notes),
        details={
            "agreement": {r: {str(k): v for k, v in a.items()} for r, a in agreement.items()},
            "first_divergence": first,
            "decode_vs_prefill": gaps,
            "bounds": {"route_agree_min": b.route_agree_min, "context_dlogp": b.context_dlogp},
        },
        plot={
            "agreement": {r: {str(k): v for k, v in a.items()} for r, a in agreement.items()},
            "bound": b.route_agree_min,
        },
    )

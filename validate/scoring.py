"""Level 4, fixed-prefix scoring: the group and the trainer's BF16 forward score the same tokens.

The prompts are fixed; the group samples one continuation per prompt (temperature 1, the
ladder's ``top_p``) on its first replica; then every replica of the group scores each whole
sequence (``POST /v1/score`` of the router, ``logprob_start_len`` 0) and the BF16 reference
(``validate.reference``) scores the same sequences. Per replica:

- per-token KL, ``k3`` estimator over the sampled tokens (drawn from the group):
  ``k3 = (r - 1) - log r`` with ``log r = log p_bf16(x) - log p_group(x)`` (non-negative, unbiased
  for ``KL(group || bf16)``);
- ``|log p_group - log p_bf16|`` of every scored token, averaged per position bucket;
- support agreement: the share of sampled tokens inside the BF16 reference's top-p nucleus
  (the smallest set of most likely tokens whose mass reaches ``top_p``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from validate.engine_calls import Sample
from validate.level import LevelResult
from validate.reference import Forward
from validate.target import GroupTarget
from validate.thresholds import bounds

BUCKETS = ((1, 8), (8, 32), (32, 128), (128, 512), (512, 1 << 30))


@dataclass(frozen=True)
class FixedPrefix:
    """The controlled comparison levels 4 and 5 share: sequences (prompt + sampled tokens), where
    the sampled part starts, the group's decode-time log-probs, the group's scores per replica
    (``[len - 1]`` each) and the BF16 reference's forward of each sequence."""

    seqs: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    samples: tuple[Sample, ...]
    scores: dict[str, list[torch.Tensor]]
    reference: tuple[Forward, ...]


def fixed_prefix(
    client: Any, target: GroupTarget, prompts: Sequence[Sequence[int]], samples: list[Sample], reference: Any
) -> FixedPrefix:
    """Score ``prompts`` + ``samples`` on every replica of ``target`` and on ``reference``."""
    seqs = tuple(tuple(p) + s.tokens for p, s in zip(prompts, samples, strict=True))
    res = client.score(
        {"input_ids": [list(s) for s in seqs], "logprob_start_len": 0, "groups": [target.name]}
    )
    scores: dict[str, list[torch.Tensor]] = {}
    for r in res["results"]:
        scores[r["replica"]] = [
            torch.tensor([x for x in lp[1:]], dtype=torch.float64) for lp in r["logprobs"]
        ]
    refs = tuple(reference.forward(list(s)) for s in seqs)
    return FixedPrefix(seqs, tuple(len(p) for p in prompts), tuple(samples), scores, refs)


def _token_logp(f: Forward, seq: tuple[int, ...]) -> torch.Tensor:
    return f.logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def in_nucleus(logp: torch.Tensor, token: int, top_p: float) -> bool:
    """Whether ``token`` is in the top-p nucleus of the distribution ``logp`` ``[V]``."""
    p = logp.exp()
    above = float(p[p > p[token]].sum())
    return above < top_p


def measure(fp: FixedPrefix, top_p: float) -> dict[str, dict[str, Any]]:
    """Per replica: k3 mean, |d log p| per bucket (with counts), support agreement, |d log p| series."""
    out = {}
    for rep, scores in fp.scores.items():
        k3s, inside, total = [], 0, 0
        sums = [0.0] * len(BUCKETS)
        counts = [0] * len(BUCKETS)
        series: list[list[float]] = []
        for seq, start, ref, grp in zip(fp.seqs, fp.starts, fp.reference, scores, strict=True):
            ref_lp = _token_logp(ref, seq)
            d = ref_lp - grp
            series.append([float(x) for x in d.abs()])
            for pos, v in enumerate(d.abs().tolist(), start=1):
                b = next(i for i, (lo, hi) in enumerate(BUCKETS) if lo <= pos < hi)
                sums[b] += v
                counts[b] += 1
            sampled = d[start - 1 :]
            # expm1(d) - d: (e^d - 1) - d cancels near d = 0 and goes below 0 (about -4e-17 at
            # |d| ~ 1e-12, where a BF16 group's true k3 is ~1e-25); clamped for expm1's last bit
            k3s += (torch.expm1(sampled) - sampled).clamp_min(0.0).tolist()
            for j in range(start, len(seq)):
                total += 1
                inside += in_nucleus(ref.logp[j - 1], seq[j], top_p)
        out[rep] = {
            "k3_mean": sum(k3s) / max(len(k3s), 1),
            "buckets": [
                {
                    "positions": f"{lo}-{hi - 1}" if hi < 1 << 29 else f"{lo}+",
                    "mean_abs_dlogp": s / c,
                    "tokens": c,
                }
                for (lo, hi), s, c in zip(BUCKETS, sums, counts, strict=True)
                if c
            ],
            "support": inside / max(total, 1),
            "sampled_tokens": total,
            "series": series,
        }
    return out


def check(target: GroupTarget, fp: FixedPrefix, top_p: float) -> LevelResult:
    """Level 4 of ``target`` on the shared comparison ``fp``."""
    b = bounds(target.format)
    per = measure(fp, top_p)
    failures = []
    for rep, m in per.items():
        if not m["k3_mean"] <= b.kl_k3_mean:
            failures.append(f"{rep}: mean k3 KL {m['k3_mean']:.3g} > {b.kl_k3_mean:.3g}")
        for bk in m["buckets"]:
            if not bk["mean_abs_dlogp"] <= b.dlogp_mean:
                failures.append(
                    f"{rep}: positions {bk['positions']}: mean |d log p| {bk['mean_abs_dlogp']:.3g} "
                    f"> {b.dlogp_mean:.3g}"
                )
        if m["support"] < b.support_min:
            failures.append(
                f"{rep}: {m['support']:.1%} of sampled tokens in BF16's top-{top_p} nucleus "
                f"< {b.support_min:.0%}"
            )
    if not per:
        failures.append("no replica of the group scored")
    worst = max(per.values(), key=lambda m: m["k3_mean"]) if per else None
    summary = (
        f"{len(fp.seqs)} sequences, {worst['sampled_tokens']} sampled tokens: mean k3 KL "
        f"{worst['k3_mean']:.3g} (bound {b.kl_k3_mean:.3g}), support {worst['support']:.1%}"
        if worst
        else "no score"
    )
    details = {rep: {k: v for k, v in m.items() if k != "series"} for rep, m in per.items()}
    return LevelResult.checked(
        4,
        summary,
        failures,
        details={
            "replicas": details,
            "top_p": top_p,
            "bounds": {"kl_k3_mean": b.kl_k3_mean, "dlogp_mean": b.dlogp_mean, "support_min": b.support_min},
        },
        plot={"series": {rep: m["series"] for rep, m in per.items()}, "bound": b.dlogp_mean},
    )

"""Reference policy losses for a BF16 trainer learning from mixed-precision samplers.

Notation (per sampled position t): ``y`` the sampled token, ``q`` the sampler's (behavior)
probability as recorded by the fleet (after temperature, top-k and top-p, renormalized over the
support ``S``), ``p`` the trainer's probability, ``r = p / q``, ``A`` the advantage and ``sg`` the
stop-gradient. Every function is vectorized over a packed batch of ``T`` positions: the support
is CSR (``support_ids`` holds the rows one after another, ``support_offsets`` [T+1] where row t
starts), ``support_logprobs`` are the sampler's renormalized log-probs in the same order. A row
with no ids means the sampler applied no filter (the support is the whole vocabulary).

All arithmetic is float32 whatever the logits' dtype. Weights are detached. Losses are the mean
over all ``T`` positions, counted before any masking.

Methods of :func:`policy_loss`:

=============== =======================================================================
``grpo``        PPO-clipped ratio ``-min(r A, clip(r, 1-eps, 1+eps) A)``, full-vocabulary p
``grpo-mis``    ``grpo`` times the MIS mask ``1[low <= r <= high]``
``sc``          score centering, weight ``w(r) = 1``, tail mode (full-vocabulary p)
``sc-mis``      score centering, MIS weight ``w(r) = r 1[low <= r <= high]``, tail mode
``sc-mis-topp`` ``sc-mis`` with top-p mask replay: p renormalized over S, exact centering
=============== =======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.methods import DEFAULT_BAND, METHODS

TAIL_FLOOR = 1e-6
PPO_CLIP_EPS = 0.2


@dataclass(frozen=True)
class Support:
    """A packed batch's recorded candidate sets as CSR, with derived row indices.

    ``ids`` [N] int64, ``offsets`` [T+1] int64 (``offsets[0] == 0``, non-decreasing,
    ``offsets[-1] == N``), ``logprobs`` [N] float32 (the sampler's renormalized log-probs),
    ``rows`` [N] the position each entry belongs to, ``lengths`` [T].
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    logprobs: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def build(
        cls, ids: torch.Tensor, offsets: torch.Tensor, logprobs: torch.Tensor, n_positions: int, vocab: int
    ) -> Support:
        """Check the CSR arrays against ``n_positions`` and ``vocab``; raise ValueError naming
        the first problem."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        offsets = torch.as_tensor(offsets, dtype=torch.int64)
        logprobs = torch.as_tensor(logprobs).to(torch.float32)
        if offsets.ndim != 1 or offsets.numel() != n_positions + 1:
            raise ValueError(
                f"support_offsets: expected {n_positions + 1} entries, got {tuple(offsets.shape)}"
            )
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
            raise ValueError(
                f"support_offsets must start at 0 and end at len(support_ids) = {ids.numel()}, "
                f"got {int(offsets[0])} .. {int(offsets[-1])}"
            )
        lengths = offsets[1:] - offsets[:-1]
        if bool((lengths < 0).any()):
            raise ValueError("support_offsets must be non-decreasing")
        if logprobs.shape != ids.shape:
            raise ValueError(
                f"support_logprobs: expected {tuple(ids.shape)} entries, got {tuple(logprobs.shape)}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(
                f"support_ids must lie in [0, {vocab}), got {int(ids.min())} .. {int(ids.max())}"
            )
        rows = torch.repeat_interleave(torch.arange(n_positions), lengths)
        return cls(ids, offsets, logprobs, rows, lengths)

    def row_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position sum of one value per support entry ([N] -> [T]); 0 for empty rows."""
        out = torch.zeros(self.lengths.numel(), dtype=values.dtype)
        return out.index_add(0, self.rows, values)

    def row_logsumexp(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position log-sum-exp of one value per entry ([N] -> [T]); -inf for empty rows."""
        n = self.lengths.numel()
        peak = torch.full((n,), -torch.inf, dtype=values.dtype)
        peak = peak.scatter_reduce(0, self.rows, values.detach(), reduce="amax")
        safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        total = self.row_sum(torch.exp(values - safe[self.rows]))
        return torch.log(total) + safe

    def contains(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T] bool: the position's token is one of its row's ids (False for empty rows)."""
        hit = (self.ids == tokens[self.rows]).to(torch.int64)
        out = torch.zeros(self.lengths.numel(), dtype=torch.int64)
        return out.index_add(0, self.rows, hit) > 0


def mis_weight(ratio: torch.Tensor, band: tuple[float, float] = DEFAULT_BAND) -> torch.Tensor:
    """Masked importance sampling: ``w(r) = r`` for ``low <= r <= high``, else 0 (detached)."""
    ratio = ratio.detach()
    low, high = band
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))


def icepop_mask(ratio: torch.Tensor, band: tuple[float, float] = DEFAULT_BAND) -> torch.Tensor:
    """IcePop: MIS's band applied to the ratio as a mask, ``1[low <= r <= high]`` (detached)."""
    ratio = ratio.detach()
    low, high = band
    return ((ratio >= low) & (ratio <= high)).to(torch.float32)


def tis_weight(ratio: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling: ``w(r) = min(r, C)`` (detached)."""
    return torch.clamp(ratio.detach(), max=cap)


def replay_logprobs(logits: torch.Tensor, support: Support) -> torch.Tensor:
    """Top-p mask replay: the trainer's log-probs renormalized over each recorded support,
    ``log p^S_v = log p_v - logsumexp_{u in S} log p_u``, one value per support entry ([N]).

    Only the logits of support ids enter, so every token outside ``S`` gets exactly zero
    gradient."""
    gathered = logits.float()[support.rows, support.ids]
    return gathered - support.row_logsumexp(gathered)[support.rows]


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, support: Support | None) -> torch.Tensor:
    """log p_y per position: full-vocabulary when ``support`` is None, else renormalized over the
    row's support (rows with an empty support: over the whole vocabulary)."""
    full = torch.log_softmax(logits.float(), dim=-1)
    lp = full.gather(1, tokens[:, None])[:, 0]
    if support is None:
        return lp
    if not bool(torch.all(support.contains(tokens) | (support.lengths == 0))):
        bad = int(torch.nonzero(~(support.contains(tokens) | (support.lengths == 0)))[0, 0])
        raise ValueError(
            f"position {bad}: the sampled token {int(tokens[bad])} is not in its recorded support"
        )
    gathered = logits.float()[support.rows, support.ids]
    norm = support.row_logsumexp(gathered)
    return torch.where(support.lengths > 0, logits.float().gather(1, tokens[:, None])[:, 0] - norm, lp)


def score_centering_terms(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    support: Support,
    weight,
    *,
    replay: bool,
) -> torch.Tensor:
    """Per-position score-centering objective (before the advantage), whose gradient is

    ``sg(w(p_y/q_y)) grad log p_y - sum_{v in H} sg(q_v w(p_v/q_v) - alpha p_v) grad log p_v``

    with H the recorded candidate set (Marek & Ryabinin, arXiv:2609.20807).

    * ``replay=True``: H = the support, p and q renormalized over it, ``alpha = 0``: the sum is
      the exact centering term of the replayed distribution. An empty row means the whole
      vocabulary; the sampler's q beyond the sampled token is then unknown and modelled as p,
      whose centering term is zero, so such a row contributes ``w(r_y) log p_y`` only.
    * ``replay=False`` (tail mode): p is full-vocabulary, H the head of the sampler's
      distribution, neither renormalized; the tail is modelled as ``q_hat = rho p`` with
      ``rho = (1 - sum_H q) / (1 - sum_H p)``, each tail mass floored at ``TAIL_FLOOR``, and
      ``alpha = rho w(1/rho)``. The sampled token keeps its own q even when it is outside H.
    """
    if replay:
        lp_head = replay_logprobs(logits, support)
    else:
        lp_head = torch.log_softmax(logits.float(), dim=-1)[support.rows, support.ids]
    lp_y = sampled_logprobs(logits, tokens, support if replay else None)
    q_y_log = behavior_logprobs.float()
    w_y = weight(torch.exp(lp_y.detach() - q_y_log))
    q_head = torch.exp(support.logprobs)
    p_head = torch.exp(lp_head.detach())
    w_head = weight(p_head / q_head)
    if replay:
        coef = q_head * w_head
    else:
        tail_q = torch.clamp(1.0 - support.row_sum(q_head), min=TAIL_FLOOR)
        tail_p = torch.clamp(1.0 - support.row_sum(p_head), min=TAIL_FLOOR)
        rho = tail_q / tail_p
        alpha = rho * weight(1.0 / rho)
        coef = q_head * w_head - alpha[support.rows] * p_head
    centering = support.row_sum(coef.detach() * lp_head)
    return w_y.detach() * lp_y - centering


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalized advantages: ``(R - mean_g R) / (std_g R + eps)`` over the
    trajectories that share a prompt group (``groups``: one integer id per reward; population
    std). A group of one gets advantage 0."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    groups = torch.as_tensor(groups, dtype=torch.int64)
    _, index = torch.unique(groups, return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(n).index_add(0, index, torch.ones_like(rewards))
    mean = torch.zeros(n).index_add(0, index, rewards) / count
    var = torch.zeros(n).index_add(0, index, (rewards - mean[index]) ** 2) / count
    return (rewards - mean[index]) / (var[index].sqrt() + eps)


def policy_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    support_ids: torch.Tensor,
    support_offsets: torch.Tensor,
    support_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    method: str = "sc-mis-topp",
    band: tuple[float, float] = DEFAULT_BAND,
    clip_eps: float = PPO_CLIP_EPS,
) -> torch.Tensor:
    """The mean per-token loss of ``method`` (see the module table) over ``T`` positions.

    ``logits`` [T, V] the trainer's, ``tokens`` [T], ``behavior_logprobs`` [T] (log mu, as
    recorded), the support as CSR with the sampler's renormalized log-probs, ``advantages`` [T].
    Raises ValueError naming the first bad argument (shapes, CSR, an unknown method, a sampled
    token outside its support under replay)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, V], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    for name, x in (("tokens", tokens), ("behavior_logprobs", behavior_logprobs), ("advantages", advantages)):
        if tuple(x.shape) != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(x.shape)}")
    if n and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"tokens must lie in [0, {vocab})")
    low, high = band
    if not 0 <= low < high:
        raise ValueError(f"band must satisfy 0 <= low < high, got {band}")
    if n == 0:
        return logits.float().sum() * 0.0
    support = Support.build(support_ids, support_offsets, support_logprobs, n, vocab)
    adv = advantages.detach().float()
    if method.startswith("grpo"):
        ratio = torch.exp(sampled_logprobs(logits, tokens, None) - behavior_logprobs.float())
        clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        if method == "grpo-mis":
            per_token = per_token * icepop_mask(ratio, band)
        return per_token.mean()
    if method == "sc":
        terms = score_centering_terms(
            logits, tokens, behavior_logprobs, support, torch.ones_like, replay=False
        )
    else:
        terms = score_centering_terms(
            logits,
            tokens,
            behavior_logprobs,
            support,
            lambda r: mis_weight(r, band),
            replay=method == "sc-mis-topp",
        )
    return (-adv * terms).mean()


@dataclass(frozen=True)
class Mismatch:
    """Sampler-trainer mismatch over a set of sampled tokens. The figures carry the names of the
    router's gauges without their ``mixfleet_mismatch_`` prefix (``mixfleet_mismatch_k3_kl``,
    ``..._abs_logprob_diff_mean``, ``..._extreme_ratio_share``), so a trainer's logs and the
    fleet's dashboards name the same quantity alike."""

    tokens: int
    k3_kl: float
    abs_logprob_diff_mean: float
    extreme_ratio_share: float


def mismatch(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    band: tuple[float, float] = (0.2, 5.0),
) -> Mismatch:
    """Mismatch of sampled tokens with ``r = p / q``: the k3 estimator of KL(q || p),
    ``mean(r - 1 - log r)`` (each term computed as ``expm1(log r) - log r``: never negative);
    ``mean |log p - log q|``; the share of ``r`` outside ``band``.
    Zero tokens give zeros."""
    lp = torch.as_tensor(trainer_logprobs, dtype=torch.float64)
    lq = torch.as_tensor(sampler_logprobs, dtype=torch.float64)
    if lp.shape != lq.shape:
        raise ValueError(
            f"trainer and sampler log-probs differ in shape: {tuple(lp.shape)} vs {tuple(lq.shape)}"
        )
    if lp.numel() == 0:
        return Mismatch(0, 0.0, 0.0, 0.0)
    log_r = lp - lq
    r = torch.exp(log_r)
    # k3 as expm1(d) - d, never negative (r - 1 - d cancels near d = 0 and comes out below zero
    # for |d| ~ 1e-12); the clamp guards the last bit of expm1 (router.mismatch.k3_terms alike)
    k3 = (torch.expm1(log_r) - log_r).clamp_min(0.0)
    low, high = band
    return Mismatch(
        tokens=lp.numel(),
        k3_kl=float(k3.mean()),
        abs_logprob_diff_mean=float(log_r.abs().mean()),
        extreme_ratio_share=float(((r < low) | (r > high)).double().mean()),
    )


def mismatch_by_group(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    groups: list[str],
    band: tuple[float, float] = (0.2, 5.0),
) -> dict[str, Mismatch]:
    """:func:`mismatch` per sampler group (``groups``: the group of each token)."""
    if len(groups) != len(trainer_logprobs):
        raise ValueError(f"{len(groups)} group labels for {len(trainer_logprobs)} tokens")
    names = sorted(set(groups))
    code = {name: i for i, name in enumerate(names)}
    label = torch.tensor([code[g] for g in groups], dtype=torch.int64)
    lp = torch.as_tensor(trainer_logprobs)
    lq = torch.as_tensor(sampler_logprobs)
    return {name: mismatch(lp[label == i], lq[label == i], band) for i, name in enumerate(names)}

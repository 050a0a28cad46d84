"""Token sampling with an exact behavior record, as SGLang defines it.

Pure functions on a batch of float32 logits ``[B, V]``; nothing here knows about requests,
caches or HTTP. For every row the sampler returns a :class:`Draw`:

- ``logprob``: SGLang's ``output_token_logprobs`` value: log-softmax of ``logits / T``, after
  temperature and before top-k / top-p / min-p. Greedy rows (``temperature == 0``) use ``T = 1``,
  i.e. the raw log-softmax, exactly as SGLang rewrites ``temperature 0`` to ``top_k = 1, T = 1``.
- ``support_ids``: the exact candidate set the token was drawn from, sorted ascending by token id.
  The empty tuple means *the whole vocabulary* (no filter was active). A filter is active when
  ``temperature == 0``, ``top_k < V``, ``top_p < 1`` or ``min_p > 0``.
- ``support_logprobs``: log-probs renormalized over that support, aligned with ``support_ids``
  (empty with an empty support). :meth:`Draw.ranked_support` gives the support in the order
  SGLang 0.5.23 sends it (highest renormalized probability first).
- ``sampling_logprob``: the behavior log-prob μ of the drawn token: its renormalized log-prob
  (equal to ``logprob`` when the support is the whole vocabulary, ``0.0`` for greedy).

Support rule (SGLang's joint top-k / top-p / min-p filter on the temperature-scaled
distribution p): sort tokens by p descending, ties broken by ascending token id; token at rank
``r`` (0-based) is kept iff ``r < top_k`` **and** the mass strictly before it is ``< top_p``
(so the top-p part is the smallest prefix whose mass is ``>= top_p``; ``top_p >= 1`` disables
it) **and** ``p >= min_p * max(p)``; tokens with p == 0 (float64 underflow) are never in a
support. The top-ranked token is always kept. Masses are computed in float64.

Sampling draws one uniform number per row from the row's own ``random.Random`` and inverts
the renormalized CDF over the support in rank order (for every row, filtered or not), so a request seeded with
``sampling_seed`` reproduces its tokens whatever else shares its batch (given equal logits).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TOP_K_ALL = -1


@dataclass(frozen=True)
class SamplerSettings:
    """One row's sampling settings, already validated (see ``protocol.SamplingParams``).

    ``temperature >= 0`` (0 = greedy), ``0 < top_p <= 1``, ``top_k == -1`` (all) or ``>= 1``,
    ``0 <= min_p <= 1``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filters(self, vocab_size: int) -> bool:
        """True when the support is smaller than the whole vocabulary by construction."""
        return (
            self.greedy
            or (self.top_k != TOP_K_ALL and self.top_k < vocab_size)
            or self.top_p < 1.0
            or self.min_p > 0.0
        )


@dataclass(frozen=True)
class Draw:
    """One sampled token and its behavior record (see the module docstring for definitions)."""

    token_id: int
    logprob: float
    sampling_logprob: float
    support_ids: tuple[int, ...]
    support_logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[float, int], ...] = ()

    def ranked_support(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The support and its log-probs ranked as SGLang 0.5.23 sends a sampling mask: by the
        renormalized probability the token was drawn with, highest first, equal ones by ascending
        id (``support_logprobs`` already are those log-probs; empty for an empty support)."""
        pairs = sorted(zip(self.support_logprobs, self.support_ids, strict=True), key=_rank_key)
        return tuple(t for _, t in pairs), tuple(lp for lp, _ in pairs)


def _rank_key(pair: tuple[float, int]) -> tuple[float, int]:
    """Sort key of a ``(logprob, id)`` pair: highest log-prob first, then ascending id."""
    return -pair[0], pair[1]


def scaled_logprobs(logits: torch.Tensor, settings: Sequence[SamplerSettings]) -> torch.Tensor:
    """float64 ``[B, V]`` log-softmax of ``logits / T`` per row (``T = 1`` for greedy rows)."""
    temps = torch.tensor(
        [1.0 if s.greedy else s.temperature for s in settings], dtype=torch.float64, device=logits.device
    )
    return torch.log_softmax(logits.to(torch.float64) / temps[:, None], dim=-1)


def support_sizes(sorted_probs: torch.Tensor, settings: Sequence[SamplerSettings]) -> torch.Tensor:
    """Number of leading ranks kept per row, given probabilities sorted descending ``[B, V]``.

    After: ``1 <= n[b] <= V`` and ranks ``< n[b]`` form row b's support (see module docstring).
    """
    b, v = sorted_probs.shape
    top_k = torch.tensor(
        [1 if s.greedy else (v if s.top_k == TOP_K_ALL else min(s.top_k, v)) for s in settings],
        dtype=torch.long,
    )
    top_p = torch.tensor([s.top_p for s in settings], dtype=torch.float64)
    min_p = torch.tensor([s.min_p for s in settings], dtype=torch.float64)
    rank = torch.arange(v)
    keep = rank[None, :] < top_k[:, None]
    # Mass strictly before each rank: a shifted cumsum (cumsum - p would round differently).
    mass_before = torch.cat(
        [torch.zeros(b, 1, dtype=sorted_probs.dtype), torch.cumsum(sorted_probs, dim=-1)[:, :-1]], dim=-1
    )
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep &= sorted_probs > 0.0
    keep[:, 0] = True
    # Every rule keeps a prefix of the ranking, so the count is the prefix length.
    return keep.sum(dim=-1)


def sample(
    logits: torch.Tensor,
    settings: Sequence[SamplerSettings],
    rngs: Sequence[random.Random],
    *,
    want_support: Sequence[bool] | None = None,
    top_logprobs_num: Sequence[int] | None = None,
) -> list[Draw]:
    """Draw one token per row of ``logits [B, V]``, using one ``rngs[b].random()`` per row.

    Before: ``len(settings) == len(rngs) == B``. After: one :class:`Draw` per row; the
    drawn token is in its support; ``support_ids``/``support_logprobs`` are filled only where
    ``want_support[b]`` (else empty); ``top_logprobs`` holds the ``top_logprobs_num[b]`` highest
    raw log-probs as ``(logprob, token_id)``, highest first, ties by ascending id.
    """
    b, v = logits.shape
    if not (len(settings) == len(rngs) == b):
        raise ValueError(f"batch of {b} rows needs as many settings and random generators")
    want = list(want_support or [False] * b)
    top_n = [min(k, v) for k in (top_logprobs_num or [0] * b)]
    logprobs = scaled_logprobs(logits, settings)
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    filtered_l = [s.filters(v) for s in settings]
    filtered = torch.tensor(filtered_l)
    # support_sizes never counts zero-mass ranks; unfiltered rows keep every positive-mass rank.
    sizes = support_sizes(sorted_lp.exp(), settings)
    keep = torch.arange(v)[None, :] < sizes[:, None]
    log_z = torch.logsumexp(torch.where(keep, sorted_lp, -torch.inf), dim=-1)
    renorm = sorted_lp - log_z[:, None]
    cdf = torch.cumsum(torch.where(keep, renorm.exp(), 0.0), dim=-1)
    u = torch.tensor([rng.random() for rng in rngs], dtype=torch.float64)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    idx = torch.minimum(idx, sizes - 1)
    tokens = order.gather(1, idx[:, None])[:, 0]
    raw = logprobs.gather(1, tokens[:, None])[:, 0]
    mu = torch.where(filtered, renorm.gather(1, idx[:, None])[:, 0], raw)

    support: dict[int, tuple[tuple[int, ...], tuple[float, ...]]] = {}
    support_rows = [i for i in range(b) if want[i] and filtered_l[i]]
    if support_rows:
        sel = torch.tensor(support_rows)
        n_sel = sizes[sel].tolist()
        width = max(n_sel)
        ids_l = order[sel, :width].tolist()
        lps_l = renorm[sel, :width].tolist()
        for j, row in enumerate(support_rows):
            n = n_sel[j]
            pairs = sorted(zip(ids_l[j][:n], lps_l[j][:n], strict=True))
            support[row] = (tuple(t for t, _ in pairs), tuple(x for _, x in pairs))

    k_max = max(top_n)
    top_vals = sorted_lp[:, :k_max].tolist() if k_max else None
    top_ids = order[:, :k_max].tolist() if k_max else None
    out: list[Draw] = []
    for row, (token, lp, m) in enumerate(zip(tokens.tolist(), raw.tolist(), mu.tolist(), strict=True)):
        ids, lps_row = support.get(row, ((), ()))
        k = top_n[row]
        top = tuple(zip(top_vals[row][:k], top_ids[row][:k], strict=True)) if k else ()  # type: ignore[index]
        out.append(Draw(token, lp, m, ids, lps_row, top))
    return out


def top_logprobs(row_logprobs: torch.Tensor, k: int) -> tuple[tuple[float, int], ...]:
    """The ``k`` highest entries of a ``[V]`` log-prob row as ``(logprob, id)``, ties by ascending id."""
    k = min(k, row_logprobs.shape[-1])
    vals, ids = torch.sort(row_logprobs, descending=True, stable=True)
    return tuple((float(val), int(i)) for val, i in zip(vals[:k].tolist(), ids[:k].tolist(), strict=True))


def finite_or_none(x: float) -> float | None:
    """JSON-safe float: non-finite values become ``None`` (as orjson serializes them in SGLang)."""
    return x if math.isfinite(x) else None

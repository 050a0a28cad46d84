"""The sampler against brute-force references written independently here (Python floats,
enumeration of candidate sets), and its statistics against the recorded behavior log-probs."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from engine.runtime.sampler import SamplerSettings, sample
from tests.engine.stats import chi_square_p

V = 10


def ref_probs(logits: list[float], temperature: float) -> list[float]:
    t = 1.0 if temperature == 0 else temperature
    m = max(x / t for x in logits)
    e = [math.exp(x / t - m) for x in logits]
    z = sum(e)
    return [x / z for x in e]


def ref_support(probs: list[float], s: SamplerSettings) -> list[int]:
    """The support by enumeration: the top-k set, the smallest set with mass >= top_p (over all
    subsets), and the min-p set, intersected. Ties (none with random logits) would go by id."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    k = 1 if s.temperature == 0 else (len(probs) if s.top_k == -1 else s.top_k)
    top_k = set(order[:k])
    if s.top_p >= 1.0:
        top_p = set(range(len(probs)))
    else:
        top_p = None
        for size in range(1, len(probs) + 1):
            best = None
            for subset in itertools.combinations(range(len(probs)), size):
                mass = sum(probs[i] for i in subset)
                if mass >= s.top_p and (best is None or mass > best[0]):
                    best = (mass, subset)
            if best is not None:
                top_p = set(best[1])
                break
        assert top_p is not None
    pmax = max(probs)
    min_p = {i for i in range(len(probs)) if probs[i] >= s.min_p * pmax}
    return sorted(top_k & top_p & min_p)


SETTINGS = [
    SamplerSettings(temperature=1.0, top_p=1.0, top_k=-1),
    SamplerSettings(temperature=0.0),
    SamplerSettings(temperature=1.0, top_p=0.7, top_k=-1),
    SamplerSettings(temperature=0.6, top_p=0.9, top_k=-1),
    SamplerSettings(temperature=1.3, top_p=1.0, top_k=4),
    SamplerSettings(temperature=1.0, top_p=0.8, top_k=3),
    SamplerSettings(temperature=0.8, top_p=0.95, top_k=6, min_p=0.1),
    SamplerSettings(temperature=1.0, top_p=0.3, top_k=-1),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_draws_match_brute_force_reference(settings: SamplerSettings) -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, V) * 2.0
    gens = [random.Random(100 + i) for i in range(64)]
    draws = sample(logits, [settings] * 64, gens, want_support=[True] * 64, top_logprobs_num=[3] * 64)
    for row, d in zip(logits.tolist(), draws, strict=True):
        p = ref_probs(row, settings.temperature)
        # Raw log-prob: after temperature, before filtering.
        assert d.logprob == pytest.approx(math.log(p[d.token_id]), abs=1e-9)
        support = ref_support(p, settings)
        if settings.filters(V):
            assert list(d.support_ids) == support
            z = sum(p[i] for i in support)
            expected = [math.log(p[i] / z) for i in support]
            assert list(d.support_logprobs) == pytest.approx(expected, abs=1e-9)
            assert d.token_id in d.support_ids
            mu = d.support_logprobs[d.support_ids.index(d.token_id)]
            assert d.sampling_logprob == pytest.approx(mu, abs=1e-12)
        else:
            assert support == list(range(V))
            assert d.support_ids == () and d.support_logprobs == ()
            assert d.sampling_logprob == pytest.approx(d.logprob, abs=1e-12)
        top = sorted(range(V), key=lambda i: (-p[i], i))[:3]
        assert [t for _, t in d.top_logprobs] == top


def test_greedy_is_argmax_with_raw_logprob_and_zero_mu() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 5.0, 1.0, 0.0]])
    gens = [random.Random(0) for _ in range(2)]
    draws = sample(logits, [SamplerSettings(temperature=0.0)] * 2, gens, want_support=[True, True])
    assert [d.token_id for d in draws] == [1, 0]  # the tie at 5.0 goes to the lower id
    for row, d in zip(logits.tolist(), draws, strict=True):
        assert d.support_ids == (d.token_id,)
        assert d.sampling_logprob == 0.0 and d.support_logprobs == (0.0,)
        assert d.logprob == pytest.approx(math.log(ref_probs(row, 1.0)[d.token_id]), abs=1e-9)


def test_ties_are_broken_by_token_id() -> None:
    logits = torch.zeros(1, 8)
    d = sample(logits, [SamplerSettings(top_k=3)], [random.Random(0)], want_support=[True])[0]
    assert d.support_ids == (0, 1, 2)
    d = sample(logits, [SamplerSettings(top_p=0.5)], [random.Random(0)], want_support=[True])[0]
    assert d.support_ids == (0, 1, 2, 3)  # 4 x 1/8 = 0.5 >= top_p; three are not enough


def test_the_ranked_support_is_sglangs_mask_order() -> None:
    """:meth:`Draw.ranked_support`: the support and its log-probs by probability, highest first
    (SGLang's mask, layers/sampler.py 607-616), equal probabilities by ascending id."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0, 0.5]])
    d = sample(logits, [SamplerSettings(top_k=5)], [random.Random(0)], want_support=[True])[0]
    assert d.support_ids == (0, 1, 3, 4, 5)
    ids, lps = d.ranked_support()
    assert ids == (1, 3, 4, 0, 5)
    assert lps == tuple(d.support_logprobs[d.support_ids.index(t)] for t in ids)
    greedy = sample(logits, [SamplerSettings(temperature=0.0)], [random.Random(0)], want_support=[True])[0]
    assert greedy.ranked_support() == ((1,), (0.0,))
    whole = sample(logits, [SamplerSettings()], [random.Random(0)], want_support=[True])[0]
    assert whole.ranked_support() == ((), ())


def test_zero_probability_tokens_are_never_in_a_support() -> None:
    logits = torch.tensor([[0.0, -2000.0, -1.0, -3000.0, -0.5]])
    d = sample(logits, [SamplerSettings(top_k=4)], [random.Random(0)], want_support=[True])[0]
    assert d.support_ids == (0, 2, 4)
    assert all(math.isfinite(x) for x in d.support_logprobs)


def test_same_seed_same_draws_whatever_the_batch() -> None:
    torch.manual_seed(3)
    row = torch.randn(1, V)
    s = SamplerSettings(temperature=1.0, top_p=0.9)

    def run(seed: int, batch_noise: int) -> list[int]:
        g = random.Random(seed)
        others = torch.randn(batch_noise, V)
        out = []
        for _ in range(20):
            logits = torch.cat([others, row])
            gens = [random.Random(999 + i) for i in range(batch_noise)] + [g]
            out.append(sample(logits, [s] * (batch_noise + 1), gens)[-1].token_id)
        return out

    assert run(7, 0) == run(7, 5)
    assert run(7, 0) != run(8, 0)


@pytest.mark.parametrize(
    "settings",
    [
        SamplerSettings(temperature=1.0),
        SamplerSettings(temperature=0.7, top_p=0.85),
        SamplerSettings(temperature=1.2, top_k=5),
        SamplerSettings(temperature=1.0, top_p=0.9, top_k=6, min_p=0.05),
    ],
    ids=str,
)
def test_frequencies_match_recorded_behavior_logprobs(settings: SamplerSettings) -> None:
    """Many draws from one distribution: counts agree with exp(recorded mu) (chi-square)."""
    torch.manual_seed(5)
    row = torch.randn(1, V) * 1.5
    n = 6000
    gens = [random.Random(10_000 + i) for i in range(n)]
    draws = sample(row.expand(n, V), [settings] * n, gens, want_support=[True] * n)
    counts = [0] * V
    mu: dict[int, float] = {}
    for d in draws:
        counts[d.token_id] += 1
        mu.setdefault(d.token_id, d.sampling_logprob)
        assert mu[d.token_id] == d.sampling_logprob
    if settings.filters(V):
        expected_p = dict(
            zip(draws[0].support_ids, (math.exp(x) for x in draws[0].support_logprobs), strict=True)
        )
    else:
        expected_p = dict(enumerate(ref_probs(row[0].tolist(), settings.temperature)))
    for token, lp in mu.items():
        assert math.exp(lp) == pytest.approx(expected_p[token], rel=1e-9)
    assert all(counts[t] == 0 for t in range(V) if t not in expected_p)
    p_value = chi_square_p([counts[t] for t in expected_p], [n * p for p in expected_p.values()])
    assert p_value > 1e-3, (settings, counts, expected_p)


def test_chi_square_detects_a_wrong_distribution() -> None:
    """The statistic has power: a skewed sample against a uniform expectation is rejected."""
    observed = [700, 500, 400, 400]
    assert chi_square_p(observed, [500.0] * 4) < 1e-6
    assert chi_square_p([498, 503, 505, 494], [500.0] * 4) > 0.5

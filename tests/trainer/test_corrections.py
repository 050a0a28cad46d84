"""The reference losses against brute force on a tiny vocabulary.

Each expected gradient is computed by enumerating every token the sampler could have drawn
(weighting each sampled token's autograd gradient by its sampler probability) and compared with
the closed form the method is meant to estimate, built here from ``torch.log_softmax`` alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.corrections import (
    METHODS,
    Support,
    group_advantages,
    mismatch,
    mismatch_by_group,
    policy_loss,
    replay_logprobs,
    sampled_logprobs,
)

V = 9
BAND = (0.5, 5.0)


def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(seed: int, support: list[int]):
    """Trainer logits [V], a sampler distribution q over ``support`` (renormalized) and
    advantages per token."""
    g = _rng(seed)
    logits = torch.randn(V, generator=g, dtype=torch.float64)
    q_logits = logits + 0.6 * torch.randn(V, generator=g, dtype=torch.float64)
    q = torch.full((V,), 0.0, dtype=torch.float64)
    q[support] = torch.softmax(q_logits[support], dim=0)
    adv = torch.randn(V, generator=g, dtype=torch.float64)
    return logits, q, adv


def _grad_one(logits, y, log_q_y, ids, lps, adv_y, method):
    """d loss / d logits for one position with sampled token ``y``."""
    x = logits.clone().float().requires_grad_(True)
    loss = policy_loss(
        x[None, :],
        torch.tensor([y]),
        torch.tensor([log_q_y], dtype=torch.float32),
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor([0, len(ids)]),
        torch.tensor(lps, dtype=torch.float32),
        torch.tensor([adv_y], dtype=torch.float32),
        method=method,
        band=BAND,
    )
    loss.backward()
    return x.grad.double()


def _dlogp(logits, v, over=None):
    """grad of log p_v (softmax over ``over``, default all) w.r.t. the logits, by autograd."""
    x = logits.clone().requires_grad_(True)
    if over is None:
        lp = torch.log_softmax(x, dim=0)[v]
    else:
        idx = torch.tensor(over)
        lp = torch.log_softmax(x[idx], dim=0)[over.index(v)]
    lp.backward()
    return x.grad


def _band(r: float) -> float:
    return 1.0 if BAND[0] <= r <= BAND[1] else 0.0


def test_sc_mis_topp_expected_gradient_is_the_centered_on_policy_gradient() -> None:
    S = [0, 2, 3, 5, 8]
    logits, q, adv = _case(0, S)
    q[8] *= 0.01  # far below the trainer's: its ratio leaves the band, so the mask is active
    q /= q.sum()
    p_s = torch.softmax(logits[S], dim=0)
    assert [_band(float(p_s[j] / q[v])) for j, v in enumerate(S)].count(0.0) >= 1
    ids, lps = S, [math.log(q[v]) for v in S]
    expected = sum(q[y] * _grad_one(logits, y, math.log(q[y]), ids, lps, adv[y], "sc-mis-topp") for y in S)
    a_bar = sum(q[y] * adv[y] for y in S)
    closed = torch.zeros(V, dtype=torch.float64)
    for j, v in enumerate(S):
        m = _band(float(p_s[j] / q[v]))
        closed -= p_s[j] * m * (adv[v] - a_bar) * _dlogp(logits, v, S)
    torch.testing.assert_close(expected, closed, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("method,weighted", [("sc", False), ("sc-mis", True)])
def test_tail_mode_expected_gradient_with_a_proportional_tail(method: str, weighted: bool) -> None:
    """A full-vocabulary sampler whose tail (outside its recorded top-k head H) is proportional
    to the trainer's: the tail model is exact, so the expectation over every token equals
    ``-sum_v q_v w_v (A_v - A_bar) grad log p_v`` over the whole vocabulary."""
    g = _rng(1)
    logits = torch.randn(V, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, dim=0)
    head = [1, 4, 6]
    q = p.clone()
    q[head] = p[head] * torch.tensor([1.7, 0.6, 1.2], dtype=torch.float64)
    tail = [v for v in range(V) if v not in head]
    rho = (1 - q[head].sum()) / p[tail].sum()
    q[tail] = rho * p[tail]
    assert abs(float(q.sum()) - 1) < 1e-12
    adv = torch.randn(V, generator=g, dtype=torch.float64)
    lps = [math.log(q[v]) for v in head]
    expected = sum(q[y] * _grad_one(logits, y, math.log(q[y]), head, lps, adv[y], method) for y in range(V))
    a_bar = float((q * adv).sum())
    closed = torch.zeros(V, dtype=torch.float64)
    for v in range(V):
        w = float(p[v] / q[v]) * _band(float(p[v] / q[v])) if weighted else 1.0
        closed -= q[v] * w * (adv[v] - a_bar) * _dlogp(logits, v)
    torch.testing.assert_close(expected, closed, atol=2e-6, rtol=1e-4)


def test_tail_mode_equals_exact_full_vocabulary_sc_when_the_tail_is_proportional() -> None:
    """Per sampled token (not only in expectation): the tail-mode loss with the top-k head has
    the gradient of exact score centering computed with the sampler's whole distribution."""
    g = _rng(2)
    logits = torch.randn(V, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, dim=0)
    head = [0, 3, 7]
    q = p.clone()
    q[head] = p[head] * torch.tensor([0.5, 1.4, 1.1], dtype=torch.float64)
    tail = [v for v in range(V) if v not in head]
    q[tail] = (1 - q[head].sum()) / p[tail].sum() * p[tail]
    lps = [math.log(q[v]) for v in head]
    for method, weighted in (("sc", False), ("sc-mis", True)):
        for y in (0, 5):  # in the head, and in the tail
            got = _grad_one(logits, y, math.log(q[y]), head, lps, 1.0, method)

            def w(v: int, weighted: bool = weighted) -> float:
                r = float(p[v] / q[v])
                return r * _band(r) if weighted else 1.0

            exact = -(w(y) * _dlogp(logits, y) - sum(q[v] * w(v) * _dlogp(logits, v) for v in range(V)))
            torch.testing.assert_close(got, exact, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("method", ["grpo", "grpo-mis"])
def test_grpo_expected_gradient_is_the_clipped_importance_weighted_gradient(method: str) -> None:
    S = list(range(V))
    logits, q, adv = _case(3, S)
    p = torch.softmax(logits, dim=0)
    expected = sum(q[y] * _grad_one(logits, y, math.log(q[y]), [], [], adv[y], method) for y in S)
    closed = torch.zeros(V, dtype=torch.float64)
    for v in S:
        r = float(p[v] / q[v])
        clipped = (adv[v] > 0 and r > 1.2) or (adv[v] < 0 and r < 0.8)
        keep = 0.0 if clipped else 1.0
        if method == "grpo-mis":
            keep *= _band(r)
        closed -= q[v] * keep * adv[v] * r * _dlogp(logits, v)
    torch.testing.assert_close(expected, closed, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("method", ["sc", "sc-mis", "sc-mis-topp", "grpo", "grpo-mis"])
def test_with_p_equal_q_every_method_is_plain_reinforce(method: str) -> None:
    g = _rng(4)
    logits = torch.randn(V, generator=g, dtype=torch.float64)
    if method == "sc-mis-topp":
        S = [1, 2, 4, 5]
        q_s = torch.softmax(logits[S], dim=0)
        ids, lps = S, [math.log(x) for x in q_s]
        qs = dict(zip(S, q_s.tolist(), strict=True))
        over = S
    else:
        p = torch.softmax(logits, dim=0)
        ids = [int(i) for i in torch.topk(p, 3).indices]
        lps = [math.log(p[v]) for v in ids]
        qs = {v: float(p[v]) for v in range(V)}
        over = None
    for y in (ids[0], ids[-1]):
        got = _grad_one(logits, y, math.log(qs[y]), ids, lps, 0.7, method)
        torch.testing.assert_close(got, -0.7 * _dlogp(logits, y, over), atol=2e-6, rtol=1e-4)


def test_replay_gives_tokens_outside_the_mask_exactly_zero_gradient() -> None:
    S = [0, 2, 3]
    logits, q, _ = _case(5, S)
    for method in ("sc-mis-topp",):
        grad = _grad_one(logits, 2, math.log(q[2]), S, [math.log(q[v]) for v in S], 1.3, method)
        outside = [v for v in range(V) if v not in S]
        assert torch.count_nonzero(grad[outside]) == 0
        assert torch.count_nonzero(grad[S]) > 0


def test_replay_logprobs_are_log_softmax_over_the_support() -> None:
    logits = torch.randn(3, V, generator=_rng(6))
    ids = torch.tensor([1, 4, 0, 2, 3, 8, 5])
    offsets = torch.tensor([0, 2, 6, 7])
    support = Support.build(ids, offsets, torch.zeros(7), 3, V)
    got = replay_logprobs(logits, support)
    want = torch.cat(
        [
            torch.log_softmax(logits[0, [1, 4]], 0),
            torch.log_softmax(logits[1, [0, 2, 3, 8]], 0),
            torch.log_softmax(logits[2, [5]], 0),
        ]
    )
    torch.testing.assert_close(got, want)


def test_an_unfiltered_turns_empty_supports_are_the_whole_vocabulary() -> None:
    """A turn sampled without a filter records an empty support per token (router/records.py):
    the trainer's replayed log-prob is then the full-vocabulary one, and mask replay over the
    whole vocabulary is the tail mode with nothing in the head: ``sc-mis-topp`` has ``sc-mis``'s
    value and gradient."""
    g = _rng(9)
    T = 5
    logits = torch.randn(T, V, generator=g)
    tokens = torch.tensor([0, 3, 8, 3, 5])
    mu = torch.log_softmax(logits + 0.3 * torch.randn(T, V, generator=g), dim=-1)[torch.arange(T), tokens]
    adv = torch.randn(T, generator=g)
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(T + 1, dtype=torch.int64), torch.zeros(0))
    support = Support.build(*empty, T, V)
    want = torch.log_softmax(logits, dim=-1)[torch.arange(T), tokens]
    torch.testing.assert_close(sampled_logprobs(logits, tokens, support), want, rtol=0, atol=0)
    out = {}
    for method in ("sc-mis-topp", "sc-mis"):
        x = logits.clone().requires_grad_(True)
        loss = policy_loss(x, tokens, mu, *empty, adv, method=method)
        loss.backward()
        out[method] = (loss.detach(), x.grad)
    torch.testing.assert_close(out["sc-mis-topp"], out["sc-mis"])
    assert torch.count_nonzero(out["sc-mis"][1]) > 0


@pytest.mark.parametrize("method", METHODS)
def test_a_packed_batch_is_the_mean_of_its_positions(method: str) -> None:
    """Vectorization: one call over T positions (rows of different support sizes, one empty)
    equals the mean of T single-position calls, value and gradient."""
    g = _rng(7)
    T = 4
    logits = torch.randn(T, V, generator=g)
    rows = [[0, 3, 4], [2, 5], [], [1, 6, 7, 8]]
    tokens = [3, 5, 6, 8]
    lps_rows = [torch.log_softmax(torch.randn(len(r), generator=g), 0).tolist() if r else [] for r in rows]
    mu = [lps_rows[t][rows[t].index(tokens[t])] if rows[t] else -1.9 for t in range(T)]
    adv = torch.randn(T, generator=g)
    ids = torch.tensor([i for r in rows for i in r])
    offsets = torch.tensor([0, 3, 5, 5, 9])
    flat = torch.tensor([x for r in lps_rows for x in r])
    x = logits.clone().requires_grad_(True)
    loss = policy_loss(x, torch.tensor(tokens), torch.tensor(mu), ids, offsets, flat, adv, method=method)
    loss.backward()
    total = 0.0
    grads = []
    for t in range(T):
        xt = logits[t : t + 1].clone().requires_grad_(True)
        lt = policy_loss(
            xt,
            torch.tensor([tokens[t]]),
            torch.tensor([mu[t]]),
            torch.tensor(rows[t], dtype=torch.int64),
            torch.tensor([0, len(rows[t])]),
            torch.tensor(lps_rows[t], dtype=torch.float32),
            adv[t : t + 1],
            method=method,
        )
        lt.backward()
        total += float(lt.detach()) / T
        grads.append(xt.grad[0] / T)
    assert float(loss.detach()) == pytest.approx(total, abs=1e-6)
    torch.testing.assert_close(x.grad, torch.stack(grads), atol=1e-6, rtol=1e-5)


def test_bad_arguments_are_named() -> None:
    logits = torch.zeros(2, V)
    ok = dict(
        tokens=torch.tensor([0, 1]),
        behavior_logprobs=torch.zeros(2),
        support_ids=torch.tensor([0, 1]),
        support_offsets=torch.tensor([0, 1, 2]),
        support_logprobs=torch.zeros(2),
        advantages=torch.zeros(2),
    )
    with pytest.raises(ValueError, match="method must be one of"):
        policy_loss(logits, **ok, method="ppo")
    with pytest.raises(ValueError, match="support_offsets"):
        policy_loss(logits, **{**ok, "support_offsets": torch.tensor([0, 2])})
    with pytest.raises(ValueError, match="support_ids must lie"):
        policy_loss(logits, **{**ok, "support_ids": torch.tensor([0, V])})
    with pytest.raises(ValueError, match="not in its recorded support"):
        policy_loss(logits, **{**ok, "tokens": torch.tensor([1, 1])})
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logits, **{**ok, "advantages": torch.zeros(3)})


def test_mismatch_k3_is_not_negative_when_p_equals_q_but_for_rounding() -> None:
    """d = log p - log q of 2e-12, -3e-12, -1e-10 and log(1 +- 1e-12): e^d - 1 - d is about 5e-25
    to 5e-21, which e^d - 1 - d in doubles gets as about -4e-17 for the first three."""
    ds = [2e-12, -3e-12, -1e-10, math.log1p(1e-12), math.log1p(-1e-12)]
    for d in ds:
        m = mismatch(torch.tensor([d], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64))
        want = d * d / 2 + d**3 / 6  # e^d - 1 - d to float64 precision at |d| <= 1e-10
        assert m.k3_kl >= 0.0 and m.k3_kl == pytest.approx(want, rel=1e-3, abs=4 * math.ulp(d)), (d, m.k3_kl)


def test_group_advantages_by_hand() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0]), torch.tensor([7, 7, 3, 3, 9]))
    # group 7: mean 0.5, std 0.5; group 3: constant; group 9: alone
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_mismatch_numbers_by_hand() -> None:
    lp = [math.log(0.5), math.log(0.1), math.log(0.9), math.log(0.02)]
    lq = [math.log(0.5), math.log(0.4), math.log(0.3), math.log(0.2)]
    m = mismatch(torch.tensor(lp, dtype=torch.float64), torch.tensor(lq, dtype=torch.float64))
    rs = [1.0, 0.25, 3.0, 0.1]
    assert m.tokens == 4
    assert m.k3_kl == pytest.approx(sum(r - 1 - math.log(r) for r in rs) / 4, rel=1e-12)
    assert m.abs_logprob_diff_mean == pytest.approx(sum(abs(math.log(r)) for r in rs) / 4, rel=1e-12)
    assert m.extreme_ratio_share == 0.25  # only 0.1 is outside [0.2, 5]
    by = mismatch_by_group(torch.tensor(lp), torch.tensor(lq), ["a", "b", "a", "b"])
    assert by["a"].tokens == 2 and by["a"].extreme_ratio_share == 0.0
    assert by["b"].extreme_ratio_share == 0.5

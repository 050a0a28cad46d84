"""Pearson's chi-square goodness-of-fit test without scipy (survival function via torch.special)."""

from __future__ import annotations

import torch


def chi_square_p(observed: list[int], expected: list[float], min_expected: float = 5.0) -> float:
    """p-value that ``observed`` counts come from ``expected`` counts (same total).

    Categories with an expected count below ``min_expected`` are pooled into one (then dropped
    if the pool is still too small), the usual validity rule for the chi-square approximation.
    """
    if len(observed) != len(expected):
        raise ValueError("observed and expected differ in length")
    obs: list[float] = []
    exp: list[float] = []
    pool_o, pool_e = 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e >= min_expected:
            obs.append(float(o))
            exp.append(e)
        else:
            pool_o += o
            pool_e += e
    if pool_e >= min_expected:
        obs.append(pool_o)
        exp.append(pool_e)
    elif obs and pool_e > 0:
        obs[-1] += pool_o
        exp[-1] += pool_e
    df = len(obs) - 1
    if df < 1:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )

"""Test inputs for the format tests: random weights with planted special values, small shapes."""

from __future__ import annotations

import torch

SPECIALS = (0.0, -0.0, 1e-40, -1e-40, 1e-30, 3e38, -3e38, 448.0, -448.0, 6.0, -6.0, 0.25, 2.5, 5.0)


def weights(
    shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, seed: int = 0, specials: bool = True
) -> torch.Tensor:
    """Gaussian weights whose rows span many magnitudes (1e-6 .. 1e6), ~10% special values."""
    g = torch.Generator().manual_seed(seed)
    rows = shape[0] if len(shape) > 1 else 1
    scale = torch.exp(torch.randn(rows, 1, generator=g) * 4.0)
    x = (torch.randn(rows, int(torch.tensor(shape).prod()) // rows, generator=g) * scale).reshape(shape)
    if specials:
        flat = x.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 10)]
        vals = torch.tensor(SPECIALS, dtype=torch.float32)
        flat[idx] = vals[torch.randint(0, len(vals), (len(idx),), generator=g)]
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    return x.to(dtype)

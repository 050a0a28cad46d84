"""The demo's figure: per update, the reward (mean and exact share), the per-group k3 KL and
extreme-ratio share between trainer and samplers, and the mean version age of the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plot(record: dict[str, Any], path: str | Path) -> Path | None:
    """Write the figure of a ``demo.json`` record to ``path`` (PNG); None, writing nothing, when
    matplotlib is not installed or the record has no update."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ups = record.get("updates") or []
    if not ups:
        return None
    x = [u["update"] for u in ups]
    groups = sorted({g for u in ups for g in u["k3_kl"]})
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(x, [u["mean_reward"] for u in ups], label="mean reward")
    ax.plot(x, [u["exact"] for u in ups], label="exact answers")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"reward ({record['config']['method']})")
    ax.legend()
    for ax, key, title in (
        (axes[0][1], "k3_kl", "k3 KL(sampler || trainer) per group"),
        (axes[1][0], "extreme_ratio_share", "share of p/q outside [0.2, 5] per group"),
    ):
        for g in groups:
            ax.plot(x, [u[key].get(g, float("nan")) for u in ups], label=g)
        ax.set_title(title)
        ax.legend()
    ax = axes[1][1]
    ax.plot(x, [u["version_age"]["mean"] for u in ups], label="mean")
    ax.plot(x, [u["version_age"]["max"] for u in ups], label="max")
    ax.set_title("version age of the batch's tokens")
    ax.legend()
    for ax in axes[1]:
        ax.set_xlabel("update")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

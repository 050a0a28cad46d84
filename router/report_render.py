"""Render the cost report (:func:`router.report.build`'s object) into a directory:
``report.json`` (the object), ``report.md`` (tables, linking the plots written beside it as PNG
files) and ``report.html`` (self-contained: styles inline, every plot an inline base64 PNG).

Plots (matplotlib, Agg): cost per update over time, cost per 1M tokens per group, shares of
tokens, sessions and cost per group, and the mixed fleet against the what-if baseline.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first
from matplotlib.ticker import MaxNLocator  # noqa: E402

from router.ledger import per_million  # noqa: E402

UNVERIFIED = "* the price was not confirmed by independent sources (price_verified = false in the preset)."
COLORS = ("#2b6cb0", "#dd6b20", "#2f855a", "#805ad5", "#c53030", "#718096")


# formatting ------------------------------------------------------------------------------------
def dollars(x: float | None) -> str:
    if x is None:
        return "n/a"
    if abs(x) >= 1:
        return f"${x:,.2f}"
    if x == 0:
        return "$0"
    digits = 3 - int(math.floor(math.log10(abs(x))))  # four significant digits
    return f"${x:,.{digits}f}"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def num(x: float | int | None, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    return f"{x:,}" if isinstance(x, int) else f"{x:,.{digits}f}"


def hours(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:,.1f}" if h >= 100 else f"{h:.3g}"


def sci(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _mismatch(g: dict[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
    m = g.get("mismatch")
    return "n/a" if not m or m.get(key) is None else fmt(m[key])


# tables ----------------------------------------------------------------------------------------
def group_table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Cost, samples and their shares per group."""
    head = [
        "group",
        "accelerator",
        "weights",
        "$/GPU-h",
        "price date",
        "replica-h",
        "cost",
        "tokens",
        "sessions",
        "$/1M tokens",
        "token share",
        "session share",
        "cost share",
    ]
    rows = [
        [
            g["name"],
            (g["accelerator"] or "?") + (f" x{g['gpus_per_replica']}" if g["gpus_per_replica"] else ""),
            g["weight_format"] or "?",
            dollars(g["price_per_gpu_hour"]),
            (g["price_date"] or "n/a") + ("" if g["price_verified"] else " *"),
            hours(g["replica_seconds"]),
            dollars(g["cost_dollars"]),
            num(int(g["tokens"])),
            num(int(g["sessions"])),
            dollars(g["cost_per_1m_tokens"]),
            pct(g["token_share"]),
            pct(g["session_share"]),
            pct(g["cost_share"]),
        ]
        for g in report["groups"]
    ]
    return head, rows


def footnotes(report: dict[str, Any]) -> list[str]:
    """The cost table's footnote, when a price in it is starred."""
    return [UNVERIFIED] if any(not g["price_verified"] for g in report["groups"]) else []


def mismatch_table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each group's sampler-trainer mismatch beside its cost."""
    head = ["group", "weights", "cost", "$/1M tokens", "cost share", "tokens compared", "k3 KL",
            "mean |Δ log p|", "p/q outside [0.2, 5]"]  # fmt: skip
    rows = [
        [
            g["name"],
            g["weight_format"] or "?",
            dollars(g["cost_dollars"]),
            dollars(g["cost_per_1m_tokens"]),
            pct(g["cost_share"]),
            _mismatch(g, "tokens", lambda x: num(int(x))),
            _mismatch(g, "k3_kl", sci),
            _mismatch(g, "abs_logprob_diff_mean", sci),
            _mismatch(g, "extreme_share", pct),
        ]
        for g in report["groups"]
    ]
    return head, rows


def version_table(report: dict[str, Any], last: int = 50) -> tuple[list[str], list[list[str]]]:
    """Cost and tokens per weight version over every group (n/a: replicas that reported none),
    after one row of the versions the router rolled up (``earlier_versions``, when any); per group
    they are in report.json."""
    head = ["version", "replica-h", "GPU-h", "cost", "tokens", "$/1M tokens"]
    earlier = report.get("earlier_versions") or []
    rolled = [("earlier (rolled up)", _summed(earlier))] if earlier else []
    shown = [
        ("n/a" if v["version"] is None else str(v["version"]), v) for v in report["version_totals"][-last:]
    ]
    rows = [
        [
            name,
            hours(v["replica_seconds"]),
            hours(v["gpu_seconds"]),
            dollars(v["cost_dollars"]),
            num(int(v["tokens"])),
            dollars(per_million(float(v["cost_dollars"]), int(v["tokens"]))),
        ]
        for name, v in rolled + shown
    ]
    return head, rows


def _summed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("replica_seconds", "gpu_seconds", "cost_dollars", "tokens")
    return {k: sum(r[k] for r in rows) for k in keys}


def update_table(report: dict[str, Any], last: int = 50) -> tuple[list[str], list[list[str]]]:
    """The latest ``last`` updates, after one row of the updates the router rolled up
    (``earlier_updates``, when any: their seq range, the last one's acknowledgement)."""
    head = ["update", "acknowledged", "trajectories", "tokens", "cost", "$/1M tokens"]
    e = report.get("earlier_updates") or {}
    rolled = [(f"1-{e['through_seq']} (rolled up)", {**e, "at": None})] if e.get("updates") else []
    shown = [(str(u["seq"]), u) for u in report["updates"][-last:]]
    rows = [
        [
            name,
            "" if u["at"] is None else when(u["at"]),
            num(int(u["trajectories"])),
            num(int(u["tokens"])),
            dollars(u["cost_dollars"]),
            dollars(per_million(float(u["cost_dollars"]), int(u["tokens"]))),
        ]
        for name, u in rolled + shown
    ]
    return head, rows


def what_if_lines(report: dict[str, Any]) -> list[str]:
    w = report["what_if"]
    if not w["available"]:
        return [f"Not computed: {w['reason']}."]
    b = w["baseline"]
    ratio = w["mixed_over_baseline"]
    saving = w["savings_dollars"]
    verdict = f"saving {dollars(saving)}" if saving >= 0 else f"costing {dollars(-saving)} more"
    return [
        f"Baseline: preset `{b['preset']}`, group `{b['group']}`: "
        f"{b['accelerator']} x{b['gpus_per_replica']}, "
        f"{b['weight_format']} weights, {b['kv_cache_dtype']} KV cache, "
        f"{dollars(b['price_per_gpu_hour'])}/GPU-h (price date {b['price_date'] or 'n/a'}; "
        f"source: {b['price_source'] or 'n/a'}).",
        throughput_line(b),
        f"Serving the same {num(int(w['tokens']))} tokens takes "
        f"{hours(w['replica_seconds'])} replica-hours "
        f"= {dollars(w['cost_dollars'])} ({dollars(w['cost_per_1m_tokens'])} per 1M tokens).",
        f"The mixed fleet booked {dollars(w['mixed_cost_dollars'])} "
        f"({dollars(w['mixed_cost_per_1m_tokens'])} per 1M tokens): "
        f"{'n/a' if ratio is None else f'{ratio:.2f}x'} the baseline's cost, {verdict}.",
    ]


def throughput_line(b: dict[str, Any]) -> str:
    """Which throughput the what-if used: stated, or measured in this ledger (and from what)."""
    tps = f"{b['tokens_per_s_per_replica']:,.4g} generated tokens/s per replica"
    if b.get("throughput", "stated") == "stated":
        return f"Assumed throughput: {tps} (stated with --baseline-tokens-per-s, not measured)."
    return (
        f"Measured throughput: {tps}: the {num(int(b['measured_tokens']))} tokens group `{b['group']}` "
        f"booked over its {num(b['measured_replica_seconds'])} replica-seconds in this ledger, idle time "
        "included (no --baseline-tokens-per-s stated)."
    )


def summary_lines(report: dict[str, Any]) -> list[str]:
    t = report["totals"]
    return [
        f"Fleet `{report['fleet']}`, ledger read {when(report['generated_at'])} "
        f"from {report['source'] or 'n/a'}.",
        f"Booked {hours(t['replica_seconds'])} replica-hours, "
        f"{hours(t['gpu_seconds'])} GPU-hours: {dollars(t['cost_dollars'])} for "
        f"{num(int(t['tokens']))} tokens in {num(int(t['sessions']))} sessions "
        f"({dollars(t['cost_per_1m_tokens'])} per 1M tokens).",
        f"{t['updates']} updates, {dollars(t['cost_per_update_mean'])} per update on average.",
        f"A replica's time counts from its first heartbeat (or ready health poll) to its last plus "
        f"{float(report['span_s']):g} s; an update costs what the fleet booked since the previous "
        "acknowledgement.",
    ]


# plots -----------------------------------------------------------------------------------------
def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#718096")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_updates(report: dict[str, Any]) -> bytes:
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ups = report["updates"]
    if ups:
        ax.plot(
            [u["seq"] for u in ups], [u["cost_dollars"] for u in ups], marker="o", color=COLORS[0], lw=1.5
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"update (acknowledged {when(ups[0]['at'])} to {when(ups[-1]['at'])})", fontsize=8)
        ax.set_ylabel("dollars per update")
        ax.set_ylim(bottom=0, top=max(u["cost_dollars"] for u in ups) * 1.15 or 1)
        ax.grid(alpha=0.3)
    else:
        _empty(ax, "no update acknowledged yet")
    ax.set_title("Cost per update")
    return _png(fig)


def plot_cost_per_million(report: dict[str, Any]) -> bytes:
    groups = [g for g in report["groups"] if g["cost_per_1m_tokens"] is not None]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * max(3, len(groups)) + 0.8))
    if groups:
        names = [g["name"] for g in groups][::-1]
        vals = [g["cost_per_1m_tokens"] for g in groups][::-1]
        bars = ax.barh(names, vals, color=COLORS[1])
        ax.bar_label(bars, labels=[dollars(v) for v in vals], padding=3, fontsize=8)
        ax.set_xlabel("dollars per 1M generated tokens")
        ax.set_xlim(0, max(vals) * 1.25 or 1)
        ax.grid(axis="x", alpha=0.3)
    else:
        _empty(ax, "no tokens generated yet")
    ax.set_title("Cost per 1M tokens per group")
    return _png(fig)


def plot_shares(report: dict[str, Any]) -> bytes:
    groups = report["groups"]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    kinds = (("token_share", "tokens"), ("session_share", "sessions"), ("cost_share", "cost"))
    if any(g[k] is not None for g in groups for k, _ in kinds):
        width = 0.8 / len(kinds)
        for i, (key, label) in enumerate(kinds):
            xs = [j + (i - 1) * width for j in range(len(groups))]
            ax.bar(xs, [100 * (g[key] or 0.0) for g in groups], width, label=label, color=COLORS[i])
        ax.set_xticks(range(len(groups)), [g["name"] for g in groups], rotation=20, ha="right")
        ax.set_ylabel("share of the fleet (%)")
        ax.set_ylim(0, 100)
        ax.legend(frameon=False, ncols=3, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))
        ax.grid(axis="y", alpha=0.3)
    else:
        _empty(ax, "nothing booked yet")
    ax.set_title("Share of samples vs share of cost", pad=22)
    return _png(fig)


def plot_what_if(report: dict[str, Any]) -> bytes:
    w = report["what_if"]
    fig, ax = plt.subplots(figsize=(7.5, 2.4))
    if w["available"]:
        labels = ["mixed fleet (booked)", f"{w['baseline']['group']} (what-if)"]
        vals = [w["mixed_cost_dollars"], w["cost_dollars"]]
        bars = ax.barh(labels[::-1], vals[::-1], color=[COLORS[5], COLORS[0]])
        ax.bar_label(bars, labels=[dollars(v) for v in vals[::-1]], padding=3, fontsize=8)
        ax.set_xlim(0, max(vals) * 1.25 or 1)
        ax.set_xlabel(f"dollars for the same {num(int(w['tokens']))} tokens")
        ax.grid(axis="x", alpha=0.3)
    else:
        _empty(ax, "what-if not computed: " + w["reason"])
    ax.set_title("Mixed fleet vs homogeneous baseline")
    return _png(fig)


PLOTS: tuple[tuple[str, str, Callable[[dict[str, Any]], bytes]], ...] = (
    ("cost_per_update.png", "Cost per update over time", plot_updates),
    ("cost_per_1m_tokens.png", "Cost per 1M tokens per group", plot_cost_per_million),
    ("shares.png", "Share of samples vs share of cost", plot_shares),
    ("what_if.png", "Mixed fleet vs homogeneous baseline", plot_what_if),
)


# documents -------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    def table(head: list[str], rows: list[list[str]]) -> list[str]:
        esc = [[c.replace("|", "\\|") for c in r] for r in [head, *rows]]
        return [
            "| " + " | ".join(esc[0]) + " |",
            "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in esc[1:]),
        ]

    out = ["# mixfleet cost report", "", *summary_lines(report), ""]
    out += ["## Cost and samples per group", "", *table(*group_table(report)), "", *footnotes(report), ""]
    out += ["## Mismatch beside cost", "", *table(*mismatch_table(report)), ""]
    out += ["## Mixed fleet vs homogeneous baseline", "", *what_if_lines(report), ""]
    out += ["## Per weight version (latest 50)", "", *table(*version_table(report)), ""]
    head, rows = update_table(report)
    out += [
        "## Updates (latest 50)",
        "",
        *(table(head, rows) if rows else ["No update acknowledged yet."]),
        "",
    ]
    out += ["## Plots", ""] + [f"![{title}]({name})" for name, title, _ in PLOTS] + [""]
    return "\n".join(out)


_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1a202c;
       margin: 24px auto; max-width: 1240px; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
p.note { color: #4a5568; margin: 2px 0; }
.wide { overflow-x: auto; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border-bottom: 1px solid #e2e8f0; padding: 4px 7px; text-align: right; white-space: nowrap; }
th { background: #f7fafc; } td:first-child, th:first-child { text-align: left; }
code { font-size: 12.5px; background: #f7fafc; padding: 0 3px; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 12px; }
.plots img { width: 100%; border: 1px solid #e2e8f0; }
"""


def html_page(report: dict[str, Any], images: dict[str, bytes]) -> str:
    def table(head: list[str], rows: list[list[str]]) -> str:
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f'<div class="wide"><table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'

    def paras(lines: list[str]) -> str:
        return "".join(f'<p class="note">{_code(html.escape(x))}</p>' for x in lines)

    figs = "".join(
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,{_b64(images[name])}">'
        for name, title, _ in PLOTS
    )
    head, rows = update_table(report)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>mixfleet cost report: {html.escape(report['fleet'])}</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<h1>mixfleet cost report</h1>{paras(summary_lines(report))}"
        f'<div class="plots">{figs}</div>'
        f"<h2>Cost and samples per group</h2>{table(*group_table(report))}{paras(footnotes(report))}"
        f"<h2>Mismatch beside cost</h2>{table(*mismatch_table(report))}"
        f"<h2>Mixed fleet vs homogeneous baseline</h2>{paras(what_if_lines(report))}"
        f"<h2>Per weight version (latest 50)</h2>{table(*version_table(report))}"
        f"<h2>Updates (latest 50)</h2>{table(head, rows) if rows else paras(['No update acknowledged yet.'])}"
        "</body></html>"
    )


def _code(text: str) -> str:
    """Markdown's `code` spans as HTML."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` (+ its PNG plots) and ``report.html`` into
    ``out_dir`` (created if missing); returns the paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = {name: fn(report) for name, _, fn in PLOTS}
    paths = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html"}
    paths["json"].write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    paths["md"].write_text(markdown(report))
    paths["html"].write_text(html_page(report, images))
    for name, data in images.items():
        (out / name).write_bytes(data)
    return paths

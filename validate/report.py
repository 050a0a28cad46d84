"""The validation report: a terminal table, the JSON (``ValidationReport.to_dict``), and with
``--out`` ``validate.json`` and ``validate.html`` (self-contained: one inline PNG plot per level,
matplotlib Agg, in the style of ``mixfleet report``)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from validate.level import NAMES

COLORS = ("#2b6cb0", "#dd6b20", "#2f855a", "#805ad5", "#c53030", "#718096")


def table(report: dict[str, Any]) -> str:
    """One row per group and level: PASS / FAIL / - (not run) and the level's summary line."""
    lines = [f"{'group':16s} {'format':6s} {'ver':>4s}  level                        result  summary"]
    for g in report["groups"]:
        done = {lv["level"]: lv for lv in g["levels"]}
        for n in range(1, 7):
            lv = done.get(n)
            mark = "-" if lv is None else ("PASS" if lv["ok"] else "FAIL")
            text = "not run" if lv is None else lv["summary"]
            head = f"{g['group']:16s} {g['format']:6s} {str(g['version']):>4s}" if n == 1 else " " * 28
            lines.append(f"{head}  {n}. {NAMES[n]:25s} {mark:6s}  {text}")
            for note in [] if lv is None else lv["notes"]:
                lines.append(" " * 66 + f"note: {note}")
            for failure in [] if lv is None else lv["failures"][1:]:  # the first is in the summary
                lines.append(" " * 66 + f"also: {failure}")
    verdicts = [f"{g['group']}: " + verdict(g) for g in report["groups"]]
    lines.append("validate: " + ("OK" if report["ok"] else "FAILED") + " (" + "; ".join(verdicts) + ")")
    return "\n".join(lines)


def verdict(g: dict[str, Any]) -> str:
    """``all levels pass``, or the first failing level (and where level 5 localizes a level-4 failure)."""
    if g["ok"]:
        return "all levels pass"
    text = f"fails at level {g['first_failure']}"
    five = _level(g, 5)
    if g["first_failure"] == 4 and five is not None and not five["ok"]:
        first = five["details"].get("first_divergence") or {}
        layers = sorted({d["layer"] for d in first.values()})
        if layers:
            text += f", localized by level 5: routes first diverge at layer {layers[0]}"
    return text


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _level(g: dict[str, Any], n: int) -> dict[str, Any] | None:
    return next((lv for lv in g["levels"] if lv["level"] == n), None)


def plot(report: dict[str, Any], n: int) -> bytes:
    """The plot of level ``n`` across groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    drawn = False
    for i, g in enumerate(report["groups"]):
        lv = _level(g, n)
        if lv is None:
            continue
        c = COLORS[i % len(COLORS)]
        p, d = lv["plot"], lv["details"]
        if n == 1:
            ax.bar(i, len(d.get("exceptions", [])), color=c, label=g["group"])
            ax.set_ylabel("modules kept BF16")
        elif n == 2 and p.get("rel_err"):
            ax.plot(
                sorted(p["rel_err"].values()), ".", color=c, label=f"{g['group']} (bound {p['bound']:.3g})"
            )
            ax.axhline(p["bound"], color=c, ls="--", lw=0.8)
            ax.set_ylabel("weight relative error")
            ax.set_xlabel("quantized linears, sorted")
        elif n == 3 and p.get("linears"):
            ax.semilogy(
                [r["qdq_vs_bf16"] or 1e-12 for r in p["linears"]],
                "o-",
                color=c,
                label=f"{g['group']} QDQ vs BF16",
            )
            eng = [max(r.get("engine_vs_qdq", {0: float("nan")}).values()) for r in p["linears"]]
            ax.semilogy(eng, "x:", color=c, label=f"{g['group']} engine vs QDQ")
            ax.set_xlabel("sampled linear")
            ax.set_ylabel("relative error")
        elif n == 4 and p.get("series"):
            series = next(iter(p["series"].values()))
            for j, s in enumerate(series):
                floored = [max(v, 1e-9) for v in s]  # log axis: exact agreement drawn at 1e-9
                ax.plot(range(1, len(s) + 1), floored, color=c, lw=0.8, label=g["group"] if j == 0 else None)
            ax.set_yscale("log")
            ax.set_xlabel("position")
            ax.set_ylabel("|log p group - log p BF16|")
        elif n == 5 and p.get("agreement"):
            agree = next(iter(p["agreement"].values()))
            ax.plot([int(k) for k in agree], list(agree.values()), "o-", color=c, label=g["group"])
            ax.axhline(p["bound"], color=c, ls="--", lw=0.8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("MoE layer")
            ax.set_ylabel("tokens with BF16's top-k")
            ax.set_ylim(0, 1.05)
        elif n == 6 and p.get("expected") is not None:
            rise = [p["expected"], p["observed"] or 0]
            ax.bar([2 * i, 2 * i + 0.8], rise, color=[c, c], alpha=0.6, label=g["group"])
            ax.set_ylabel("log-prob rise (expected, observed)")
        else:
            continue
        drawn = True
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no group reached this level", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title(f"{n}. {NAMES[n]}")
    return _png(fig)


def html_page(report: dict[str, Any]) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>mixfleet validate</title>",
        "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto}"
        "pre{background:#f5f5f5;padding:1em;overflow-x:auto;font-size:12px}"
        ".ok{color:#2f855a}.fail{color:#c53030}</style></head><body>",
        f"<h1>mixfleet validate: <span class='{'ok' if report['ok'] else 'fail'}'>"
        f"{'OK' if report['ok'] else 'FAILED'}</span></h1>",
        f"<pre>{html.escape(table(report))}</pre>",
    ]
    for n in range(1, 7):
        img = base64.b64encode(plot(report, n)).decode()
        parts.append(
            f"<h2>{n}. {html.escape(NAMES[n])}</h2><img alt='level {n}' src='data:image/png;base64,{img}'>"
        )
        for g in report["groups"]:
            lv = _level(g, n)
            for f in [] if lv is None else lv["failures"]:
                parts.append(f"<p class='fail'>{html.escape(g['group'])}: {html.escape(f)}</p>")
    parts.append(
        "<h2>Thresholds</h2><pre>" + html.escape(json.dumps(report["thresholds"], indent=1)) + "</pre>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)


def write(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``validate.json`` and ``validate.html`` into ``out_dir`` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "validate.json", "html": out_dir / "validate.html"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["html"].write_text(html_page(report))
    return paths

"""The cost report's figures (pure): from the ledger's JSON (``GET /v1/ledger``,
:class:`router.routes_ledger.LedgerView`), optionally the groups' JSON (``GET /v1/groups``, for
each group's mismatch) and a what-if baseline, :func:`build` computes what ``report.json`` holds
and the Markdown and HTML show (:mod:`router.report_render`).

Figures, all from the ledger's totals:

* per group: cost per 1M tokens (``cost_dollars / tokens x 1e6``; None without tokens), its share
  of tokens, of sessions and of cost (None when the fleet total is 0), and its mismatch (None
  when no token of it was counted from the trainer's log-prob uploads, or no groups JSON was
  given);
* per update (:func:`router.ledger.update_costs`' rule): cost, tokens, cost per 1M tokens; the
  updates the router rolled up (``earlier_updates``, :mod:`router.ledger`'s bounds) count in the
  number of updates and the mean cost per update;
* per weight version: per group as booked, and summed over the groups;
* the what-if: a homogeneous fleet of the baseline group serving the same tokens at its
  tokens/s per replica needs ``tokens / tokens_per_s`` replica-seconds, costing
  ``replica_seconds x gpus_per_replica x price_per_gpu_hour / 3600``; ``mixed_over_baseline`` is
  the mixed fleet's booked cost divided by that (None when the baseline costs 0). The baseline's
  throughput is ``stated`` (a :class:`Baseline` handed in: ``mixfleet report
  --baseline-tokens-per-s``) or else ``measured`` (:func:`measured_baseline`): a group of this
  ledger at the tokens it booked per replica-second it booked (idle time included, as the mixed
  fleet's cost includes it); ``what_if.baseline.throughput`` says which.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from router.ledger import SECONDS_PER_HOUR, per_million

MISMATCH_FIELDS = ("tokens", "k3_kl", "abs_logprob_diff_mean", "extreme_share")


@dataclass(frozen=True)
class Baseline:
    """The what-if fleet: one group's spec and its decode throughput per replica, ``stated`` or
    ``measured`` (then from ``measured_tokens`` over ``measured_replica_seconds`` of a ledger)."""

    preset: str
    group: str
    accelerator: str
    weight_format: str
    kv_cache_dtype: str
    gpus_per_replica: int
    price_per_gpu_hour: float
    price_date: str | None
    price_source: str | None
    tokens_per_s_per_replica: float
    throughput: Literal["stated", "measured"] = "stated"
    measured_tokens: int | None = None
    measured_replica_seconds: float | None = None

    def __post_init__(self) -> None:
        if not self.tokens_per_s_per_replica > 0:
            raise ValueError(f"tokens_per_s_per_replica must be > 0, got {self.tokens_per_s_per_replica}")


def _share(part: float, total: float) -> float | None:
    return part / total if total > 0 else None


_LEDGER_FIELDS = {  # GET /v1/ledger's top-level fields and their JSON types
    "generated_at": (float, int),
    "fleet": (str,),
    "span_s": (float, int),
    "groups": (list,),
    "versions": (list,),
    "updates": (list,),
}


def build(
    ledger: Mapping[str, Any],
    groups: Mapping[str, Any] | None = None,
    baseline: Baseline | None = None,
    *,
    source: str = "",
    measure_group: str | None = None,
) -> dict[str, Any]:
    """``report.json``'s object; without a ``baseline``, the what-if measures one from
    ``ledger`` (:func:`measured_baseline` of ``measure_group``). Raises ValueError naming the
    first top-level field ``ledger`` lacks or holds of another type, or a ``measure_group`` it does
    not list."""
    for key, kinds in _LEDGER_FIELDS.items():
        if key not in ledger:
            raise ValueError(f"ledger: missing field {key!r} (not the JSON of GET /v1/ledger?)")
        if type(ledger[key]) not in kinds:
            raise ValueError(
                f"ledger: field {key!r} is {ledger[key]!r}, not {' or '.join(k.__name__ for k in kinds)}"
            )
    mismatch = {g["name"]: g.get("mismatch") for g in (groups or {}).get("groups", [])}
    rows = ledger["groups"]
    total_cost = sum(float(g["cost_dollars"]) for g in rows)
    total_tokens = sum(int(g["tokens"]) for g in rows)
    total_sessions = sum(int(g["sessions"]) for g in rows)
    out_groups = []
    for g in rows:
        m = mismatch.get(g["name"])
        out_groups.append(
            {
                **{k: g[k] for k in g},
                "cost_per_1m_tokens": per_million(float(g["cost_dollars"]), int(g["tokens"])),
                "token_share": _share(int(g["tokens"]), total_tokens),
                "session_share": _share(int(g["sessions"]), total_sessions),
                "cost_share": _share(float(g["cost_dollars"]), total_cost),
                "mismatch": {k: m.get(k) for k in MISMATCH_FIELDS} if m and m.get("tokens") else None,
            }
        )
    updates = [
        {**u, "cost_per_1m_tokens": per_million(float(u["cost_dollars"]), int(u["tokens"]))}
        for u in ledger["updates"]
    ]
    n_updates, per_update = update_figures(ledger.get("earlier_updates"), updates)
    totals = {
        "replica_seconds": sum(float(g["replica_seconds"]) for g in rows),
        "gpu_seconds": sum(float(g["gpu_seconds"]) for g in rows),
        "cost_dollars": total_cost,
        "tokens": total_tokens,
        "sessions": total_sessions,
        "cost_per_1m_tokens": per_million(total_cost, total_tokens),
        "updates": n_updates,
        "cost_per_update_mean": per_update,
    }
    return {
        "source": source,
        "generated_at": ledger["generated_at"],
        "fleet": ledger["fleet"],
        "span_s": ledger["span_s"],
        "totals": totals,
        "groups": out_groups,
        "updates": updates,
        "earlier_updates": ledger.get("earlier_updates"),
        "earlier_versions": ledger.get("earlier_versions", []),
        "versions": [
            {**v, "cost_per_1m_tokens": per_million(float(v["cost_dollars"]), int(v["tokens"]))}
            for v in ledger["versions"]
        ],
        "version_totals": version_totals(ledger["versions"]),
        "what_if": _what_if(ledger, total_tokens, total_cost, baseline, measure_group),
    }


def _what_if(
    ledger: Mapping[str, Any], tokens: int, cost: float, baseline: Baseline | None, group: str | None
) -> dict[str, Any]:
    if baseline is not None:
        return what_if(tokens, cost, baseline)
    try:
        return what_if(tokens, cost, measured_baseline(ledger, group))
    except NoMeasurement as exc:
        return {"available": False, "reason": str(exc)}


class NoMeasurement(Exception):
    """The ledger holds no group whose throughput can be measured; the message says why."""


def measured_baseline(ledger: Mapping[str, Any], group: str | None = None) -> Baseline:
    """The baseline measured from ``ledger`` (``GET /v1/ledger``'s JSON): ``group``, else its
    first BF16 group (the precision a homogeneous fleet serves: ``fleet/presets/homogeneous.toml``)
    that booked tokens, at ``tokens / replica_seconds`` per replica. ValueError naming ``group``
    when the ledger does not list it; :class:`NoMeasurement` when that group (or any BF16 group)
    booked no tokens or no replica time, or has no spec in the preset."""
    rows = {g["name"]: g for g in ledger["groups"]}
    if group is not None and group not in rows:
        raise ValueError(f"--baseline-group: the ledger has no group {group!r} (known: {', '.join(rows)})")
    candidates = (
        [rows[group]] if group is not None else [g for g in rows.values() if g["weight_format"] == "bf16"]
    )
    measured = [g for g in candidates if int(g["tokens"]) > 0 and float(g["replica_seconds"]) > 0]
    if not measured:
        which = (
            f"group {group} booked no tokens or no replica time" if group else "no BF16 group booked tokens"
        )
        raise NoMeasurement(
            f"no stated baseline throughput (--baseline-tokens-per-s), and {which} to measure one"
        )
    g = measured[0]
    if g["accelerator"] is None:
        raise NoMeasurement(f"group {g['name']} of the ledger is not in the preset (no spec to price it)")
    tokens, seconds = int(g["tokens"]), float(g["replica_seconds"])
    return Baseline(
        preset=str(ledger["fleet"]),
        group=g["name"],
        accelerator=g["accelerator"],
        weight_format=g["weight_format"],
        kv_cache_dtype=g["kv_cache_dtype"],
        gpus_per_replica=int(g["gpus_per_replica"]),
        price_per_gpu_hour=float(g["price_per_gpu_hour"]),
        price_date=g["price_date"],
        price_source=g["price_source"],
        tokens_per_s_per_replica=tokens / seconds,
        throughput="measured",
        measured_tokens=tokens,
        measured_replica_seconds=seconds,
    )


def update_figures(
    earlier: Mapping[str, Any] | None, updates: list[Mapping[str, Any]]
) -> tuple[int, float | None]:
    """The number of updates and their mean cost: the ``updates`` listed and the ``earlier`` ones
    the router rolled up (None: none); the mean is None without any update."""
    n = len(updates) + (int(earlier["updates"]) if earlier else 0)
    cost = sum(float(u["cost_dollars"]) for u in updates) + (
        float(earlier["cost_dollars"]) if earlier else 0.0
    )
    return n, cost / n if n else None


def version_totals(versions: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per weight version over every group (ascending; version None, not reported, last)."""
    acc: dict[int | None, dict[str, Any]] = {}
    for v in versions:
        a = acc.setdefault(
            v["version"], {"replica_seconds": 0.0, "gpu_seconds": 0.0, "cost_dollars": 0.0, "tokens": 0}
        )
        for key in ("replica_seconds", "gpu_seconds", "cost_dollars"):
            a[key] += float(v[key])
        a["tokens"] += int(v["tokens"])
    order = sorted(acc, key=lambda k: (k is None, k or 0))
    return [
        {"version": k, **acc[k], "cost_per_1m_tokens": per_million(acc[k]["cost_dollars"], acc[k]["tokens"])}
        for k in order
    ]


def what_if(tokens: int, mixed_cost: float, baseline: Baseline | None) -> dict[str, Any]:
    """The homogeneous fleet serving ``tokens`` (see the module docstring); ``available`` False
    with a ``reason`` without a baseline."""
    if baseline is None:
        return {"available": False, "reason": "no stated baseline throughput (--baseline-tokens-per-s)"}
    replica_seconds = tokens / baseline.tokens_per_s_per_replica
    gpu_seconds = replica_seconds * baseline.gpus_per_replica
    cost = gpu_seconds * baseline.price_per_gpu_hour / SECONDS_PER_HOUR
    return {
        "available": True,
        "baseline": asdict(baseline),
        "tokens": tokens,
        "replica_seconds": replica_seconds,
        "gpu_seconds": gpu_seconds,
        "cost_dollars": cost,
        "cost_per_1m_tokens": per_million(cost, tokens),
        "mixed_cost_dollars": mixed_cost,
        "mixed_cost_per_1m_tokens": per_million(mixed_cost, tokens),
        "mixed_over_baseline": mixed_cost / cost if cost > 0 else None,
        "savings_dollars": cost - mixed_cost,
    }

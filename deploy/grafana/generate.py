"""The Grafana dashboards of a mixfleet, as code: this module writes ``deploy/grafana/dashboards/*.json``.

Edit the panels here and run ``python -m deploy.grafana.generate``; never edit the JSON by hand.
``--check`` writes nothing and exits 1 (one line per problem on stderr) when a committed file
differs from what this module generates, or when a panel or variable queries a metric that no
code defines. The defined names are read from the metric registries themselves: the router's
(:class:`router.metrics.RouterMetrics`), a sidecar's (:class:`replica.reconciler.SidecarMetrics`;
both include prometheus-client's ``process_*`` families), the engine's
(:class:`engine.runtime.metrics.EngineMetrics`, SGLang's ``sglang:*`` names), plus the recording
rules of ``deploy/prometheus/rules/``.

Every dashboard is Grafana 11 schema (``schemaVersion`` :data:`SCHEMA_VERSION`), takes its
Prometheus data source from the ``datasource`` variable (no data-source uid is written) and
filters by the ``group`` variable. Every ratio drops series whose denominator is 0
(``/ (den > 0)``) and every quantile is taken only where its histogram counted something, so an
idle series shows no value instead of NaN. Event counters whose labelled series only exist after
the first event (failovers, session moves) fall back to 0 per group.

Aggregation across routers: several routers may share one state store. Figures a router reads
from the shared state (group gauges, versions, queue, ledger, mismatch) are the same on every
router, so they are combined with ``max``; counters a router counts on its own request path
(turns, tokens, sessions, failovers, latencies) are summed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from engine.runtime.metrics import EngineMetrics
from replica.reconciler import SidecarMetrics
from router.metrics import RouterMetrics

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "dashboards"
RULES_DIR = HERE.parent / "prometheus" / "rules"
SCHEMA_VERSION = 39
TAGS = ["mixfleet"]
USD = "currencyUSD"

JSON = dict[str, Any]

DATASOURCE: JSON = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
GROUP = 'group=~"$group"'
REPLICA = 'group=~"$group", replica=~"$replica"'
ROUTER_JOB = "mixfleet-router"
REPLICA_JOB = "mixfleet-replicas"

# Metric names as the code exposes them.
M = {
    "info": "mixfleet_group_info",
    "cap_sessions": "mixfleet_group_capacity_sessions",
    "cap_tps": "mixfleet_group_capacity_tokens_per_second",
    "cap_share": "mixfleet_group_capacity_share",
    "ready": "mixfleet_group_ready_replicas",
    "active_sessions": "mixfleet_group_active_sessions",
    "session_share": "mixfleet_group_session_share",
    "token_share": "mixfleet_group_token_share",
    "turn_s": "mixfleet_router_turn_seconds",
    "engine_s": "mixfleet_router_engine_seconds",
    "turns": "mixfleet_router_turns_total",
    "tokens": "mixfleet_router_tokens_total",
    "sessions": "mixfleet_router_sessions_created_total",
    "failovers": "mixfleet_router_failovers_total",
    "moves": "mixfleet_router_session_moves_total",
    "forks": "mixfleet_router_forks_total",
    "chat_turns": "mixfleet_router_chat_turns_total",
    "context_text": "mixfleet_router_context_text_total",
    "replays": "mixfleet_router_turn_replays_total",
    "published": "mixfleet_weights_published_version",
    "active_version": "mixfleet_group_active_version",
    "lag": "mixfleet_group_version_lag",
    "lag_bound": "mixfleet_router_version_lag_bound",
    "traj_ready": "mixfleet_router_trajectories_ready",
    "traj_leased": "mixfleet_router_trajectories_leased",
    "traj_held": "mixfleet_router_trajectories_held_back",
    "traj_taken": "mixfleet_router_trajectories_taken_total",
    "traj_acked": "mixfleet_router_trajectories_acked_total",
    "traj_redelivered": "mixfleet_router_trajectories_redelivered_total",
    "replica_s": "mixfleet_group_replica_seconds_total",
    "gpu_s": "mixfleet_group_gpu_seconds_total",
    "cost": "mixfleet_group_cost_dollars_total",
    "price": "mixfleet_group_price_dollars_per_gpu_hour",
    "mm_tokens": "mixfleet_mismatch_tokens_total",
    "mm_k3": "mixfleet_mismatch_k3_total",
    "mm_abs": "mixfleet_mismatch_abs_logprob_diff_total",
    "mm_extreme": "mixfleet_mismatch_extreme_tokens_total",
    "mm_kl_version": "mixfleet_mismatch_k3_kl",
    "mm_extreme_version": "mixfleet_mismatch_extreme_ratio_share",
    "r_ready": "mixfleet_replica_ready",
    "r_active": "mixfleet_replica_active_version",
    "r_desired": "mixfleet_replica_desired_version",
    "r_restarts": "mixfleet_replica_restarts_total",
    "r_stage_s": "mixfleet_replica_stage_seconds",
    "r_activation_s": "mixfleet_replica_activation_seconds",
    "r_activations": "mixfleet_replica_activations_total",
    "r_failures": "mixfleet_replica_activation_failures_total",
    "r_in_flight": "mixfleet_replica_in_flight_requests",
    "r_error": "mixfleet_replica_error",
    "r_conflicts": "mixfleet_replica_version_conflicts_total",
    "request_s": "mixfleet_router_request_seconds",
    "expired": "mixfleet_router_sessions_expired_total",
    "generate": "mixfleet_router_generate_requests_total",
    "leases": "mixfleet_router_leases_total",
    "state_up": "mixfleet_router_state_up",
    "state_lost": "mixfleet_router_state_data_lost_total",
    "updates": "mixfleet_router_updates_total",
    "open_leases": "mixfleet_router_open_leases",
    "mm_oob": "mixfleet_mismatch_out_of_band_tokens_total",
    "mm_band": "mixfleet_mismatch_band_info",
    "mm_abs_version": "mixfleet_mismatch_abs_logprob_diff_mean",
    "mm_oob_version": "mixfleet_mismatch_out_of_band_share",
    "mm_tokens_version": "mixfleet_mismatch_version_tokens",
    "mm_kl_position": "mixfleet_mismatch_position_k3_kl",
    "mm_extreme_position": "mixfleet_mismatch_position_extreme_ratio_share",
    "mm_abs_position": "mixfleet_mismatch_position_abs_logprob_diff_mean",
    "mm_tokens_position": "mixfleet_mismatch_position_tokens",
    "mm_route_tokens": "mixfleet_mismatch_route_tokens_total",
    "mm_route_differ": "mixfleet_mismatch_route_differ_tokens_total",
    "mm_route_version": "mixfleet_mismatch_route_share",
}


# PromQL --------------------------------------------------------------------------------------


def sel(metric: str, *matchers: str) -> str:
    """``metric{matchers}``."""
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def agg(op: str, by: str, expr: str) -> str:
    return f"{op} by ({by}) ({expr})" if by else f"{op}({expr})"


def rate(metric: str, *matchers: str, window: str = RATE) -> str:
    return f"rate({sel(metric, *matchers)}[{window}])"


def sum_rate(metric: str, *matchers: str, by: str = "group", window: str = RATE) -> str:
    """Per-router counters, summed over routers."""
    return agg("sum", by, rate(metric, *matchers, window=window))


def max_rate(metric: str, *matchers: str, by: str = "group", window: str = RATE) -> str:
    """Counters every router reads from the shared state: the same on each, so ``max``."""
    return agg("max", by, rate(metric, *matchers, window=window))


def gauge(metric: str, *matchers: str, by: str = "group") -> str:
    """Gauges every router reads from the shared state: the same on each, so ``max``."""
    return agg("max", by, sel(metric, *matchers))


def increase(metric: str, matcher: str, window: str, op: str = "sum", by: str = "group") -> str:
    return agg(op, by, f"increase({sel(metric, *filter(None, [matcher]))}[{window}])")


def divide(num: str, den: str, matching: str = "") -> str:
    """``num / (den > 0)``: no value (not NaN or +Inf) where the denominator is 0."""
    op = f" / {matching} " if matching else " / "
    return f"{num}{op}({den} > 0)"


def quantile(q: float, histogram: str, *matchers: str, by: str = "group", window: str = RATE) -> str:
    """The ``q`` quantile of a histogram per ``by``, only where it counted something in the window."""
    labels = f"le, {by}" if by else "le"
    buckets = agg("sum", labels, rate(f"{histogram}_bucket", *matchers, window=window))
    counted = agg("sum", by, rate(f"{histogram}_count", *matchers, window=window))
    on = f"on ({by})" if by else "on ()"
    return f"histogram_quantile({q}, {buckets} and {on} ({counted} > 0))"


def mean(histogram: str, *matchers: str, by: str = "group", window: str = RATE) -> str:
    return divide(
        agg("sum", by, rate(f"{histogram}_sum", *matchers, window=window)),
        agg("sum", by, rate(f"{histogram}_count", *matchers, window=window)),
    )


def or_zero(expr: str, by: str = "group") -> str:
    """``expr``, or 0 for each selected group that has no series yet (an event never seen)."""
    return f"({expr}) or ({gauge(M['info'], GROUP, by=by)} * 0)"


# Panels --------------------------------------------------------------------------------------


def target(expr: str, legend: str = "__auto", *, instant: bool = False, table: bool = False) -> JSON:
    t: JSON = {"datasource": DATASOURCE, "editorMode": "code", "expr": expr, "legendFormat": legend}
    if table:
        t["format"] = "table"
    if instant or table:
        t |= {"instant": True, "range": False}
    else:
        t |= {"instant": False, "range": True}
    return t


def _panel(kind: str, title: str, description: str, targets: list[JSON]) -> JSON:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
    }


def timeseries(
    title: str,
    description: str,
    targets: list[JSON],
    *,
    unit: str = "short",
    max_value: float | None = None,
    decimals: int | None = None,
    stack: bool = False,
    step: bool = False,
) -> JSON:
    custom: JSON = {
        "drawStyle": "line",
        "fillOpacity": 20 if stack else 8,
        "lineWidth": 1,
        "lineInterpolation": "stepAfter" if step else "linear",
        "showPoints": "never",
        "spanNulls": False,
    }
    if stack:
        custom["stacking"] = {"group": "A", "mode": "normal"}
    defaults: JSON = {"color": {"mode": "palette-classic"}, "custom": custom, "unit": unit, "min": 0}
    if max_value is not None:
        defaults["max"] = max_value
    if decimals is not None:
        defaults["decimals"] = decimals
    panel = _panel("timeseries", title, description, targets)
    panel["fieldConfig"] = {"defaults": defaults, "overrides": []}
    panel["options"] = {
        "legend": {
            "calcs": ["lastNotNull", "max"],
            "displayMode": "table",
            "placement": "bottom",
            "showLegend": True,
        },
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel


def stat(
    title: str, description: str, expr: str, *, unit: str = "short", decimals: int | None = None
) -> JSON:
    defaults: JSON = {
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "blue", "value": None}]},
        "unit": unit,
        "noValue": "no data",
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    panel = _panel("stat", title, description, [target(expr, instant=True)])
    panel["fieldConfig"] = {"defaults": defaults, "overrides": []}
    panel["options"] = {
        "colorMode": "none",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "value",
    }
    return panel


def table(title: str, description: str, columns: list[tuple[str, str, str]], labels: list[str]) -> JSON:
    """One instant query per column (``(name, expr, unit)``), merged on ``labels``."""
    targets = [target(expr, table=True) for _, expr, _ in columns]
    panel = _panel("table", title, description, targets)
    rename = {f"Value #{chr(ord('A') + i)}": name for i, (name, _, _) in enumerate(columns)}
    order = labels + list(rename)
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {
            "id": "organize",
            "options": {
                "excludeByName": {"Time": True},
                "indexByName": {name: i for i, name in enumerate(order)},
                "renameByName": rename,
            },
        },
    ]
    panel["fieldConfig"] = {
        "defaults": {"custom": {"align": "auto", "cellOptions": {"type": "auto"}}},
        "overrides": [
            {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": unit}]}
            for name, _, unit in columns
        ],
    }
    panel["options"] = {"cellHeight": "sm", "footer": {"show": False}, "showHeader": True}
    return panel


def info_table(title: str, description: str, expr: str, columns: list[str]) -> JSON:
    """The labels of an ``_info`` metric, one row per series."""
    panel = _panel("table", title, description, [target(expr, table=True)])
    panel["transformations"] = [
        {"id": "filterFieldsByName", "options": {"include": {"names": columns}}},
        {"id": "organize", "options": {"indexByName": {name: i for i, name in enumerate(columns)}}},
    ]
    panel["fieldConfig"] = {"defaults": {"custom": {"align": "auto"}}, "overrides": []}
    panel["options"] = {"cellHeight": "sm", "footer": {"show": False}, "showHeader": True}
    return panel


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows; numbers them."""

    WIDTH = 24

    def __init__(self) -> None:
        self.panels: list[JSON] = []
        self.x = self.y = self.row_h = 0

    def _place(self, panel: JSON, w: int, h: int) -> None:
        if self.x + w > self.WIDTH:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel["id"] = len(self.panels) + 1
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self._place({"type": "row", "title": title, "collapsed": False, "panels": []}, self.WIDTH, 1)
        self.x, self.y, self.row_h = 0, self.y + 1, 0

    def add(self, panel: JSON, w: int = 12, h: int = 8) -> None:
        self._place(panel, w, h)


def datasource_variable() -> JSON:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def query_variable(name: str, label: str, query: str) -> JSON:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "options": [],
    }


GROUP_VARIABLE = ("group", "Group", f"label_values({M['info']}, group)")


def dashboard(uid: str, title: str, description: str, layout: Layout, variables: list[JSON]) -> JSON:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "weekStart": "",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {"asDropdown": True, "includeVars": True, "keepTime": True, "tags": TAGS, "title": "mixfleet",
             "type": "dashboards"}
        ],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": layout.panels,
    }  # fmt: skip


WORKERS_NOTE = "With `mixfleet router --workers N`, one series per worker (label `pid`)."


def process_panels(who: str, matcher: str, by: str, legend: str, note: str = "") -> list[JSON]:
    """Resident memory, and open file descriptors as a share of the limit, of the processes
    ``matcher`` selects (prometheus-client's ``process_*`` families), per ``by``: memory that
    creeps up over days, fds nearing the limit. ``note`` ends each description's first paragraph."""
    fds = divide(
        agg("max", by, sel("process_open_fds", matcher)), agg("max", by, sel("process_max_fds", matcher))
    )
    note = f" {note}" if note else ""
    return [
        timeseries(
            f"{who} resident memory",
            f"Resident memory of each {who.lower()} process.{note}\n\n"
            "Metric: `process_resident_memory_bytes`",
            [target(agg("max", by, sel("process_resident_memory_bytes", matcher)), legend)],
            unit="bytes",
        ),
        timeseries(
            f"{who} open file descriptors / limit",
            f"Open file descriptors of each {who.lower()} process as a share of its limit (`ulimit -n`): "
            f"at 1 it can accept no connection and open no file.{note}\n\n"
            "Metrics: `process_open_fds`, `process_max_fds`",
            [target(fds, legend)],
            unit="percentunit",
            max_value=1,
        ),
    ]


# Dashboards ----------------------------------------------------------------------------------


def overview() -> JSON:
    lay = Layout()
    tokens = sum_rate(M["tokens"], GROUP)
    moved = rate(M["moves"], 'from_group=~"$group"')
    moved_away = agg("sum", "group", f'label_replace({moved}, "group", "$1", "from_group", "(.*)")')
    for panel in (
        stat("Ready replicas", "Replicas in rotation, selected groups.", f"sum({gauge(M['ready'], GROUP)})"),
        stat("Active sessions", "Open sessions.", f"sum({gauge(M['active_sessions'], GROUP)})"),
        stat("Tokens / s", "Output tokens recorded per second.", f"sum({tokens})", unit="short"),
        stat("Turns / s", "Turns recorded per second.", f"sum({sum_rate(M['turns'], GROUP)})", unit="short"),
        stat("Turn latency p50", "Median whole-turn latency over the selected groups.",
             quantile(0.5, M["turn_s"], GROUP, by=""), unit="s"),
        stat("Turn latency p99", "99th percentile whole-turn latency over the selected groups.",
             quantile(0.99, M["turn_s"], GROUP, by=""), unit="s"),
    ):  # fmt: skip
        lay.add(panel, 4, 4)

    lay.row("Capacity and share")
    lay.add(
        timeseries(
            "Share of sessions and tokens vs share of capacity",
            "Per group: its share of the fleet's capacity beside the share of sessions "
            "and of output tokens it got over the routing window. The capacity policy keeps them "
            f"together.\n\nMetrics: `{M['cap_share']}`, `{M['session_share']}`, `{M['token_share']}`",
            [
                target(gauge(M["cap_share"], GROUP), "{{group}} capacity"),
                target(gauge(M["session_share"], GROUP), "{{group}} sessions"),
                target(gauge(M["token_share"], GROUP), "{{group}} tokens"),
            ],
            unit="percentunit",
            max_value=1,
        ),
        24,
        9,
    )
    lay.add(
        timeseries(
            "Capacity (sessions)",
            "Ready replicas x sessions per replica, corrected by measured throughput.\n\n"
            f"Metric: `{M['cap_sessions']}`",
            [target(gauge(M["cap_sessions"], GROUP), "{{group}}")],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Capacity (tokens / s)",
            f"Decode throughput the group can serve.\n\nMetric: `{M['cap_tps']}`",
            [target(gauge(M["cap_tps"], GROUP), "{{group}}")],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Ready replicas",
            f"Replicas of the group in rotation.\n\nMetric: `{M['ready']}`",
            [target(gauge(M["ready"], GROUP), "{{group}}")],
            step=True,
        ),
        8,
    )

    lay.row("Load")
    lay.add(
        timeseries(
            "Active sessions",
            f"Open sessions assigned to each group.\n\nMetric: `{M['active_sessions']}`",
            [target(gauge(M["active_sessions"], GROUP), "{{group}}")],
            stack=True,
        ),
        8,
    )
    lay.add(
        timeseries(
            "Tokens / s",
            f"Output tokens recorded per second.\n\nMetric: `{M['tokens']}`",
            [target(tokens, "{{group}}")],
            stack=True,
        ),
        8,
    )
    lay.add(
        timeseries(
            "Sessions and /generate requests / s",
            "New sessions per second by the group they were assigned to, open sessions abandoned after "
            "idling, and SGLang-native /generate requests.\n\n"
            f"Metrics: `{M['sessions']}`, `{M['expired']}`, `{M['generate']}`",
            [
                target(sum_rate(M["sessions"], GROUP), "{{group}} created"),
                target(sum_rate(M["expired"], GROUP), "{{group}} expired"),
                target(sum_rate(M["generate"], GROUP), "{{group}} /generate"),
            ],
        ),
        8,
    )

    lay.row("Latency")
    lay.add(
        timeseries(
            "Turn latency",
            f"Whole turn as the router serves it (retries included).\n\nMetric: `{M['turn_s']}`",
            [
                target(quantile(0.5, M["turn_s"], GROUP), "{{group}} p50"),
                target(quantile(0.99, M["turn_s"], GROUP), "{{group}} p99"),
            ],
            unit="s",
        ),
    )
    lay.add(
        timeseries(
            "Engine call latency",
            f"One engine call seen by the router.\n\nMetric: `{M['engine_s']}`",
            [
                target(quantile(0.5, M["engine_s"], GROUP), "{{group}} p50"),
                target(quantile(0.99, M["engine_s"], GROUP), "{{group}} p99"),
                target(mean(M["engine_s"], GROUP), "{{group}} mean"),
            ],
            unit="s",
        ),
    )
    lay.add(
        timeseries(
            "Failovers / s",
            "Engine attempts that failed and were retried elsewhere, and sessions moved to another "
            "group by failover (0 until the first one); and clients' retries of a turn answered with the "
            "turn recorded under its Idempotency-Key, all groups: found (nothing sampled) or raced "
            "(sampled on one router process while another recorded the key: that sample discarded)."
            f"\n\nMetrics: `{M['failovers']}`, `{M['moves']}`, `{M['replays']}`",
            [
                target(or_zero(sum_rate(M["failovers"], GROUP)), "{{group}} failovers"),
                target(or_zero(moved_away), "{{group}} sessions moved away"),
                target(sum_rate(M["replays"], by="outcome"), "retries answered ({{outcome}})"),
            ],
        ),
    )
    lay.add(
        timeseries(
            "Forks / s",
            "Turns whose input did not extend the session's stored context (the harness edited or "
            "re-rendered history): each starts a new segment of its trajectory, trained as its own "
            f"sample. Forks per turn says how much context is stored twice. Chat turns rendered whole: "
            "chat turns whose every message was rendered (the history before the last turn changed, "
            "or token turns came between), not only the messages after the last turn. Engine input "
            "text reused: the share of turns whose whole input (the engine gets the whole context) was "
            "encoded only where it extends the session's last input on the same router process; "
            "low with several router processes unless agents keep their connection.\n\nMetrics: "
            f"`{M['forks']}`, `{M['turns']}`, `{M['chat_turns']}`, `{M['context_text']}`",
            [
                target(or_zero(sum_rate(M["forks"], GROUP)), "{{group}} forks"),
                target(
                    divide(sum_rate(M["forks"], GROUP), sum_rate(M["turns"], GROUP)),
                    "{{group}} forks per turn",
                ),
                target(
                    or_zero(sum_rate(M["chat_turns"], GROUP, 'context="whole"')),
                    "{{group}} chat turns rendered whole",
                ),
                target(
                    divide(
                        sum_rate(M["context_text"], GROUP, 'result="reused"'),
                        sum_rate(M["context_text"], GROUP),
                    ),
                    "{{group}} engine input text reused (share)",
                ),
            ],
        ),
    )

    lay.row("Trajectories")
    lay.add(
        timeseries(
            "Trajectory queue",
            "Finished trajectories waiting for a trainer, leased and not yet acknowledged, held back "
            "as older than a batch's version bound, and open leases.\n\n"
            f"Metrics: `{M['traj_ready']}`, `{M['traj_leased']}`, `{M['traj_held']}`, `{M['open_leases']}`",
            [
                target(gauge(M["traj_ready"], by=""), "ready"),
                target(gauge(M["traj_leased"], by=""), "leased"),
                target(gauge(M["traj_held"], by=""), "held back"),
                target(gauge(M["open_leases"], by=""), "open leases"),
            ],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Trajectories / s",
            "Handed to trainers, acknowledged, handed out again after a lease expired; batches taken.\n\n"
            f"Metrics: `{M['traj_taken']}`, `{M['traj_acked']}`, `{M['traj_redelivered']}`, `{M['leases']}`",
            [
                target(sum_rate(M["traj_taken"], by=""), "taken"),
                target(sum_rate(M["traj_acked"], by=""), "acknowledged"),
                target(sum_rate(M["traj_redelivered"], by=""), "redelivered"),
                target(sum_rate(M["leases"], by=""), "batches (leases)"),
            ],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Router requests / s",
            f"Every request the router answered, by status class.\n\nMetric: `{M['request_s']}`",
            [target(sum_rate(f"{M['request_s']}_count", by="status"), "{{status}}")],
            stack=True,
        ),
        8,
    )
    lay.add(
        timeseries(
            "Router request latency p99 by route",
            f"Per route template, over every status.\n\nMetric: `{M['request_s']}`",
            [target(quantile(0.99, M["request_s"], by="route"), "{{route}}")],
            unit="s",
        ),
        16,
    )
    lay.add(
        timeseries(
            "State store",
            "Per router: 1 while its scrapes read the state store (0: requests that need it answer "
            "503); the times it found the store had lost its data (Redis restarted without "
            "persistence, flushed, or failed over to an empty replica: every open session, "
            "unacknowledged trajectory and lease gone).\n\n"
            f"Metrics: `{M['state_up']}`, `{M['state_lost']}`",
            [
                target(agg("min", "instance", sel(M["state_up"])), "{{instance}} up"),
                target(increase(M["state_lost"], "", RATE, by="instance"), "{{instance}} data lost"),
            ],
            step=True,
        ),
        8,
    )
    lay.add(
        info_table(
            "Groups",
            "Each group's accelerator, weight format, KV-cache dtype and GPUs per replica.\n\n"
            f"Metric: `{M['info']}`",
            gauge(M["info"], GROUP, by="group, accelerator, weight_format, kv_cache_dtype, gpus_per_replica"),
            ["group", "accelerator", "weight_format", "kv_cache_dtype", "gpus_per_replica"],
        ),
        24,
        6,
    )
    lay.row("Router processes")
    for panel in process_panels(
        "Router", f'job="{ROUTER_JOB}"', "instance, pid", "{{instance}} {{pid}}", WORKERS_NOTE
    ):
        lay.add(panel)
    return dashboard(
        "mixfleet-overview",
        "mixfleet / Fleet overview",
        "Capacity against share per sampler group, sessions, tokens/s, latency and the trajectory queue.",
        lay,
        [query_variable(*GROUP_VARIABLE)],
    )


def versions() -> JSON:
    lay = Layout()
    for panel in (
        stat("Published version", "Latest version published.", gauge(M["published"], by=""), decimals=0),
        stat("Lowest active version", "Lowest version active on any selected group.",
             f"min({gauge(M['active_version'], GROUP)})", decimals=0),
        stat("Largest lag", "Largest version lag over the selected groups.", f"max({gauge(M['lag'], GROUP)})",
             decimals=0),
        stat("Activations (range)", "Completed activations over the dashboard's range.",
             f"sum(increase({sel(M['r_activations'], GROUP)}[$__range]))", decimals=0),
    ):  # fmt: skip
        lay.add(panel, 6, 4)
    lay.row("Versions")
    lay.add(
        timeseries(
            "Published vs active version",
            f"The latest published version and each group's lowest active version.\n\nMetrics: "
            f"`{M['published']}`, `{M['active_version']}`",
            [
                target(gauge(M["published"], by=""), "published"),
                target(gauge(M["active_version"], GROUP), "{{group}} active"),
            ],
            decimals=0,
            step=True,
        ),
    )
    lay.add(
        timeseries(
            "Version lag",
            "Published minus active version, per group, and the bound above which "
            "MixfleetVersionLagHigh fires (the routers' --max-version-lag, else 2).\n\n"
            f"Metrics: `{M['lag']}`, `{M['lag_bound']}`",
            [
                target(gauge(M["lag"], GROUP), "{{group}}"),
                target(gauge(M["lag_bound"], by=""), "alert bound"),
            ],
            decimals=0,
            step=True,
        ),
    )
    lay.add(
        timeseries(
            "Replica versions",
            "Each replica's active version and the version its store pointer names (desired).\n\n"
            f"Metrics: `{M['r_active']}`, `{M['r_desired']}`",
            [
                target(gauge(M["r_active"], GROUP, by="group, replica"), "{{replica}} active"),
                target(gauge(M["r_desired"], GROUP, by="group, replica"), "{{replica}} desired"),
            ],
            decimals=0,
            step=True,
        ),
        24,
    )
    lay.row("Stage and activation")
    lay.add(
        timeseries(
            "Stage time",
            f"Copy and checksum verification of a version on a replica.\n\nMetric: `{M['r_stage_s']}`",
            [
                target(quantile(0.5, M["r_stage_s"], GROUP), "{{group}} p50"),
                target(quantile(0.99, M["r_stage_s"], GROUP), "{{group}} p99"),
            ],
            unit="s",
        ),
    )
    lay.add(
        timeseries(
            "Activation time",
            f"From the engine's pause to serving the new version.\n\nMetric: `{M['r_activation_s']}`",
            [
                target(quantile(0.5, M["r_activation_s"], GROUP), "{{group}} p50"),
                target(quantile(0.99, M["r_activation_s"], GROUP), "{{group}} p99"),
            ],
            unit="s",
        ),
    )
    lay.add(
        timeseries(
            "Activations and failures",
            f"Completed activations and failed stage or activation attempts over 5 minutes, per group.\n\n"
            f"Metrics: `{M['r_activations']}`, `{M['r_failures']}`",
            [
                target(increase(M["r_activations"], GROUP, "5m"), "{{group}} activations"),
                target(increase(M["r_failures"], GROUP, "5m"), "{{group}} failures"),
            ],
        ),
    )  # fmt: skip
    lay.add(
        timeseries(
            "Replicas ready and restarts",
            "Ready replicas per group as the sidecars report it, engine or sidecar restarts over 15 "
            "minutes, and replicas whose last stage or activation failed.\n\n"
            f"Metrics: `{M['r_ready']}`, `{M['r_restarts']}`, `{M['r_error']}`",
            [
                target(agg("sum", "group", sel(M["r_ready"], GROUP)), "{{group}} ready"),
                target(increase(M["r_restarts"], GROUP, "15m"), "{{group}} restarts"),
                target(agg("sum", "group", sel(M["r_error"], GROUP)), "{{group}} in error"),
            ],
        ),
    )
    lay.add(
        timeseries(
            "Version conflicts / s",
            "Requests a replica refused with 409 because its active version did not meet the request's "
            f"min_version / exact_version (retried elsewhere).\n\nMetric: `{M['r_conflicts']}`",
            [target(sum_rate(M["r_conflicts"], GROUP), "{{group}}")],
        ),
        24,
    )  # fmt: skip
    return dashboard(
        "mixfleet-versions",
        "mixfleet / Weight versions",
        "Published against active version per group, lag, and each replica's stage and activation time.",
        lay,
        [query_variable(*GROUP_VARIABLE)],
    )


def mismatch() -> JSON:
    lay = Layout()
    tokens = max_rate(M["mm_tokens"], GROUP)
    kl = divide(max_rate(M["mm_k3"], GROUP), tokens)
    abs_diff = divide(max_rate(M["mm_abs"], GROUP), tokens)
    extreme = divide(max_rate(M["mm_extreme"], GROUP), tokens)
    oob = divide(max_rate(M["mm_oob"], GROUP), tokens)
    gv, gp = "group, version", "group, position"
    lay.row("Sampler-trainer mismatch over time")
    lay.add(
        timeseries(
            "KL (k3 estimator)",
            "Mean of r - 1 - log r with r = p_trainer / q_sampler over the sampled tokens the trainer "
            f"uploaded log-probs for, per group.\n\nMetrics: `{M['mm_k3']}`, `{M['mm_tokens']}`",
            [target(kl, "{{group}}")],
            unit="none",
            decimals=5,
        ),
    )
    lay.add(
        timeseries(
            "Tokens with an extreme ratio",
            "Share of tokens whose ratio p / q lies outside [0.2, 5], and outside the router's configured "
            f"band.\n\nMetrics: `{M['mm_extreme']}`, `{M['mm_oob']}`, `{M['mm_tokens']}`",
            [target(extreme, "{{group}} outside [0.2, 5]"), target(oob, "{{group}} outside the band")],
            unit="percentunit",
        ),
    )
    lay.add(
        timeseries(
            "Mean |Δ log p|",
            f"Mean absolute log-prob difference per token.\n\nMetrics: `{M['mm_abs']}`, `{M['mm_tokens']}`",
            [target(abs_diff, "{{group}}")],
            unit="none",
            decimals=4,
        ),
        8,
    )
    lay.add(
        timeseries(
            "Compared tokens / s",
            f"Tokens the trainer uploaded log-probs for.\n\nMetric: `{M['mm_tokens']}`",
            [target(tokens, "{{group}}")],
        ),
        8,
    )
    lay.add(
        info_table(
            "Configured band",
            f"The band [low, high] of p / q the out-of-band share counts.\n\nMetric: `{M['mm_band']}`",
            gauge(M["mm_band"], by="low, high"),
            ["low", "high"],
        ),
        8,
    )
    route_share = divide(max_rate(M["mm_route_differ"], GROUP), max_rate(M["mm_route_tokens"], GROUP))
    lay.add(
        timeseries(
            "Route mismatch (routing replay)",
            "Share of the compared tokens whose trainer top-k experts (at the position that predicted "
            "the token, as a set per MoE layer) differ from the routed experts the sampler recorded, in "
            "some layer; groups and sessions with record_routes only.\n\n"
            f"Metrics: `{M['mm_route_differ']}`, `{M['mm_route_tokens']}`",
            [target(route_share, "{{group}}")],
            unit="percentunit",
        ),
    )
    lay.add(
        timeseries(
            "Route mismatch by version",
            f"Cumulative per version.\n\nMetric: `{M['mm_route_version']}`",
            [target(gauge(M["mm_route_version"], GROUP, by="group, version"), "{{group}} v{{version}}")],
            unit="percentunit",
        ),
    )
    lay.row("By weight version (cumulative per version)")
    lay.add(
        timeseries(
            "KL by version",
            f"k3 KL over all tokens of each version so far.\n\nMetric: `{M['mm_kl_version']}`",
            [target(gauge(M["mm_kl_version"], GROUP, by=gv), "{{group}} v{{version}}")],
            unit="none",
            decimals=5,
        ),
        8,
    )
    lay.add(
        timeseries(
            "Extreme-ratio share by version",
            f"Share of tokens outside [0.2, 5], per version.\n\nMetric: `{M['mm_extreme_version']}`",
            [target(gauge(M["mm_extreme_version"], GROUP, by=gv), "{{group}} v{{version}}")],
            unit="percentunit",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Mean |Δ log p| by version",
            f"Per version.\n\nMetric: `{M['mm_abs_version']}`",
            [target(gauge(M["mm_abs_version"], GROUP, by=gv), "{{group}} v{{version}}")],
            unit="none",
            decimals=4,
        ),
        8,
    )
    lay.add(
        table(
            "Mismatch per group and version",
            "The cumulative figures of each of a group's latest versions.",
            [
                ("tokens", gauge(M["mm_tokens_version"], GROUP, by=gv), "short"),
                ("KL (k3)", gauge(M["mm_kl_version"], GROUP, by=gv), "none"),
                ("mean |Δ log p|", gauge(M["mm_abs_version"], GROUP, by=gv), "none"),
                ("outside [0.2, 5]", gauge(M["mm_extreme_version"], GROUP, by=gv), "percentunit"),
                ("outside the band", gauge(M["mm_oob_version"], GROUP, by=gv), "percentunit"),
            ],
            ["group", "version"],
        ),
        24,
    )
    lay.row("By token position (all versions)")
    lay.add(
        timeseries(
            "KL by token position",
            f"k3 KL per bucket of the token's position in its sequence.\n\nMetric: `{M['mm_kl_position']}`",
            [target(gauge(M["mm_kl_position"], GROUP, by=gp), "{{group}} {{position}}")],
            unit="none",
            decimals=5,
        ),
        8,
    )
    lay.add(
        timeseries(
            "Extreme-ratio share by token position",
            f"Share of tokens outside [0.2, 5] per position bucket.\n\nMetric: `{M['mm_extreme_position']}`",
            [target(gauge(M["mm_extreme_position"], GROUP, by=gp), "{{group}} {{position}}")],
            unit="percentunit",
        ),
        8,
    )
    lay.add(
        table(
            "Mismatch per group and token position",
            "Cumulative over all versions.",
            [
                ("tokens", gauge(M["mm_tokens_position"], GROUP, by=gp), "short"),
                ("KL (k3)", gauge(M["mm_kl_position"], GROUP, by=gp), "none"),
                ("mean |Δ log p|", gauge(M["mm_abs_position"], GROUP, by=gp), "none"),
                ("outside [0.2, 5]", gauge(M["mm_extreme_position"], GROUP, by=gp), "percentunit"),
            ],
            ["group", "position"],
        ),
        8,
    )
    return dashboard(
        "mixfleet-mismatch",
        "mixfleet / Sampler-trainer mismatch",
        "Per group, from the trainer's log-prob uploads: k3 KL, mean |Δ log p| and the share of extreme "
        "ratios, over time, by weight version and by token position.",
        lay,
        [query_variable(*GROUP_VARIABLE)],
    )


def cost() -> JSON:
    lay = Layout()
    dollars = max_rate(M["cost"], GROUP)
    per_hour = f"{dollars} * 3600"
    updates = increase(M["updates"], "", RATE, by="")
    per_update = divide(increase(M["cost"], GROUP, RATE, op="max"), updates, "on () group_left ()")
    per_million = divide(f"{dollars} * 1e6", sum_rate(M["tokens"], GROUP))
    spent_range = increase(M["cost"], GROUP, "$__range", op="max")
    for panel in (
        stat("Dollars / hour", "What the selected groups cost per hour now.", f"sum({per_hour})", unit=USD),
        stat("Dollars (range)", "Spent over the dashboard's range.", f"sum({spent_range})", unit=USD),
        stat("Dollars / 1M tokens", "Over the selected groups.",
             divide(f"sum({dollars}) * 1e6", f"sum({sum_rate(M['tokens'], GROUP)})"), unit=USD),
        stat("Dollars / update", "Spent per update the trainer closed (acknowledged) over the range.",
             divide(f"sum({spent_range})", increase(M["updates"], "", "$__range", by="")), unit=USD),
    ):  # fmt: skip
        lay.add(panel, 6, 4)
    lay.row("Cost per group")
    lay.add(
        timeseries(
            "Dollars / hour",
            f"Replica-seconds x GPUs per replica x the group's price, per hour.\n\nMetric: `{M['cost']}`",
            [target(per_hour, "{{group}}")],
            unit=USD,
            stack=True,
        ),
    )
    lay.add(
        timeseries(
            "GPUs billed",
            "GPU-seconds booked per second: the GPUs the group holds.\n\n"
            f"Metrics: `{M['gpu_s']}`, `{M['replica_s']}`",
            [
                target(max_rate(M["gpu_s"], GROUP), "{{group}} GPUs"),
                target(max_rate(M["replica_s"], GROUP), "{{group}} replicas"),
            ],
            stack=False,
        ),
    )
    lay.add(
        timeseries(
            "Dollars / update",
            "What each group cost per update in the window: its spend over the updates the trainer closed "
            "(an acknowledgement of at least one trajectory closes one; the ledger's report, "
            "`mixfleet report`, books each update exactly).\n\n"
            f"Metrics: `{M['cost']}`, `{M['updates']}`",
            [target(per_update, "{{group}}")],
            unit=USD,
            stack=True,
        ),
    )
    lay.add(
        timeseries(
            "Dollars / 1M output tokens",
            f"Per group.\n\nMetrics: `{M['cost']}`, `{M['tokens']}`",
            [target(per_million, "{{group}}")],
            unit=USD,
        ),
    )
    lay.add(
        table(
            "Prices and totals",
            "Price per GPU-hour of each group and what it cost so far.\n\n"
            f"Metrics: `{M['price']}`, `{M['cost']}`",
            [
                ("$ / GPU-hour", gauge(M["price"], GROUP), "currencyUSD"),
                ("spent", gauge(M["cost"], GROUP), "currencyUSD"),
                ("GPU-hours", f"{gauge(M['gpu_s'], GROUP)} / 3600", "short"),
            ],
            ["group"],
        ),
        24,
        6,
    )
    return dashboard(
        "mixfleet-cost",
        "mixfleet / Cost",
        "Dollars per hour per group, per update and per million output tokens, from the router's ledger.",
        lay,
        [query_variable(*GROUP_VARIABLE)],
    )


def engines() -> JSON:
    lay = Layout()
    by = "group, replica"

    def e(name: str) -> str:
        return sel(name, REPLICA)

    lay.row("Load")
    lay.add(
        timeseries(
            "Running and queued requests",
            "Requests each replica's engine runs and holds waiting.\n\nMetrics: `sglang:num_running_reqs`, "
            "`sglang:num_queue_reqs`, `sglang:num_paused_reqs`",
            [
                target(agg("max", by, e("sglang:num_running_reqs")), "{{replica}} running"),
                target(agg("max", by, e("sglang:num_queue_reqs")), "{{replica}} queued"),
                target(agg("max", by, e("sglang:num_paused_reqs")), "{{replica}} paused"),
            ],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Generation throughput",
            "Tokens/s the engine reports, and generated tokens per second from its counter.\n\nMetrics: "
            "`sglang:gen_throughput`, `sglang:generation_tokens_total`",
            [
                target(agg("max", by, e("sglang:gen_throughput")), "{{replica}} reported"),
                target(sum_rate("sglang:generation_tokens_total", REPLICA, by=by), "{{replica}} counted"),
            ],
        ),
        8,
    )
    lay.add(
        timeseries(
            "KV tokens in use",
            "Tokens held in the KV cache.\n\nMetric: `sglang:num_used_tokens`",
            [target(agg("max", by, e("sglang:num_used_tokens")), "{{replica}}")],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Prompt tokens / s",
            "Prefill tokens processed per second.\n\nMetric: `sglang:prompt_tokens_total`",
            [target(sum_rate("sglang:prompt_tokens_total", REPLICA, by=by), "{{replica}} prompt tokens")],
        ),
    )
    lay.add(
        timeseries(
            "Prefix cache hit rate",
            "Cached prompt tokens / prompt tokens.\n\n"
            "Metrics: `sglang:cached_tokens_total`, `sglang:prompt_tokens_total`",
            [
                target(
                    divide(
                        sum_rate("sglang:cached_tokens_total", REPLICA, by=by),
                        sum_rate("sglang:prompt_tokens_total", REPLICA, by=by),
                    ),
                    "{{replica}}",
                )
            ],
            unit="percentunit",
            max_value=1,
        ),
    )
    lay.row("Latency")
    for title, hist in (
        ("Time to first token", "sglang:time_to_first_token_seconds"),
        ("Inter-token latency", "sglang:inter_token_latency_seconds"),
        ("End-to-end request latency", "sglang:e2e_request_latency_seconds"),
    ):
        lay.add(
            timeseries(
                title,
                f"Per replica.\n\nMetric: `{hist}`",
                [
                    target(quantile(0.5, hist, REPLICA, by=by), "{{replica}} p50"),
                    target(quantile(0.99, hist, REPLICA, by=by), "{{replica}} p99"),
                ],
                unit="s",
            ),
            8,
        )
    lay.row("Requests")
    lay.add(
        timeseries(
            "Requests / s",
            "Finished, aborted and retracted requests per second.\n\nMetrics: `sglang:num_requests_total`, "
            "`sglang:num_aborted_requests_total`, `sglang:num_retracted_requests_total`",
            [
                target(sum_rate("sglang:num_requests_total", REPLICA, by=by), "{{replica}} finished"),
                target(sum_rate("sglang:num_aborted_requests_total", REPLICA, by=by), "{{replica}} aborted"),
                target(
                    sum_rate("sglang:num_retracted_requests_total", REPLICA, by=by), "{{replica}} retracted"
                ),
            ],
        ),
    )
    lay.add(
        timeseries(
            "Sidecar in-flight requests and replica up",
            f"Requests the replica's sidecar is proxying, and whether Prometheus reaches the replica.\n\n"
            f"Metrics: `{M['r_in_flight']}`, `up`",
            [
                target(agg("max", by, e(M["r_in_flight"])), "{{replica}} in flight"),
                target(agg("max", by, sel("up", f'job="{REPLICA_JOB}"', REPLICA)), "{{replica}} up"),
            ],
        ),
    )
    lay.row("Sidecar process")
    sidecar = f'job="{REPLICA_JOB}", component="sidecar", {REPLICA}'
    for panel in process_panels("Sidecar", sidecar, by, "{{replica}}"):
        lay.add(panel)
    return dashboard(
        "mixfleet-engines",
        "mixfleet / Engines (SGLang)",
        "The SGLang engine panels of each group's replicas, scraped through the replica's sidecar.",
        lay,
        [
            query_variable(*GROUP_VARIABLE),
            query_variable(
                "replica", "Replica", 'label_values(sglang:num_running_reqs{group=~"$group"}, replica)'
            ),
        ],
    )


DASHBOARDS: dict[str, Callable[[], JSON]] = {
    "mixfleet-overview.json": overview,
    "mixfleet-versions.json": versions,
    "mixfleet-mismatch.json": mismatch,
    "mixfleet-cost.json": cost,
    "mixfleet-engines.json": engines,
}


# Checks --------------------------------------------------------------------------------------

METRIC_RE = re.compile(r"(?<![\w:$])((?:mixfleet|sglang|process_)[\w:]*)")
BUILTIN = frozenset({"up"})


def queries(dash: JSON) -> Iterator[str]:
    """Every PromQL expression of a dashboard: its panels' targets and its query variables."""
    for panel in dash["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            yield from (t["expr"] for t in p.get("targets", []))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            yield var["definition"]


def _exposed(name: str, kind: str) -> set[str]:
    """The sample names a metric family of ``kind`` is exposed under."""
    if kind == "counter":
        return {f"{name}_total"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    if kind == "summary":
        return {name, f"{name}_count", f"{name}_sum"}
    if kind == "info":
        return {f"{name}_info"}
    return {name}


def _registry_names(registry: Any) -> set[str]:
    return {n for fam in registry.collect() for n in _exposed(fam.name, fam.type)}


def defined_metrics() -> set[str]:
    """Every metric name the code exposes (router, sidecar, engine) and every recording rule."""
    names = set(BUILTIN)
    names |= _registry_names(RouterMetrics().registry)
    names |= _registry_names(SidecarMetrics("group", "replica").registry)
    names |= _registry_names(EngineMetrics("model").registry)
    names |= recording_rules()
    return names


def recording_rules(rules_dir: Path = RULES_DIR) -> set[str]:
    names: set[str] = set()
    for path in sorted(rules_dir.glob("*.yml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names |= {r["record"] for r in group.get("rules", []) if "record" in r}
    return names


STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def metric_names(expr: str) -> set[str]:
    """The ``mixfleet``/``sglang``/``process_`` metric names (and :data:`BUILTIN` ones) an expression selects;
    string literals (label values, ``label_replace`` arguments) are not names."""
    bare = STRING_RE.sub('""', expr)
    return set(METRIC_RE.findall(bare)) | (BUILTIN & set(re.findall(r"\b(\w+)\s*\{", bare)))


def undefined_metrics(dash: JSON, defined: set[str]) -> list[str]:
    """The metric names a dashboard queries that the code does not define."""
    return sorted({m for q in queries(dash) for m in metric_names(q)} - defined)


def render(dash: JSON) -> str:
    return json.dumps(dash, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def problems(out_dir: Path, check: bool, defined: set[str] | None = None) -> list[str]:
    """Generate every dashboard; write it to ``out_dir`` unless ``check``. Returns the problems:
    undefined metrics, and with ``check`` committed files that are missing or stale."""
    defined = defined_metrics() if defined is None else defined
    errors: list[str] = []
    for filename, build in DASHBOARDS.items():
        dash = build()
        missing = undefined_metrics(dash, defined)
        if missing:
            errors.append(f"{filename}: queries metrics the code does not define: {', '.join(missing)}")
        path = out_dir / filename
        text = render(dash)
        if not check:
            out_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        elif not path.is_file():
            errors.append(f"{path}: missing (run python -m deploy.grafana.generate)")
        elif path.read_text(encoding="utf-8") != text:
            errors.append(f"{path}: stale (run python -m deploy.grafana.generate)")
    if check:
        extra = sorted(p.name for p in out_dir.glob("*.json") if p.name not in DASHBOARDS)
        errors += [f"{out_dir / name}: not generated by this module" for name in extra]
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.grafana.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; fail if a file is stale or a metric undefined"
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"dashboard directory (default {OUT_DIR})")
    args = parser.parse_args(argv)
    errors = problems(args.out, args.check)
    for line in errors:
        print(line, file=sys.stderr)
    if not errors and not args.check:
        print(f"wrote {len(DASHBOARDS)} dashboards to {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""Prometheus metrics of one router (``/metrics``), in a registry private to the app.

Counters and the latency histograms are prometheus-client's own types, updated on the request
path. Gauges that describe the fleet (capacity, replicas, sessions, versions, queue) are
computed at scrape time from the registry and the state store (``RouterMetrics.snapshot``,
refreshed by the app before each scrape), so they are right even when several routers share
Redis. Names follow Prometheus conventions: ``mixfleet_*``, base units, ``_total`` on counters.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)


class RouterMetrics:
    """The router's metrics. Counters are exported as ``<name>_total``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.request_seconds = Histogram(
            "mixfleet_router_request_seconds",
            "Router request latency by route and status class",
            ["route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "mixfleet_router_engine_seconds",
            "Engine call latency seen by the router, by group",
            ["group"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.turns = Counter("mixfleet_router_turns", "Turns recorded, by group", ["group"], registry=r)
        self.tokens = Counter(
            "mixfleet_router_tokens", "Output tokens recorded, by group", ["group"], registry=r
        )
        self.sessions = Counter(
            "mixfleet_router_sessions_created", "Sessions created, by group", ["group"], registry=r
        )
        self.failovers = Counter(
            "mixfleet_router_failovers",
            "Engine attempts that failed and were retried elsewhere",
            ["group", "reason"],
            registry=r,
        )
        self.moves = Counter(
            "mixfleet_router_session_moves",
            "Sessions moved to another group by failover",
            ["from_group", "to_group"],
            registry=r,
        )
        self.expired = Counter(
            "mixfleet_router_sessions_expired", "Open sessions abandoned after idling", ["group"], registry=r
        )
        self.leases = Counter("mixfleet_router_leases", "Batch leases handed out", registry=r)
        self.taken = Counter(
            "mixfleet_router_trajectories_taken", "Trajectories handed to trainers", registry=r
        )
        self.redelivered = Counter(
            "mixfleet_router_trajectories_redelivered",
            "Trajectories handed out again after a lease expired",
            registry=r,
        )
        self.acked = Counter("mixfleet_router_trajectories_acked", "Trajectories acknowledged", registry=r)
        self.generate = Counter(
            "mixfleet_router_generate_requests",
            "SGLang-native /generate requests, by group",
            ["group"],
            registry=r,
        )
        self.snapshot: dict[str, Any] = {}
        r.register(_SnapshotCollector(self))


class _SnapshotCollector:
    """Exposes ``RouterMetrics.snapshot`` (refreshed by the app right before each scrape)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        snap = self.metrics.snapshot
        groups: list[dict[str, Any]] = snap.get("groups", [])
        specs = [
            (
                "mixfleet_group_capacity",
                "Session capacity (ready replicas x sessions, corrected)",
                "capacity",
            ),
            ("mixfleet_group_ready_replicas", "Replicas of the group in rotation", "ready_replicas"),
            ("mixfleet_group_active_sessions", "Open sessions assigned to the group", "active_sessions"),
            ("mixfleet_group_session_share", "Share of all sessions created in the group", "session_share"),
            ("mixfleet_group_token_share", "Share of all output tokens made by the group", "token_share"),
            (
                "mixfleet_group_active_version",
                "Lowest weight version active on the group's replicas",
                "active_version",
            ),
            (
                "mixfleet_group_version_lag",
                "Latest published version minus the group's active version",
                "version_lag",
            ),
        ]
        for name, doc, key in specs:
            fam = GaugeMetricFamily(name, doc, labels=["group"])
            for g in groups:
                if g.get(key) is not None:
                    fam.add_metric([g["name"]], float(g[key]))
            yield fam
        queue = snap.get("queue", {})
        for key, doc in (
            ("ready", "Finished trajectories waiting for a trainer"),
            ("pending", "Trajectories leased and not yet acknowledged"),
            ("held_back", "Trajectories held back as older than the batch's max_version_age"),
            ("leases", "Open leases"),
        ):
            fam = GaugeMetricFamily(f"mixfleet_router_queue_{key}", doc)
            if key in queue:
                fam.add_metric([], float(queue[key]))
            yield fam
        latest = GaugeMetricFamily("mixfleet_router_latest_version", "Latest published weight version")
        if snap.get("latest_version") is not None:
            latest.add_metric([], float(snap["latest_version"]))
        yield latest

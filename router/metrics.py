"""Prometheus metrics of one router (``/metrics``), in a registry private to the app.

Counters and the latency histograms are updated on the request path (the per-request ones are
:class:`LoopHistogram` / :class:`LoopCounter`: no lock, since only the event-loop thread
touches them); gauges that describe the
fleet (capacity, replicas, sessions, versions, queue) are computed at scrape time from the
registry and the state store, so they are right even when several routers share Redis.
"""

from __future__ import annotations

import bisect
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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


class CachedLabels:
    """A labelled metric whose children are looked up once per label tuple.

    ``prometheus_client``'s ``labels()`` validates and locks on every call; the request path
    calls it several times per request with a handful of distinct label values, so the child
    is kept in a dict (label sets are small: routes x status classes, groups, reasons).
    Everything else is forwarded to the wrapped metric.
    """

    __slots__ = ("metric", "_children")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class LoopHistogram:
    """A labelled histogram for the request path: ``labels(...).observe(x)`` is a bisect and two
    additions, without prometheus_client's per-call locks (only the router's event-loop thread
    updates and scrapes it). Exported exactly like ``prometheus_client.Histogram`` (``_bucket``
    with ``le``, ``_count``, ``_sum``; buckets are upper bounds, inclusive)."""

    def __init__(
        self, name: str, documentation: str, labelnames: list[str], buckets: tuple[float, ...], registry: Any
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = _HistogramChild(self.bounds)
        return child

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            cumulative = 0
            buckets = []
            for bound, count in zip((*self.bounds, float("inf")), child.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            fam.add_metric(list(values), buckets, child.sum)
        yield fam


class LoopCounter:
    """A labelled counter updated from the event-loop thread only (no per-call lock); exported
    like ``prometheus_client.Counter`` (``<name>_total``)."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], registry: Any) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self._children: dict[tuple[str, ...], _CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = _CounterChild()
        return child

    def collect(self):
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            fam.add_metric(list(values), child.value)
        yield fam


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        # updated on every turn / request: the lock-free event-loop kinds
        self.request_seconds = LoopHistogram(
            "mixfleet_router_request_seconds",
            "Router request latency by route and status class",
            ["route", "status"],
            LATENCY_BUCKETS,
            r,
        )
        self.engine_seconds = LoopHistogram(
            "mixfleet_router_engine_seconds",
            "Engine call latency seen by the router, by group",
            ["group"],
            LATENCY_BUCKETS,
            r,
        )
        self.turns = LoopCounter("mixfleet_router_turns", "Turns recorded, by group", ["group"], r)
        self.tokens = LoopCounter("mixfleet_router_tokens", "Output tokens recorded, by group", ["group"], r)
        self.sessions = CachedLabels(
            Counter("mixfleet_router_sessions", "Sessions created, by group", ["group"], registry=r)
        )
        self.failovers = CachedLabels(
            Counter(
                "mixfleet_router_failovers",
                "Engine attempts that failed and were retried elsewhere",
                ["group", "reason"],
                registry=r,
            )
        )
        self.moves = CachedLabels(
            Counter(
                "mixfleet_router_session_moves",
                "Sessions moved to another group by failover",
                ["from_group", "to_group"],
                registry=r,
            )
        )
        self.expired = CachedLabels(
            Counter(
                "mixfleet_router_sessions_expired",
                "Open sessions abandoned after idling",
                ["group"],
                registry=r,
            )
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
        self.generate = LoopCounter(
            "mixfleet_router_generate_requests", "SGLang-native /generate requests, by group", ["group"], r
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

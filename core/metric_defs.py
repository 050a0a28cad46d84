"""Declared Prometheus metrics: one :class:`MetricDef` per exported family, from which the
prometheus-client objects (or, for values computed at scrape time, the metric families) are
built, and from which the metric catalogue (``docs/metrics.md``) is generated.

Contract: ``name`` is the family's name as exposed (a counter's ends in ``_total``, which
prometheus-client adds to a counter's base name itself), in base units, with no colons; ``unit``
names the base unit of the value (``""`` for a dimensionless count or ratio stated in ``help``).
An ``external`` family is named by another program -- SGLang's ``sglang:*`` engine metrics, which
the local engine exports under SGLang's names (:mod:`core.sglang_metrics`) -- so only the
``_total`` and unit rules apply to its name (no ``mixfleet_`` prefix, colons allowed).

``multiprocess_mode`` says how prometheus-client's multiprocess collection
(``prometheus_client/multiprocess.py`` 88-143, 0.26.0) combines a gauge's per-process values when
several processes serve one port (``mixfleet router --workers N``): ``sum``/``max``/``min``/
``mostrecent``/``all`` over every process that ever wrote it, the ``live*`` modes over the live ones
only (a dead process's file is removed by ``mark_process_dead``, ``multiprocess.py`` 177-183).
Only a gauge has one (counters and histograms are always summed, and a dead process's counts are
kept); ``None`` is prometheus-client's default, ``all`` (a series per process, ``pid`` label).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Kind = Literal["counter", "gauge", "histogram"]
MultiprocessMode = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent", "livemostrecent"
]
"""prometheus-client's gauge modes (``prometheus_client/metrics.py`` 410, 0.26.0)."""
MULTIPROCESS_MODES: frozenset[str] = frozenset(get_args(MultiprocessMode))


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    labels: tuple[str, ...]
    unit: str
    help: str
    buckets: tuple[float, ...] | None = None
    multiprocess_mode: MultiprocessMode | None = None
    external: bool = False

    def __post_init__(self) -> None:
        if not self.external and (":" in self.name or not self.name.startswith("mixfleet_")):
            raise ValueError(f"metric {self.name!r}: names start with mixfleet_ and have no colons")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: counters, and only counters, end in _total")
        if self.unit and self.unit not in self.name:
            raise ValueError(f"metric {self.name!r}: the name must state its unit {self.unit!r}")
        if self.multiprocess_mode is not None:
            if self.kind != "gauge":
                raise ValueError(f"metric {self.name!r}: only a gauge has a multiprocess_mode")
            if self.multiprocess_mode not in MULTIPROCESS_MODES:
                raise ValueError(f"metric {self.name!r}: no multiprocess_mode {self.multiprocess_mode!r}")

    def instrument(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        """The prometheus-client object of this family, registered in ``registry``."""
        labels = list(self.labels)
        if self.kind == "counter":
            return Counter(self.name, self.help, labels, registry=registry)
        if self.kind == "gauge":
            mode = self.multiprocess_mode or "all"
            return Gauge(self.name, self.help, labels, registry=registry, multiprocess_mode=mode)
        kw = {"buckets": self.buckets} if self.buckets else {}
        return Histogram(self.name, self.help, labels, registry=registry, **kw)

    def family(self) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty metric family of this (counter or gauge) definition, for a collector that
        computes its samples at scrape time (once, in the process that answers the scrape: a
        multiprocess mode does not apply, so declaring one is a ValueError)."""
        if self.multiprocess_mode is not None:
            raise ValueError(f"metric {self.name!r}: computed at scrape time, it has no multiprocess_mode")
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=list(self.labels))
        if self.kind == "gauge":
            return GaugeMetricFamily(self.name, self.help, labels=list(self.labels))
        raise ValueError(f"metric {self.name!r}: a histogram is not computed at scrape time")


def by_name(defs: Sequence[MetricDef]) -> dict[str, MetricDef]:
    """``defs`` keyed by name; ValueError on a name declared twice."""
    out: dict[str, MetricDef] = {}
    for d in defs:
        if d.name in out:
            raise ValueError(f"metric {d.name!r} declared twice")
        out[d.name] = d
    return out


def _process(name: str, kind: Kind, unit: str, help: str) -> MetricDef:
    return MetricDef(name, kind, (), unit, help, external=True)


PROCESS_METRICS: tuple[MetricDef, ...] = (
    _process("process_resident_memory_bytes", "gauge", "bytes", "Resident memory size in bytes."),
    _process("process_virtual_memory_bytes", "gauge", "bytes", "Virtual memory size in bytes."),
    _process(
        "process_cpu_seconds_total", "counter", "seconds", "Total user and system CPU time spent in seconds."
    ),
    _process("process_open_fds", "gauge", "", "Number of open file descriptors."),
    _process("process_max_fds", "gauge", "", "Maximum number of open file descriptors."),
    _process(
        "process_start_time_seconds",
        "gauge",
        "seconds",
        "Start time of the process since unix epoch in seconds.",
    ),
)
"""The families prometheus-client's ``ProcessCollector`` exports on Linux (read from
``/proc/<pid>/stat``, ``limits`` and ``fd``: ``prometheus_client/process_collector.py`` 50-101,
0.26.0), under its names and help texts, which the router and the sidecar add to their registries
(:class:`router.metrics.RouterMetrics`, :mod:`replica.reconciler`). Declared here for the catalogue
only; prometheus-client builds them."""

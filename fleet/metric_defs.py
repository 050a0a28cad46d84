"""Declared Prometheus metrics: one :class:`MetricDef` per exported family, from which the
prometheus-client objects (or, for values computed at scrape time, the metric families) are
built, and from which the metric catalogue (``docs/metrics.md``) is generated.

Contract: ``name`` is the family's name as exposed (a counter's ends in ``_total``, which
prometheus-client adds to a counter's base name itself), in base units, with no colons; ``unit``
names the base unit of the value (``""`` for a dimensionless count or ratio stated in ``help``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    labels: tuple[str, ...]
    unit: str
    help: str
    buckets: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if ":" in self.name or not self.name.startswith("mixfleet_"):
            raise ValueError(f"metric {self.name!r}: names start with mixfleet_ and have no colons")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: counters, and only counters, end in _total")
        if self.unit and self.unit not in self.name:
            raise ValueError(f"metric {self.name!r}: the name must state its unit {self.unit!r}")

    def instrument(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        """The prometheus-client object of this family, registered in ``registry``."""
        labels = list(self.labels)
        if self.kind == "counter":
            return Counter(self.name, self.help, labels, registry=registry)
        if self.kind == "gauge":
            return Gauge(self.name, self.help, labels, registry=registry)
        kw = {"buckets": self.buckets} if self.buckets else {}
        return Histogram(self.name, self.help, labels, registry=registry, **kw)

    def family(self) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty metric family of this (counter or gauge) definition, for a collector that
        computes its samples at scrape time."""
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

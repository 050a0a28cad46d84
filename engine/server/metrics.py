"""The engine's Prometheus metrics, under SGLang's ``sglang:*`` names and ``model_name`` label.

Names, types and histogram buckets follow SGLang's ``srt/metrics/collector.py``
(``SchedulerMetricsCollector`` gauges and ``TokenizerMetricsCollector`` counters/histograms),
so dashboards and alerts written for SGLang read the CPU engine unchanged. Every instance owns a
private registry; :meth:`EngineMetrics.render` is the ``/metrics`` body. All methods are
thread-safe (the scheduler thread writes, the HTTP thread reads).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "EngineMetrics"]

_TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
_E2E_BUCKETS = [
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    2,
    4,
    6,
    8,
    10,
    20,
    40,
    60,
    80,
    100,
    200,
    400,
    600,
    1200,
    1800,
    2400,
]
_ITL_BUCKETS = [
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
    0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
]  # fmt: skip


class EngineMetrics:
    """SGLang-named metrics for one engine; ``gen_throughput`` is tokens/s over the last ``window_s``."""

    def __init__(self, model_name: str, window_s: float = 5.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name}
        names = list(self.labels)
        r = self.registry
        self.num_running_reqs = Gauge(
            "sglang:num_running_reqs", "The number of running requests.", names, registry=r
        )
        self.num_queue_reqs = Gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", names, registry=r
        )
        self.num_used_tokens = Gauge(
            "sglang:num_used_tokens", "The number of used tokens.", names, registry=r
        )
        self.gen_throughput = Gauge(
            "sglang:gen_throughput", "The generation throughput (token/s).", names, registry=r
        )
        self.num_paused_reqs = Gauge(
            "sglang:num_paused_reqs", "The number of paused requests.", names, registry=r
        )
        self.prompt_tokens_total = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", names, registry=r
        )
        self.generation_tokens_total = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", names, registry=r
        )
        self.cached_tokens_total = Counter(
            "sglang:cached_tokens", "Number of cached prompt tokens.", names, registry=r
        )
        self.num_requests_total = Counter(
            "sglang:num_requests", "Number of requests processed.", names, registry=r
        )
        self.num_aborted_requests_total = Counter(
            "sglang:num_aborted_requests", "Number of requests aborted.", names, registry=r
        )
        self.num_retracted_reqs_total = Counter(
            "sglang:num_retracted_requests", "Number of retracted requests.", names, registry=r
        )
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            names,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self._lock = threading.Lock()
        self._window_s = window_s
        self._token_times: deque[tuple[float, int]] = deque()
        for metric in (
            self.num_running_reqs,
            self.num_queue_reqs,
            self.num_used_tokens,
            self.gen_throughput,
            self.num_paused_reqs,
            self.prompt_tokens_total,
            self.generation_tokens_total,
            self.cached_tokens_total,
            self.num_requests_total,
            self.num_aborted_requests_total,
            self.num_retracted_reqs_total,
        ):
            metric.labels(**self.labels)  # so every series is exported from the start

    def set_load(self, running: int, queued: int, paused: int, used_tokens: int) -> None:
        self.num_running_reqs.labels(**self.labels).set(running)
        self.num_queue_reqs.labels(**self.labels).set(queued)
        self.num_paused_reqs.labels(**self.labels).set(paused)
        self.num_used_tokens.labels(**self.labels).set(used_tokens)

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens_total.labels(**self.labels).inc(n)

    def add_generated_tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        self.generation_tokens_total.labels(**self.labels).inc(n)
        now = time.monotonic() if now is None else now
        with self._lock:
            self._token_times.append((now, n))
        self.refresh_throughput(now)

    def refresh_throughput(self, now: float | None = None) -> float:
        """Recompute ``gen_throughput`` from the tokens of the last window; returns it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._token_times and self._token_times[0][0] < now - self._window_s:
                self._token_times.popleft()
            total = sum(n for _, n in self._token_times)
        rate = total / self._window_s
        self.gen_throughput.labels(**self.labels).set(rate)
        return rate

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.labels(**self.labels).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.labels(**self.labels).observe(seconds)

    def observe_finished(self, e2e_seconds: float, aborted: bool) -> None:
        self.num_requests_total.labels(**self.labels).inc()
        if aborted:
            self.num_aborted_requests_total.labels(**self.labels).inc()
        self.e2e_request_latency.labels(**self.labels).observe(e2e_seconds)

    def add_retracted(self, n: int) -> None:
        self.num_retracted_reqs_total.labels(**self.labels).inc(n)

    def render(self) -> bytes:
        self.refresh_throughput()
        return generate_latest(self.registry)

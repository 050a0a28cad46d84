"""The SGLang release's engine metrics (``sglang:*``) that the fleet exports or reads, declared once.

The local engine exports these families under SGLang's names (:mod:`engine.runtime.metrics` builds
its instruments from :data:`ENGINE_METRICS`), so a sidecar reads an engine's load the same way
from either engine (the ``NUM_RUNNING_REQS`` / ``NUM_QUEUE_REQS`` / ``GEN_THROUGHPUT`` /
``GENERATION_TOKENS`` names) and the dashboards chart either unchanged.

Names, types, help texts and histogram buckets are SGLang 0.5.23's, read from the released wheel's
``python/sglang/srt/observability/metrics_collector.py`` (the line of each declaration beside it;
scheduler gauges and ``sglang:num_retracted_requests_total`` in ``SchedulerMetricsCollector``,
the other counters and the histograms in ``TokenizerMetricsCollector``, buckets its defaults at
1966-2036). Labels are the local engine's,
``model_name`` only: SGLang adds ``is_streaming`` to some and ``cache_source`` to
``sglang:cached_tokens_total``, which a query that sums or takes the maximum by ``model_name``
(or by the scrape's own labels) reads alike.
"""

from __future__ import annotations

from core.metric_defs import MetricDef

LABELS = ("model_name",)

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
    0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip


def _gauge(name: str, help: str) -> MetricDef:
    return MetricDef(name, "gauge", LABELS, "", help, external=True)


def _counter(name: str, unit: str, help: str) -> MetricDef:
    return MetricDef(name, "counter", LABELS, unit, help, external=True)


def _histogram(name: str, help: str, buckets: tuple[float, ...]) -> MetricDef:
    return MetricDef(name, "histogram", LABELS, "seconds", help, buckets, external=True)


NUM_RUNNING_REQS = _gauge("sglang:num_running_reqs", "The number of running requests.")  # 364-369
NUM_QUEUE_REQS = _gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")  # 370-375
NUM_USED_TOKENS = _gauge("sglang:num_used_tokens", "The number of used tokens.")  # 432-437
GEN_THROUGHPUT = _gauge("sglang:gen_throughput", "The generation throughput (token/s).")  # 382-387
NUM_PAUSED_REQS = _gauge(  # 573-577
    "sglang:num_paused_reqs", "The number of paused requests by async weight sync."
)
PROMPT_TOKENS = _counter(  # 1855-1859
    "sglang:prompt_tokens_total", "tokens", "Number of prefill tokens processed."
)
GENERATION_TOKENS = _counter(  # 1860-1864
    "sglang:generation_tokens_total", "tokens", "Number of generation tokens processed."
)
CACHED_TOKENS = _counter(  # 1934-1938
    "sglang:cached_tokens_total", "tokens", "Number of cached prompt tokens by source (device/host/storage)."
)
NUM_REQUESTS = _counter("sglang:num_requests_total", "", "Number of requests processed.")  # 1940-1944
NUM_ABORTED_REQUESTS = _counter(  # 1959-1963
    "sglang:num_aborted_requests_total", "", "Number of requests aborted."
)
NUM_RETRACTED_REQUESTS = _counter(  # 557-562
    "sglang:num_retracted_requests_total", "", "Total number of retracted requests."
)
TIME_TO_FIRST_TOKEN = _histogram(  # 2040-2048
    "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
)
INTER_TOKEN_LATENCY = _histogram(  # 2050-2055
    "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
)
E2E_REQUEST_LATENCY = _histogram(  # 2067-2072
    "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", E2E_BUCKETS
)

ENGINE_METRICS: tuple[MetricDef, ...] = (
    NUM_RUNNING_REQS,
    NUM_QUEUE_REQS,
    NUM_USED_TOKENS,
    GEN_THROUGHPUT,
    NUM_PAUSED_REQS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    CACHED_TOKENS,
    NUM_REQUESTS,
    NUM_ABORTED_REQUESTS,
    NUM_RETRACTED_REQUESTS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
)
"""Every engine family the local engine exports, in exposition order."""

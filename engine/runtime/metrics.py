"""The engine's Prometheus metrics, under SGLang's ``sglang:*`` names and ``model_name`` label.

Every family is declared once, in :data:`core.sglang_metrics.ENGINE_METRICS` (names, types, help
and histogram buckets as SGLang 0.5.23 declares them), so dashboards and alerts written for SGLang
read the CPU engine unchanged. Every instance owns a private registry; :meth:`EngineMetrics.render`
is the ``/metrics`` body. All methods are thread-safe (the scheduler thread writes, the HTTP thread
reads).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import CollectorRegistry, generate_latest

from core import sglang_metrics as sm

__all__ = ["CONTENT_TYPE", "EngineMetrics"]


class EngineMetrics:
    """SGLang-named metrics for one engine; ``gen_throughput`` is tokens/s over the last ``window_s``."""

    def __init__(self, model_name: str, window_s: float = 5.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name}
        m = {d.name: d.instrument(self.registry) for d in sm.ENGINE_METRICS}
        self.num_running_reqs = m[sm.NUM_RUNNING_REQS.name]
        self.num_queue_reqs = m[sm.NUM_QUEUE_REQS.name]
        self.num_used_tokens = m[sm.NUM_USED_TOKENS.name]
        self.gen_throughput = m[sm.GEN_THROUGHPUT.name]
        self.num_paused_reqs = m[sm.NUM_PAUSED_REQS.name]
        self.prompt_tokens_total = m[sm.PROMPT_TOKENS.name]
        self.generation_tokens_total = m[sm.GENERATION_TOKENS.name]
        self.cached_tokens_total = m[sm.CACHED_TOKENS.name]
        self.num_requests_total = m[sm.NUM_REQUESTS.name]
        self.num_aborted_requests_total = m[sm.NUM_ABORTED_REQUESTS.name]
        self.num_retracted_reqs_total = m[sm.NUM_RETRACTED_REQUESTS.name]
        self.time_to_first_token = m[sm.TIME_TO_FIRST_TOKEN.name]
        self.inter_token_latency = m[sm.INTER_TOKEN_LATENCY.name]
        self.e2e_request_latency = m[sm.E2E_REQUEST_LATENCY.name]
        self._lock = threading.Lock()
        self._window_s = window_s
        self._token_times: deque[tuple[float, int]] = deque()
        for d in sm.ENGINE_METRICS:
            if d.kind != "histogram":
                m[d.name].labels(**self.labels)  # so every series is exported from the start

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

"""Prometheus metrics of one router (``/metrics``), in a registry private to the app.

Every family is declared once in :data:`ROUTER_METRICS` (:class:`core.metric_defs.MetricDef`;
``docs/metrics.md`` is generated from it). Request-path counters, histograms and gauges
(:data:`REQUEST_PATH`) are prometheus-client's own types, updated where the event happens in the
process that served it. Families that describe the fleet (groups, versions, queue, ledger,
mismatch; :data:`SNAPSHOT`) are computed at scrape time from ``RouterMetrics.snapshot``, which the
app refreshes from the registry and the state store right before each scrape, so they agree
across routers sharing Redis; a scrape whose state read fails or takes over 5 s leaves them out
(``mixfleet_router_state_up 0``) rather than repeat an older read: workers scraped in turn would
otherwise show the ledger's counters going backwards. Names follow Prometheus conventions:
``mixfleet_*``, base units, ``_total`` on counters, ``_info`` for metadata, no colons.

**Several workers on one port** (``mixfleet router --workers N``, :mod:`mixfleet.router`): with
``PROMETHEUS_MULTIPROC_DIR`` set before prometheus-client is first imported (its value class is
chosen then: ``prometheus_client/values.py`` 152-163, 0.26.0), every worker writes its request-path
values to its own files there and a scrape of any worker reads all of them through
``MultiProcessCollector`` (``multiprocess.py`` 19-171): counters and histograms summed over every
worker that ever ran, a dead one's files included, so a counter does not go backwards when uvicorn
replaces a killed worker; each gauge combined by its declared ``multiprocess_mode``. Before each
such scrape the files of ``live*`` gauges of processes that no longer exist are removed with
``mark_process_dead`` (``multiprocess.py`` 177-183; uvicorn 0.54's supervisor restarts a dead worker,
``supervisors/multiprocess.py`` 214-239, but has no hook to call it). The snapshot families are not
in those files: the worker that answers computes them once from the shared state.

**Process metrics** (prometheus-client's ``ProcessCollector``: resident memory, CPU seconds, open
and max file descriptors, start time; :data:`core.metric_defs.PROCESS_METRICS`): one process, one
unlabelled series each, as every Python exporter shows them. With several workers the worker that
answers reads every live worker's ``/proc/<pid>`` (the pids of the ``live*`` gauge files, after
removing the dead ones'), one series per worker labelled ``pid`` (the label prometheus-client's
multiprocess gauges carry): whichever worker answers, a scrape shows every worker's memory and fds,
and a worker's CPU counter never mixes with another's. The supervisor process is not among them.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.values import MutexValue, ValueClass

from core.metric_defs import MetricDef, by_name
from core.process import process_alive
from router.mismatch import BUCKET_LABELS, MismatchSums, rollup

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

MISMATCH_VERSIONS_EXPORTED = 16
"""Per-version mismatch gauges cover each group's latest this many versions."""

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's multiprocess directory variable (``values.py`` 157)."""

SUPERVISOR_ENV = "MIXFLEET_ROUTER_SUPERVISOR"
"""The pid of the ``mixfleet router --workers N`` process (N > 1) whose uvicorn supervisor
starts the workers; set in the workers' environment."""

DEFAULT_VERSION_LAG_BOUND = 2
"""The version lag the lag alert allows when the router has no ``--max-version-lag``: the
staleness the demo trainer accepts by default (``trainer/demo_config.py``, ``max_version_age``)."""

FAILOVER_REASONS = ("timeout_retry", "unavailable", "lost", "version", "busy", "bad_response")
"""The ``reason`` label values of ``mixfleet_router_failovers_total`` (:mod:`router.dispatch`)."""

G = ("group",)
GV = ("group", "version")
GP = ("group", "position")


def _c(name: str, labels: tuple[str, ...], unit: str, help: str) -> MetricDef:
    return MetricDef(name, "counter", labels, unit, help)


def _g(name: str, labels: tuple[str, ...], unit: str, help: str) -> MetricDef:
    return MetricDef(name, "gauge", labels, unit, help)


def _h(name: str, labels: tuple[str, ...], help: str) -> MetricDef:
    return MetricDef(name, "histogram", labels, "seconds", help, LATENCY_BUCKETS)


CONTEXT_TEXT = ("reused", "encoded")
"""The ``result`` label of ``mixfleet_router_context_text_total`` (:mod:`router.dispatch`)."""

CHAT_CONTEXTS = ("resumed", "whole")
"""The ``context`` label of ``mixfleet_router_chat_turns_total`` (:mod:`router.chat.service`)."""

TURN_REPLAYS = ("found", "raced")
"""The ``outcome`` label of ``mixfleet_router_turn_replays_total`` (:mod:`router.idempotency`)."""

# Updated on the request path (prometheus-client objects).
REQUEST_PATH: tuple[MetricDef, ...] = (
    _h(
        "mixfleet_router_request_seconds",
        ("route", "status"),
        "Router request latency by route template and status class (2xx, 4xx, ...)",
    ),
    _h("mixfleet_router_turn_seconds", G, "Whole turn latency: engine call, failover and recording"),
    _h("mixfleet_router_engine_seconds", G, "Engine call latency seen by the router"),
    _c("mixfleet_router_turns_total", G, "", "Turns recorded"),
    _c(
        "mixfleet_router_forks_total",
        G,
        "",
        "Turns whose input did not extend the session's stored context (history edited or "
        "re-rendered): each starts a new segment of its trajectory",
    ),
    _c(
        "mixfleet_router_context_text_total",
        (*G, "result"),
        "",
        "Turns by how the engine input's JSON text was built (router/context_text.py): extended "
        "from the session's cached text (reused: only the new tokens encoded) or encoded whole "
        "(encoded: a session's first turn here, a fork, an entry not kept)",
    ),
    _c(
        "mixfleet_router_chat_turns_total",
        (*G, "context"),
        "",
        "Chat turns recorded (OpenAI and Anthropic routes), by how their context was rendered: "
        "resumed (only the messages after the session's last turn) or whole (every message, against "
        "the whole trajectory: no chat note of the last turn, or the history before it changed)",
    ),
    _c(
        "mixfleet_router_turn_replays_total",
        ("outcome",),
        "",
        "Turn requests answered with the turn already recorded under their Idempotency-Key (a "
        "client's retry; token and chat routes): found (the recorded turn answered, nothing sampled) "
        "or raced (sampled here while another router process recorded the key first: this sample "
        "discarded, the recorded turn answered)",
    ),
    _c("mixfleet_router_tokens_total", G, "tokens", "Output tokens recorded"),
    _c("mixfleet_router_sessions_created_total", G, "", "Sessions created"),
    _c(
        "mixfleet_router_failovers_total",
        ("group", "reason"),
        "",
        "Engine attempts that failed and were retried, by reason: timeout_retry (a first timeout, "
        "retried on the same replica), unavailable (refused or dropped connection, 5xx, engine abort, "
        "second timeout), lost (abandoned in flight: the replica went without a sign of health for "
        "the heartbeat timeout), version (409), busy (429), bad_response",
    ),
    _c(
        "mixfleet_router_session_moves_total",
        ("from_group", "to_group"),
        "",
        "Sessions moved to another group by failover",
    ),
    _c(
        "mixfleet_router_replica_moves_total",
        G,
        "",
        "Turns sent off their session's replica because its queue stayed above the affinity bound",
    ),
    _c("mixfleet_router_sessions_expired_total", G, "", "Open sessions abandoned after idling"),
    _c("mixfleet_router_leases_total", (), "", "Batch leases handed out"),
    _c("mixfleet_router_trajectories_taken_total", (), "", "Trajectories handed to trainers"),
    _c(
        "mixfleet_router_trajectories_redelivered_total",
        (),
        "",
        "Trajectories handed out again after their lease expired",
    ),
    _c("mixfleet_router_trajectories_acked_total", (), "", "Trajectories acknowledged by trainers"),
    _c("mixfleet_router_generate_requests_total", G, "", "SGLang-native /generate requests"),
    _c(
        "mixfleet_router_state_data_lost_total",
        (),
        "",
        "Times this router found the state store had lost its data since its previous check "
        "(Redis restarted without persistence, flushed, or failed over to an empty replica: the "
        "mf:epoch marker changed; StateStore.data_lost): every open session, unacknowledged "
        "trajectory and lease it held is gone",
    ),
    _c(
        "mixfleet_router_updates_total",
        (),
        "",
        "Acknowledgements that closed an update in the cost ledger (acknowledged >= 1 trajectory)",
    ),
    # livesum: each live worker adds its 1 and a dead one's 1 leaves with it (mark_process_dead).
    MetricDef(
        "mixfleet_router_workers",
        "gauge",
        (),
        "",
        "Router processes serving this port (--workers): each live one adds 1",
        multiprocess_mode="livesum",
    ),
)

# Computed at scrape time from the snapshot.
SNAPSHOT: tuple[MetricDef, ...] = (
    _g(
        "mixfleet_group_info",
        ("group", "accelerator", "weight_format", "kv_cache_dtype", "gpus_per_replica"),
        "",
        "Always 1; the group's accelerator, weight format, KV-cache dtype and GPUs per replica",
    ),
    _g(
        "mixfleet_group_capacity_sessions",
        G,
        "sessions",
        "Session capacity: replicas in rotation x sessions per replica x measured throughput factor",
    ),
    _g(
        "mixfleet_group_capacity_tokens_per_second",
        G,
        "tokens_per_second",
        "Decode throughput of the replicas in rotation (mean measured per replica x replicas)",
    ),
    _g("mixfleet_group_capacity_share", G, "", "The group's share of the fleet's session capacity (0-1)"),
    _g("mixfleet_group_ready_replicas", G, "", "Replicas of the group in rotation"),
    _g("mixfleet_group_active_sessions", G, "", "Open sessions assigned to the group"),
    _g(
        "mixfleet_group_session_share",
        G,
        "",
        "The group's share of the sessions in the routing window every router shares (0-1)",
    ),
    _g(
        "mixfleet_group_token_share",
        G,
        "",
        "The group's share of the tokens generated since the routing window's oldest assignment (0-1)",
    ),
    _g("mixfleet_weights_published_version", (), "", "Latest published weight version"),
    _g("mixfleet_group_active_version", G, "", "Lowest weight version active on the group's replicas"),
    _g(
        "mixfleet_group_version_lag",
        G,
        "",
        "Latest published version minus the group's active version",
    ),
    _g("mixfleet_router_trajectories_ready", (), "", "Finished trajectories waiting for a trainer"),
    _g("mixfleet_router_trajectories_leased", (), "", "Trajectories leased and not yet acknowledged"),
    _g(
        "mixfleet_router_trajectories_held_back",
        (),
        "",
        "Trajectories held back as older than a take's max_version_age",
    ),
    _g("mixfleet_router_open_leases", (), "", "Leases handed out and not yet acknowledged"),
    _g(
        "mixfleet_router_state_up",
        (),
        "",
        "1 when this scrape read the state store; 0 when it did not answer in time (the families "
        "read from it, fleet, queue, ledger and mismatch, are then left out of the scrape)",
    ),
    _g(
        "mixfleet_router_version_lag_bound",
        (),
        "",
        "The version lag a group may have before MixfleetVersionLagHigh fires: the router's "
        f"--max-version-lag, else {DEFAULT_VERSION_LAG_BOUND}",
    ),
    _c(
        "mixfleet_group_replica_seconds_total",
        G,
        "seconds",
        "Replica-seconds booked by the cost ledger",
    ),
    _c(
        "mixfleet_group_gpu_seconds_total",
        G,
        "seconds",
        "GPU-seconds booked by the cost ledger (replica-seconds x GPUs per replica)",
    ),
    _c(
        "mixfleet_group_cost_dollars_total",
        G,
        "dollars",
        "US dollars booked by the cost ledger (GPU-seconds x price per GPU-hour / 3600)",
    ),
    _g(
        "mixfleet_group_price_dollars_per_gpu_hour",
        G,
        "dollars_per_gpu_hour",
        "The group's price per GPU-hour in US dollars (from the preset)",
    ),
    _c(
        "mixfleet_mismatch_tokens_total",
        G,
        "tokens",
        "Sampled tokens with a trainer log-prob uploaded and a known sampler log-prob",
    ),
    _c(
        "mixfleet_mismatch_k3_total",
        G,
        "",
        "Sum over those tokens of k3 = r - 1 - log r, r = p_trainer / q_sampler (divide by tokens: KL)",
    ),
    _c(
        "mixfleet_mismatch_abs_logprob_diff_total",
        G,
        "",
        "Sum over those tokens of |log p_trainer - log q_sampler| (nats)",
    ),
    _c(
        "mixfleet_mismatch_extreme_tokens_total",
        G,
        "tokens",
        "Tokens whose ratio r lies outside [0.2, 5]",
    ),
    _c(
        "mixfleet_mismatch_out_of_band_tokens_total",
        G,
        "tokens",
        "Tokens whose ratio r lies outside the router's configured band (mixfleet_mismatch_band_info)",
    ),
    _c(
        "mixfleet_mismatch_route_tokens_total",
        G,
        "tokens",
        "Sampled tokens whose recorded routed experts the trainer compared with its own (routing replay)",
    ),
    _c(
        "mixfleet_mismatch_route_differ_tokens_total",
        G,
        "tokens",
        "Of those, tokens whose trainer experts differ from the recorded ones in some MoE layer",
    ),
    _g(
        "mixfleet_mismatch_route_share",
        GV,
        "",
        "Share of a weight version's compared tokens whose trainer routes differ from the recorded (0-1)",
    ),
    _g(
        "mixfleet_mismatch_band_info",
        ("low", "high"),
        "",
        "Always 1; the configured band [low, high] of the out-of-band count",
    ),
    _g(
        "mixfleet_mismatch_k3_kl",
        GV,
        "",
        "Mean k3 (KL(sampler || trainer) estimate) of the tokens of a weight version, cumulative",
    ),
    _g(
        "mixfleet_mismatch_abs_logprob_diff_mean",
        GV,
        "",
        "Mean |log p_trainer - log q_sampler| of the tokens of a weight version, cumulative",
    ),
    _g(
        "mixfleet_mismatch_extreme_ratio_share",
        GV,
        "",
        "Share of a weight version's tokens with r outside [0.2, 5], cumulative (0-1)",
    ),
    _g(
        "mixfleet_mismatch_out_of_band_share",
        GV,
        "",
        "Share of a weight version's tokens with r outside the configured band, cumulative (0-1)",
    ),
    _g("mixfleet_mismatch_version_tokens", GV, "tokens", "Tokens counted for a weight version"),
    _g(
        "mixfleet_mismatch_position_k3_kl",
        GP,
        "",
        "Mean k3 by token-position bucket (0-63, 64-255, 256-1023, 1024+), all versions",
    ),
    _g(
        "mixfleet_mismatch_position_extreme_ratio_share",
        GP,
        "",
        "Share of tokens with r outside [0.2, 5] by token-position bucket, all versions (0-1)",
    ),
    _g(
        "mixfleet_mismatch_position_abs_logprob_diff_mean",
        GP,
        "",
        "Mean |log p_trainer - log q_sampler| by token-position bucket, all versions",
    ),
    _g("mixfleet_mismatch_position_tokens", GP, "tokens", "Tokens counted by token-position bucket"),
)

ROUTER_METRICS: tuple[MetricDef, ...] = REQUEST_PATH + SNAPSHOT
"""Every family the router exports."""

for _d in REQUEST_PATH:  # its workers combine a gauge by its mode: each states one
    if _d.kind == "gauge" and _d.multiprocess_mode is None:
        raise ValueError(f"metric {_d.name!r}: a request-path gauge needs a multiprocess_mode")

_DEFS = by_name(ROUTER_METRICS)
LEDGER_COUNTERS = (
    "mixfleet_group_replica_seconds_total",
    "mixfleet_group_gpu_seconds_total",
    "mixfleet_group_cost_dollars_total",
)
MISMATCH_COUNTERS = (
    "mixfleet_mismatch_tokens_total",
    "mixfleet_mismatch_k3_total",
    "mixfleet_mismatch_abs_logprob_diff_total",
    "mixfleet_mismatch_extreme_tokens_total",
    "mixfleet_mismatch_out_of_band_tokens_total",
    "mixfleet_mismatch_route_tokens_total",
    "mixfleet_mismatch_route_differ_tokens_total",
)


class RouterMetrics:
    """The router's metrics: the request-path instruments as attributes, ``snapshot``, and
    ``registry``, what ``/metrics`` exposes (:meth:`exposition`).

    ``groups`` are the groups known when the router starts (the preset's): every group-labelled
    request-path series of each exists from the start, at 0 (:meth:`zero_groups`; a group that
    becomes known later, e.g. from a scrape's snapshot, gets them then). ``version_lag_bound`` is
    the router's ``--max-version-lag`` (None: :data:`DEFAULT_VERSION_LAG_BOUND`). With
    ``PROMETHEUS_MULTIPROC_DIR`` set, ``registry`` collects every worker's files (module
    docstring); RuntimeError when prometheus-client was imported before it was set (its values
    would then never reach the files)."""

    def __init__(self, groups: Iterable[str] = (), *, version_lag_bound: int | None = None) -> None:
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        instruments = CollectorRegistry(auto_describe=False)
        if self.multiprocess_dir is None:
            self.registry = instruments
            ProcessCollector(registry=self.registry)
        else:
            if ValueClass is MutexValue:
                raise RuntimeError(f"{MULTIPROC_ENV} was set after prometheus_client was imported")
            self.registry = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self.registry, self.multiprocess_dir)
            self.registry.register(_WorkerProcessCollector(self.multiprocess_dir))
        m = {d.name: d.instrument(instruments) for d in REQUEST_PATH}
        self.request_seconds = m["mixfleet_router_request_seconds"]
        self.turn_seconds = m["mixfleet_router_turn_seconds"]
        self.engine_seconds = m["mixfleet_router_engine_seconds"]
        self.turns = m["mixfleet_router_turns_total"]
        self.forks = m["mixfleet_router_forks_total"]
        self.chat_turns = m["mixfleet_router_chat_turns_total"]
        self.context_text = m["mixfleet_router_context_text_total"]
        self.tokens = m["mixfleet_router_tokens_total"]
        self.turn_replays = m["mixfleet_router_turn_replays_total"]
        for outcome in TURN_REPLAYS:
            self.turn_replays.labels(outcome)
        self.sessions = m["mixfleet_router_sessions_created_total"]
        self.failovers = m["mixfleet_router_failovers_total"]
        self.moves = m["mixfleet_router_session_moves_total"]
        self.replica_moves = m["mixfleet_router_replica_moves_total"]
        self.expired = m["mixfleet_router_sessions_expired_total"]
        self.leases = m["mixfleet_router_leases_total"]
        self.taken = m["mixfleet_router_trajectories_taken_total"]
        self.redelivered = m["mixfleet_router_trajectories_redelivered_total"]
        self.acked = m["mixfleet_router_trajectories_acked_total"]
        self.generate = m["mixfleet_router_generate_requests_total"]
        self.state_data_lost = m["mixfleet_router_state_data_lost_total"]
        self.updates = m["mixfleet_router_updates_total"]
        m["mixfleet_router_workers"].set(1)
        self.version_lag_bound = DEFAULT_VERSION_LAG_BOUND if version_lag_bound is None else version_lag_bound
        self.snapshot: dict[str, Any] = {}
        self._known: list[str] = []
        self.zero_groups(groups)
        self.registry.register(_SnapshotCollector(self))

    def zero_groups(self, groups: Iterable[str]) -> None:
        """Make every group-labelled request-path series of ``groups`` exist (at 0 if new): per
        group, every failover reason, chat context and context-text result, and a session move
        between every ordered pair of known groups. Panels then show 0, not "no data", and the
        first event of a series counts in rate() instead of being its first sample."""
        new = [g for g in dict.fromkeys(groups) if g not in self._known]
        if not new:
            return
        per_group = (self.turn_seconds, self.engine_seconds, self.turns, self.forks, self.tokens)
        per_group += (self.sessions,)
        for g in new:
            for metric in (*per_group, self.expired, self.generate, self.replica_moves):
                metric.labels(g)
            for reason in FAILOVER_REASONS:
                self.failovers.labels(g, reason)
            for context in CHAT_CONTEXTS:
                self.chat_turns.labels(g, context)
            for result in CONTEXT_TEXT:
                self.context_text.labels(g, result)
        self._known += new
        for a in self._known:
            for b in self._known:
                if a != b and (a in new or b in new):
                    self.moves.labels(a, b)

    def exposition(self) -> bytes:
        """The text exposition of ``registry`` (in multiprocess mode, after removing the ``live*``
        gauge files of processes that no longer exist)."""
        if self.multiprocess_dir is not None:
            mark_dead_processes(self.multiprocess_dir)
        return generate_latest(self.registry)


def _live_gauge_pids(path: str) -> set[int]:
    """The pids of the ``live*`` gauge files in ``path`` (``gauge_<mode>_<pid>.db``)."""
    return {int(f.rsplit("_", 1)[1][:-3]) for f in glob.glob(os.path.join(path, "gauge_live*_*.db"))}


def mark_dead_processes(path: str) -> list[int]:
    """``mark_process_dead`` for every process with a ``live*`` gauge file in ``path`` that no
    longer exists; the pids it marked."""
    dead = sorted(p for p in _live_gauge_pids(path) if not process_alive(p))
    for pid in dead:
        mark_process_dead(pid, path)
    return dead


class _WorkerProcessCollector:
    """``ProcessCollector``'s families for every process of a router of several: each live worker
    writing to the multiprocess directory ``path`` (every worker sets the ``livesum`` gauge
    ``mixfleet_router_workers``, so each has a ``live*`` file) and the supervisor that started
    them (:data:`SUPERVISOR_ENV`), one series per process labelled ``pid``. A process that exits
    between listing and reading is left out (``ProcessCollector`` skips what it cannot read)."""

    def __init__(self, path: str) -> None:
        self.path = path
        supervisor = os.environ.get(SUPERVISOR_ENV, "")
        self.supervisor = {int(supervisor)} if supervisor.isdigit() else set()

    def collect(self) -> Iterator[Metric]:
        fams: dict[str, Metric] = {}
        for pid in sorted(p for p in _live_gauge_pids(self.path) | self.supervisor if process_alive(p)):
            for fam in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                out = fams.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "pid": str(pid)}, s.value)
        yield from fams.values()


class _SnapshotCollector:
    """Exposes ``RouterMetrics.snapshot``: ``state_up`` (whether it was read from the state
    store), ``groups`` (``RouterContext.groups_snapshot``'s,
    with ``gpus_per_replica`` and ``price_per_gpu_hour``), ``latest_version``, ``queue``
    (``StateStore.queue_stats``), ``ledger`` (group -> an object with ``replica_seconds``,
    ``gpu_seconds``, ``cost_dollars``), ``mismatch`` (``StateStore.mismatch``),
    ``mismatch_totals`` (``StateStore.mismatch_totals``) and ``mismatch_band``. A missing part
    exports its families without samples."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self.metrics.snapshot
        groups: list[dict[str, Any]] = snap.get("groups", [])
        self.metrics.zero_groups(g["name"] for g in groups)
        fams = {d.name: d.family() for d in SNAPSHOT}

        def put(name: str, labels: list[str], value: float | None) -> None:
            if value is not None:
                fams[name].add_metric(labels, float(value))

        for g in groups:
            name = g["name"]
            put(
                "mixfleet_group_info",
                [
                    name,
                    g["accelerator"],
                    g["weight_format"],
                    g["kv_cache_dtype"],
                    str(g.get("gpus_per_replica", 1)),
                ],
                1,
            )
            put("mixfleet_group_capacity_sessions", [name], g.get("capacity"))
            put("mixfleet_group_capacity_tokens_per_second", [name], _capacity_tps(g))
            put("mixfleet_group_capacity_share", [name], g.get("capacity_share"))
            put("mixfleet_group_ready_replicas", [name], g.get("ready_replicas"))
            put("mixfleet_group_active_sessions", [name], g.get("active_sessions"))
            put("mixfleet_group_session_share", [name], g.get("window_session_share"))
            put("mixfleet_group_token_share", [name], g.get("window_token_share"))
            put("mixfleet_group_active_version", [name], g.get("active_version"))
            put("mixfleet_group_version_lag", [name], g.get("version_lag"))
            put("mixfleet_group_price_dollars_per_gpu_hour", [name], g.get("price_per_gpu_hour"))
        put("mixfleet_weights_published_version", [], snap.get("latest_version"))
        queue = snap.get("queue", {})
        for key, fam in (
            ("ready", "mixfleet_router_trajectories_ready"),
            ("pending", "mixfleet_router_trajectories_leased"),
            ("held_back", "mixfleet_router_trajectories_held_back"),
            ("leases", "mixfleet_router_open_leases"),
        ):
            put(fam, [], queue.get(key))
        put("mixfleet_router_version_lag_bound", [], self.metrics.version_lag_bound)
        if "state_up" in snap:
            put("mixfleet_router_state_up", [], 1 if snap["state_up"] else 0)
        ledger: Mapping[str, Any] = snap.get("ledger", {})
        for group in sorted(ledger):
            t = ledger[group]
            put("mixfleet_group_replica_seconds_total", [group], t.replica_seconds)
            put("mixfleet_group_gpu_seconds_total", [group], t.gpu_seconds)
            put("mixfleet_group_cost_dollars_total", [group], t.cost_dollars)
        band = snap.get("mismatch_band")
        if band is not None:
            put("mixfleet_mismatch_band_info", [f"{band[0]:g}", f"{band[1]:g}"], 1)
        mismatch = rollup(snap.get("mismatch", {}))
        totals: Mapping[str, MismatchSums] = snap.get("mismatch_totals", {})
        for group, total in sorted(totals.items()):
            _mismatch_counters(put, group, total)
        for group, g in sorted(mismatch.items()):
            _mismatch(put, group, g)
        # A group's counters exist at 0 before its first booking or upload, so rate() counts that one.
        for g in groups:
            for names, seen in ((LEDGER_COUNTERS, ledger), (MISMATCH_COUNTERS, totals)):
                if g["name"] not in seen:
                    for name in names:
                        put(name, [g["name"]], 0)
        yield from fams.values()


def _capacity_tps(g: dict[str, Any]) -> float:
    rotation = [r for r in g.get("replicas", []) if r.get("in_rotation")]
    measured = [float(r["tokens_per_s"]) for r in rotation if (r.get("tokens_per_s") or 0) > 0]
    return sum(measured) / len(measured) * len(rotation) if measured else 0.0


def _mismatch_counters(put, group: str, total: MismatchSums) -> None:
    """The group's ``mixfleet_mismatch_*_total`` counters, from ``StateStore.mismatch_totals``
    (which only grows), not from the rolled-up sums (whose float sum moves down by ulps)."""
    put("mixfleet_mismatch_tokens_total", [group], total.tokens)
    put("mixfleet_mismatch_k3_total", [group], total.k3)
    put("mixfleet_mismatch_abs_logprob_diff_total", [group], total.abs_logprob_diff)
    put("mixfleet_mismatch_extreme_tokens_total", [group], total.extreme)
    put("mixfleet_mismatch_out_of_band_tokens_total", [group], total.out_of_band)
    put("mixfleet_mismatch_route_tokens_total", [group], total.route_tokens)
    put("mixfleet_mismatch_route_differ_tokens_total", [group], total.route_differ)


def _mismatch(put, group: str, g: dict[str, Any]) -> None:
    versions = sorted(g["versions"])[-MISMATCH_VERSIONS_EXPORTED:]
    for v in versions:
        view = g["versions"][v].view()
        labels = [group, str(v)]
        put("mixfleet_mismatch_k3_kl", labels, view["k3_kl"])
        put("mixfleet_mismatch_abs_logprob_diff_mean", labels, view["abs_logprob_diff_mean"])
        put("mixfleet_mismatch_extreme_ratio_share", labels, view["extreme_share"])
        put("mixfleet_mismatch_out_of_band_share", labels, view["out_of_band_share"])
        put("mixfleet_mismatch_version_tokens", labels, view["tokens"])
        if view["route_tokens"]:
            put("mixfleet_mismatch_route_share", labels, view["route_mismatch_share"])
    for bucket in (b for b in BUCKET_LABELS if b in g["positions"]):
        view = g["positions"][bucket].view()
        labels = [group, bucket]
        put("mixfleet_mismatch_position_k3_kl", labels, view["k3_kl"])
        put("mixfleet_mismatch_position_extreme_ratio_share", labels, view["extreme_share"])
        put("mixfleet_mismatch_position_abs_logprob_diff_mean", labels, view["abs_logprob_diff_mean"])
        put("mixfleet_mismatch_position_tokens", labels, view["tokens"])

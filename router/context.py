"""The router's live state, one per app (``app.state.ctx``): config, state store, replica
registry, the JSON text of each session's last engine input (``context_text``,
:mod:`router.context_text`), the one HTTP pool of engine calls (``http``;
:meth:`RouterContext.client` is the engine client on it, :meth:`RouterContext.replica_client` the
one of a replica, pinned to its container on
Modal), the container pins (``pins``, :mod:`router.pinning`; None for a local fleet), metrics, and
the latest published weight version. While it runs, the process returns its free C-heap pages to
the system every ``config.heap_trim_s`` (:mod:`core.heap`).

What changes answers lives in the state store, shared by every router process on it: sessions,
trajectories, the replicas' heartbeats and static-poll results, the latest version, the routing
window (:func:`router.policy.assign_group`) and the weight jobs. The registry is this process's
view of the store's replicas (adopted every ``poll_interval_s`` and before ``/v1/groups``
answers) plus what only this process observes of its own engine calls: requests in flight,
failure cooldowns and the passive health of a served request. Every poll signals the requests in
flight on a replica that is lost, which the dispatcher then abandons (:mod:`router.dispatch`).

Other modules add routes that use it (e.g. the weight-sync admin routes): pass them to
``create_app(config, extra_routers=[...])`` or call :func:`router.app.include_routes`; inside a
route, ``request.app.state.ctx`` is this object. ``await ctx.publish_version(v)`` records a
newly published version (monotonic; shared through the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp

from clients.engine import (
    EngineError,
    EngineRejected,
    EngineUnavailable,
    SGLangClient,
    make_http_client,
    parse_prometheus,
)
from core import heap
from core.tasks import cancel_and_wait
from router.config import RouterConfig
from router.context_text import ContextText
from router.errors import ApiError
from router.metrics import RouterMetrics
from router.mismatch import group_view
from router.pinning import ContainerPins, open_pins
from router.policy import WINDOW_SIZE, AssignmentWindow, GroupLoad
from router.registry import Registry, Replica
from router.state import open_store
from router.state.base import GroupCounters, StateError, StateStore, StateUnavailable
from router.state.redis import display_url

log = logging.getLogger("mixfleet.router")
HEAP_TASK = "router-heap-trim"
"""The name of the task returning the process's free C-heap pages (:func:`core.heap.trim_every`)."""


class RouterContext:
    def __init__(self, config: RouterConfig, *, store: StateStore | None = None) -> None:
        """The context of ``config``, on ``store`` (default: the one ``config.state_url`` names)."""
        self.config = config
        self.fleet = config.fleet
        self.store: StateStore = (
            store if store is not None else open_store(config.state_url, retention=config.retention())
        )
        self.pins: ContainerPins | None = open_pins(config.modal_app, [g.name for g in config.fleet.groups])
        self.registry = Registry(
            config.fleet,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            max_version_lag=config.max_version_lag,
            pins=self.pins,
            queue_bound=config.affinity_queue_bound,
            overload_hold_s=config.affinity_hold_s,
        )
        self.metrics = RouterMetrics(
            (g.name for g in config.fleet.groups), version_lag_bound=config.max_version_lag
        )
        self.context_text = ContextText(config.context_cache_bytes)
        self.running_turns: Counter[str] = Counter()  # session id -> its turns running here
        self.http: aiohttp.ClientSession | None = None
        self._latest: int | None = None
        self._tasks: list[asyncio.Task] = []
        self._state_down: str | None = None  # since when a poll found the state store unavailable
        self.state_lost_at: float | None = None  # when this router last found the store lost its data
        self.started = time.time()

    # lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.http = make_http_client(
            connect_timeout_s=self.config.connect_timeout_s, timeout_s=self.config.engine_timeout_s
        )
        with contextlib.suppress(StateError):
            self._latest = await self.store.get_latest_version()
        with contextlib.suppress(StateError):
            if warning := await self.store.durability():
                log.warning("%s", warning)
        await self.check_state_kept()
        await self.poll_once()
        self._tasks.append(asyncio.create_task(self._poll_loop(), name="router-poll"))
        if self.pins is not None:
            await self.pins.refresh()
            self._tasks.append(asyncio.create_task(self._pin_loop(self.pins), name="router-pins"))
        if self.config.heap_trim_s is not None and heap.AVAILABLE:
            self._tasks.append(asyncio.create_task(heap.trim_every(self.config.heap_trim_s), name=HEAP_TASK))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self.http is not None:
            await self.http.close()
        await self.store.close()

    def client(self, url: str, headers: dict[str, str] | None = None) -> SGLangClient:
        """The engine client of the replica at ``url``: ``config.engine_headers`` (then
        ``headers``) go with each of its requests."""
        assert self.http is not None, "RouterContext.start() not called"
        return SGLangClient(self.http, url, {**self.config.engine_headers, **(headers or {})})

    def replica_client(self, replica_id: str, url: str) -> SGLangClient:
        """The engine client of replica ``replica_id`` at ``url``: with pins, its requests carry the
        header that routes them to the replica's own container (:meth:`ContainerPins.headers`)."""
        return self.client(url, self.pins.headers(replica_id) if self.pins is not None else None)

    # versions ----------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        """The latest published version known to this router (None before any publish)."""
        return self._latest

    async def publish_version(self, version: int) -> int:
        self._latest = await self.store.set_latest_version(version)
        return self._latest

    def trainer_version(self) -> int:
        """Version ages are measured against this: latest published, else the newest active."""
        if self._latest is not None:
            return self._latest
        return self.registry.max_active_version() or 0

    async def book_replica(self, r: Replica) -> None:
        """Book an observation of ``r`` now in the cost ledger (:mod:`router.ledger`: covers the
        heartbeat timeout at the group's price)."""
        spec = self.fleet.group(r.group)
        await self.store.book_replica(
            r.replica_id,
            group=r.group,
            version=r.active_version,
            at=time.time(),
            span_s=self.config.heartbeat_timeout_s,
            gpus_per_replica=spec.gpus_per_replica,
            price_per_gpu_hour=spec.price_per_gpu_hour,
        )

    # polling -----------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        last_sweep = last_compact = time.monotonic()
        idle = self.config.session_idle_s
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                with self.store.polling():  # its calls give up sooner while the store is down
                    await self.check_state_kept()
                    await self.poll_once()
                    if idle is not None and time.monotonic() - last_sweep >= min(60.0, max(1.0, idle / 10)):
                        last_sweep = time.monotonic()
                        await self.expire_idle_sessions()
                    if time.monotonic() - last_compact >= self.config.compact_interval_s:
                        last_compact = time.monotonic()
                        await self.store.compact()
            except StateUnavailable as exc:  # expected while the store is down: said once
                self.note_state(exc)
            except Exception:  # a poll must never kill the loop
                log.exception("replica poll failed")

    def note_state(self, exc: StateError | None) -> None:
        """Log one line when the state store becomes unavailable (``exc``: naming its URL and the
        error; requests that need it answer 503 meanwhile) and one when it is back (``exc`` None,
        after a poll read it); nothing while it stays as it was, no traceback (an outage is
        expected: other errors of a poll keep theirs)."""
        where = display_url(self.config.state_url)
        if exc is not None and self._state_down is None:
            log.error("state store %s is unavailable: %s (requests that need it answer 503)", where, exc)
        elif exc is None and self._state_down is not None:
            log.warning("state store %s is available again (unavailable since %s)", where, self._state_down)
        if exc is None:
            self._state_down = None
        elif self._state_down is None:
            self._state_down = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    async def check_state_kept(self) -> None:
        """Log an error and count it (``mixfleet_router_state_data_lost_total``) when the state
        store lost its data since the previous check (:meth:`StateStore.data_lost`; an
        unreachable store is checked at the next poll)."""
        with contextlib.suppress(StateError):
            if lost := await self.store.data_lost():
                self.state_lost_at = time.time()
                self.metrics.state_data_lost.inc()
                log.error("%s", lost)

    def unknown_session(self, session_id: str) -> ApiError:
        """The 404 for a session the store does not know; once this router found the store lost
        its data (:meth:`check_state_kept`), it says when, as the session may have been lost then."""
        detail = f"unknown session {session_id!r}"
        if self.state_lost_at is not None:
            at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.state_lost_at))
            detail += f" (the state store lost its data at {at})"
        return ApiError(404, detail)

    async def _pin_loop(self, pins: ContainerPins) -> None:
        while True:
            await asyncio.sleep(self.config.container_list_interval_s)
            try:
                await pins.refresh()
            except Exception:  # a listing must never kill the loop
                log.exception("container listing failed")

    @contextlib.contextmanager
    def turn_running(self, session_id: str) -> Iterator[None]:
        """While a turn of ``session_id`` runs in this process (:attr:`running_turns`)."""
        self.running_turns[session_id] += 1
        try:
            yield
        finally:
            self.running_turns[session_id] -= 1
            if not self.running_turns[session_id]:
                del self.running_turns[session_id]

    async def expire_idle_sessions(self) -> int:
        """Abandon open sessions idle for ``session_idle_s`` (frees their capacity slots). The
        sessions with a turn running in this process are marked active first, so a turn that
        outlasts the timeout keeps its session; the poll loop sweeps every tenth of the timeout
        (1-60 s), so a turn running in another router process is covered by that process's sweeps
        when the timeout is longer than one sweep period."""
        if self.config.session_idle_s is None:
            return 0
        if self.running_turns:
            await self.store.touch_sessions(list(self.running_turns))
        expired = await self.store.expire_idle(self.config.session_idle_s)
        for _sid, group in expired:
            self.metrics.expired.labels(group).inc()
        if expired:
            log.info("abandoned %d idle sessions", len(expired))
        return len(expired)

    async def poll_once(self) -> None:
        """Health-poll static replicas; adopt heartbeats and the latest version from the store;
        then signal the requests running on replicas now lost (:meth:`Registry.signal_lost`:
        the dispatcher abandons them), unless the store could not be read (this process would
        judge other routers' heartbeats by a stale view)."""
        statics = [r for r in self.registry.replicas.values() if r.static]
        await asyncio.gather(*(self._poll_static(r.replica_id, r.url) for r in statics))
        try:
            await self.adopt_shared()
        except StateError as exc:
            self.note_state(exc)
            return
        self.note_state(None)
        self.registry.signal_lost()

    async def adopt_shared(self) -> None:
        """Bring the registry and the latest version up to the store's: heartbeats and poll
        results any router stored, replicas any router removed. Raises StateError."""
        started = time.time()
        shared = await self.store.list_replicas()
        self.registry.merge_shared(shared, read_since=started)
        latest = await self.store.get_latest_version()
        if latest is not None:
            self._latest = latest if self._latest is None else max(self._latest, latest)

    async def _poll_static(self, replica_id: str, url: str) -> None:
        """Poll a static replica (an engine without a sidecar) as the sidecar reads its own
        engine: health (``/health``), the served version (``/model_info``'s ``weight_version``,
        the tokenizer manager's: entrypoints/http_server.py 812-850) and its load from
        ``/metrics`` (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
        ``sglang:gen_throughput``: observability/metrics_collector.py 364-387; none, and no load,
        from a server started without ``--enable-metrics``). SGLang 0.5.23's
        ``/server_info`` reports none of these as served (its ``weight_version`` is the start-up
        one and its ``internal_states`` carry no request counts: utils/common.py 3584-3593,
        managers/scheduler_components/internal_state.py 45-74)."""
        c = self.client(url)
        try:
            state = await c.probe(timeout=max(1.0, self.config.heartbeat_timeout_s / 2))
            if state == "timeout":  # busy, not dead: it leaves rotation only when polls stay stale
                self.registry.replicas[replica_id].error = "health check timed out"
                return
            if state != "ok":
                self.registry.poll_result(replica_id, ready=False, version=None, error=f"health: {state}")
                return
            version = await c.weight_version()
            try:
                load = parse_prometheus(await c.metrics())
            except EngineRejected:  # no /metrics without --enable-metrics (http_server.py 314-315)
                load = {}
            r = self.registry.replicas[replica_id]
            r.running = int(load.get("sglang:num_running_reqs", 0))
            r.queued = int(load.get("sglang:num_queue_reqs", 0))
            r.tokens_per_s = load.get("sglang:gen_throughput", 0.0)
            self.registry.poll_result(replica_id, ready=True, version=version, error=None)
        except EngineUnavailable as exc:
            if "Timeout" in exc.message:  # busy: keep the last good poll until it is stale
                self.registry.replicas[replica_id].error = exc.message[:300]
            else:
                self.registry.poll_result(replica_id, ready=False, version=None, error=exc.message[:300])
        except (EngineError, ValueError, TypeError, AttributeError) as exc:
            self.registry.poll_result(replica_id, ready=False, version=None, error=str(exc)[:300])
        with contextlib.suppress(StateError):  # so every router and the weights routes see it
            await self.store.put_replica(replica_id, self.registry.replicas[replica_id].shared())
            r = self.registry.replicas[replica_id]
            if r.ready:
                await self.book_replica(r)

    def _container_view(self, r: Replica) -> dict[str, Any] | None:
        """Where requests to ``r`` are pinned (None without pins or for a static replica)."""
        if self.pins is None or r.static:
            return None
        upstream = self.pins.upstream(r.replica_id)
        why = None if upstream is not None else self.pins.errors.get(r.group, "container not listed")
        return {"upstream": upstream, "error": why}

    # loads and snapshots --------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self.config.policy

    def group_loads(self, counters: dict[str, GroupCounters]) -> list[GroupLoad]:
        """Every group's live capacity, load and token total (:meth:`Registry.group_loads`)."""
        return self.registry.group_loads(
            {g: c.active_sessions for g, c in counters.items()},
            {g: c.tokens for g, c in counters.items()},
            self.latest_version(),
        )

    async def current_loads(self) -> list[GroupLoad]:
        return self.group_loads(await self.store.counters())

    async def groups_snapshot(self) -> dict[str, Any]:
        await self.adopt_shared()
        counters = await self.store.counters()
        mismatch = await self.store.mismatch()
        loads = {g.name: g for g in self.group_loads(counters)}
        latest = self.latest_version()
        now = time.monotonic()
        total_sessions = sum(c.sessions for c in counters.values()) or 0
        total_tokens = sum(c.tokens for c in counters.values()) or 0
        total_capacity = sum(g.capacity for g in loads.values()) or 0.0
        window = AssignmentWindow.of(await self.store.window(WINDOW_SIZE))
        window_sessions = window.sessions()
        window_tokens = window.tokens({g: c.tokens for g, c in counters.items()})
        window_total = sum(window_sessions.values())
        window_tokens_total = sum(window_tokens.values())
        groups = []
        for g in self.fleet.groups:
            c = counters.get(g.name, GroupCounters())
            load = loads[g.name]
            rotation = {r.replica_id for r in self.registry.in_rotation(g.name, latest, now)}
            active_version = self.registry.active_version(g.name, latest)
            replicas = [
                {
                    "replica_id": r.replica_id,
                    "url": r.url,
                    "static": r.static,
                    "ready": r.ready,
                    "in_rotation": r.replica_id in rotation,
                    "active_version": r.active_version,
                    "running": r.running,
                    "queued": r.queued,
                    "inflight": r.inflight,
                    "tokens_per_s": r.tokens_per_s,
                    "last_seen_s": None if r.last_seen == float("-inf") else round(now - r.last_seen, 3),
                    "error": r.error,
                    "container": self._container_view(r),
                }
                for r in self.registry.replicas.values()
                if r.group == g.name
            ]
            groups.append(
                {
                    "name": g.name,
                    "accelerator": g.accelerator,
                    "weight_format": g.weight_format,
                    "kv_cache_dtype": g.kv_cache_dtype,
                    "sessions_per_replica": g.sessions_per_replica,
                    "capacity": load.capacity,
                    "ready_replicas": len(rotation),
                    "active_sessions": c.active_sessions,
                    "sessions_total": c.sessions,
                    "tokens_total": c.tokens,
                    "session_share": c.sessions / total_sessions if total_sessions else 0.0,
                    "token_share": c.tokens / total_tokens if total_tokens else 0.0,
                    "capacity_share": load.capacity / total_capacity if total_capacity else 0.0,
                    "window_sessions": window_sessions.get(g.name, 0),
                    "window_tokens": window_tokens.get(g.name, 0),
                    "window_session_share": window_sessions.get(g.name, 0) / window_total
                    if window_total
                    else 0.0,
                    "window_token_share": window_tokens.get(g.name, 0) / window_tokens_total
                    if window_tokens_total
                    else 0.0,
                    "active_version": active_version,
                    "version_lag": None
                    if latest is None or active_version is None
                    else latest - active_version,
                    "cost_per_token": load.cost_per_token,
                    "replicas": replicas,
                    "mismatch": group_view(mismatch, g.name, self.config.mismatch_band),
                }
            )
        return {"latest_version": latest, "policy": self.config.policy, "groups": groups}

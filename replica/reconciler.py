"""One replica's weight-version reconciler: pointer watch, staging, activation, heartbeats.

docs/architecture.md, "2. A weight version". :class:`Reconciler` runs three loops beside one engine (the
local CPU engine or SGLang), inside the sidecar process (:mod:`replica.sidecar` is its HTTP
front):

- **watch**: the pointer ``<store>/<run>/<format>/CURRENT`` is read every ``poll_s`` (<= 1 s)
  and at once on :meth:`Reconciler.wake`.
- **reconcile**: a newer pointer is staged while the engine keeps serving (copied and
  checksum-verified, :mod:`weight_sync.stage`), then activated by :func:`replica.activation.activate`
  (the one protocol, SGLang's and the local engine's: ``/pause_generation {"mode": "retract"}`` ->
  ``/update_weights_from_disk`` with the format's request, cache flush included ->
  ``/continue_generation``; an update whose flush alone was refused is completed while paused by
  ``/flush_cache`` and ``/update_weight_version``); new generations wait in the sidecar's
  :class:`~replica.hold.Hold` meanwhile, not at the engine. The active version changes only once the
  engine's ``/model_info`` names it. Pending versions coalesce: the newest pointer is the only
  target, and a staging that a newer pointer overtakes is abandoned. A failure (checksum, engine
  refusal) keeps the old version serving, is reported (``error`` in status, heartbeat and
  metrics), and is retried with exponential backoff; a newer pointer is tried at once.
  *Ready* means: the engine has served the pointer's version at least once since start (a new
  replica joins at the current version).
- **engine**: health (:meth:`Reconciler.engine_health`; not asked while an activation runs, so
  heartbeats keep coming, ready, and the router keeps the turns in flight on the replica), load
  figures from the engine's ``sglang:*`` metrics, version drift (an engine restarted underneath
  is believed and reconciled; compared only once the reconcile loop has learned the version the
  engine serves at start), and heartbeats to the router
  (``POST {router}/v1/replicas/heartbeat`` every ``heartbeat_s`` and after every activation:
  group, URL, ready, active version, running and queued requests, tokens/s, error).

Every engine call goes through :class:`clients.engine.SGLangClient` and every router call
through :class:`clients.router.RouterClient`; the sidecar owns their connections and
hands them to :meth:`Reconciler.start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

from clients.engine import EngineError, SGLangClient, parse_prometheus
from clients.router import RouterClient, RouterError
from core.metric_defs import MetricDef
from core.tasks import cancel_and_wait
from replica.activation import ActivationFailed, activate
from replica.hold import Hold
from weight_sync.manifest import ChecksumError
from weight_sync.stage import STAGE_MODES, StageAborted, StagedVersion, clean_staging, stage_version
from weight_sync.store.base import VersionStore
from weight_sync.types import FormatRef, VersionRef

log = logging.getLogger("mixfleet.sidecar")


@dataclass(frozen=True)
class ReconcileSettings:
    """What one replica's reconciler serves and how; ``poll_s`` <= 1 keeps pointer reads within a
    second. Invalid values raise ``ValueError`` naming the field."""

    group: str
    weight_format: str
    run_id: str
    replica_id: str
    advertise_url: str
    staging_dir: Path
    stage_mode: str = "copy"
    stage_rate_bytes_per_s: float | None = None
    poll_s: float = 0.5
    heartbeat_s: float = 1.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    engine_timeout_s: float = 600.0
    restarts: int = 0  # times a supervisor (``mixfleet up``) restarted this replica before

    def __post_init__(self) -> None:
        if self.restarts < 0:
            raise ValueError(f"restarts must be >= 0, got {self.restarts}")
        if not 0 < self.poll_s <= 1.0:
            raise ValueError(f"poll_s must be in (0, 1], got {self.poll_s}")
        if self.stage_mode not in STAGE_MODES:
            raise ValueError(f"stage_mode must be one of {STAGE_MODES}, got {self.stage_mode!r}")


@dataclass(frozen=True)
class Activation:
    """One completed activation, with where its time went (seconds; ``at`` is Unix time)."""

    version: int
    at: float
    seen_at: float  # when the sidecar first saw the pointer name this version
    stage_s: float
    pause_s: float  # /pause_generation sent -> /continue_generation answered
    update_s: float  # /update_weights_from_disk alone
    total_s: float  # seen -> active
    bytes: int


@dataclass
class _State:
    active_version: int | None = None
    desired_version: int | None = None
    desired_seen_at: float = 0.0
    ready: bool = False
    engine_ok: bool = False
    error: str | None = None
    error_version: int | None = None
    failures: int = 0
    next_retry_at: float = 0.0
    staging: dict[str, Any] | None = None
    activations: deque[Activation] = field(default_factory=lambda: deque(maxlen=32))
    in_flight: int = 0
    running: float = 0.0
    queued: float = 0.0
    tokens_per_s: float = 0.0
    started_at: float = field(default_factory=time.time)


STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_R = ("group", "replica")

REPLICA_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "mixfleet_replica_ready", "gauge", _R, "", "1 when the replica is ready (serving its desired version)"
    ),
    MetricDef("mixfleet_replica_active_version", "gauge", _R, "", "Weight version the engine serves"),
    MetricDef("mixfleet_replica_desired_version", "gauge", _R, "", "Version the store pointer names"),
    MetricDef(
        "mixfleet_replica_error", "gauge", _R, "", "1 while the last stage or activation attempt failed"
    ),
    MetricDef("mixfleet_replica_activations_total", "counter", _R, "", "Completed activations"),
    MetricDef(
        "mixfleet_replica_activation_failures_total", "counter", _R, "", "Failed stage or activation attempts"
    ),
    MetricDef(
        "mixfleet_replica_version_conflicts_total",
        "counter",
        _R,
        "",
        "Requests refused with 409 for a version constraint",
    ),
    MetricDef(
        "mixfleet_replica_stage_seconds",
        "histogram",
        _R,
        "seconds",
        "Stage time of a version: copy to the replica's disk and verify checksums",
        STAGE_BUCKETS,
    ),
    MetricDef(
        "mixfleet_replica_activation_seconds",
        "histogram",
        _R,
        "seconds",
        "Commit time of an activation: pause sent until the engine serves it",
        STAGE_BUCKETS,
    ),
    MetricDef(
        "mixfleet_replica_in_flight_requests", "gauge", _R, "", "Generate requests the sidecar is proxying"
    ),
    MetricDef(
        "mixfleet_replica_restarts_total",
        "counter",
        _R,
        "",
        "Times the supervisor restarted this replica's engine or sidecar",
    ),
)
"""Every family a sidecar exports itself (its ``/metrics`` adds the engine's ``sglang:*``)."""


class SidecarMetrics:
    """The sidecar's registry: :data:`REPLICA_METRICS` labelled ``group`` and ``replica``, and
    prometheus-client's ``ProcessCollector`` (this process's memory, CPU, fds, start time:
    :data:`core.metric_defs.PROCESS_METRICS`)."""

    def __init__(self, group: str, replica: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        m = {d.name: d.instrument(self.registry).labels(group, replica) for d in REPLICA_METRICS}
        self.ready = m["mixfleet_replica_ready"]
        self.active = m["mixfleet_replica_active_version"]
        self.desired = m["mixfleet_replica_desired_version"]
        self.error = m["mixfleet_replica_error"]
        self.activations = m["mixfleet_replica_activations_total"]
        self.failures = m["mixfleet_replica_activation_failures_total"]
        self.conflicts = m["mixfleet_replica_version_conflicts_total"]
        self.stage_s = m["mixfleet_replica_stage_seconds"]
        self.activation_s = m["mixfleet_replica_activation_seconds"]
        self.in_flight = m["mixfleet_replica_in_flight_requests"]
        self.restarts = m["mixfleet_replica_restarts_total"]


class Reconciler:
    """The weight-version reconciler of one replica (see the module docstring)."""

    def __init__(self, config: ReconcileSettings, store: VersionStore) -> None:
        self.config = config
        self.store = store
        self.state = _State()
        self.metrics = SidecarMetrics(config.group, config.replica_id)
        self.metrics.restarts.inc(config.restarts)
        self._work = asyncio.Event()
        self._wake = asyncio.Event()
        self._activation_lock = asyncio.Lock()
        self.hold = Hold()  # closed while an activation has the engine paused
        self._stage_cache: StagedVersion | None = None
        self.engine: SGLangClient | None = None
        self._router: RouterClient | None = None
        self._engine_known = False  # the reconcile loop learned the engine's start-up version
        self._tasks: list[asyncio.Task] = []
        self._last_tokens: tuple[float, float] | None = None
        self._epoch = 0  # activations started; a version read across one is stale

    # lifecycle ----------------------------------------------------------------------------
    async def start(self, engine: SGLangClient, router: RouterClient | None = None) -> None:
        """Start the loops on ``engine`` (heartbeats to ``router`` when given); both stay the
        caller's (their connections are not closed by :meth:`stop`)."""
        self.engine = engine
        self._router = router
        self._tasks = [
            asyncio.create_task(self._watch_loop(), name="watch"),
            asyncio.create_task(self._reconcile_loop(), name="reconcile"),
            asyncio.create_task(self._engine_loop(), name="engine"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)

    def wake(self) -> None:
        self._wake.set()

    # status -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        s = self.state
        last = s.activations[-1] if s.activations else None
        return {
            "replica_id": self.config.replica_id,
            "group": self.config.group,
            "format": self.config.weight_format,
            "run_id": self.config.run_id,
            "url": self.config.advertise_url,
            "engine_url": None if self.engine is None else self.engine.base_url,
            "ready": s.ready,
            "engine_ok": s.engine_ok,
            "active_version": s.active_version,
            "desired_version": s.desired_version,
            "staging": s.staging,
            "error": s.error,
            "error_version": s.error_version,
            "failures": s.failures,
            "last_activation": asdict(last) if last else None,
            "activations": [asdict(a) for a in s.activations],
            "running": s.running,
            "queued": s.queued,
            "tokens_per_s": s.tokens_per_s,
            "in_flight": s.in_flight,
            "held": self.hold.held,
        }

    def heartbeat_body(self) -> dict[str, Any]:
        s = self.state
        return {
            "replica_id": self.config.replica_id,
            "group": self.config.group,
            "url": self.config.advertise_url,
            "ready": bool(s.ready and s.engine_ok),
            "active_version": s.active_version,
            "running": int(max(s.running, s.in_flight)),
            "queued": int(s.queued),
            "tokens_per_s": float(s.tokens_per_s),
            "error": s.error,
        }

    # pointer watch --------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        """Read the pointer every ``poll_s`` or on wake; signal the reconciler on a change."""
        while True:
            self._wake.clear()  # a wake from now on triggers another read
            try:
                ptr = await asyncio.to_thread(
                    self.store.read_pointer, FormatRef(self.config.run_id, self.config.weight_format)
                )
            except Exception as exc:  # store briefly unreadable: keep serving, say so
                log.warning("reading the pointer failed: %s", exc)
                ptr = self.state.desired_version
            if ptr != self.state.desired_version:
                self.state.desired_version = ptr
                self.state.desired_seen_at = time.time()
                if ptr is not None:
                    self.metrics.desired.set(ptr)
                self._work.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_s):
                    await self._wake.wait()

    # reconcile --------------------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        await self._wait_engine()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                clean_staging,
                self.config.staging_dir,
                {self.state.active_version} if self.state.active_version is not None else set(),
            )
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_s):
                    await self._work.wait()
            self._work.clear()
            try:
                await self._reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the loop die
                log.exception("reconcile failed")
                self._fail(self.state.desired_version, f"internal error: {exc}")

    async def _reconcile_once(self) -> None:
        s = self.state
        target = s.desired_version
        if target is None:
            # Nothing published yet: the replica serves whatever its engine loaded.
            if s.engine_ok and not s.ready:
                self._set_ready(True)
            return
        if s.active_version is not None and target <= s.active_version:
            # Serving the pointer's version (or newer: pointers never move back).
            if not s.ready:
                self._set_ready(True)
            return
        if s.error_version == target and time.monotonic() < s.next_retry_at:
            return
        seen_at = s.desired_seen_at or time.time()
        staged = await self._stage(target)
        if staged is None:
            return
        await self._activate(target, staged, seen_at)

    async def _stage(self, target: int) -> StagedVersion | None:
        cached = self._stage_cache
        if cached is not None and cached.version == target and cached.path.is_dir():
            return cached
        s = self.state
        s.staging = {"version": target, "bytes_done": 0, "bytes_total": None, "started_at": time.time()}
        ref = VersionRef(self.config.run_id, self.config.weight_format, target)
        try:
            manifest = await asyncio.to_thread(self.store.read_manifest, ref)
            s.staging["bytes_total"] = manifest.total_bytes

            def progress(n: int) -> None:
                if s.staging is not None:
                    s.staging["bytes_done"] = n

            staged = await asyncio.to_thread(
                stage_version,
                self.store,
                ref,
                self.config.staging_dir,
                mode=self.config.stage_mode,  # type: ignore[arg-type]
                should_abort=lambda: self.state.desired_version != target,
                rate_bytes_per_s=self.config.stage_rate_bytes_per_s,
                progress=progress,
            )
        except StageAborted:
            return None
        except ChecksumError as exc:
            self._fail(
                target, f"staging version {target} failed: checksum mismatch in {exc.path} ({exc.reason})"
            )
            return None
        except Exception as exc:
            self._fail(target, f"staging version {target} failed: {exc}")
            return None
        finally:
            s.staging = None
        self.metrics.stage_s.observe(staged.seconds)
        self._stage_cache = staged
        return staged

    async def _activate(self, target: int, staged: StagedVersion, seen_at: float) -> None:
        """Activate ``target`` by :func:`replica.activation.activate` (retract -> update with flush ->
        continue); the active version moves only once the engine's ``/model_info`` names it."""
        assert self.engine is not None
        s = self.state
        async with self._activation_lock:
            self._epoch += 1
            try:
                async with self.hold.closed():
                    times = await activate(
                        self.engine,
                        str(staged.path),
                        target,
                        self.config.weight_format,
                        timeout_s=self.config.engine_timeout_s,
                    )
            except ActivationFailed as exc:
                self._fail(target, exc.message)
                return
            s.active_version = target
            s.error = None
            s.error_version = None
            s.failures = 0
            act = Activation(
                version=target,
                at=time.time(),
                seen_at=seen_at,
                stage_s=staged.seconds,
                pause_s=times.pause_s,
                update_s=times.update_s,
                total_s=time.time() - seen_at,
                bytes=staged.bytes,
            )
            s.activations.append(act)
            self.metrics.active.set(target)
            self.metrics.error.set(0)
            self.metrics.activations.inc()
            self.metrics.activation_s.observe(times.pause_s)
            if s.desired_version == target:
                self._set_ready(True)
        log.info(
            "replica %s active at version %d (stage %.3fs, pause %.3fs, update %.3fs; engine: %s)",
            self.config.replica_id,
            target,
            staged.seconds,
            times.pause_s,
            times.update_s,
            times.message[:200],
        )
        if staged.copied:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(clean_staging, self.config.staging_dir, {target})
        self._stage_cache = None
        await self._heartbeat()

    def _fail(self, version: int | None, message: str) -> None:
        s = self.state
        s.failures = s.failures + 1 if s.error_version == version else 1
        s.error = message
        s.error_version = version
        delay = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (s.failures - 1))
        s.next_retry_at = time.monotonic() + delay
        self._stage_cache = None
        self.metrics.failures.inc()
        self.metrics.error.set(1)
        log.warning("%s (retry in %.1fs)", message, delay)

    def _set_ready(self, ready: bool) -> None:
        self.state.ready = ready
        self.metrics.ready.set(1 if ready else 0)

    # engine -----------------------------------------------------------------------------------
    async def _wait_engine(self) -> None:
        """Block until the engine answers /health; learn the version it serves."""
        assert self.engine is not None
        while True:
            if await self.engine_health():
                # A previous sidecar may have died between pause and continue: resume (a no-op
                # on an engine that is not paused).
                with contextlib.suppress(EngineError):
                    await self.engine.continue_generation()
                version = await self._engine_version()
                self.state.active_version = version
                if version is not None:
                    self.metrics.active.set(version)
                self._engine_known = True
                return
            await asyncio.sleep(0.2)

    async def engine_health(self) -> bool:
        """Whether the engine counts as answering now (kept as ``state.engine_ok``): its
        ``/health`` answered 200 within 5 s. While this sidecar activates a version the engine is
        not asked and keeps the standing it had: the activation's own calls say whether the engine
        is there (a refused connection fails it at once; they are bounded by
        ``engine_timeout_s``), and SGLang's ``/health`` would only wait on the paused scheduler
        -- by default (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``, environ.py 344) it sends a
        one-token generation and answers 200 once any scheduler output arrived after it
        started, 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) without one
        (entrypoints/http_server.py 218, 721-799; managers/tokenizer_manager.py 2465-2479). For
        the same reason a late or non-200 answer to a check that an activation overlapped keeps
        that standing too. So a replica's heartbeats keep coming, ready, through an activation,
        and the router keeps the turns in flight on it (:meth:`router.registry.Registry.lost`)."""
        if self.engine is None:
            self.state.engine_ok = False
            return False
        if self._activation_lock.locked():
            return self.state.engine_ok
        epoch = self._epoch
        answer = await self.engine.probe(timeout=5.0)
        overlapped = epoch != self._epoch or self._activation_lock.locked()
        if answer == "ok" or answer == "unreachable" or not overlapped:
            self.state.engine_ok = answer == "ok"
        return self.state.engine_ok

    async def _engine_version(self) -> int | None:
        """The version the engine serves (None if it names none, a non-integer, or cannot say)."""
        assert self.engine is not None
        try:
            return await self.engine.weight_version(timeout=10.0)
        except EngineError:
            return None

    async def _engine_loop(self) -> None:
        """Engine health, load figures, version drift (engine restarted), heartbeats."""
        while True:
            try:
                await self._engine_tick()
                await self._heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("engine poll failed: %s", exc)
            await asyncio.sleep(self.config.heartbeat_s)

    async def _engine_tick(self) -> None:
        s = self.state
        if not await self.engine_health():
            return
        await self._read_engine_metrics()
        if self._activation_lock.locked() or not self._engine_known:
            return
        epoch = self._epoch
        version = await self._engine_version()
        if version != s.active_version and not self._activation_lock.locked() and epoch == self._epoch:
            # The engine was restarted or changed under us: believe the engine, reconcile.
            log.warning("engine reports version %s, expected %s", version, s.active_version)
            s.active_version = version
            if version is not None:
                self.metrics.active.set(version)
            self._work.set()

    async def _read_engine_metrics(self) -> None:
        text = await self.engine_metrics_text()
        if not text:
            return
        values = parse_prometheus(text)
        s = self.state
        s.running = values.get("sglang:num_running_reqs", 0.0)
        s.queued = values.get("sglang:num_queue_reqs", 0.0)
        if "sglang:gen_throughput" in values:
            s.tokens_per_s = values["sglang:gen_throughput"]
        else:
            total = values.get("sglang:generation_tokens_total")
            now = time.monotonic()
            if total is not None and self._last_tokens is not None:
                dt = now - self._last_tokens[0]
                if dt > 0:
                    s.tokens_per_s = max(0.0, (total - self._last_tokens[1]) / dt)
            if total is not None:
                self._last_tokens = (now, total)

    async def _heartbeat(self) -> None:
        if self._router is None:
            return
        try:
            await self._router.call("POST", "/v1/replicas/heartbeat", self.heartbeat_body())
        except RouterError as exc:
            if exc.status is None:
                log.debug("heartbeat failed: %s", exc)
            else:
                log.warning("heartbeat refused: %s", exc)

    async def engine_metrics_text(self) -> str:
        """The engine's Prometheus text; empty when it does not answer."""
        if self.engine is None:
            return ""
        try:
            return await self.engine.metrics()
        except EngineError:
            return ""

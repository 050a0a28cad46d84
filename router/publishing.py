"""The router's weight publisher: the store, the publish jobs and the converter behind the
admin weight routes (:mod:`router.routes_weights`).

Contracts:

- One job runs at a time across every router sharing the state store (its job lock,
  :meth:`~router.state.base.StateStore.acquire_job_lock`; :class:`JobRunning` for a second,
  whichever router it reaches); a job ends ``done`` with the publisher's result or ``failed`` with
  a message, never silently. Job views live in the state store, so any router answers for any
  job; the last ``MAX_JOBS_KEPT`` stay readable. The router running a job renews its lock every
  ``LOCK_RENEW_S`` seconds; a job whose router stopped (its lock lapsed ``LOCK_TTL_S`` after the
  last renewal, or another job holds it) reads ``failed``.
- A job converts the BF16 checkpoint once per format and publishes it
  (:mod:`weight_sync.publish`); every pointer move raises the router's latest published version
  (``ctx.publish_version``, which the routing policy uses for ``max_version_lag``) and wakes every
  known replica (the sidecar's ``POST /v1/wake``) so it reconciles at once instead of at its next
  poll.
- :meth:`PublishService.adopt_pointers` raises the latest version to the store's highest pointer
  (publishes that bypassed this router count too) and wakes the replicas when it moved; an
  unreadable store is logged, never raised.
- Pruning (:mod:`weight_sync.prune`, the rule :mod:`weight_sync.retention`): with
  ``keep_store_versions`` N every job first prunes the run's store to its newest N versions,
  under the job's lock (no other job publishes, rolls back or prunes meanwhile) and keeping, besides
  what retention always keeps, what the job itself reads (a rollback's target, a delta's base, a
  perturbation's source) and every version from the lowest one a live replica serves upward (a
  replica serves, stages or is about to stage only those: pointers never move backwards). A
  failed prune is a warning event of the job, never its failure. ``POST /v1/weights/prune``
  (:meth:`PublishService.prune`) runs the same prune as a job of its own, or only plans it.
- The service is configured by a :class:`router.config.WeightsConfig` (built by the command from
  its environment; the service reads none). A publication runs where the service's converter
  (:mod:`weight_sync.converters`) runs it: in this router's conversion pool
  (:class:`~weight_sync.converters.LocalConverter`, the default), or in the deployed Modal function
  the configuration names (``convert_function``,
  :class:`~weight_sync.converters.ModalFunctionConverter`), with the store then the Modal Volume
  ``volume`` mounted at ``store_root``. The converter's workers are started by
  :meth:`start` and stopped by :meth:`close`: after ``close`` no worker process and no semaphore
  of the pool is left. A perturbation always converts in this router (in its pool, or in this
  process when the converter is remote).

Refusals are errors that carry their data (:class:`StoreNotConfigured`, :class:`StoreUnreadable`,
:class:`JobRunning`, :class:`VersionTooOld`, :class:`NoBf16Copy`, and
:class:`~weight_sync.publish.VersionMissing` from the publisher); any other
:class:`~core.errors.UserError` is bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.engine import EngineError
from clients.sidecar import SidecarClient
from core.errors import UserError
from core.formats import FORMATS
from core.fs import make_dir
from router.config import WeightsConfig
from router.context import RouterContext
from router.state.base import StateError
from weight_sync.converters import (
    Converter,
    ConvertRequest,
    LocalConverter,
    open_converter,
)
from weight_sync.store.base import VersionStore
from weight_sync.types import FormatRef, VersionRef

log = logging.getLogger("mixfleet.router.publishing")
MAX_JOBS_KEPT = 50
SIDECAR_TIMEOUT_S = 1.0
LOCK_TTL_S = 30.0
LOCK_RENEW_S = 5.0
ORPHANED = "the router running this job stopped before it finished"


class StoreNotConfigured(UserError):
    """The router was started without a weight store."""

    def __init__(self) -> None:
        super().__init__(
            "weight publishing is not configured: the router has no store "
            "(start it with MIXFLEET_STORE set to the store's root)"
        )


class StoreUnreadable(UserError):
    """The store could not be read (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the weight store is unreadable: {reason}")
        self.reason = reason


class JobRunning(UserError):
    """A weight job is running (``running``: its ids)."""

    def __init__(self, running: list[str]) -> None:
        super().__init__(f"a weight job is already running ({', '.join(running)}); retry when it is done")
        self.running = running


class VersionTooOld(UserError):
    """``version`` is older than the run's current version (pointers never move backwards)."""

    def __init__(self, run_id: str, version: int, current: int) -> None:
        super().__init__(
            f"version {version} is older than run {run_id!r}'s current version {current} "
            "(pointers never move backwards; publish a newer number or roll back with a new one)"
        )
        self.run_id, self.version, self.current = run_id, version, current


class NoBf16Copy(UserError):
    """``version`` of ``run_id`` has no bf16 copy in the store to derive a perturbation from."""

    def __init__(self, run_id: str, version: int) -> None:
        super().__init__(
            f"version {version} of run {run_id!r} has no bf16 copy in the store to derive a perturbation from"
        )
        self.run_id, self.version = run_id, version


@dataclass
class Job:
    """One weight job; ``state`` is ``running`` until it ends ``done`` (``result``) or
    ``failed`` (``error``)."""

    job_id: str
    kind: str
    run_id: str
    version: int | None
    state: str = "running"
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: str | None = None

    def view(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "kind": self.kind,
            "run_id": self.run_id,
            "version": self.version,
            "state": self.state,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "events": list(self.events),
            "result": self.result,
            "error": self.error,
        }


def new_number(store: VersionStore, run_id: str, formats: list[str], version: int | None) -> int:
    """The number a publication takes (under the job lock): ``version``, default the next one;
    :class:`VersionTooOld` for one below the run's current version (pointers never move back),
    before anything is converted or linked."""
    from weight_sync.publish import latest_version, next_version

    number = version if version is not None else next_version(store, run_id, formats)
    current = latest_version(store, run_id, formats)
    if current is not None and number < current:
        raise VersionTooOld(run_id, number, current)
    return number


class PublishService:
    """Store access, jobs and the converter of one router (see the module docstring).

    ``config`` names the store, the default run and where conversions run; ``converter``
    defaults to :func:`weight_sync.converters.open_converter` of its ``convert_function`` and
    ``workers`` (conversion processes of a local converter; None:
    :meth:`~weight_sync.publish.ConversionPool.for_formats` of the fleet's formats; 0:
    conversions run in the router process, one format at a time).
    """

    def __init__(self, config: WeightsConfig, *, converter: Converter | None = None) -> None:
        self.config = config
        self.converter = converter or open_converter(config.convert_function, workers=config.workers)
        self.jobs: dict[str, Job] = {}  # the jobs this router runs now
        self._saving = asyncio.Lock()
        self._store = None
        self.tasks: set[asyncio.Task] = set()

    # configuration -------------------------------------------------------------------------
    @property
    def configured(self) -> bool:
        return self.config.store_root is not None

    @property
    def run_id(self) -> str:
        return self.config.run_id

    def own_run(self, run_id: str | None) -> str:
        """The run a job of this router publishes: its own (``run_id`` None or equal to it).
        Another run is a ``UserError`` naming both: no replica of this fleet would activate its
        versions, while the router would take them for its own latest."""
        if run_id is None or run_id == self.run_id:
            return self.run_id
        raise UserError(
            f"this router's fleet serves run {self.run_id!r}, not {run_id!r}: no replica would "
            f"activate a version of {run_id!r} (publish into its store with `mixfleet weights "
            "publish --store ROOT --run RUN` instead)"
        )

    def store(self):
        """The store (made on first call); :class:`StoreNotConfigured` without a root."""
        if self._store is None:
            root, volume = self.config.store_root, self.config.volume
            if root is None:
                raise StoreNotConfigured()
            from weight_sync.store import open_store

            if volume is None:
                try:
                    make_dir(Path(root), "store")
                except UserError as exc:
                    raise StoreUnreadable(str(exc)) from None
            self._store = open_store(Path(root), volume=volume)
        return self._store

    # converter ---------------------------------------------------------------------------------
    def start(self, formats: int) -> None:
        """Prepare the converter for publications of ``formats`` formats (a local converter
        starts its workers and loads the converter in them, in the background)."""
        self.converter.start(formats)

    def _local(self) -> LocalConverter:
        """The converter of work that runs in this router: the service's when it is local, else
        one converting in this process."""
        return self.converter if isinstance(self.converter, LocalConverter) else LocalConverter(workers=0)

    def close(self) -> None:
        """Stop the converter's workers and join them (no worker process or semaphore is left);
        a conversion still running (a job's or the warm-up's) is killed, which the publication
        protocol survives (no pointer names an incomplete version). Blocking; idempotent."""
        self.converter.close()

    # jobs --------------------------------------------------------------------------------------
    async def start_job(
        self, ctx: RouterContext, kind: str, run_id: str, decide: Callable[[], int], job_id: str | None = None
    ) -> Job:
        """A new running job (id ``job_id``, default a fresh one) holding the store's job lock, its
        view stored; :class:`JobRunning` while another job (of any router) holds the lock.

        ``decide`` runs once the lock is held and returns the job's version (or raises a
        ``UserError``, which frees the lock): no other job can commit a version between the
        choice of a number (the next one, by default) and this job's start, so two publishes
        without a version never pick the same number."""
        job = Job(job_id=job_id or uuid.uuid4().hex[:16], kind=kind, run_id=run_id, version=None)
        if not await ctx.store.acquire_job_lock(job.job_id, LOCK_TTL_S):
            holder = await ctx.store.job_lock_holder()
            if holder is not None or not await ctx.store.acquire_job_lock(job.job_id, LOCK_TTL_S):
                raise JobRunning([holder or "another router's"])
        job.started_at = time.time()  # a job starts once it holds the lock, after the last one ended
        try:
            job.version = decide()
            self.jobs[job.job_id] = job
            await self.save(ctx, job)
        except BaseException:  # no job started: the lock is freed whatever stopped it
            self.jobs.pop(job.job_id, None)
            with contextlib.suppress(StateError):
                await ctx.store.release_job_lock(job.job_id)
            raise
        return job

    async def finish_job(
        self, ctx: RouterContext, job: Job, result: dict[str, Any] | None, error: str | None
    ) -> None:
        """End ``job``: its final view is stored, then the lock is freed."""
        job.result, job.error = result, error
        job.state = "failed" if error else "done"
        job.finished_at = time.time()
        try:
            await self.save(ctx, job)
        finally:
            self.jobs.pop(job.job_id, None)
            with contextlib.suppress(StateError):
                await ctx.store.release_job_lock(job.job_id)

    async def save(self, ctx: RouterContext, job: Job) -> None:
        """Store the job's view as it is now (a save never overwrites a newer one with an older)."""
        async with self._saving:
            await ctx.store.put_job(job.job_id, job.view(), MAX_JOBS_KEPT)

    async def job_view(self, ctx: RouterContext, job_id: str) -> dict[str, Any] | None:
        """The stored view of any router's job (None: unknown or forgotten), as :func:`_as_held`
        reads it."""
        holder = await ctx.store.job_lock_holder()
        view = await ctx.store.get_job(job_id)
        return None if view is None else await _as_held(ctx, view, holder)

    def _run(
        self, ctx: RouterContext, job: Job, work: Callable[[], Any], *, needs: tuple[int, ...] = ()
    ) -> None:
        """Run ``work`` (a blocking publisher call) for ``job`` in a thread, from the event loop,
        after the job's prune (:meth:`_pruning`; ``needs``: the versions ``work`` reads)."""
        prune = self._pruning(ctx, job, needs)

        def pruned_then_work() -> Any:
            prune()
            return work()

        task = asyncio.get_running_loop().create_task(self._finish(ctx, job, pruned_then_work))
        self.tasks.add(task)  # keep a reference until done
        task.add_done_callback(self.tasks.discard)

    async def _finish(self, ctx: RouterContext, job: Job, work: Callable[[], Any]) -> None:
        runner = asyncio.ensure_future(asyncio.to_thread(work))
        while not (await asyncio.wait({runner}, timeout=LOCK_RENEW_S))[0]:
            try:  # still running: keep the lock, and the stored view current
                if not await ctx.store.acquire_job_lock(job.job_id, LOCK_TTL_S):
                    job.events.append({"kind": "warning", "message": "lost the job lock", "t": time.time()})
                await self.save(ctx, job)
            except StateError as exc:
                log.warning("cannot renew weight job %s in the state store: %s", job.job_id, exc)
        try:
            result = runner.result()
        except UserError as exc:
            await self.finish_job(ctx, job, None, str(exc))
            return
        except Exception as exc:  # a bug must still end the job with a message
            await self.finish_job(ctx, job, None, f"{type(exc).__name__}: {exc}")
            return
        if not isinstance(result, dict):  # a rollback's PublishResult
            result = result.to_dict()
        if job.kind == "prune":
            await self.finish_job(ctx, job, result, None)
            return
        try:
            await ctx.publish_version(result["version"])
        except Exception as exc:
            job.events.append({"kind": "warning", "message": f"could not record latest version: {exc}"})
        job.version = result["version"]
        await self.finish_job(ctx, job, result, None)
        await wake_replicas(ctx)

    def _events(self, ctx: RouterContext, job: Job) -> Callable[[str, dict[str, Any]], None]:
        """The publisher's progress callback (it runs in the publisher's thread; made on the event
        loop's): record the event; when a pointer moved, raise the latest version and wake the
        replicas at once."""
        loop = asyncio.get_running_loop()

        async def advanced(version: int) -> None:
            with contextlib.suppress(Exception):
                await ctx.publish_version(version)
            await wake_replicas(ctx)

        async def saved() -> None:
            with contextlib.suppress(StateError):
                await self.save(ctx, job)

        def on_event(kind: str, info: dict[str, Any]) -> None:
            job.events.append({"kind": kind, **info, "t": time.time()})
            asyncio.run_coroutine_threadsafe(saved(), loop)
            if kind == "advanced" and job.version is not None:
                asyncio.run_coroutine_threadsafe(advanced(job.version), loop)

        return on_event

    # pruning -------------------------------------------------------------------------------------
    def _pruning(self, ctx: RouterContext, job: Job, needs: tuple[int, ...]) -> Callable[[], None]:
        """The prune ``job`` runs first in its thread (see the module docstring): nothing without
        ``keep_store_versions``. The live replicas' versions are read now, on the event loop."""
        keep = self.config.keep_store_versions
        if keep is None or job.kind == "prune":
            return lambda: None
        floor = serving_floor(ctx)
        store, run_id = self.store(), job.run_id

        def prune() -> None:
            from weight_sync.prune import apply_prune, plan_prune

            try:
                plan = plan_prune(store, run_id, keep, protect=needs, serving_from=floor)
                apply_prune(store, plan)
            except Exception as exc:  # the job's own work still runs; the next job prunes again
                log.warning("pruning run %s's store failed: %s", run_id, exc)
                job.events.append({"kind": "warning", "message": f"pruning the store failed: {exc}"})
                return
            if plan.delete:
                log.info("pruned run %s: %s (%d bytes)", run_id, plan.delete, plan.bytes_freed)
                job.events.append({"kind": "pruned", **plan.to_dict(), "t": time.time()})

        return prune

    async def prune(
        self, ctx: RouterContext, keep: int, *, run_id: str | None, dry_run: bool
    ) -> dict[str, Any]:
        """Prune the run's store to its newest ``keep`` versions (see the module docstring): with
        ``dry_run`` the plan (what would be deleted, the bytes it would free), read now; else a
        ``prune`` job (its result the plan it carried out) under the job lock, as a view.
        ``UserError`` for ``keep`` below 1; :class:`JobRunning` while another job runs."""
        from weight_sync.prune import apply_prune, check_keep, plan_prune
        from weight_sync.publish import latest_version

        check_keep(keep)
        store = self.store()
        await self.synced(ctx)
        run_id = self.own_run(run_id)
        floor = serving_floor(ctx)
        if dry_run:
            plan = await asyncio.to_thread(plan_prune, store, run_id, keep, serving_from=floor)
            return {**plan.to_dict(), "dry_run": True}
        formats = list(ctx.config.fleet.formats)
        job = await self.start_job(ctx, "prune", run_id, lambda: latest_version(store, run_id, formats) or 0)

        def work() -> dict[str, Any]:
            plan = plan_prune(store, run_id, keep, serving_from=floor)
            apply_prune(store, plan)
            return {**plan.to_dict(), "dry_run": False, "version": job.version}

        self._run(ctx, job, work)
        return job.view()

    # the three kinds of job ---------------------------------------------------------------------
    async def publish(
        self,
        ctx: RouterContext,
        checkpoint: Path,
        *,
        version: int | None,
        run_id: str | None,
        mode: str,
        formats: list[str] | None,
        delta_of: int | None,
        job_id: str | None = None,
    ) -> Job:
        """Start converting the BF16 checkpoint directory ``checkpoint`` once per format (default:
        the fleet's) and publishing it as ``version`` (default: the next one, chosen under the job
        lock); with ``delta_of`` B the directory holds only the tensors changed since B and every
        format is published as a delta over B. Raises before any job starts for bad input: a
        relative path, a path that does not exist or is not a directory, a full checkpoint
        without ``config.json``, no shard, a format no group serves, a version older than the
        pointers, a missing base."""
        from weight_sync.publish import (
            check_checkpoint,
            check_delta_base,
            check_formats,
        )

        store = self.store()
        await self.synced(ctx)
        run_id = self.own_run(run_id)
        if not checkpoint.is_absolute():
            raise UserError(f"checkpoint must be an absolute path on the router's filesystem: {checkpoint}")
        check_checkpoint(checkpoint, delta=delta_of is not None, where=" on the router's filesystem")
        served = list(ctx.config.fleet.formats)
        formats = check_formats(formats or served)
        unserved = [f for f in formats if f not in served]
        if unserved:
            raise UserError(
                f"no group of this fleet serves {', '.join(unserved)} (it serves {', '.join(served)}): "
                "its version would be the fleet's latest while no replica can activate it"
            )

        def decide() -> int:
            number = new_number(store, run_id, formats, version)
            if delta_of is not None:
                check_delta_base(store, run_id, number, delta_of, formats)
            return number

        job = await self.start_job(ctx, "publish", run_id, decide, job_id)
        request = ConvertRequest(run_id, job.version, str(checkpoint), tuple(formats), mode, delta_of)
        on_event = self._events(ctx, job)
        needs = () if delta_of is None else (delta_of,)
        self._run(ctx, job, lambda: self.converter.publish(store, request, on_event), needs=needs)
        return job

    async def rollback(
        self,
        ctx: RouterContext,
        to: int,
        *,
        run_id: str | None,
        version: int | None,
        job_id: str | None = None,
    ) -> Job:
        """Start publishing a new version (default: the next one, chosen under the job lock) whose
        content is ``to``'s; :class:`~weight_sync.publish.VersionMissing` at once when some format has
        no version ``to``."""
        from weight_sync.publish import check_rollback_target
        from weight_sync.publish import rollback as do_rollback

        store = self.store()
        await self.synced(ctx)
        run_id = self.own_run(run_id)
        formats = list(ctx.config.fleet.formats)
        check_rollback_target(store, run_id, to, formats)

        job = await self.start_job(
            ctx, "rollback", run_id, lambda: new_number(store, run_id, formats, version), job_id
        )
        on_event = self._events(ctx, job)
        new = job.version
        self._run(
            ctx,
            job,
            lambda: do_rollback(store, run_id, to, formats, version=new, on_event=on_event),
            needs=(to,),
        )
        return job

    async def perturb(
        self,
        ctx: RouterContext,
        from_version: int,
        swap_rows: tuple[int, int],
        *,
        run_id: str | None,
        job_id: str | None = None,
    ) -> Job:
        """Start publishing ``from_version`` with two output-projection rows swapped as the next
        version; :class:`NoBf16Copy` when the store has no bf16 copy of it, ``UserError`` when
        ``swap_rows`` are not two different rows of its output projection (both before any job)."""
        from weight_sync.delta import link_version, scratch_dir, version_shards
        from weight_sync.perturb import check_swap_rows, swap_output_rows
        from weight_sync.publish import next_version

        store = self.store()
        await self.synced(ctx)
        run_id = self.own_run(run_id)
        formats = list(ctx.config.fleet.formats)
        if "bf16" not in store_formats(store, run_id, from_version):
            raise NoBf16Copy(run_id, from_version)
        t, s = swap_rows
        source = VersionRef(run_id, "bf16", from_version)  # a delta's content is its layers'
        await asyncio.to_thread(lambda: check_swap_rows(version_shards(store, source), t, s))
        job = await self.start_job(
            ctx, "perturbation", run_id, lambda: next_version(store, run_id, formats), job_id
        )
        version = job.version
        on_event = self._events(ctx, job)

        def work():
            tmp = scratch_dir(store)  # on the store's own disk: the version's files link into it
            try:
                link_version(store, source, tmp / "source")
                swap_output_rows(tmp / "source", tmp / "swapped", t, s)
                request = ConvertRequest(run_id, version, str(tmp / "swapped"), tuple(formats))
                return self._local().publish(store, request, on_event)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        self._run(ctx, job, work, needs=(from_version,))
        return job

    # the latest version ---------------------------------------------------------------------------
    async def sync_latest(self, ctx: RouterContext) -> int | None:
        """Raise the router's latest published version to the store's highest pointer; return it."""
        from weight_sync.publish import latest_version

        store = self.store()
        formats = list(ctx.config.fleet.formats)
        latest = await asyncio.to_thread(latest_version, store, self.run_id, formats)
        if latest is not None:
            await ctx.publish_version(latest)
        return latest

    async def synced(self, ctx: RouterContext) -> None:
        """:meth:`sync_latest` before a job or a status; an unreadable pointer is logged (it must
        not hide the rest), :class:`StoreNotConfigured` is raised."""
        self.store()
        try:
            await self.sync_latest(ctx)
        except Exception as exc:
            log.warning("cannot read the store's pointers: %s", exc)

    async def adopt_pointers(self, ctx: RouterContext) -> None:
        """Raise the latest version to the store's newest pointer; wake the replicas if it moved.
        An unreadable store is logged, never raised (the router serves without it)."""
        before = ctx.latest_version()
        try:
            latest = await self.sync_latest(ctx)
        except Exception as exc:
            log.warning("cannot read the store's pointers: %s", exc)
            return
        if latest is not None and before is not None and latest > before:
            await wake_replicas(ctx)

    # status -----------------------------------------------------------------------------------------
    async def status(self, ctx: RouterContext) -> dict[str, Any]:
        """Per format: pointer, versions, manifest; per group: desired version, every replica's
        active version, lag and last activation; the last ten jobs (without events); the router's
        ``max_version_lag`` (None: replicas receive turns however far they lag)."""
        store = self.store()
        await self.synced(ctx)
        run_id = self.run_id
        fleet = ctx.config.fleet
        latest = ctx.latest_version()
        try:
            fmt_view = await asyncio.to_thread(formats_view, store, run_id, list(fleet.formats))
        except UserError as exc:
            raise StoreUnreadable(str(exc)) from None
        replicas = known_replicas(ctx)
        details = await replica_details(ctx, [(r["replica_id"], r["url"]) for r in replicas])
        groups = []
        for g in fleet.groups:
            reps = []
            for r in sorted(replicas, key=lambda x: x["replica_id"]):
                if r["group"] != g.name:
                    continue
                active = r["active_version"]
                d = details.get(r["replica_id"]) or {}
                if d.get("replica_id") not in (None, r["replica_id"]):
                    d = {}  # an unpinned shared URL: the answer was another container's
                last = d.get("last_activation") or {}
                reps.append(
                    {
                        "replica_id": r["replica_id"],
                        "url": r["url"],
                        "ready": r["ready"],
                        "fresh": r["fresh"],
                        "active_version": active,
                        "lag": None if latest is None or active is None else latest - active,
                        "error": r["error"],
                        "staging": d.get("staging"),
                        "last_activation_at": last.get("at"),
                        "last_activation": last or None,
                    }
                )
            lags = [r["lag"] for r in reps if r["lag"] is not None]
            groups.append(
                {
                    "group": g.name,
                    "format": g.weight_format,
                    "desired_version": fmt_view[g.weight_format]["pointer"],
                    "lag": max(lags) if lags else None,
                    "replicas": reps,
                }
            )
        holder = await ctx.store.job_lock_holder()
        jobs = [await _as_held(ctx, j, holder) for j in await ctx.store.list_jobs(10)]
        for j in jobs:
            j.pop("events", None)
        return {
            "run_id": run_id,
            "latest_version": latest,
            "max_version_lag": ctx.config.max_version_lag,
            "formats": fmt_view,
            "groups": groups,
            "jobs": jobs,
        }


async def _as_held(ctx: RouterContext, view: dict[str, Any], holder: str | None) -> dict[str, Any]:
    """A stored job's view as it reads: a running job that held the store's job lock neither when
    ``holder`` was read (before the view) nor now (read again after it) reads ``failed``, its
    router having stopped. Reading the lock on both sides of the view keeps a job that ended or
    started between the reads from reading ``failed``: a job stores its final view before it frees
    the lock (:meth:`PublishService.finish_job`), and takes the lock before it stores its first
    (:meth:`PublishService.start_job`)."""
    if view["state"] != "running" or view["job_id"] == holder:
        return view
    if view["job_id"] == await ctx.store.job_lock_holder():
        return view
    return {**view, "state": "failed", "error": ORPHANED}


def known_replicas(ctx: RouterContext) -> list[dict[str, Any]]:
    """Every replica the router knows (heartbeats and static), ``fresh`` = ready and recent."""
    now = time.monotonic()
    return [
        {
            "replica_id": r.replica_id,
            "group": r.group,
            "url": r.url,
            "ready": r.ready,
            "active_version": r.active_version,
            "error": r.error,
            "fresh": ctx.registry.fresh(r, now),
        }
        for r in ctx.registry.replicas.values()
    ]


def serving_floor(ctx: RouterContext) -> int | None:
    """The lowest version a live (fresh) replica serves, or None when none reports one: every
    version from it upward may be served, staged or about to be staged by some replica (a replica
    only moves to its format's pointer, and pointers never move backwards)."""
    actives = [
        r["active_version"] for r in known_replicas(ctx) if r["fresh"] and r["active_version"] is not None
    ]
    return min(actives) if actives else None


def store_formats(store, run_id: str, version: int) -> list[str]:
    """The formats in which ``version`` of ``run_id`` is committed."""
    return [f for f in FORMATS if version in store.versions(FormatRef(run_id, f))]


def formats_view(store, run_id: str, formats: list[str]) -> dict[str, Any]:
    """Per format: its pointer, committed versions and the pointer's manifest summary."""
    out = {}
    for f in formats:
        ptr = store.read_pointer(FormatRef(run_id, f))
        manifest = None
        if ptr is not None:
            m = store.read_manifest(VersionRef(run_id, f, ptr))
            manifest = {
                "version": m.version,
                "format": m.format,
                "kind": m.kind,
                "base_version": m.base_version,
                "source_checksum": m.source_checksum,
                "tensor_count": m.tensor_count,
                "total_bytes": m.total_bytes,
                "files": len(m.files),
            }
        out[f] = {"pointer": ptr, "versions": store.versions(FormatRef(run_id, f)), "manifest": manifest}
    return out


async def replica_details(ctx: RouterContext, replicas: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """The ``GET /v1/status`` (last activation, staging; its ``replica_id``) of each ``(replica_id,
    url)``'s sidecar, by replica id, each asked through its own container's pin
    (:meth:`RouterContext.replica_client`); a replica that does not answer it (a plain engine) is
    missing."""

    async def one(replica_id: str, url: str) -> dict[str, Any] | None:
        try:
            return await SidecarClient(ctx.replica_client(replica_id, url)).status(SIDECAR_TIMEOUT_S)
        except EngineError:
            return None

    answers = await asyncio.gather(*(one(rid, url) for rid, url in replicas))
    return {rid: a for (rid, _), a in zip(replicas, answers, strict=True) if a is not None}


async def wake_replicas(ctx: RouterContext) -> None:
    """``POST /v1/wake`` to every known replica (best effort: failures are ignored), each through
    its own container's pin (:meth:`RouterContext.replica_client`), so every container of a Modal
    server is woken, not only the one its shared URL reaches."""
    replicas = [(r["replica_id"], r["url"]) for r in known_replicas(ctx)]
    await asyncio.gather(
        *(SidecarClient(ctx.replica_client(rid, url)).wake(SIDECAR_TIMEOUT_S) for rid, url in replicas),
        return_exceptions=True,
    )


__all__ = [
    "Job",
    "JobRunning",
    "NoBf16Copy",
    "PublishService",
    "StoreNotConfigured",
    "StoreUnreadable",
    "VersionTooOld",
]

"""The router's admin weight routes (``/v1/weights``) and fixed-prefix scoring (``/v1/score``).

Routes (Bearer key; ``admin`` scope for weights, ``trainer`` or ``admin`` for scoring):

- ``POST /v1/weights`` ``{checkpoint, version?, run_id?, mode?, formats?, delta_of?}`` -> 202 job:
  converts the BF16 checkpoint (a directory on this router's filesystem, e.g. already on the
  store's volume) once per format the fleet serves and publishes it (:mod:`weight_sync.publish`).
  With ``delta_of`` B the directory holds only the tensors changed since B, and every format is
  published as a delta over B (:mod:`weight_sync.delta`).
- ``POST /v1/weights/rollback`` ``{to, run_id?}`` -> 202 job: a new version with ``to``'s content.
- ``POST /v1/weights/perturbations`` ``{from_version, swap_rows: [t, s]}`` -> 202 job: publishes
  ``from_version`` with two output-projection rows swapped (``mixfleet weights verify``).
- ``GET /v1/weights/jobs/{id}``: a job's state (``running`` | ``done`` | ``failed``), events,
  result or error.
- ``GET /v1/weights``: per format the pointer, versions and manifest; per group the desired
  version, every replica's active version, lag and last activation.
- ``POST /v1/score`` ``{input_ids: [[...]], logprob_start_len, groups?}``: every ready replica
  of every (chosen) group scores the sequences (SGLang ``max_new_tokens: 0``); returns the
  input-token log-probs and the weight version that scored them.

After a publish job succeeds the router's latest published version is raised to it (state
``set_latest_version``, which the routing policy uses for ``max_version_lag``) and every
known replica is woken (``POST {replica}/v1/wake``) so it reconciles at once instead of at its
next poll. One job runs at a time; a second gets 409.

The router also knows the latest version without any weights call: when it starts (before it
serves its first request) it adopts the store's highest pointer, and while it runs it re-reads
the pointers every ``pointer_poll_s`` seconds (publishes that bypassed this router, such as a
trainer committing to the store directly, count too); a pointer that moved wakes the replicas.
So ``/v1/groups`` lag, the lag metrics and ``max_version_lag`` are right from the start.

The store root and run id come from :func:`create_weights_router`'s arguments, else from
``MIXFLEET_STORE`` / ``MIXFLEET_RUN`` (run default ``default``); conversion processes from its
``workers`` argument, else ``MIXFLEET_PUBLISH_WORKERS``. The router context
(``request.app.state.ctx``) supplies ``config.fleet`` (formats, groups) and ``state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from router.auth import require
from weight_sync.errors import UserError
from weight_sync.publish import ConversionPool

log = logging.getLogger("mixfleet.router.weights")
MAX_JOBS_KEPT = 50


class PublishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        min_length=1, description="HF BF16 checkpoint directory on the router's filesystem"
    )
    version: int | None = Field(default=None, ge=0, description="version number (default: the next one)")
    run_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    mode: Literal["barrier", "per_format"] = "barrier"
    formats: list[Literal["bf16", "fp8", "nvfp4", "mxfp4"]] | None = Field(default=None, min_length=1)
    delta_of: int | None = Field(
        default=None,
        ge=0,
        description="the checkpoint holds only the BF16 tensors changed since this version; "
        "each format is published as a delta over it",
    )


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: int = Field(ge=0, description="the version whose content to publish again")
    run_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    version: int | None = Field(default=None, ge=0)


class PerturbRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    from_version: int = Field(ge=0)
    swap_rows: list[int] = Field(
        min_length=2, max_length=2, description="two token ids whose lm_head rows swap"
    )
    run_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[list[int]] = Field(min_length=1, max_length=256)
    logprob_start_len: int = Field(default=0, ge=0)
    groups: list[str] | None = None


@dataclass
class Job:
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


class WeightsService:
    """Jobs and store access behind the routes; one job at a time."""

    def __init__(self, store_root: Path | None, run_id: str | None, workers: int | None = None) -> None:
        self._store_root = store_root
        self._run_id = run_id
        self.workers = workers
        self.jobs: dict[str, Job] = {}
        self._busy = threading.Lock()
        self._store = None
        self.tasks: set[asyncio.Task] = set()
        self.pool: ConversionPool | None = None
        self._pool_lock = threading.Lock()

    @property
    def configured(self) -> bool:
        return self._store_root is not None or bool(os.environ.get("MIXFLEET_STORE"))

    def start_pool(self, formats: int, *, warm: bool = True) -> ConversionPool | None:
        """The conversion pool, made on first call (``warm``: its workers start and load the
        converter in the background): ``workers`` processes when given, else
        :meth:`ConversionPool.for_formats` of the fleet's ``formats``. ``None`` when ``workers``
        is 0 (conversions run in the router process)."""
        if self.workers == 0:
            return None
        with self._pool_lock:
            if self.pool is None:
                self.pool = (
                    ConversionPool(self.workers)
                    if self.workers is not None
                    else ConversionPool.for_formats(formats)
                )
                if warm:
                    threading.Thread(target=self._warm, name="conversion-warmup", daemon=True).start()
            return self.pool

    def _warm(self) -> None:
        with contextlib.suppress(Exception):
            assert self.pool is not None
            self.pool.warm()

    def publish_kwargs(self, formats: int) -> dict[str, Any]:
        pool = self.start_pool(formats, warm=False)  # the publish starts the workers itself
        return {"conversion_pool": pool} if pool is not None else {"workers": 0}

    @property
    def run_id(self) -> str:
        return self._run_id or os.environ.get("MIXFLEET_RUN") or "default"

    def store(self):
        if self._store is None:
            root = self._store_root or (
                Path(os.environ["MIXFLEET_STORE"]) if os.environ.get("MIXFLEET_STORE") else None
            )
            if root is None:
                raise HTTPException(
                    503,
                    "weight publishing is not configured: the router has no store "
                    "(start it with a store root or set MIXFLEET_STORE)",
                )
            from weight_sync.store.local import LocalStore

            root.mkdir(parents=True, exist_ok=True)
            self._store = LocalStore(root)
        return self._store

    def start_job(self, kind: str, run_id: str, version: int | None) -> Job:
        if not self._busy.acquire(blocking=False):
            running = [j.job_id for j in self.jobs.values() if j.state == "running"]
            raise HTTPException(
                409, f"a weight job is already running ({', '.join(running)}); retry when it is done"
            )
        job = Job(job_id=uuid.uuid4().hex[:16], kind=kind, run_id=run_id, version=version)
        self.jobs[job.job_id] = job
        for old in list(itertools.islice(self.jobs, max(0, len(self.jobs) - MAX_JOBS_KEPT))):
            if self.jobs[old].state != "running":
                del self.jobs[old]
        return job

    def finish_job(self, job: Job, result: dict[str, Any] | None, error: str | None) -> None:
        job.result, job.error = result, error
        job.state = "failed" if error else "done"
        job.finished_at = time.time()
        self._busy.release()


def _ctx(request: Request):
    return request.app.state.ctx


def _fleet_formats(request: Request) -> list[str]:
    return list(_ctx(request).config.fleet.formats)


async def sync_latest_version(app, service: WeightsService) -> int | None:
    """Raise the router's latest published version to the store's highest pointer."""
    store = service.store()
    formats = list(app.state.ctx.config.fleet.formats)
    from weight_sync.publish import latest_version

    latest = await asyncio.to_thread(latest_version, store, service.run_id, formats)
    if latest is not None:
        await _record_latest(app.state.ctx, latest)
    return latest


async def _record_latest(ctx, version: int) -> None:
    if hasattr(ctx, "publish_version"):
        await ctx.publish_version(version)
    else:
        await ctx.state.set_latest_version(version)


async def _adopt_pointers(app, service: WeightsService) -> None:
    """Raise the latest version to the store's newest pointer; wake the replicas if it moved.
    An unreadable store is logged, never raised (the router serves without it)."""
    before = app.state.ctx.latest_version()
    try:
        latest = await sync_latest_version(app, service)
    except Exception as exc:
        log.warning("cannot read the store's pointers: %s", getattr(exc, "detail", exc))
        return
    if latest is not None and before is not None and latest > before:
        await _wake_replicas(app.state.ctx)


def _pointer_lifespan(service: WeightsService, poll_s: float):
    """The weights routes' lifespan (merged into the app's, after the router context started)."""

    @contextlib.asynccontextmanager
    async def lifespan(app) -> Any:
        if not service.configured:
            yield
            return
        # conversion workers start now, so that the first publish does not pay their start-up
        service.start_pool(len(app.state.ctx.config.fleet.formats))
        await _adopt_pointers(app, service)

        async def watch() -> None:
            while True:
                await asyncio.sleep(poll_s)
                await _adopt_pointers(app, service)

        task = asyncio.create_task(watch(), name="weights-pointer-watch")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return lifespan


def _replicas(ctx) -> list[dict[str, Any]]:
    """Every replica the router knows (heartbeats and static), with ``fresh`` = ready and recent."""
    now = time.monotonic()
    out = []
    for r in ctx.registry.replicas.values():
        out.append(
            {
                "replica_id": r.replica_id,
                "group": r.group,
                "url": r.url,
                "ready": r.ready,
                "active_version": r.active_version,
                "error": r.error,
                "fresh": ctx.registry.fresh(r, now),
            }
        )
    return out


def create_weights_router(
    store_root: str | Path | None = None,
    run_id: str | None = None,
    *,
    workers: int | None = None,
    pointer_poll_s: float = 2.0,
) -> APIRouter:
    """The APIRouter to include in the router app (see the module docstring).

    ``workers``: conversion processes kept by the router (default ``MIXFLEET_PUBLISH_WORKERS``,
    else one per core and at least one per format the fleet serves); ``0`` converts inside the
    router process, one format at a time.
    ``pointer_poll_s``: how often the store's pointers are re-read while the router runs.
    """
    if workers is None and os.environ.get("MIXFLEET_PUBLISH_WORKERS", "").strip():
        try:
            workers = max(0, int(os.environ["MIXFLEET_PUBLISH_WORKERS"]))
        except ValueError:
            raise UserError(
                f"MIXFLEET_PUBLISH_WORKERS must be an integer, got {os.environ['MIXFLEET_PUBLISH_WORKERS']!r}"
            ) from None
    service = WeightsService(Path(store_root) if store_root else None, run_id, workers)
    router = APIRouter(tags=["weights"], lifespan=_pointer_lifespan(service, pointer_poll_s))
    admin = [Depends(require("admin"))]

    async def ensure_synced(request: Request) -> None:
        """Adopt the store's newest pointer (publishes that bypassed this router count too)."""
        try:
            await sync_latest_version(request.app, service)
        except HTTPException:
            raise
        except Exception as exc:  # an unreadable pointer must not hide the rest of the status
            log.warning("cannot read the store's pointers: %s", exc)

    async def finish(request: Request, job: Job, work) -> None:
        try:
            result = await asyncio.to_thread(work)
        except UserError as exc:
            service.finish_job(job, None, str(exc))
            return
        except Exception as exc:  # a bug must still end the job with a message
            service.finish_job(job, None, f"{type(exc).__name__}: {exc}")
            return
        try:
            await _record_latest(_ctx(request), result.version)
        except Exception as exc:
            job.events.append({"kind": "warning", "message": f"could not record latest version: {exc}"})
        job.version = result.version
        service.finish_job(job, result.to_dict(), None)
        await _wake_replicas(_ctx(request))

    def events_for(request: Request, job: Job):
        """The publisher's progress callback (runs in its thread): record the event; when a
        pointer moved, raise the router's latest version and wake the replicas at once."""
        loop = asyncio.get_running_loop()

        async def advanced(version: int) -> None:
            with contextlib.suppress(Exception):
                await _record_latest(_ctx(request), version)
            await _wake_replicas(_ctx(request))

        def on_event(kind: str, info: dict[str, Any]) -> None:
            job.events.append({"kind": kind, **info, "t": time.time()})
            if kind == "advanced" and job.version is not None:
                asyncio.run_coroutine_threadsafe(advanced(job.version), loop)

        return on_event

    def spawn(request: Request, job: Job, work) -> None:
        task = asyncio.get_running_loop().create_task(finish(request, job, work))
        service.tasks.add(task)  # keep a reference until done
        task.add_done_callback(service.tasks.discard)

    @router.post("/v1/weights", status_code=202, dependencies=admin)
    async def publish(body: PublishRequest, request: Request) -> dict[str, Any]:
        """Convert a BF16 checkpoint once per format and publish it (a job; poll its id)."""
        from weight_sync.publish import (
            check_delta_base,
            check_formats,
            latest_version,
            next_version,
            publish_checkpoint,
            publish_delta,
        )

        store = service.store()
        await ensure_synced(request)
        run_id = body.run_id or service.run_id
        ckpt = Path(body.checkpoint)
        if not ckpt.is_absolute():
            raise HTTPException(
                400, f"checkpoint must be an absolute path on the router's filesystem: {ckpt}"
            )
        if not ckpt.is_dir():
            raise HTTPException(400, f"checkpoint directory {ckpt} does not exist on the router's filesystem")
        try:
            formats = check_formats(body.formats or _fleet_formats(request))
        except UserError as exc:
            raise HTTPException(400, str(exc)) from None
        version = body.version if body.version is not None else next_version(store, run_id, formats)
        current = latest_version(store, run_id, formats)
        if current is not None and version < current:
            raise HTTPException(
                409,
                f"version {version} is older than run {run_id!r}'s current version {current} "
                "(pointers never move backwards; publish a newer number or roll back with a new one)",
            )
        if body.delta_of is not None:
            try:
                check_delta_base(store, run_id, version, body.delta_of, formats)
            except UserError as exc:
                raise HTTPException(400, str(exc)) from None
        job = service.start_job("publish", run_id, version)

        on_event = events_for(request, job)  # made here, on the event loop's thread
        kwargs = {"mode": body.mode, **service.publish_kwargs(len(formats)), "on_event": on_event}

        def work():
            if body.delta_of is not None:
                return publish_delta(store, run_id, version, ckpt, body.delta_of, formats, **kwargs)
            return publish_checkpoint(store, run_id, version, ckpt, formats, **kwargs)

        spawn(request, job, work)
        return job.view()

    @router.post("/v1/weights/rollback", status_code=202, dependencies=admin)
    async def rollback(body: RollbackRequest, request: Request) -> dict[str, Any]:
        """Publish a new version whose content is ``to``'s (pointers never move backwards)."""
        from weight_sync.publish import next_version
        from weight_sync.publish import rollback as do_rollback

        store = service.store()
        await ensure_synced(request)
        run_id = body.run_id or service.run_id
        formats = _fleet_formats(request)
        version = body.version if body.version is not None else next_version(store, run_id, formats)
        job = service.start_job("rollback", run_id, version)

        on_event = events_for(request, job)  # made here, on the event loop's thread

        def work():
            return do_rollback(
                store,
                run_id,
                body.to,
                formats,
                version=version,
                on_event=on_event,
            )

        spawn(request, job, work)
        return job.view()

    @router.post("/v1/weights/perturbations", status_code=202, dependencies=admin)
    async def perturb(body: PerturbRequest, request: Request) -> dict[str, Any]:
        """Publish ``from_version`` with two output-projection rows swapped (for verify)."""
        from weight_sync.publish import next_version, publish_checkpoint

        store = service.store()
        await ensure_synced(request)
        run_id = body.run_id or service.run_id
        formats = _fleet_formats(request)
        if "bf16" not in store_formats(store, run_id, body.from_version):
            raise HTTPException(
                409,
                f"version {body.from_version} of run {run_id!r} has no bf16 copy in the "
                "store to derive a perturbation from",
            )
        version = next_version(store, run_id, formats)
        job = service.start_job("perturbation", run_id, version)
        t, s = body.swap_rows

        on_event = events_for(request, job)  # made here, on the event loop's thread

        def work():
            src = Path(store.version_dir(run_id, "bf16", body.from_version))
            tmp = Path(
                tempfile.mkdtemp(prefix=".perturb-", dir=store.root if hasattr(store, "root") else None)
            )
            try:
                from weight_sync.perturb import swap_output_rows

                swap_output_rows(src, tmp, t, s)
                return publish_checkpoint(
                    store,
                    run_id,
                    version,
                    tmp,
                    formats,
                    **service.publish_kwargs(len(formats)),
                    on_event=on_event,
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        spawn(request, job, work)
        return job.view()

    @router.get("/v1/weights/jobs/{job_id}", dependencies=admin)
    async def job_status(job_id: str) -> dict[str, Any]:
        job = service.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no weight job {job_id!r}")
        return job.view()

    @router.get("/v1/weights", dependencies=admin)
    async def status(request: Request) -> dict[str, Any]:
        """Per format: pointer, versions, manifest; per group: desired, replicas' versions, lag."""
        store = service.store()
        await ensure_synced(request)
        ctx = _ctx(request)
        run_id = service.run_id
        fleet = ctx.config.fleet
        formats = list(fleet.formats)
        latest = ctx.latest_version()
        try:
            fmt_view = await asyncio.to_thread(_formats_view, store, run_id, formats)
        except UserError as exc:
            raise HTTPException(503, f"the weight store is unreadable: {exc}") from None
        replicas = _replicas(ctx)
        details = await _replica_details([r["url"] for r in replicas])
        groups = []
        for g in fleet.groups:
            desired = fmt_view[g.weight_format]["pointer"]
            reps = []
            for r in sorted(replicas, key=lambda x: x["replica_id"]):
                if r["group"] != g.name:
                    continue
                active = r["active_version"]
                d = details.get(r["url"]) or {}
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
                    "desired_version": desired,
                    "lag": max(lags) if lags else None,
                    "replicas": reps,
                }
            )
        jobs = [j.view() for j in list(service.jobs.values())[-10:]]
        for j in jobs:
            j.pop("events", None)
        return {
            "run_id": run_id,
            "latest_version": latest,
            "formats": fmt_view,
            "groups": groups,
            "jobs": jobs,
        }

    @router.post("/v1/score", dependencies=[Depends(require("trainer", "admin"))])
    async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
        """Score fixed sequences on every ready replica of every (chosen) group."""
        ctx = _ctx(request)
        names = [g.name for g in ctx.config.fleet.groups]
        chosen = body.groups or names
        unknown = sorted(set(chosen) - set(names))
        if unknown:
            raise HTTPException(400, f"groups: unknown group(s) {', '.join(unknown)}")
        for i, seq in enumerate(body.input_ids):
            if len(seq) <= body.logprob_start_len:
                raise HTTPException(
                    400,
                    f"input_ids[{i}]: {len(seq)} tokens, not more than logprob_start_len "
                    f"{body.logprob_start_len}",
                )
            if any(t < 0 for t in seq):
                raise HTTPException(400, f"input_ids[{i}]: token ids must be non-negative")
        fmt = {g.name: g.weight_format for g in ctx.config.fleet.groups}
        targets = [r for r in _replicas(ctx) if r["group"] in chosen and r["fresh"]]
        if not targets:
            raise HTTPException(503, "no ready replica in the chosen groups")
        payload = {
            "input_ids": body.input_ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": body.logprob_start_len,
        }
        async with httpx.AsyncClient(timeout=120.0, trust_env=False) as http:
            answers = await asyncio.gather(
                *(http.post(r["url"] + "/generate", json=payload) for r in targets), return_exceptions=True
            )
        results = []
        for r, ans in zip(targets, answers, strict=True):
            rid = r["replica_id"]
            if isinstance(ans, Exception):
                raise HTTPException(502, f"replica {rid} did not answer: {ans!r}")
            if ans.status_code != 200:
                raise HTTPException(
                    502 if ans.status_code >= 500 else ans.status_code,
                    f"replica {rid}: HTTP {ans.status_code}: {ans.text[:300]}",
                )
            items = ans.json()
            items = items if isinstance(items, list) else [items]
            logprobs, versions = [], set()
            for item in items:
                meta = item.get("meta_info", {})
                logprobs.append(
                    [float(x[0]) if x[0] is not None else None for x in meta.get("input_token_logprobs", [])]
                )
                versions.add(meta.get("weight_version"))
            version = _int_or_none(versions.pop()) if len(versions) == 1 else None
            results.append(
                {
                    "group": r["group"],
                    "format": fmt.get(r["group"]),
                    "replica": rid,
                    "weight_version": version,
                    "logprobs": logprobs,
                }
            )
        return {"results": results}

    router.service = service  # type: ignore[attr-defined]
    return router


def store_formats(store, run_id: str, version: int) -> list[str]:
    from weight_sync.publish import FORMATS

    return [f for f in FORMATS if version in store.versions(run_id, f)]


def _formats_view(store, run_id: str, formats: list[str]) -> dict[str, Any]:
    out = {}
    for f in formats:
        ptr = store.read_pointer(run_id, f)
        manifest = None
        if ptr is not None:
            m = store.read_manifest(run_id, f, ptr)
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
        out[f] = {"pointer": ptr, "versions": store.versions(run_id, f), "manifest": manifest}
    return out


async def _replica_details(urls: list[str]) -> dict[str, dict[str, Any]]:
    """Each sidecar's ``/v1/status`` (last activation, staging); missing for plain engines."""
    if not urls:
        return {}
    async with httpx.AsyncClient(timeout=1.0, trust_env=False) as http:
        answers = await asyncio.gather(*(http.get(u + "/v1/status") for u in urls), return_exceptions=True)
    out = {}
    for u, a in zip(urls, answers, strict=True):
        if isinstance(a, httpx.Response) and a.status_code == 200:
            with contextlib.suppress(ValueError):
                out[u] = a.json()
    return out


async def _wake_replicas(ctx) -> None:
    urls = [r["url"] for r in _replicas(ctx)]
    if not urls:
        return
    async with httpx.AsyncClient(timeout=1.0, trust_env=False) as http:
        await asyncio.gather(*(http.post(u + "/v1/wake") for u in urls), return_exceptions=True)


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


__all__ = ["create_weights_router", "sync_latest_version"]

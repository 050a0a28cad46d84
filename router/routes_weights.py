"""Admin weight routes (scope ``admin``): publish, roll back, perturb, job state, status.

- ``POST /v1/weights`` ``{checkpoint, version?, run_id?, mode?, formats?, delta_of?}`` -> 202 job:
  converts the BF16 checkpoint (a directory on this router's filesystem, e.g. already on the
  store's volume) once per format the fleet serves and publishes it (:mod:`weight_sync.publish`).
  With ``delta_of`` B the directory holds only the tensors changed since B, and every format is
  published as a delta over B (:mod:`weight_sync.delta`). Without ``version`` the router takes
  the next number (one more than every pointer and committed version) while it holds the job
  lock, so publishes without a version compose. Every version number in a body is a JSON
  integer in ``[0, 2**63)`` (what a batch's int64 versions hold, :data:`core.wire.VERSION_MAX`),
  else 422. A path that does not exist or is not a directory, a full checkpoint without
  ``config.json`` or a directory without shards is a 400 at
  once (:func:`weight_sync.publish.check_checkpoint`), before any job starts.
- ``run_id`` (every job route) may only name this router's run (the default): the fleet's
  replicas activate no other, so another is a 400 at once.
- ``POST /v1/weights/rollback`` ``{to, run_id?, version?}`` -> 202 job: a new version with
  ``to``'s content; 404 at once when some format the fleet serves has no version ``to``.
- ``POST /v1/weights/perturbations`` ``{from_version, swap_rows: [t, s], run_id?}`` -> 202 job:
  publishes ``from_version`` with two output-projection rows swapped (``mixfleet weights verify``).
- ``POST /v1/weights/prune`` ``{keep, run_id?}`` -> 202 job: deletes the run's versions that
  :mod:`weight_sync.retention` does not keep for the newest ``keep`` (nor any version from the
  lowest a live replica serves upward); its result names them and the bytes freed.
  ``GET /v1/weights/prune?keep=N`` -> 200: the same plan, nothing deleted. ``keep`` below 1 is a 422.
- ``GET /v1/weights/jobs/{id}``: a job's state (``running`` | ``done`` | ``failed``), events,
  result or error.
- ``GET /v1/weights``: per format the pointer, versions and manifest; per group the desired
  version, every replica's active version, lag and last activation.

One job runs at a time across every router on the state store; a second gets 409 wherever it lands
(with ``Retry-After``: it passes when the job ends), and any router answers for any job. The jobs,
the store and the converter (this router's conversion pool, or a deployed Modal function) are the
:class:`router.publishing.PublishService` that :func:`create_weights_router` makes of a
:class:`router.config.WeightsConfig`; the routes (:data:`router`) reach it as
``request.app.state.weights``. Its lifespan (merged into the app's, inside the router context's)
sets that, starts the converter's workers, adopts the store's highest pointer before the first
request, re-reads the pointers every ``pointer_poll_s`` seconds while the router runs (a pointer
that moved wakes the replicas), and at shutdown stops the converter and joins its workers. Without
a store root every weight route answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from core.errors import UserError
from core.formats import WeightFormat
from core.tasks import cancel_and_wait
from core.wire import VERSION_MAX
from router.auth import require
from router.config import WeightsConfig
from router.context import RouterContext
from router.errors import AUTH, BODY, ApiError, error_responses
from router.idempotency import HEADER, check_key, request_digest
from router.json_route import JsonRoute
from router.publishing import (
    JobRunning,
    NoBf16Copy,
    PublishService,
    StoreNotConfigured,
    StoreUnreadable,
    VersionTooOld,
)
from router.schemas import bounded_int, unbounded_int
from weight_sync.converters import Converter
from weight_sync.publish import VersionMissing

RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
JOB_RETRY_S = 5.0  # Retry-After of the 409 refusing a job while another runs


class PublishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        min_length=1, description="HF BF16 checkpoint directory on the router's filesystem"
    )
    version: bounded_int(0, VERSION_MAX) | None = Field(
        default=None, description="version number (default: the next one)"
    )
    run_id: str | None = Field(default=None, pattern=RUN_ID)
    mode: Literal["barrier", "per_format"] = "barrier"
    formats: list[WeightFormat] | None = Field(default=None, min_length=1)
    delta_of: bounded_int(0, VERSION_MAX) | None = Field(
        default=None,
        description="the checkpoint holds only the BF16 tensors changed since this version; "
        "each format is published as a delta over it",
    )


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: bounded_int(0, VERSION_MAX) = Field(description="the version whose content to publish again")
    run_id: str | None = Field(default=None, pattern=RUN_ID)
    version: bounded_int(0, VERSION_MAX) | None = None


class PerturbRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    from_version: bounded_int(0, VERSION_MAX)
    swap_rows: list[unbounded_int(None)] = Field(
        min_length=2,
        max_length=2,
        description="two token ids whose lm_head rows swap (rows outside the model's: a 400 naming them)",
    )
    run_id: str | None = Field(default=None, pattern=RUN_ID)


class PruneRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep: bounded_int(1, VERSION_MAX) = Field(description="how many of the run's newest versions to keep")
    run_id: str | None = Field(default=None, pattern=RUN_ID)


def _ctx(request: Request) -> RouterContext:
    return request.app.state.ctx


def _refusal(exc: UserError) -> ApiError:
    """The HTTP answer to a refused weight call."""
    if isinstance(exc, StoreNotConfigured | StoreUnreadable):
        return ApiError(503, str(exc))
    if isinstance(exc, JobRunning):
        return ApiError(409, str(exc), retry_after=JOB_RETRY_S)  # passes when the job ends
    if isinstance(exc, VersionTooOld | NoBf16Copy):
        return ApiError(409, str(exc))
    if isinstance(exc, VersionMissing):
        return ApiError(404, str(exc))
    return ApiError(400, str(exc))


def _service(request: Request) -> PublishService:
    """The publish service of the app (set by :func:`create_weights_router`'s lifespan)."""
    return request.app.state.weights


def _lifespan(service: PublishService, poll_s: float):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.weights = service
        if not service.configured:
            yield
            return
        ctx: RouterContext = app.state.ctx
        # conversion workers start now, so that the first publish does not pay their start-up
        service.start(len(ctx.config.fleet.formats))
        await service.adopt_pointers(ctx)

        async def watch() -> None:
            while True:
                await asyncio.sleep(poll_s)
                await service.adopt_pointers(ctx)

        task = asyncio.create_task(watch(), name="weights-pointer-watch")
        try:
            yield
        finally:
            await cancel_and_wait([task])
            await asyncio.to_thread(service.close)

    return lifespan


router = APIRouter(tags=["weights"], route_class=JsonRoute)
ADMIN = [Depends(require("admin"))]
JOB_REFUSALS = error_responses(*AUTH, *BODY, 409, 503)


JOB_KEY_DOC = (
    "1-255 visible ASCII characters, one per request (its retries repeat it): the key and the body "
    "name the job, so a request sent again with both answers the job the first started (running or "
    "ended) instead of starting another"
)
JobKey = Annotated[str | None, Header(alias=HEADER, description=JOB_KEY_DOC)]


def _job_id(kind: str, key: str | None, body: BaseModel) -> str | None:
    """The id of the job a keyed request starts (None without a key): a digest of its kind, key and
    body, so that its retries name the same job."""
    if key is None:
        return None
    return request_digest({"kind": kind, "key": check_key(key), "body": body.model_dump(mode="json")})[:16]


async def _start(
    request: Request,
    kind: str,
    key: str | None,
    body: BaseModel,
    start: Callable[[PublishService, RouterContext, str | None], Awaitable[Any]],
) -> dict[str, Any]:
    """The view of the job ``start(service, ctx, job_id)`` starts; for a keyed request whose job
    (:func:`_job_id`) started before, that job's view (its retry after a lost answer starts
    nothing). A retry sent while its first attempt still starts the job waits for that job's view
    (5 s, then the 409)."""
    service, ctx, job_id = _service(request), _ctx(request), _job_id(kind, key, body)
    if job_id is not None and (view := await service.job_view(ctx, job_id)) is not None:
        return view
    try:
        return (await start(service, ctx, job_id)).view()
    except JobRunning as exc:
        if job_id is not None and exc.running == [job_id]:
            for _ in range(50):
                await asyncio.sleep(0.1)
                if (view := await service.job_view(ctx, job_id)) is not None:
                    return view
        raise _refusal(exc) from None
    except UserError as exc:
        raise _refusal(exc) from None


@router.post("/v1/weights", status_code=202, dependencies=ADMIN, responses=JOB_REFUSALS)
async def publish(body: PublishRequest, request: Request, key: JobKey = None) -> dict[str, Any]:
    """Convert a BF16 checkpoint once per format and publish it (a job; poll its id)."""
    formats = list(body.formats) if body.formats else None
    return await _start(
        request,
        "publish",
        key,
        body,
        lambda service, ctx, job_id: service.publish(
            ctx,
            Path(body.checkpoint),
            version=body.version,
            run_id=body.run_id,
            mode=body.mode,
            formats=formats,
            delta_of=body.delta_of,
            job_id=job_id,
        ),
    )


@router.post(
    "/v1/weights/rollback",
    status_code=202,
    dependencies=ADMIN,
    responses=error_responses(*AUTH, *BODY, 404, 409, 503),
)
async def rollback(body: RollbackRequest, request: Request, key: JobKey = None) -> dict[str, Any]:
    """Publish a new version whose content is ``to``'s (pointers never move backwards)."""
    return await _start(
        request,
        "rollback",
        key,
        body,
        lambda service, ctx, job_id: service.rollback(
            ctx, body.to, run_id=body.run_id, version=body.version, job_id=job_id
        ),
    )


@router.post("/v1/weights/perturbations", status_code=202, dependencies=ADMIN, responses=JOB_REFUSALS)
async def perturb(body: PerturbRequest, request: Request, key: JobKey = None) -> dict[str, Any]:
    """Publish ``from_version`` with two output-projection rows swapped (for verify)."""
    swap = tuple(body.swap_rows)
    return await _start(
        request,
        "perturbation",
        key,
        body,
        lambda service, ctx, job_id: service.perturb(
            ctx, body.from_version, swap, run_id=body.run_id, job_id=job_id
        ),
    )


@router.post("/v1/weights/prune", status_code=202, dependencies=ADMIN, responses=JOB_REFUSALS)
async def prune(body: PruneRequest, request: Request) -> dict[str, Any]:
    """Delete the versions the store no longer needs to keep the newest ``keep`` (a job)."""
    try:
        return await _service(request).prune(_ctx(request), body.keep, run_id=body.run_id, dry_run=False)
    except UserError as exc:
        raise _refusal(exc) from None


@router.get("/v1/weights/prune", dependencies=ADMIN, responses=error_responses(*AUTH, 400, 422, 503))
async def prune_plan(
    request: Request,
    keep: Annotated[int, Query(ge=1, le=VERSION_MAX, description="how many newest versions to keep")],
    run_id: Annotated[str | None, Query(pattern=RUN_ID)] = None,
) -> dict[str, Any]:
    """What ``POST /v1/weights/prune`` would delete now, and the bytes it would free."""
    try:
        return await _service(request).prune(_ctx(request), keep, run_id=run_id, dry_run=True)
    except UserError as exc:
        raise _refusal(exc) from None


@router.get("/v1/weights/jobs/{job_id}", dependencies=ADMIN, responses=error_responses(*AUTH, 404, 422))
async def job_status(job_id: str, request: Request) -> dict[str, Any]:
    """A weight job's state, events, result or error (a job of any router on the state store)."""
    view = await _service(request).job_view(_ctx(request), job_id)
    if view is None:
        raise ApiError(404, f"no weight job {job_id!r}")
    return view


@router.get("/v1/weights", dependencies=ADMIN, responses=error_responses(*AUTH, 503))
async def status(request: Request) -> dict[str, Any]:
    """Per format: pointer, versions, manifest; per group: desired, replicas' versions, lag."""
    try:
        return await _service(request).status(_ctx(request))
    except UserError as exc:
        raise _refusal(exc) from None


def create_weights_router(config: WeightsConfig, *, converter: Converter | None = None) -> APIRouter:
    """The weight routes (:data:`router`) bound to a new :class:`router.publishing.PublishService`
    of ``config``: an APIRouter to include in the router app, whose lifespan (see the module
    docstring) makes the service the app's ``state.weights``. Its service is also ``.service``.

    ``converter``: where publications run (default: ``config.convert_function``'s Modal function
    when set, else this router's pool of ``config.workers`` processes; see
    :class:`router.publishing.PublishService`).
    """
    service = PublishService(config, converter=converter)
    bound = APIRouter(lifespan=_lifespan(service, config.pointer_poll_s))
    bound.include_router(router)
    bound.service = service  # type: ignore[attr-defined]
    return bound


__all__ = [
    "PerturbRequest",
    "PruneRequest",
    "PublishRequest",
    "RollbackRequest",
    "create_weights_router",
    "router",
]

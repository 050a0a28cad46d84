"""Trainer-facing routes: take a batch under a lease, acknowledge it, upload the trainer's
log-probs for it (scope ``trainer``); score fixed sequences on the fleet (``POST /v1/score``,
scope ``trainer`` or ``admin``).

The batch is JSON by default; with ``Accept: application/x-mixfleet-records`` it is the compact
binary batch of :mod:`router.records` (same content, records never as JSON lists). A take that
finds nothing to give answers an empty batch without a lease (``lease_id`` null); its
``trainer_version`` may not be above the versions the fleet can serve (409). A lease id in a path
that no take could have made is a 422 (:data:`router.schemas.LeaseId`) before any lookup;
acknowledging a lease that is unknown (never handed out, or forgotten) is a 404; acknowledging one
again, while it is known (``lease_timeout_s + retention_s`` after its take), answers the first
acknowledgement's counts with ``already_acked`` (a trainer retrying an ack whose answer it lost
gets a 200; nothing is counted twice). A trainer whose step failed hands its lease back
(``POST /v1/batches/{lease_id}/release``): what the lease still owns is ready for the next take
at once, not after ``lease_timeout_s``, also a lease answered again to a retry of its take id,
and the lease is forgotten (its acknowledgement is then a 404); a release answers how many went
back, 0 for a lease released or acknowledged already (that stays acknowledged), timed out and
taken again, or unknown: a released lease is forgotten, so a retried release cannot be told from
an unknown lease and a 404 would fail the retry. A take whose client
disconnects before the answer is cancelled (:mod:`router.disconnect`): what it picked is ready
again at once, also when the store had already made its lease (the store's ``release``; its
handing-out is not counted). Once the answer has started, a disconnect is not acted on: the
router cannot know whether the client read the batch, so its lease times out as any lease whose
answer was lost (what the take does between the store's answer and the response's start does
not wait on anything but the lease's take order, so that window is one state round trip).
Unless the client retries: a take with an ``Idempotency-Key`` header (validated as a turn's,
:func:`router.idempotency.check_key`) whose earlier take's lease is still open answers that
lease's batch again, the same bytes (the store keeps the lease's trajectories in order, its
``held_back`` and the ``trainer_version`` it was taken for, :meth:`StateStore.take`), and
hands out and counts nothing; that lease is then the retry's: the first attempt's client
leaving afterwards (before its own answer started) does not release it (the store's ``release``
leaves a lease answered again), so its trajectories are not handed out again while the retry's
client trains on them. A key whose lease is acknowledged, released or timed out takes
afresh. A take without the header takes afresh. The latest take with a key holds it: a take with
a key that an earlier take still waiting (``wait_s``, no lease yet) holds takes the key over, on
any router sharing the state store, and the earlier one gives up at once: it puts back what it
picked and answers 409 without ``Retry-After`` (to a client that is gone when it was a retry
after a timeout whose disconnect the router did not see, e.g. behind a proxy that keeps the
connection open); only the take holding the key makes a lease, so a take retried while its
first attempt still waits ends with one lease (:meth:`StateStore.take`, :class:`TakeTakenOver`).

The take's request body is small and its answer has no size limit; the batch's size is bounded
by ``size`` trajectories. Trainer log-probs (``POST /v1/batches/{lease_id}/trainer_logprobs``,
body in the encoding of :mod:`router.trainer_logprobs`, exactly the size the lease's token count
gives: the router's generic body limit does not apply to it) are accepted once per lease, for a
lease a take handed out within the last ``lease_timeout_s + retention_s`` seconds, whether the
trainer still holds it or has acknowledged it: a released lease is a 409 (its trajectories went
back to the queue; also when the release came while the upload was read, and nothing is
counted), an unknown or forgotten lease is a 404, a second
upload of the same bytes for the same lease (a retry whose answer was lost) answers the same
figures with ``already_uploaded`` and counts nothing, a different second upload is a 409 (nothing
is counted twice), a lease whose trajectories are no longer stored a 409. A trajectory
redelivered under a later lease counts once for each lease that uploads it. The figures
(:mod:`router.mismatch`) accumulate per group, weight version and token-position bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from clients.engine import EngineError, EngineRejected, reported_version
from core.jsonio import dumps
from core.tasks import raise_if_cancelled
from core.wire import LOGPROBS_MEDIA_TYPE
from core.wire import RECORDS_MEDIA_TYPE as MEDIA_TYPE
from router.auth import require
from router.body import read_body
from router.context import RouterContext
from router.dispatch import check_vocab
from router.errors import AUTH, BODY, ApiError, error_responses
from router.idempotency import HEADER, check_key
from router.json_route import JsonRoute
from router.mismatch import TurnTokens, batch_mismatch
from router.records import decode_turn, decode_turn_header, decode_turn_outputs, encode_batch
from router.schemas import (
    AckResponse,
    LeaseId,
    MismatchUploadResponse,
    QueueStats,
    ReleaseResponse,
    TakeRequest,
    TakeResponse,
    TokenRows,
    VersionConflict,
    unbounded_int,
)
from router.state.base import (
    Lease,
    LeaseNotFound,
    LeaseReleased,
    StateError,
    TakenTrajectory,
    TakeTakenOver,
)
from router.trainer_logprobs import LogprobsFormatError, decode_upload, upload_size
from router.turns import check_version_bound

TAKE_KEY_DOC = (
    "1-255 visible ASCII characters, one per take (its retries repeat it): while the lease the first "
    "take with this key made is open, a take with it answers that lease's batch again instead of "
    "taking other trajectories; an earlier take with it that still waits gives up (409)"
)

router = APIRouter(
    prefix="/v1/batches",
    tags=["trainer"],
    dependencies=[Depends(require("trainer"))],
    responses=error_responses(*AUTH),
    route_class=JsonRoute,  # bodies decoded by core.jsonio, strictly
)


def _ctx(request: Request) -> RouterContext:
    return request.app.state.ctx


def version_age(turn_headers: list[dict[str, Any]], trainer_version: int) -> dict[str, Any]:
    """min / max / mean over tokens of (trainer version - token version), floored at 0."""
    count = total = 0
    lo: int | None = None
    hi: int | None = None
    for h in turn_headers:
        for span in h.get("weight_versions") or []:
            n = int(span["end"]) - int(span["start"])
            if n <= 0:
                continue
            age = max(0, trainer_version - int(span["version"]))
            count += n
            total += age * n
            lo = age if lo is None else min(lo, age)
            hi = age if hi is None else max(hi, age)
    return {"min": lo or 0, "max": hi or 0, "mean": total / count if count else 0.0}


def _header(t: TakenTrajectory, trainer_version: int, headers: list[dict[str, Any]]) -> dict[str, Any]:
    s = t.session
    return {
        "session_id": s.session_id,
        "group": s.group,
        "reward": s.reward,
        "metadata": {**s.metadata, **s.finish_metadata},
        "version_age": version_age(headers, trainer_version),
    }


@router.post(
    "/take",
    response_model=TakeResponse,
    summary="Take up to `size` finished trajectories under a lease",
    responses={
        200: {"content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
        **error_responses(*BODY, 409, models={409: VersionConflict}),
    },
)
async def take(
    request: Request,
    body: TakeRequest,
    take_id: Annotated[str | None, Header(alias=HEADER, description=TAKE_KEY_DOC)] = None,
) -> Response:
    """A ``trainer_version`` above every version the fleet can serve is a 409 before anything is
    taken (:func:`router.turns.check_version_bound`, as a turn's ``min_version``). With an
    ``Idempotency-Key`` whose earlier take's lease is still open, the answer is that lease's
    batch again, the same bytes, and a disconnect of the take that made it no longer releases
    it; an earlier take with the key still waiting gives up (409) and this one takes (module
    docstring)."""
    ctx = _ctx(request)
    if take_id is not None:
        check_key(take_id)
    await check_version_bound(ctx, "trainer_version", body.trainer_version)
    trainer_version = body.trainer_version if body.trainer_version is not None else ctx.trainer_version()
    try:
        lease = await ctx.store.take(
            body.size,
            trainer_version=trainer_version,
            max_version_age=body.max_version_age,
            lease_timeout_s=ctx.config.lease_timeout_s,
            wait_s=body.wait_s,
            take_id=take_id,
        )
    except TakeTakenOver:
        raise ApiError(
            409,
            f"{HEADER} {take_id!r}: a later take with this key took it over while this one waited "
            "(this one handed out nothing)",
        ) from None
    lease_id = lease.lease_id if lease.trajectories else None
    if lease.repeated:  # the lease this take id made, answered again: nothing was handed out now
        if lease_id is not None:  # its first answer may have failed before recording its order
            await _record_order(ctx, lease_id, lease)
        return _answer(
            request, lease, trainer_version if lease.trainer_version is None else lease.trainer_version
        )
    if lease_id is not None:
        try:
            await _record_order(ctx, lease_id, lease)
            raise_if_cancelled()  # one Python 3.11 dropped
        except asyncio.CancelledError:  # its client left (router.disconnect): it gets no batch
            await _release(ctx, lease_id)
            raise
        ctx.metrics.leases.inc()
    ctx.metrics.taken.inc(len(lease.trajectories))
    ctx.metrics.redelivered.inc(lease.redelivered)
    # nothing below awaits until the answer starts: a disconnect from here on is noticed only once
    # the answer has started, when the router cannot know whether the client got it (the lease
    # then times out like any lease whose answer was lost, unless the client retries its take id)
    return _answer(request, lease, trainer_version)


async def _record_order(ctx: RouterContext, lease_id: str, lease: Lease) -> None:
    """The lease's trajectories in the order handed out, for its log-prob upload's window."""
    order = [t.session.session_id for t in lease.trajectories]
    await ctx.store.record_lease_order(lease_id, order, ttl_s=_upload_window_s(ctx))


def _answer(request: Request, lease: Lease, trainer_version: int) -> Response:
    """The batch of ``lease`` as the request accepts it (records or JSON)."""
    lease_id = lease.lease_id if lease.trajectories else None
    binary = MEDIA_TYPE in request.headers.get("accept", "")
    if binary:
        items = []
        for t in lease.trajectories:
            headers = [decode_turn_header(b) for b in t.turns]
            items.append((_header(t, trainer_version, headers), t.turns))
        return Response(
            encode_batch(lease_id, lease.held_back, items, trainer_version), media_type=MEDIA_TYPE
        )
    out = []
    for t in lease.trajectories:
        turns = [decode_turn(b) for b in t.turns]
        headers = [{"weight_versions": x.weight_versions} for x in turns]
        out.append(
            {
                **_header(t, trainer_version, headers),
                "turns": [x.to_json(t.session.session_id) for x in turns],
            }
        )
    return Response(
        dumps(
            {
                "lease_id": lease_id,
                "trajectories": out,
                "held_back": lease.held_back,
                "trainer_version": trainer_version,
            }
        ),
        media_type="application/json",
    )


async def _release(ctx: RouterContext, lease_id: str) -> None:
    """Put the lease of a take whose client left back at once, unless a retry of its take id was
    answered it (the store leaves it: the retry's client holds it); a store down meanwhile
    leaves it to time out."""
    with contextlib.suppress(StateError):
        await ctx.store.release(lease_id)


@router.post(
    "/{lease_id}/ack",
    response_model=AckResponse,
    summary="Acknowledge a lease",
    responses=error_responses(404, 422),
)
async def ack(request: Request, lease_id: LeaseId) -> dict[str, Any]:
    """Idempotent: a repeated acknowledgement answers the first one's counts with
    ``already_acked`` (module docstring)."""
    ctx = _ctx(request)
    try:
        result = await ctx.store.ack(lease_id)
    except LeaseNotFound:
        raise ApiError(
            404, f"unknown lease {lease_id!r} (never handed out, released, or forgotten since its take)"
        ) from None
    if not result.already_acked:
        ctx.metrics.acked.inc(result.acked)
        if result.update is not None:  # it closed an update in the ledger
            ctx.metrics.updates.inc()
    return {
        "lease_id": lease_id,
        "acked": result.acked,
        "expired": result.expired,
        "already_acked": result.already_acked,
    }


@router.post(
    "/{lease_id}/release",
    response_model=ReleaseResponse,
    summary="Hand a lease back: its trajectories are ready for the next take at once",
    responses=error_responses(422),
)
async def release(request: Request, lease_id: LeaseId) -> dict[str, Any]:
    """The trainer holding the lease hands it back (its step failed): what the lease still owns
    is ready again at once instead of after ``--lease-timeout``, and the lease is forgotten (its
    ``ack`` is then a 404). Answers how many went back. Idempotent: a lease released or
    acknowledged already, or unknown, answers 0, never a 404 (a release forgets its lease, so a
    retry whose first answer was lost cannot be told from an unknown lease: as a repeated
    ``ack``, it gets a 200); an acknowledged lease stays acknowledged (module docstring)."""
    ctx = _ctx(request)
    released = await ctx.store.release(lease_id, by_holder=True)
    return {"lease_id": lease_id, "released": released}


def _upload_window_s(ctx: RouterContext) -> float:
    """How long after a take its lease accepts (and remembers) a trainer log-prob upload: as long
    as the lease is known (:meth:`router.state.retention.Retention.lease_record_s`)."""
    return ctx.config.retention().lease_record_s()


@router.post(
    "/{lease_id}/trainer_logprobs",
    response_model=MismatchUploadResponse,
    summary="Upload the trainer's log-probs of a taken batch's tokens (sampler-trainer mismatch)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {LOGPROBS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    responses=error_responses(400, 404, 409, 413, 415, 422),
)
async def trainer_logprobs(request: Request, lease_id: LeaseId) -> dict[str, Any]:
    """Log p of every output token of the lease's batch, in its token order (trajectory, turn,
    output token). Counted once per lease (see the module docstring); answers this batch's
    figures per (group, version).

    The body's size is the lease's: an upload for a batch of ``n`` output tokens is
    :func:`router.trainer_logprobs.upload_size` bytes (``8 + 4n``, with route flags ``12 + 5n``),
    whatever the router's ``max_body_bytes``; a larger one is a 413 naming those sizes. The lease
    and its turns are read first (an unknown lease is a 404, a released one a 409, before any
    byte of the body is read).

    Memory grows linearly with ``n``: the body is read once, into one buffer of its size (at most
    ``12 + 5n`` bytes), and decoded as views of it (no copy); beside it the route holds the
    lease's stored turn blocks (the bytes its take served), the sampler's log-probs as views of
    them, an 8-byte version reference a token, and the computation's temporaries, bounded by
    :data:`router.mismatch.CHUNK_TOKENS` tokens (about 100 MB) whatever ``n``: about 13 bytes a
    token and the stored blocks. The decoding and the computation run in a worker thread, off the
    event loop.

    The body's ``Content-Type`` must be ``application/x-mixfleet-logprobs`` (parameters after ``;``
    aside), what :meth:`trainer.client.RolloutClient.upload_trainer_logprobs` sends; another or
    none (a JSON body) is a 415 naming it, before the lease is looked up."""
    media_type = request.headers.get("content-type")
    if (media_type or "").partition(";")[0].strip().lower() != LOGPROBS_MEDIA_TYPE:
        sent = f"Content-Type {media_type!r}" if media_type else "no Content-Type"
        raise ApiError(
            415,
            f"body: {sent}; the upload takes {LOGPROBS_MEDIA_TYPE} "
            "(trainer/upload.py encode_trainer_logprobs)",
        )
    ctx = _ctx(request)
    try:
        order = await ctx.store.lease_order(lease_id)
    except LeaseReleased:
        raise _released(lease_id) from None
    if order is None:
        raise ApiError(404, f"unknown lease {lease_id!r} (never handed out, or its upload window has passed)")
    turns = await _lease_turns(ctx, lease_id, order)
    n = sum(len(t.logprobs) for t in turns)
    plain, routed = upload_size(n, routes=False), upload_size(n, routes=True)
    why = f": lease {lease_id}'s upload of {n} log-probs is {plain} bytes ({routed} with route flags)"
    body = await read_body(request, routed, why)
    try:
        trainer, route_flags = decode_upload(body)
    except LogprobsFormatError as exc:
        raise ApiError(400, f"body: {exc}") from None
    digest = hashlib.blake2b(body, digest_size=16).hexdigest()
    band = ctx.config.mismatch_band
    try:
        result = await asyncio.to_thread(batch_mismatch, turns, trainer, band, route_flags)
    except ValueError as exc:
        raise ApiError(422, f"body: {exc}") from None
    try:
        again = not await ctx.store.add_mismatch(
            lease_id, result.sums, ttl_s=_upload_window_s(ctx), digest=digest
        )
    except LeaseReleased:  # released while this upload was read: nothing was counted
        raise _released(lease_id) from None
    if again and await ctx.store.mismatch_digest(lease_id) != digest:
        raise ApiError(409, f"lease {lease_id!r}: other trainer log-probs were already uploaded")
    per: dict[tuple[str, int], Any] = {}
    for (group, version, _bucket), part in result.sums.items():
        per[(group, version)] = per[(group, version)] + part if (group, version) in per else part
    return {
        "lease_id": lease_id,
        "tokens": result.tokens,
        "skipped": result.skipped,
        "groups": [{"group": g, "version": v, **per[(g, v)].view()} for g, v in sorted(per)],
        "already_uploaded": again,
    }


def _released(lease_id: str) -> ApiError:
    """The 409 for an upload against a lease its holder (or a take's disconnect) released."""
    return ApiError(
        409,
        f"lease {lease_id!r} was released (POST /v1/batches/{lease_id}/release): its trajectories "
        "went back to the queue; upload their trainer log-probs for the lease that takes them next",
    )


async def _lease_turns(ctx: RouterContext, lease_id: str, order: list[str]) -> list[TurnTokens]:
    """The turns of the trajectories a lease handed out, in its batch's token order, as the
    mismatch needs them (:func:`router.records.decode_turn_outputs`, in a worker thread); 409 when
    one of its trajectories is no longer stored."""
    stored = await asyncio.gather(*(ctx.store.get_turns(sid) for sid in order))
    for sid, blobs in zip(order, stored, strict=True):
        if not blobs:
            raise ApiError(409, f"lease {lease_id!r}: trajectory {sid!r} is no longer stored")
    return await asyncio.to_thread(lambda: [TurnTokens(*decode_turn_outputs(b)) for bs in stored for b in bs])


@router.get(
    "/stats", response_model=QueueStats, summary="Trainer queue: ready, pending, held back, open leases"
)
async def stats(request: Request) -> dict[str, int]:
    return await _ctx(request).store.queue_stats()


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: TokenRows = Field(description="1 to 256 sequences of token ids")
    logprob_start_len: unbounded_int(0) = 0
    groups: list[str] | None = Field(
        default=None, min_length=1, description="the groups to score on (null: every group)"
    )


score_router = APIRouter(tags=["trainer"], responses=error_responses(*AUTH), route_class=JsonRoute)


@score_router.post(
    "/v1/score",
    dependencies=[Depends(require("trainer", "admin"))],
    summary="Score fixed sequences on every ready replica of every (chosen) group",
    responses=error_responses(*BODY, 502, 503),
)
async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    """Every fresh replica of the chosen groups (default: all) scores every sequence (nothing is
    generated); per replica the input-token log-probs from ``logprob_start_len`` on and the weight
    version that scored them (None when the replicas' answers disagree or name none). An id
    outside the served vocabulary is a 422 before any replica is asked (``check_vocab``)."""
    ctx = _ctx(request)
    names = [g.name for g in ctx.config.fleet.groups]
    chosen = body.groups or names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise ApiError(400, f"groups: unknown group(s) {', '.join(unknown)}")
    for i, seq in enumerate(body.input_ids):
        check_vocab(ctx, seq, f"input_ids[{i}]")
        if len(seq) <= body.logprob_start_len:
            raise ApiError(
                400,
                f"input_ids[{i}]: {len(seq)} tokens, not more than "
                f"logprob_start_len {body.logprob_start_len}",
            )
    fmt = {g.name: g.weight_format for g in ctx.config.fleet.groups}
    now = time.monotonic()
    targets = [r for r in ctx.registry.replicas.values() if r.group in chosen and ctx.registry.fresh(r, now)]
    if not targets:
        raise ApiError(503, "no ready replica in the chosen groups")
    answers = await asyncio.gather(
        *(
            ctx.replica_client(r.replica_id, r.url).score(body.input_ids, body.logprob_start_len)
            for r in targets
        ),
        return_exceptions=True,
    )
    results = []
    for r, ans in zip(targets, answers, strict=True):
        if isinstance(ans, EngineRejected):  # a sequence the engine refuses is the caller's fault
            raise ApiError(400 if ans.status == 400 else 502, f"replica {r.replica_id}: {ans.message}")
        if isinstance(ans, EngineError):
            raise ApiError(502, f"replica {r.replica_id} did not answer: {ans.message}")
        if isinstance(ans, BaseException):
            raise ans
        versions = {reported_version(meta) for meta in ans}
        results.append(
            {
                "group": r.group,
                "format": fmt.get(r.group),
                "replica": r.replica_id,
                "weight_version": versions.pop() if len(versions) == 1 else None,
                "logprobs": [
                    [float(x[0]) if x[0] is not None else None for x in meta.get("input_token_logprobs", [])]
                    for meta in ans
                ],
            }
        )
    return {"results": results}

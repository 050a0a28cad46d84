"""One turn of a session, end to end: check the session is open, generate with failover
(:func:`router.dispatch.run_turn`), record the turn exactly once, answer with what was stored.

A turn whose ``min_version`` no version the fleet can serve meets yet (above the latest
published version and the one a running publish job publishes, or with neither above the newest
a replica serves; :func:`check_version_bound`) is the caller's conflict: 409 (no
``Retry-After``: publishing is the caller's business) with those versions in the body
(:class:`~router.schemas.VersionConflict`, as the sidecar's version conflicts, weight_sync/types.py
``VersionUnavailable``), before any replica is asked. A ``min_version`` that is published but not
yet active anywhere stays the dispatcher's 503.

Contract of :func:`record_turn`: the turn's input is the whole context (``input_ids``) or the
tokens appended to the session's stored context (``append_ids``: the engine gets the stored
context and them, as SGLang's ``/generate`` takes the whole context:
``docs/sglang-contract.md``; its radix cache reuses the prefix). The turn stores only what it
appends (:mod:`router.segments`): a whole input that does not extend the stored context is a
fork, recorded in the turn (``fork``) and counted per group (``mixfleet_router_forks_total``),
and starts a new segment. On success the turn is stored once (a conflict with a concurrent turn
of the same session re-numbers it, unless the caller pinned ``turn``, and places its input again
on the context that turn left) as its turn block (:func:`router.records.encode_stored`), and the
returned JSON bytes are :meth:`~router.turn_data.TurnData.to_json` (without ``append_ids``) of
the turn as stored (float32 / float16 values), the same object a trajectory read serves for it
but for the records' supports, which it carries only when the turn asked ``return_support`` (an
agent reads its output; the supports, often hundreds of ids a token, are the trainer's);
on any :class:`~router.errors.ApiError` nothing was stored. When the request id already holds a
turn (the append stored nothing: :class:`~router.state.base.RequestRecorded`; another router
process recorded the same idempotency key first, or the state store's client repeated this
append after a lost reply), the answer is that stored turn's, read back
(:class:`Recorded` says whether it is the one this call sampled). The session is read once (with
its context), and again only after a conflict. A group that records routed experts asks them from
:func:`routes_start` (the positions the turn adds to its segment) and stores those rows only.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, replace

import numpy as np

from clients.engine_stream import TokenCallback
from core.jsonio import dumps
from router.context import RouterContext
from router.dispatch import check_vocab, run_turn
from router.errors import ApiError
from router.ledger import version_tokens
from router.records import decode_turn, encode_stored
from router.schemas import TurnSpec
from router.segments import Placement, Stored, as_ids, locate, pack, place
from router.state.base import (
    RequestRecorded,
    SessionFinished,
    SessionInfo,
    SessionNotFound,
    StoredTurn,
    TurnConflict,
    TurnRecord,
)
from router.turn_data import ROUTES_SECTION, TurnData


@dataclass(frozen=True)
class Recorded:
    """The turn stored under a turn request's id: ``answer``, its JSON answer (the turn as
    stored, without ``append_ids``; the supports if asked); ``turn``, the turn as stored;
    ``sampled``, whether it is the turn this call sampled (False: another request with the same
    id, another router process's, recorded its own first); ``digest``, the request digest stored
    with it (empty: none)."""

    answer: bytes
    turn: TurnData
    sampled: bool
    digest: str = ""


async def record_turn(
    ctx: RouterContext,
    session_id: str,
    spec: TurnSpec,
    *,
    request_id: str | None = None,
    request_digest: str = "",
    on_tokens: TokenCallback | None = None,
) -> Recorded:
    """Generate and record the next turn of ``session_id``, and return what its request id
    (default: a fresh one) holds (the store's append is idempotent per request id and keeps
    ``request_digest`` with it: :mod:`router.idempotency`). ``on_tokens``: the turn's new
    output ids as they are sampled (:func:`router.dispatch.run_turn`). The session counts as
    active while the turn runs (:meth:`RouterContext.turn_running`): however long it takes, the
    idle sweep does not abandon it."""
    with ctx.turn_running(session_id):
        return await _record_turn(ctx, session_id, spec, request_id, request_digest, on_tokens)


async def _record_turn(
    ctx: RouterContext,
    session_id: str,
    spec: TurnSpec,
    request_id: str | None,
    request_digest: str,
    on_tokens: TokenCallback | None,
) -> Recorded:
    t0 = time.perf_counter()
    session, stored = await _session_context(ctx, session_id)
    if spec.turn is not None and spec.turn != session.n_turns:
        raise ApiError(409, f"turn: expected {spec.turn} but the next turn is {session.n_turns}")
    index = session.n_turns if spec.turn is None else spec.turn
    full, at = _placed(ctx, spec, stored)
    await check_version_bound(ctx, "min_version", spec.min_version)
    turn = await run_turn(
        ctx,
        session,
        spec._replace(input_ids=full, append_ids=None),
        index,
        routes_start(at.context),
        on_tokens,
    )
    request_id = request_id or _request_id()
    low, high = turn.version_range()
    per_version = version_tokens(turn.weight_versions)
    for _ in range(64):
        turn = replace(turn, turn=index, context=at.context, append_ids=at.append, fork=at.fork)
        turn = _stored_routes(turn, at.context)
        try:
            blob, recorded = encode_stored(turn, f16=ctx.config.f16_support_logprobs)
        except ValueError as exc:
            raise ApiError(502, f"engine of replica {turn.replica} sent unusable records: {exc}") from None
        record = TurnRecord(
            request_id,
            blob,
            turn.group,
            turn.replica,
            len(turn.output_ids),
            low,
            high,
            context=pack(at.append) + pack(turn.output_ids),
            fork=at.fork is not None,
            expected_turn=index,
            version_tokens=per_version,
            request_digest=request_digest,
        )
        try:
            index = await ctx.store.append_turn(session_id, record)
        except RequestRecorded as exc:  # nothing stored: the request id holds a turn already
            first = await ctx.store.turn_for_request(session_id, request_id)
            if first is None:
                raise ApiError(404, f"session {session_id!r} was deleted during the turn") from None
            if first.blob != blob:  # another router process's turn under the same key
                return _recorded(session_id, decode_turn(first.blob), first, False, spec.return_support)
            index = exc.index  # this very append, repeated by the store client after a lost reply
        except TurnConflict as exc:  # another turn of this session was recorded meanwhile
            if spec.turn is not None:
                why = f"turn: expected {spec.turn} but the next turn is {exc.next_turn}"
                raise ApiError(409, why) from None
            state = await ctx.store.get_session_context(session_id)
            stored = b"" if state is None else state[1] or b""  # a gone session is refused by the append
            index = exc.next_turn
            at = place(full, stored)
            continue
        except SessionFinished:
            why = f"session {session_id!r} was finished during the turn; not recorded"
            raise ApiError(409, why) from None
        except SessionNotFound:
            raise ApiError(404, f"session {session_id!r} was deleted during the turn") from None
        ctx.context_text.stored(session_id, full, index + 1, as_ids(turn.output_ids))
        break
    else:
        raise ApiError(409, "too many concurrent turns on one session", retry_after=1)
    _count(ctx, turn, time.perf_counter() - t0)
    stored_turn = StoredTurn(index, blob, request_digest)
    return _recorded(session_id, recorded, stored_turn, True, spec.return_support)


def _placed(ctx: RouterContext, spec: TurnSpec, stored: Stored) -> tuple[np.ndarray, Placement]:
    """The turn's whole engine input and where it goes (:func:`router.segments.locate`), the ids
    it appends checked against the served vocabulary (:func:`router.dispatch.check_vocab`; the
    stored context's were checked when they came). ApiError 422 naming the field it sent."""
    try:
        full, at = locate(spec.input_ids, spec.append_ids, stored)
    except ValueError as exc:
        raise ApiError(422, f"append_ids: {exc}") from None
    if spec.input_ids is None:
        check_vocab(ctx, full[at.context :], "append_ids")
    else:
        check_vocab(ctx, full[at.context :], "input_ids", at.context)
    return full, at


def _recorded(
    session_id: str, turn: TurnData, stored: StoredTurn, sampled: bool, with_support: bool
) -> Recorded:
    """The :class:`Recorded` of ``turn``, the turn block ``stored`` holds (at its index)."""
    if turn.turn != stored.index:
        turn = replace(turn, turn=stored.index)
    answer = dumps(turn.to_json(session_id, with_input=False, with_support=with_support))
    return Recorded(answer, turn, sampled, stored.request_digest)


def routes_start(context: int) -> int:
    """The first position whose routed experts a turn with ``context`` stored tokens before it
    asks for (``routed_experts_start_len``): ``context - 1``, or 0 for a segment's first turn.
    The previous turn stored the rows of its positions up to its last output token, exclusive:
    that token was sampled and never fed forward in it (SGLang 0.5.23 answers the rows of
    ``[start, seqlen - 1)``: managers/scheduler_components/batch_result_processor.py 142-163,
    :mod:`core.sglang_release`); it is this turn's position ``context - 1``, within the prompt as
    SGLang requires (managers/scheduler.py 3300-3313)."""
    return max(context - 1, 0)


def _stored_routes(turn: TurnData, context: int) -> TurnData:
    """``turn`` with the routed experts a turn placed at ``context`` stores: the rows from
    :func:`routes_start` on (it was asked from an earlier position when a concurrent turn moved
    it); as asked when they start later (a turn re-placed as a fork after it ran: its segment
    keeps rows of -1 before them in the trainer's view, ``trainer.batch``)."""
    routes = turn.routed_experts
    start = routes_start(context)
    if routes is None or routes.start >= start:
        return turn
    tail = routes.tail(min(start, routes.start + routes.rows))
    return replace(turn, sections={**turn.sections, ROUTES_SECTION: tail.to_section()})


async def _session_context(ctx: RouterContext, session_id: str) -> tuple[SessionInfo, Stored]:
    """The session and its stored context, if it exists and is open; else 404 / 409. The context
    is read from the store unless this process holds it (:meth:`ContextText.known
    <router.context_text.ContextText.known>`)."""
    known = ctx.context_text.known(session_id)
    state = await ctx.store.get_session_context(session_id, None if known is None else known[0])
    if state is None:
        raise ctx.unknown_session(session_id)
    session, stored = state
    if session.status != "open":
        raise ApiError(409, f"session {session_id!r} is {session.status}: it accepts no more turns")
    if stored is None and known is not None:  # the store skips the read only for known_turns
        return session, known[1]
    return session, stored or b""


def _count(ctx: RouterContext, turn: TurnData, seconds: float) -> None:
    """The metrics of one recorded turn."""
    metrics = ctx.metrics
    metrics.turns.labels(turn.group).inc()
    metrics.tokens.labels(turn.group).inc(len(turn.output_ids))
    metrics.turn_seconds.labels(turn.group).observe(seconds)
    if turn.fork is not None:
        metrics.forks.labels(turn.group).inc()


async def check_version_bound(ctx: RouterContext, name: str, version: int | None) -> None:
    """Refuse (409, :class:`~router.schemas.VersionConflict` fields, ``constraint`` = ``name``) a
    ``version`` above every version the fleet can serve: the latest published version and the
    version a running publish job is publishing (the job lock's holder, any router's), or, with
    neither, the newest version a live replica serves; accept it when none is known (the
    dispatcher then answers). The latest is read again from the state store before refusing, so a
    version another router published since this one's last poll is not refused. The one bound of
    a turn's ``min_version`` and a take's ``trainer_version``. Raises StateError as the store
    does."""
    if version is None:
        return
    latest = ctx.latest_version()
    if latest is not None and version <= latest:
        return
    stored = await ctx.store.get_latest_version()
    if stored is not None:
        latest = stored if latest is None else max(latest, stored)
    publishing = await _publishing_version(ctx)
    served = ctx.registry.max_active_version()
    known = [v for v in (latest, publishing) if v is not None]
    bound = max(known) if known else served
    if bound is None or version <= bound:
        return
    if latest is not None:
        why = f"the latest published version is {latest}"
    elif publishing is None:
        why = f"no version is published and the newest a replica serves is {served}"
    else:
        why = "no version is published"
    if publishing is not None:
        why += f" and a running publish job publishes {publishing}"
    raise ApiError(
        409,
        f"{name} {version} cannot be met: {why}; publish it first or ask for a lower one",
        fields={
            "constraint": name,
            "target_version": version,
            "latest_version": latest,
            "served_version": served,
            "publishing_version": publishing,
        },
    )


async def _publishing_version(ctx: RouterContext) -> int | None:
    """The version the running publish job (the holder of the store's job lock) publishes; None
    when no job runs."""
    holder = await ctx.store.job_lock_holder()
    view = None if holder is None else await ctx.store.get_job(holder)
    if view is None or view.get("state") != "running" or not isinstance(view.get("version"), int):
        return None
    return view["version"]


_PREFIX = secrets.token_hex(8)
_COUNTER = itertools.count()


def _request_id() -> str:
    """Unique per call (a random per-process prefix and a counter): the idempotency key of
    one append."""
    return f"{_PREFIX}{next(_COUNTER):x}"

"""One turn of a session, end to end: check the session is open, generate with failover
(:func:`router.dispatch.run_turn`), record the turn exactly once, answer with what was stored.

A turn whose ``min_version`` no version the fleet can serve meets yet (above the latest
published, or with none published above the newest a replica serves) is the caller's conflict:
409 with those versions in the body (:class:`~router.schemas.VersionConflict`, as the sidecar's
version conflicts, weight_sync/types.py ``VersionUnavailable``), before any replica is asked. A
``min_version`` that is published but not yet active anywhere stays the dispatcher's 503.

Contract of :func:`record_turn`: on success the turn is stored once (a conflict with a
concurrent turn of the same session re-numbers it, unless the caller pinned ``turn``) as its
turn block (:func:`router.records.encode_stored`), and the returned JSON bytes are
:meth:`~router.records.TurnData.to_json` (without ``input_ids``) of the turn as stored
(float32 / float16 values), the same object a trajectory read serves for it; on any
:class:`~router.errors.ApiError` nothing was stored.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import replace

from core.jsonio import dumps
from router.context import RouterContext
from router.dispatch import run_turn
from router.errors import ApiError
from router.ledger import version_tokens
from router.records import encode_stored
from router.schemas import TurnSpec
from router.state.base import SessionFinished, SessionInfo, SessionNotFound, TurnConflict


async def load_open(ctx: RouterContext, session_id: str) -> SessionInfo:
    """The session, if it exists and is open; else 404 / 409."""
    info = await ctx.store.get_session(session_id)
    if info is None:
        raise ApiError(404, f"unknown session {session_id!r}")
    if info.status != "open":
        raise ApiError(409, f"session {session_id!r} is {info.status}: it accepts no more turns")
    return info


async def record_turn(
    ctx: RouterContext, session_id: str, spec: TurnSpec, *, request_id: str | None = None
) -> bytes:
    """Generate, record and return (as JSON bytes) the next turn of ``session_id``; the store's
    append is idempotent per ``request_id`` (default: a fresh one)."""
    t0 = time.perf_counter()
    session = await ctx.store.get_session(session_id)
    if session is None or session.status != "open":
        session = await load_open(ctx, session_id)  # refused there, with its message
    if spec.turn is not None and spec.turn != session.n_turns:
        raise ApiError(409, f"turn: expected {spec.turn} but the next turn is {session.n_turns}")
    index = session.n_turns if spec.turn is None else spec.turn
    await check_min_version(ctx, spec.min_version)
    turn = await run_turn(ctx, session, spec, index)
    request_id = request_id or _request_id()
    n = len(turn.output_ids)
    low, high = turn.version_range()
    per_version = version_tokens(turn.weight_versions)
    f16 = ctx.config.f16_support_logprobs
    for _ in range(64):
        if turn.turn != index:
            turn = replace(turn, turn=index)
        try:
            blob, stored = encode_stored(turn, f16=f16)
        except ValueError as exc:
            raise ApiError(502, f"engine of replica {turn.replica} sent unusable records: {exc}") from None
        try:
            index = await ctx.store.append_turn(
                session_id,
                request_id,
                blob,
                group=turn.group,
                replica=turn.replica,
                tokens=n,
                min_version=low,
                max_version=high,
                expected_turn=index,
                version_tokens=per_version,
            )
            break
        except TurnConflict as exc:  # another turn of this session was recorded meanwhile
            if spec.turn is not None:
                raise ApiError(
                    409, f"turn: expected {spec.turn} but the next turn is {exc.next_turn}"
                ) from None
            index = exc.next_turn
        except SessionFinished:
            raise ApiError(
                409, f"session {session_id!r} was finished during the turn; not recorded"
            ) from None
        except SessionNotFound:
            raise ApiError(404, f"session {session_id!r} was deleted during the turn") from None
    else:
        raise ApiError(409, "too many concurrent turns on one session")
    metrics = ctx.metrics
    metrics.turns.labels(turn.group).inc()
    metrics.tokens.labels(turn.group).inc(n)
    metrics.turn_seconds.labels(turn.group).observe(time.perf_counter() - t0)
    if stored.turn != index:
        stored = replace(stored, turn=index)
    return dumps(stored.to_json(session_id, with_input=False))


async def check_min_version(ctx: RouterContext, min_version: int | None) -> None:
    """Refuse (409, :class:`~router.schemas.VersionConflict` fields) a ``min_version`` above the
    latest published version, or, with none published, above the newest version a live replica
    serves; accept it when neither is known (the dispatcher then answers). The latest is read
    again from the state store before refusing, so a version another router published since this
    one's last poll is not refused. Raises StateError as the store does."""
    if min_version is None:
        return
    latest = ctx.latest_version()
    if latest is not None and min_version <= latest:
        return
    stored = await ctx.store.get_latest_version()
    if stored is not None:
        latest = stored if latest is None else max(latest, stored)
    served = ctx.registry.max_active_version()
    bound = latest if latest is not None else served
    if bound is None or min_version <= bound:
        return
    if latest is not None:
        why = f"the latest published version is {latest}"
    else:
        why = f"no version is published and the newest a replica serves is {served}"
    raise ApiError(
        409,
        f"min_version {min_version} cannot be met: {why}; publish it first or ask for a lower one",
        fields={
            "constraint": "min_version",
            "target_version": min_version,
            "latest_version": latest,
            "served_version": served,
        },
    )


_PREFIX = secrets.token_hex(8)
_COUNTER = itertools.count()


def _request_id() -> str:
    """Unique per call (a random per-process prefix and a counter): the idempotency key of
    one append."""
    return f"{_PREFIX}{next(_COUNTER):x}"

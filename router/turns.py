"""One turn of a session, end to end, shared by the FastAPI route and the hot path
(:mod:`router.hotpath`): check the session is open, generate with failover
(:func:`router.dispatch.run_turn`), record the turn exactly once, answer with what was stored.

Contract of :func:`record_turn`: on success the turn is stored once (a conflict with a
concurrent turn of the same session re-numbers it, unless the caller pinned ``turn``) and the
returned JSON bytes are the issue's turn object with the stored (float32 / float16) values;
on any :class:`~router.errors.ApiError` nothing was stored.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import replace

from fleet.jsonio import dumps
from router.context import RouterContext
from router.dispatch import run_turn
from router.errors import ApiError
from router.records import TurnData, encode_head, encode_stored
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


async def record_turn(ctx: RouterContext, session_id: str, spec: TurnSpec) -> bytes:
    """Generate, record and return (as JSON bytes) the next turn of ``session_id``."""
    session = await ctx.store.get_session(session_id)
    if session is None or session.status != "open":
        session = await load_open(ctx, session_id)  # refused there, with its message
    if spec.turn is not None and spec.turn != session.n_turns:
        raise ApiError(409, f"turn: expected {spec.turn} but the next turn is {session.n_turns}")
    index = session.n_turns if spec.turn is None else spec.turn
    result = await run_turn(ctx, session, spec, index)
    if result.group != session.group or result.replica_id != session.replica:
        try:
            await ctx.store.set_route(session_id, result.group, result.replica_id)
        except SessionNotFound:
            raise ApiError(404, f"session {session_id!r} was deleted during the turn") from None
    request_id = _request_id()
    turn = result.turn
    n = len(turn.output_ids)
    f16 = ctx.config.f16_support_logprobs
    for _ in range(64):
        if turn.turn != index:
            turn = replace(turn, turn=index)
        try:
            if result.body is not None:  # already as stored: only the header is encoded here
                head = encode_head(turn, f16)
                head += result.body
                blob, stored = bytes(head), turn
            else:
                blob, stored = encode_stored(turn, f16=f16)
        except ValueError as exc:
            raise ApiError(
                502, f"engine of replica {result.replica_id} sent unusable records: {exc}"
            ) from None
        try:
            index = await ctx.store.append_turn(
                session_id,
                request_id,
                blob,
                group=result.group,
                tokens=n,
                min_version=result.min_version,
                max_version=result.max_version,
                expected_turn=index,
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
    metrics.turns.labels(result.group).inc()
    metrics.tokens.labels(result.group).inc(n)
    if stored.turn != index:
        stored = replace(stored, turn=index)
    return turn_json(stored, session_id)


_PREFIX = secrets.token_hex(8)
_COUNTER = itertools.count()


def _request_id() -> str:
    """Unique per call (a random per-process prefix and a counter): the idempotency key of
    one append."""
    return f"{_PREFIX}{next(_COUNTER):x}"


def turn_json(turn: TurnData, session_id: str) -> bytes:
    """``dumps(turn.to_json(session_id, with_input=False))``, without its copies: the rows
    are serialized as they are and :func:`fleet.jsonio.dumps` writes non-finite floats as
    null, as ``to_json`` would."""
    records = [
        {
            "token_id": tok,
            "logprob": lp,
            "raw_logprob": raw,
            "support_ids": ids,
            "support_logprobs": lps,
            "weight_version": version,
        }
        for tok, lp, raw, ids, lps, version in zip(
            turn.output_ids,
            turn.logprobs,
            turn.raw_logprobs,
            turn.support_ids,
            turn.support_logprobs,
            turn.versions(),
            strict=True,
        )
    ]
    return dumps(
        {
            "session_id": session_id,
            "turn": turn.turn,
            "group": turn.group,
            "replica": turn.replica,
            "output_ids": turn.output_ids,
            "finish_reason": turn.finish_reason,
            "records": records,
            "weight_versions": turn.weight_versions,
            "timings": turn.timings,
            "moved_from": turn.moved_from,
        }
    )

"""Retried turns: a turn request carrying an ``Idempotency-Key`` header is sampled and recorded at
most once per session; a retry with the same key answers the recorded turn.

Contract of :func:`answer_turn` (every turn route calls it: the token API and the chat APIs):

* Without a key it is :func:`router.turns.record_turn`.
* With a key, the turn is appended under the request id ``k:<key>`` (the state store's appends
  are idempotent per request id and :meth:`~router.state.base.StateStore.turn_for_request` reads
  what one stored, for as long as the session is kept), so any router process answers a retry:
  when a turn was recorded under the key, the answer is that turn (the same JSON as the first
  answer, with the supports if the retry asks ``return_support``; the request's body is not
  compared otherwise, and neither a finished session nor ``turn`` refuses it). A key is scoped
  to its session.
* A retry while the first request with that key still runs **waits** for it (in the same router
  process) and then answers what it recorded; if the first recorded nothing (its client
  disconnected and it was aborted, :mod:`router.disconnect`, or it failed), the retry samples
  itself. On another router process a concurrent retry samples too, but only the first append
  is stored and both answer the stored turn.
* A key is 1-255 visible ASCII characters, else 422.

The ``openai`` (3.57.0) and ``anthropic`` (2.15.0) Python clients generate an idempotency key
per call but send it only under a client's ``_idempotency_header``, which both leave unset
(openai/_base_client.py 470 and 544-546, anthropic/_base_client.py 460 and 556-567): their
automatic retries carry no key. A harness sends one with ``extra_headers={"Idempotency-Key":
key}`` (kept on each of the client's own retries of that call).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

from clients.engine_stream import TokenCallback
from core.jsonio import dumps
from router.context import RouterContext
from router.errors import ApiError
from router.records import decode_turn
from router.schemas import TurnSpec
from router.turn_data import TurnData
from router.turns import record_turn

HEADER = "Idempotency-Key"
KEY_DOC = (
    "1-255 visible ASCII characters; a retry with the same key answers the turn recorded under it "
    "instead of sampling again (a retry while the first still runs waits for it)"
)
_KEY = re.compile(r"[\x21-\x7e]{1,255}")
_REQUEST = "k:"  # the store's request id of a keyed turn: k:<key> (fresh ids are hex)
_RUNNING: dict[tuple[str, str], asyncio.Future[None]] = {}


async def answer_turn(
    ctx: RouterContext,
    session_id: str,
    spec: TurnSpec,
    key: str | None,
    on_tokens: TokenCallback | None = None,
) -> bytes:
    """The turn's answer (JSON bytes, as :func:`record_turn`), recorded at most once per ``key``;
    ``on_tokens`` gets the new ids of the turn this call samples, if it samples one."""
    if key is None:
        return await record_turn(ctx, session_id, spec, on_tokens=on_tokens)
    slot = (session_id, key)
    while True:
        found = await recorded_turn(ctx, session_id, key, with_support=spec.return_support)
        if found is not None:
            return found
        if slot not in _RUNNING:  # no other waiter took the turn during the lookup: this one runs it
            break
    done = asyncio.get_running_loop().create_future()
    _RUNNING[slot] = done
    try:
        answer = await record_turn(ctx, session_id, spec, request_id=_REQUEST + key, on_tokens=on_tokens)
    finally:
        if _RUNNING.get(slot) is done:
            del _RUNNING[slot]
        done.set_result(None)
    stored = await ctx.store.turn_for_request(session_id, _REQUEST + key)
    if stored is not None and (first := _answer(session_id, stored[1], spec.return_support)) != answer:
        return first  # another router process recorded this key first
    return answer


def _answer(session_id: str, blob: bytes, with_support: bool) -> bytes:
    """The answer of a recorded turn block: the JSON :func:`record_turn` returned for it."""
    return dumps(decode_turn(blob).to_json(session_id, with_input=False, with_support=with_support))


async def recorded_turn(ctx: RouterContext, session_id: str, key: str, *, with_support: bool) -> bytes | None:
    """The answer of the turn recorded under ``key`` in ``session_id`` (None: none), as
    :func:`recorded`, with the records' supports if ``with_support``."""
    found = await recorded(ctx, session_id, key)
    if found is None:
        return None
    return dumps(found.to_json(session_id, with_input=False, with_support=with_support))


async def recorded(ctx: RouterContext, session_id: str, key: str) -> TurnData | None:
    """The turn recorded under ``key`` in ``session_id`` (None: none), once no request with
    ``key`` runs in this process any more (422 for a malformed key). A route that must know
    before it builds its turn (a chat route rendering the context) calls this first, then
    :func:`answer_turn`, and answers from what this then reads."""
    if not _KEY.fullmatch(key):
        raise ApiError(422, f"{HEADER}: must be 1-255 visible ASCII characters, got {key[:40]!r}")
    while (running := _RUNNING.get((session_id, key))) is not None:
        await asyncio.shield(running)  # the first request with this key: wait for its outcome
    found = await ctx.store.turn_for_request(session_id, _REQUEST + key)
    if found is None:
        return None
    turn = decode_turn(found[1])
    return turn if turn.turn == found[0] else replace(turn, turn=found[0])

"""Retried turns: a turn request carrying an ``Idempotency-Key`` header is sampled and recorded at
most once per session; a retry with the same key answers the recorded turn.

Contract of :func:`answer_turn` (every turn route calls it: the token API and the chat APIs):

* Without a key it is :func:`router.turns.record_turn`.
* With a key, the turn is appended under the request id ``k:<key>`` with the request's digest
  (:func:`request_digest`: SHA-256 of its canonical form; the state store's appends are
  idempotent per request id and :meth:`~router.state.base.StateStore.turn_for_request` reads
  what one stored, for as long as the session is kept), so any router process answers a retry:
  when a turn was recorded under the key, the answer is that turn (the same JSON as the first
  answer, with the supports if the retry asks ``return_support``; neither a finished session
  nor ``turn`` refuses it). A key is scoped to its session.
* A key reused with a different request (another digest) is refused with 422 naming the key,
  as the IETF's ``draft-ietf-httpapi-idempotency-key-header`` says (its error scenarios: 422
  for a key reused with a different payload, 409 while the first request is still processed);
  the chat APIs answer it as their 400 ``invalid_request_error``
  (:func:`router.chat.service.api_error`). The digest covers what the turn is made of, not how
  its answer is presented: the token route's body as validated (``input_ids`` or
  ``append_ids``, the sampling parameters as the engine gets them, ``min_version``,
  ``max_version_age``, ``turn``) without ``return_support``; a chat route's request in the
  API-neutral form both APIs are read into (:class:`router.chat.service.ChatRequest`: messages,
  tools, sampling options, stop sequences) without ``stream`` and the log-prob options. Two
  bodies that differ only in key order, spacing or a default spelled out are the same request.
  A turn recorded without a digest (by a router before this check) answers any retry.
* A retry while the first request with that key still runs **waits** for it (in the same router
  process; the draft's 409 for a request still in progress does not arise) and then answers
  what it recorded, or refuses a different request as above; if the first recorded nothing
  (its client disconnected and it was aborted, :mod:`router.disconnect`, or it failed), the
  retry samples itself. On another router process a concurrent retry samples too, but only the
  first append is stored and both answer the stored turn (a different request: the later one
  is refused).
* A key is 1-255 visible ASCII characters, else 422.
* Every answer of a recorded turn to a request that did not record it counts in
  ``mixfleet_router_turn_replays_total``: ``found`` (nothing sampled) or ``raced`` (sampled, then
  another router process's turn under the key answered); with ``mixfleet_router_turns_total`` it
  tells how often clients retry turns and how much sampling the races discarded.

The ``openai`` (3.57.0) and ``anthropic`` (2.15.0) Python clients generate an idempotency key
per call but send it only under a client's ``_idempotency_header``, which both leave unset
(openai/_base_client.py 470 and 544-546, anthropic/_base_client.py 460 and 556-567): their
automatic retries carry no key. A harness sends one with ``extra_headers={"Idempotency-Key":
key}`` (kept on each of the client's own retries of that call).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import replace
from typing import Any

from clients.engine_stream import TokenCallback
from core.jsonio import dumps
from router.context import RouterContext
from router.errors import ApiError
from router.records import decode_turn
from router.schemas import TurnSpec
from router.turn_data import TurnData
from router.turns import Recorded, record_turn

HEADER = "Idempotency-Key"
KEY_DOC = (
    "1-255 visible ASCII characters; a retry with the same key answers the turn recorded under it "
    "instead of sampling again (a retry while the first still runs waits for it); the key reused "
    "with a different request is refused (422; the chat APIs: 400)"
)
_KEY = re.compile(r"[\x21-\x7e]{1,255}")
_REQUEST = "k:"  # the store's request id of a keyed turn: k:<key> (fresh ids are hex)
_RUNNING: dict[tuple[str, str], asyncio.Future[None]] = {}


def check_key(key: str) -> str:
    """``key`` if it is a well-formed ``Idempotency-Key`` (1-255 visible ASCII characters), else
    422 naming the header (every route that takes the header checks it here)."""
    if not _KEY.fullmatch(key):
        raise ApiError(422, f"{HEADER}: must be 1-255 visible ASCII characters, got {key[:40]!r}")
    return key


def request_digest(request: Any) -> str:
    """SHA-256 (hex) of ``request``'s canonical form: compact JSON with sorted keys, arrays as
    lists (:func:`core.jsonio.dumps`). The caller passes what makes the turn, as validated (the
    module docstring lists it per route)."""
    return hashlib.sha256(dumps(request, sort_keys=True)).hexdigest()


def spec_digest(spec: TurnSpec) -> str:
    """:func:`request_digest` of a token turn: its spec without ``return_support``."""
    return request_digest({k: v for k, v in spec._asdict().items() if k != "return_support"})


async def answer_turn(
    ctx: RouterContext,
    session_id: str,
    spec: TurnSpec,
    key: str | None,
    on_tokens: TokenCallback | None = None,
    *,
    digest: str | None = None,
) -> Recorded:
    """The turn recorded for this request (as :func:`record_turn`), recorded at most once per
    ``key`` (422 when the key holds a turn of another request: ``digest``, default
    :func:`spec_digest` of ``spec``); ``on_tokens`` gets the new ids of the turn this call
    samples, if it samples one. ``sampled`` is False when the answer is a turn recorded before."""
    if key is None:
        return await record_turn(ctx, session_id, spec, on_tokens=on_tokens)
    digest = spec_digest(spec) if digest is None else digest
    slot = (session_id, key)
    while True:
        found = await recorded(ctx, session_id, key, digest)
        if found is not None:
            ctx.metrics.turn_replays.labels("found").inc()
            answer = dumps(found.to_json(session_id, with_input=False, with_support=spec.return_support))
            return Recorded(answer, found, False, digest)
        if slot not in _RUNNING:  # no other waiter took the turn during the lookup: this one runs it
            break
    done = asyncio.get_running_loop().create_future()
    _RUNNING[slot] = done
    try:
        result = await record_turn(
            ctx, session_id, spec, request_id=_REQUEST + key, request_digest=digest, on_tokens=on_tokens
        )
    finally:
        if _RUNNING.get(slot) is done:
            del _RUNNING[slot]
        done.set_result(None)
    if not result.sampled:  # another router process recorded this key first
        _check_digest(key, result.digest, digest)
        ctx.metrics.turn_replays.labels("raced").inc()
    return result


def _check_digest(key: str, stored: str, digest: str | None) -> None:
    """422 when the turn recorded under ``key`` was made by another request than ``digest``
    (a turn stored without a digest, or a caller giving none, is not compared)."""
    if stored and digest and stored != digest:
        raise ApiError(
            422,
            f"{HEADER} {key!r} was used with a different request in this session: a retry must repeat "
            "its request exactly; a new request needs a new key",
        )


async def recorded(
    ctx: RouterContext, session_id: str, key: str, digest: str | None = None
) -> TurnData | None:
    """The turn recorded under ``key`` in ``session_id`` (None: none), once no request with
    ``key`` runs in this process any more (422 for a malformed key, and when the turn was made
    by another request than ``digest``). A route that must know before it builds its turn (a chat
    route rendering the context) calls this first, then :func:`answer_turn`, and answers from
    what this then reads."""
    check_key(key)
    while (running := _RUNNING.get((session_id, key))) is not None:
        await asyncio.shield(running)  # the first request with this key: wait for its outcome
    found = await ctx.store.turn_for_request(session_id, _REQUEST + key)
    if found is None:
        return None
    _check_digest(key, found.request_digest, digest)
    turn = decode_turn(found.blob)
    return turn if turn.turn == found.index else replace(turn, turn=found.index)

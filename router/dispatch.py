"""How a turn reaches an engine, with failover.

* :func:`run_turn` sends one turn to a replica of the session's group (its affinity replica
  when in rotation), and on a refused or dropped connection, a 5xx (a 503 included: a replica
  not ready, or Modal's proxy without a container), a generation the engine aborted
  (:class:`~clients.engine.EngineAborted`: its tokens are discarded, never recorded) or a
  second timeout (a first timeout is retried on the same replica while it stays in rotation:
  slow is not dead; a timeout is ``engine_timeout_s`` without a byte of the answer,
  :class:`~router.config.RouterConfig`) marks the replica failed and retries on another replica
  of the group; a retryable refusal (409: the replica cannot meet the version constraint now;
  429: Modal's proxy refused a container over its ``max_concurrency``) retries on another
  replica without marking it failed. A request whose replica the registry finds lost while it
  runs (no sign of health for ``heartbeat_timeout_s``: :meth:`Registry.lost`; never a replica
  that is activating a version) is abandoned at once: cancelled (the turn's engine request is
  aborted, best effort) and retried on another replica, reason ``lost``. When the group
  has none left, the session moves to another group (chosen by the policy; for a session with
  ``record_routes``, among the groups whose engines return routed experts) and the turn records
  ``moved_from``; only when no group can take it does the caller see a 503. Nothing is stored
  here: the caller records the returned turn once, and nothing of a failed or abandoned attempt.

Each engine request carries a fresh ``rid`` (SGLang's ``GenerateReqInput.rid``, managers/io_struct.py
177-180). When the turn's task is cancelled (its client disconnected: :mod:`router.disconnect`),
an attempt times out or its replica is lost, the attempt's replica gets ``POST /abort_request
{"rid": ...}`` (entrypoints/http_server.py 1721-1731), so the engine stops generating tokens
nobody will record.

Every attempt goes through :meth:`RouterContext.replica_client`, so on Modal it is pinned to the
chosen replica's own container (:mod:`router.pinning`): the replica that failed is the one marked
failed, failover reaches another container, and the recorded ``replica`` is where the turn ran.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Collection, Coroutine
from typing import Any, NamedTuple, TypeVar

import numpy as np

from clients.engine import EngineError, EngineRejected, EngineUnavailable, Generation, SGLangClient
from clients.engine_stream import TokenCallback
from core.jsonio import Fragment
from core.tasks import Interrupt
from router.context import RouterContext
from router.engine_answer import EngineAnswer, read_answer, turn_of
from router.errors import ApiError, unavailable
from router.metrics import CONTEXT_TEXT
from router.policy import assign_group, choose_replica
from router.registry import Registry
from router.schemas import TurnSpec
from router.segments import Ids, as_ids
from router.state.base import SessionInfo
from router.turn_data import TurnData

log = logging.getLogger("mixfleet.router")
MIN_VERSION_HEADER = "X-Mixfleet-Min-Version"
T = TypeVar("T")


class Placement(NamedTuple):
    """Where a request finally ran: ``moved_from`` is set when it left ``start_group``;
    ``attempts`` requests were sent, and those that did not answer took ``failed_s`` seconds."""

    group: str
    replica_id: str
    url: str
    moved_from: str | None
    attempts: int
    failed_s: float = 0.0


class ReplicaLost(Exception):
    """The request on ``replica_id`` (at ``url``) was abandoned: the registry found the replica
    lost, ``silent_s`` seconds without a sign of health (:meth:`Registry.lost`)."""

    def __init__(self, replica_id: str, url: str, silent_s: float) -> None:
        self.replica_id = replica_id
        self.url = url
        self.silent_s = silent_s
        self.message = f"replica {replica_id} lost: no sign of health for {silent_s:.1f} s"
        super().__init__(f"{url}: {self.message}")


async def _attempt(registry: Registry, replica: Any, call: Coroutine[Any, Any, T]) -> T:
    """The result of ``call``, the request of one attempt on ``replica`` (a :class:`Replica` or a
    view), awaited in the caller's task inside :meth:`Registry.attempt`. Raises
    :class:`ReplicaLost` when the registry finds the replica lost before ``call`` finished:
    ``call`` is then cancelled (its own cancellation handling ran: :func:`run_turn`'s sends the
    abort) and nothing of it is kept. A cancellation of the caller cancels ``call`` too and is
    raised as such; whatever ``call`` ends in, the caller's task is left with no cancellation of
    this function's pending. Once ``call`` has answered, the caller yields to the event loop once,
    so that turns whose engine request or answer is ready go before this one's records are built."""
    with registry.attempt(replica.replica_id) as lost:
        interrupt = Interrupt()

        def on_lost(_: asyncio.Future[float]) -> None:
            interrupt.fire()

        lost.add_done_callback(on_lost)
        try:
            result = await call
        except asyncio.CancelledError:
            if interrupt.close():  # the loss was the only cancellation: fail over
                raise ReplicaLost(replica.replica_id, replica.url, lost.result()) from None
            raise
        finally:  # an answer or error that came as the replica was found lost is kept
            interrupt.close()
            lost.remove_done_callback(on_lost)
    await asyncio.sleep(0)
    return result


async def with_failover(
    ctx: RouterContext,
    start_group: str,
    affinity: str | None,
    send: Callable[[SGLangClient, str], Coroutine[Any, Any, T]],
    *,
    min_version: int | None = None,
    may_move: bool = True,
    exclude: Collection[str] = frozenset(),
    committed: Callable[[], bool] = lambda: False,
) -> tuple[T, Placement]:
    """Run ``send(client, group)`` with the engine client of a replica in rotation and its group
    (:meth:`RouterContext.replica_client`), failing over as the module says; the request never
    moves to a group in ``exclude``.

    ``send`` raises EngineUnavailable (retry elsewhere), EngineRejected (4xx: passed up as
    422/4xx unless retryable, 409 or 429; a 401/403, the replica refusing the router's own
    credentials, as 502) or ValueError (a malformed engine response: retry elsewhere); it is
    cancelled when its replica is lost, and the request then fails over unless ``committed()``
    says part of its answer already reached the caller (then ApiError 502).
    """
    latest = ctx.latest_version()
    group = start_group
    moved_from: str | None = None
    tried: set[str] = set()
    timeouts: dict[str, int] = {}
    groups_tried: set[str] = set(exclude)
    attempts = 0
    failed_s = 0.0
    limit = 2 * ctx.config.max_attempts + len(ctx.fleet.groups)
    last_error = "no replica in rotation"
    registry = ctx.registry
    while True:
        own = affinity if group == start_group else None
        replica = _pick(registry, group, own, tried, latest, min_version)
        if _shed(registry, own, replica, attempts):
            ctx.metrics.replica_moves.labels(group).inc()
        if replica is None:
            groups_tried.add(group)
            new_group = await _move(
                ctx, group, tried, latest, min_version, may_move, groups_tried, last_error
            )
            ctx.metrics.moves.labels(group, new_group).inc()
            moved_from = moved_from or start_group
            group = new_group
            continue
        attempts += 1
        if attempts > limit:
            raise unavailable(f"gave up after {attempts - 1} attempts ({last_error})")
        client = ctx.replica_client(replica.replica_id, replica.url)
        started = time.perf_counter()
        try:
            result = await _attempt(registry, replica, send(client, group))
        except (ReplicaLost, EngineError, ValueError) as exc:
            failed_s += time.perf_counter() - started
            if isinstance(exc, ReplicaLost) and committed():
                raise ApiError(502, f"engine {replica.url} failed mid-stream: {exc.message}") from None
            reason, last_error = _failed(ctx, replica, exc, timeouts)
            ctx.metrics.failovers.labels(group, reason).inc()
            if reason != "timeout_retry":
                tried.add(replica.replica_id)
            continue
        registry.touch(replica.replica_id)  # alive (passive health)
        return result, Placement(group, replica.replica_id, replica.url, moved_from, attempts, failed_s)


def _failed(
    ctx: RouterContext, replica: Any, exc: ReplicaLost | EngineError | ValueError, timeouts: dict[str, int]
) -> tuple[str, str]:
    """The failover reason (:data:`router.metrics.FAILOVER_REASONS`) and message of an attempt on
    ``replica`` that raised ``exc``: ``timeout_retry`` for a replica's first timeout (counted in
    ``timeouts``; the caller may pick it again), ``unavailable`` (the replica is marked failed),
    ``lost``, ``busy`` or ``version`` for a retryable refusal, ``bad_response``. Raises the
    ApiError of a refusal no other replica would change."""
    if isinstance(exc, ReplicaLost):
        log.warning("abandoned a request on %s (%s): %s", replica.replica_id, replica.url, exc.message)
        return "lost", exc.message
    if isinstance(exc, EngineUnavailable):
        if "Timeout" in exc.message and timeouts.get(replica.replica_id, 0) == 0:
            timeouts[replica.replica_id] = 1  # slow to connect or answer is not dead: one more try
            return "timeout_retry", exc.message
        ctx.registry.mark_failed(replica.replica_id, ctx.config.failure_cooldown_s, exc.message)
        return "unavailable", exc.message
    if isinstance(exc, EngineRejected):
        if not exc.retryable:
            raise _refused(exc, replica.url) from None
        return ("busy" if exc.status == 429 else "version"), exc.message  # 429: the container is full
    return "bad_response", f"bad engine response: {exc}"


async def _move(
    ctx: RouterContext,
    group: str,
    tried: set[str],
    latest: int | None,
    min_version: int | None,
    may_move: bool,
    groups_tried: set[str],
    last_error: str,
) -> str:
    """The group a request that no replica of ``group`` can serve moves to (the policy's choice
    outside ``groups_tried``); raises 503 when replicas of ``group`` remain that only wait for
    ``min_version``, when the request may not move, or when no group is left."""
    views = ctx.registry.views(group, latest) if min_version is not None else []
    if any(v.replica_id not in tried for v in views):
        raise unavailable(
            f"no replica of group {group} serves weight version >= {min_version} yet "
            f"(latest published: {latest})",
            retry_after=1.0,
        )
    if not may_move:
        raise unavailable(f"no replica of group {group} can serve ({last_error})")
    try:
        return await assign_group(ctx, exclude=groups_tried)
    except ApiError:
        raise unavailable(f"no sampler group can serve this request ({last_error})") from None


def _pick(
    registry: Registry,
    group: str,
    affinity: str | None,
    tried: set[str],
    latest: int | None,
    min_version: int | None,
) -> Any:
    """The session's own replica ``affinity`` when it can serve (what :func:`choose_replica` would
    pick) and is not :meth:`~Registry.overloaded`, else the policy's choice among the group's
    candidates not ``tried`` (an overloaded affinity replica only when no other is less loaded);
    None when there is none. A :class:`Replica` or a view: either has ``replica_id`` and ``url``."""
    mine = None
    if affinity is not None and affinity not in tried:
        mine = registry.serves(affinity, group, latest, min_version)
        if mine is not None and not registry.overloaded(affinity):
            return mine  # the common case: no scan of the group
    views = registry.views(group, latest, min_version=min_version)
    if mine is not None:  # overloaded: the least-loaded other replica, if it has less to do
        own = next((v for v in views if v.replica_id == affinity), None)
        other = choose_replica(views, None, tried | {affinity})
        return other if other is not None and own is not None and other.load < own.load else mine
    return choose_replica(views, affinity, tried)


def _shed(registry: Registry, own: str | None, replica: Any, attempts: int) -> bool:
    """Whether the first pick of a turn left the session's replica ``own`` because it is
    overloaded (load-aware affinity: :meth:`Registry.overloaded`)."""
    moved = own is not None and replica is not None and replica.replica_id != own
    return attempts == 0 and moved and registry.overloaded(own)


def _refused(exc: EngineRejected, url: str) -> ApiError:
    """What the caller sees of a refusal no other replica would change: a 401/403 (the replica
    refusing the router's own credentials: Modal's proxy auth) as 502, a 400 as 422, else its
    status."""
    if exc.status in (401, 403):
        return ApiError(
            502,
            f"replica {url} refused the router's credentials ({exc.message}); "
            "set MIXFLEET_PROXY_KEY and MIXFLEET_PROXY_SECRET to the servers' proxy auth token",
        )
    return ApiError(422 if exc.status == 400 else exc.status, f"engine refused the request: {exc.message}")


_ABORTS: set[asyncio.Task[None]] = set()


def abort_later(client: SGLangClient, rid: str) -> None:
    """Send ``/abort_request`` for ``rid`` to ``client``'s engine in the background (it runs on
    when the caller's task is being cancelled); a failure is logged, never raised."""
    task = asyncio.get_running_loop().create_task(_abort(client, rid))
    _ABORTS.add(task)
    task.add_done_callback(_ABORTS.discard)


async def _abort(client: SGLangClient, rid: str) -> None:
    try:
        await client.abort_request(rid)
    except EngineError as exc:
        log.warning("could not abort request %s on %s: %s", rid, client.base_url, exc.message)


def effective_min_version(
    ctx: RouterContext, min_version: int | None, max_version_age: int | None
) -> int | None:
    if max_version_age is None:
        return min_version
    latest = ctx.latest_version()
    base = latest if latest is not None else ctx.registry.max_active_version()
    if base is None:
        return min_version
    return max(min_version or 0, base - max_version_age)


def check_vocab(ctx: RouterContext, ids: Ids, field: str, offset: int = 0) -> None:
    """Refuse (ApiError 422 naming ``field[offset + i]``) an input id at or above the served
    checkpoint's vocabulary size (:attr:`~router.config.RouterConfig.vocab_size`; None: nothing
    checked). SGLang 0.5.23 would pass it to the model: its tokenizer manager checks only
    ``token_ids_logprob`` against the vocabulary (managers/tokenizer_manager.py 1513-1531), and
    the embedding checks the range only under ``SGLANG_ENABLE_ASYNC_ASSERT`` (default off,
    environ.py 515; layers/vocab_parallel_embedding.py 515-521), else gathers out of its table
    (tp=1 does not mask). A numpy row (a turn's, a score's) is checked in bulk."""
    vocab = ctx.config.vocab_size
    if vocab is None or not len(ids) or (ids.max() if isinstance(ids, np.ndarray) else max(ids)) < vocab:
        return
    i = next(i for i, t in enumerate(ids) if t >= vocab)
    raise ApiError(422, f"{field}[{offset + i}] = {ids[i]} is outside the vocabulary (size {vocab})")


def _input_text(ctx: RouterContext, session: SessionInfo, input_ids: Ids) -> bytes:
    """The JSON text of a turn's whole input (:mod:`router.context_text`), counted as reused or
    encoded."""
    text, reused = ctx.context_text.encode(session.session_id, as_ids(input_ids))
    ctx.metrics.context_text.labels(session.group, CONTEXT_TEXT[not reused]).inc()
    return text


def _ms(seconds: float) -> float:
    """Milliseconds to 3 decimals (``round(seconds * 1000, 3)`` for durations, without its
    decimal conversion)."""
    return int(seconds * 1e6 + 0.5) / 1000 if seconds >= 0 else round(seconds * 1000, 3)


class _Streamed:
    """Passes a streamed turn's new ids to ``on_tokens``; ``started`` once some did."""

    def __init__(self, on_tokens: TokenCallback | None) -> None:
        self.on_tokens = on_tokens
        self.started = False

    async def forward(self, ids: list[int]) -> None:
        self.started = True
        assert self.on_tokens is not None
        await self.on_tokens(ids)


def _route_groups(ctx: RouterContext, session: SessionInfo) -> tuple[set[str], set[str]]:
    """The groups whose engines a turn of ``session`` asks for routed experts, and the groups it
    may not move to. A session with ``record_routes`` asks whichever group serves it and never
    moves to one whose engines cannot return them (:attr:`fleet.specs.GroupSpec.returns_routes`);
    any other session is asked routes by groups with ``record_routes`` only, and may move anywhere."""
    groups = ctx.fleet.groups
    if session.record_routes:
        return {g.name for g in groups if g.returns_routes}, {g.name for g in groups if not g.returns_routes}
    return {g.name for g in groups if g.record_routes}, set()


async def run_turn(
    ctx: RouterContext,
    session: SessionInfo,
    spec: TurnSpec,
    index: int,
    routes_start: int = 0,
    on_tokens: TokenCallback | None = None,
) -> TurnData:
    """Turn ``index`` of ``session``, generated with failover and parsed by
    :func:`router.engine_answer.parse_turn`: its group, replica and ``moved_from`` say where it ran,
    its spans which weight versions produced it. Raises :class:`ApiError` (4xx/503; 502 for an
    engine answer without usable behavior records) when it cannot. The engine gets the input's
    JSON text from ``ctx.context_text`` (:mod:`router.context_text`: only what the session's
    last input did not hold is encoded).

    With ``on_tokens``, the engine request streams (:meth:`SGLangClient.generate`) and ``await
    on_tokens(ids)`` gets the new output ids as they are sampled; the turn is parsed from the final
    chunk as from a whole answer. Failover happens only before the first ids reached
    ``on_tokens``: an engine failure (or a lost replica) after that aborts the request and raises
    ApiError 502. The turn's ``timings`` say where its time went (:func:`_timings`)."""
    t0 = time.perf_counter()
    min_version = effective_min_version(ctx, spec.min_version, spec.max_version_age)
    text = _input_text(ctx, session, spec.input_ids)
    headers = {"Modal-Session-ID": session.session_id}
    if min_version is not None:
        headers[MIN_VERSION_HEADER] = str(min_version)
    recording, unable = _route_groups(ctx, session)
    streamed = _Streamed(on_tokens)

    async def send(client: SGLangClient, group: str) -> tuple[EngineAnswer, float]:
        e0 = time.perf_counter()
        routes = group in recording  # the group that serves it (the turn may have moved) records them
        rid = uuid.uuid4().hex
        try:
            generation = await client.generate(
                Fragment(text),
                spec.params,
                headers=headers,
                rid=rid,
                routed_experts=routes,
                routed_experts_start=routes_start,
                on_tokens=streamed.forward if on_tokens is not None else None,
            )
        except asyncio.CancelledError:  # the caller went away, or the replica was lost: stop the engine
            abort_later(client, rid)
            raise
        except (EngineError, ValueError) as exc:
            if streamed.started:  # ids already reached the caller: no failover
                abort_later(client, rid)
                why = exc.message if isinstance(exc, EngineError) else str(exc)
                raise ApiError(502, f"engine {client.base_url} failed mid-stream: {why}") from None
            if isinstance(exc, EngineUnavailable) and "Timeout" in exc.message:  # may still generate it
                abort_later(client, rid)
            raise
        engine_s = time.perf_counter() - e0
        return _read(generation, client.base_url, len(spec.input_ids)), engine_s

    (answer, engine_s), place = await with_failover(
        ctx,
        session.group,
        session.replica,
        send,
        min_version=min_version,
        exclude=unable,
        committed=lambda: streamed.started,
    )
    ctx.metrics.engine_seconds.labels(place.group).observe(engine_s)
    return turn_of(
        answer,
        index=index,
        group=place.group,
        replica=place.replica_id,
        input_ids=spec.input_ids,
        moved_from=place.moved_from,
        timings=_timings(t0, engine_s, place),
    )


def _timings(t0: float, engine_s: float, place: Placement) -> dict[str, Any]:
    """A turn's ``timings`` (:class:`~router.turn_data.TurnData`), in milliseconds, for a dispatch
    that began at ``t0`` (``time.perf_counter``) and ends now: ``engine_ms`` the answering
    attempt's engine request (``engine_s``), ``failed_ms`` the attempts that did not answer,
    ``router_ms`` the rest (the router's own time), and the ``attempts``."""
    return {
        "engine_ms": _ms(engine_s),
        "failed_ms": _ms(place.failed_s),
        "router_ms": _ms(time.perf_counter() - t0 - engine_s - place.failed_s),
        "attempts": place.attempts,
    }


def _read(generation: Generation, url: str, input_len: int) -> EngineAnswer:
    """The records of the answer (:func:`router.engine_answer.read_answer`), read by the attempt
    that decoded it, before it hands its result on: the decoded answer holds several Python
    objects per output token, and read there they go at once instead of living on, hundreds of
    answers at a time under load, for the garbage collector to traverse. ApiError 502 (no
    failover) when the answer holds no usable behavior records."""
    try:
        return read_answer(
            generation.body,
            input_len=input_len,
            sampling=generation.sampling,
            routed_experts=generation.routed_experts,
            routed_experts_start=generation.routed_experts_start,
        )
    except ValueError as exc:
        raise ApiError(502, f"engine {url} returned no usable behavior records: {exc}") from None

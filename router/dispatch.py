"""How a turn reaches an engine, with failover.

* :func:`run_turn` sends one turn to a replica of the session's group (its affinity replica
  when in rotation), and on a refused or dropped connection, a 5xx, or a second timeout (a
  first timeout is retried on the same replica: slow is not dead) retries on another replica
  of the group; when the group has none left, the session moves to another
  group (chosen by the policy) and the turn records ``moved_from``. Nothing is stored here:
  the caller records the returned turn once.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

from fleet.sglang_client import EngineRejected, EngineUnavailable, reported_version
from router.context import RouterContext
from router.errors import ApiError, unavailable
from router.policy import assign_group, choose_replica
from router.records import TurnData, encode_body, stored_turn
from router.schemas import TurnSpec
from router.state.base import SessionInfo

MIN_VERSION_HEADER = "X-Mixfleet-Min-Version"
T = TypeVar("T")


class TurnResult(NamedTuple):
    """``turn`` as the engine sent it; or, when ``body`` is set, already as it is stored
    (float32 / float16-rounded values) with ``body`` its encoding after the header
    (:func:`router.records.encode_body`, for ``f16`` as configured)."""

    turn: TurnData
    group: str
    replica_id: str
    moved_from: str | None
    min_version: int | None
    max_version: int | None
    body: bytes | None = None


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


_INT = {int}
_NUMBER = {float, int}
_RAW = {float, int, type(None)}
_LIST = {list}


def _record_lists(meta: dict[str, Any], n: int) -> tuple[list, list, list, list] | None:
    """(raw log-probs with None as NaN, mu, support ids, support log-probs) as the engine sent
    them, when each of the four record fields is a list of ``n`` entries and every
    ``output_token_logprobs`` entry has a first item; None otherwise. Values are not checked."""
    triples = meta.get("output_token_logprobs")
    masks = meta.get("output_token_sampling_mask")
    mu = meta.get("output_token_sampling_logprobs")
    support_lps = meta.get("output_token_sampling_support_logprobs")
    for x in (triples, masks, mu, support_lps):
        if type(x) is not list or len(x) != n:
            return None
    try:
        raw = [t[0] for t in triples]
    except (TypeError, IndexError, KeyError):
        return None
    if None in raw:
        raw = [math.nan if x is None else x for x in raw]
    return raw, mu, masks, support_lps


def _plain_records(meta: dict[str, Any], n: int) -> tuple[list, list, list, list] | None:
    """(raw, mu, support ids, support log-probs) when the engine sent every record field for
    every token in the plain JSON form (numbers, None for an unknown raw log-prob, lists of
    ints); None otherwise (the general path then converts, or refuses, value by value)."""
    lists = _record_lists(meta, n)
    if lists is None or n == 0:
        return lists
    raw, mu, masks, support_lps = lists
    if not (
        set(map(type, raw)) <= _RAW
        and set(map(type, mu)) <= _NUMBER
        and set(map(type, masks)) == _LIST
        and set(map(type, support_lps)) == _LIST
        and list(map(len, masks)) == list(map(len, support_lps))
        and set(map(type, itertools.chain.from_iterable(masks))) <= _INT
        and set(map(type, itertools.chain.from_iterable(support_lps))) <= _NUMBER
    ):
        return None
    return lists


def plain_stored(
    body: Any,
    *,
    index: int,
    group: str,
    replica: str,
    input_ids: list[int],
    moved_from: str | None,
    timings: dict[str, Any],
    f16: bool,
) -> tuple[TurnData, bytes] | None:
    """``(as_stored(turn), encode_body(turn))`` for ``turn = turn_from_response(body, ...)``
    in one pass, when the engine sent the plain JSON form (:func:`_plain_records`'s, with
    any numbers as log-probs) and the records encode; None otherwise (the general path then
    parses, encodes, or refuses with its own message). Number types are checked by packing
    them (ints and floats pack as ``float()`` of them, as the general path converts them)."""
    if type(body) is not dict:
        return None
    meta = body.get("meta_info")
    output_ids = body.get("output_ids")
    if type(meta) is not dict or type(output_ids) is not list:
        return None
    n = len(output_ids)
    lists = _record_lists(meta, n)
    if lists is None:
        return None
    raw, mu, masks, support_lps = lists
    try:
        sizes = list(map(len, masks))
        if sizes != list(map(len, support_lps)):
            return None
    except TypeError:
        return None
    if not set(map(type, output_ids)) <= _INT:
        return None
    flat_ids = list(itertools.chain.from_iterable(masks))
    try:
        encoded, logprobs, raws, flat = encode_body(
            input_ids,
            output_ids,
            mu,
            raw,
            sizes,
            flat_ids,
            itertools.chain.from_iterable(support_lps),
            f16,
        )
    except (ValueError, TypeError):
        return None
    # the encoder refused every support id that is not an int or a bool (TypeError) and every
    # row that is not strictly increasing from 0 up; so a bool (0 / 1) can only be a row's first
    # or second id: those are checked here (the general path reads True as 1)
    for row in masks:
        if row and (type(row[0]) is bool or (len(row) > 1 and type(row[1]) is bool)):
            return None
    spans, timings, finish = _header_fields(meta, n, timings)
    fields = {
        "turn": index,
        "group": group,
        "replica": replica,
        "input_ids": input_ids,
        "output_ids": output_ids,
        "weight_versions": spans,
        "finish_reason": finish,
        "timings": timings,
        "moved_from": moved_from,
    }
    return stored_turn(fields, logprobs, raws, masks, flat), bytes(encoded)


def turn_from_response(
    body: Any,
    *,
    index: int,
    group: str,
    replica: str,
    input_ids: list[int],
    moved_from: str | None,
    timings: dict[str, Any],
) -> TurnData:
    """Build the turn record from an SGLang ``/generate`` response. Raises ValueError if the
    response lacks what a behavior record needs."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ValueError("response has no meta_info")
    meta = body["meta_info"]
    output_ids = body.get("output_ids") or []
    if type(output_ids) is not list or not set(map(type, output_ids)) <= _INT:
        output_ids = [int(t) for t in output_ids]
    n = len(output_ids)
    plain = _plain_records(meta, n)
    if plain is not None:
        raw, logprobs, supports, support_values = plain
    else:
        raw, logprobs, supports, support_values = _general_records(meta, output_ids)
    return _turn(
        meta,
        index,
        group,
        replica,
        input_ids,
        output_ids,
        logprobs,
        raw,
        supports,
        support_values,
        moved_from,
        timings,
    )


def _general_records(
    meta: dict[str, Any], output_ids: list[int]
) -> tuple[list[float], list[float], list[list[int]], list[list[float]]]:
    """(raw log-probs, behavior log-probs, supports, support log-probs) of any engine answer
    (upstream SGLang's included), checked as it goes; raises ValueError naming what is wrong."""
    n = len(output_ids)
    triples = meta.get("output_token_logprobs") or []
    if len(triples) != n:
        raise ValueError(f"{len(triples)} output_token_logprobs for {n} output tokens")
    raw = [_num(t[0]) for t in triples]
    masks = meta.get("output_token_sampling_mask")
    if masks is None or len(masks) != n:
        raise ValueError("response lacks output_token_sampling_mask for every token")
    mu = meta.get("output_token_sampling_logprobs")
    support_lps = meta.get("output_token_sampling_support_logprobs")
    logprobs: list[float] = []
    supports: list[list[int]] = []
    support_values: list[list[float]] = []
    for i in range(n):
        ids = [int(x) for x in masks[i]]
        supports.append(ids)
        if support_lps is not None:
            support_values.append([_num(x) for x in support_lps[i]])
        else:  # upstream SGLang: the support's log-probs are not returned
            support_values.append([math.nan] * len(ids))
        if mu is not None and i < len(mu) and not isinstance(mu[i], list):
            logprobs.append(_num(mu[i]))
        elif ids and support_lps is not None:
            logprobs.append(support_values[i][ids.index(output_ids[i])])
        else:
            logprobs.append(raw[i])
    return raw, logprobs, supports, support_values


def _turn(
    meta: dict[str, Any],
    index: int,
    group: str,
    replica: str,
    input_ids: list[int],
    output_ids: list[int],
    logprobs: list[float],
    raw: list[float],
    supports: list[list[int]],
    support_values: list[list[float]],
    moved_from: str | None,
    timings: dict[str, Any],
) -> TurnData:
    spans, timings, finish = _header_fields(meta, len(output_ids), timings)
    return TurnData(
        turn=index,
        group=group,
        replica=replica,
        input_ids=input_ids,
        output_ids=output_ids,
        logprobs=logprobs,
        raw_logprobs=raw,
        support_ids=supports,
        support_logprobs=support_values,
        weight_versions=spans,
        finish_reason=finish,
        timings=timings,
        moved_from=moved_from,
    )


def _header_fields(
    meta: dict[str, Any], n: int, timings: dict[str, Any]
) -> tuple[list[dict[str, int]], dict[str, Any], dict[str, Any] | None]:
    """The weight-version spans, timings and finish reason of a turn from its ``meta_info``."""
    spans = []
    for s in meta.get("weight_versions") or []:
        if int(s["end"]) > int(s["start"]):
            spans.append({"version": int(s["version"]), "start": int(s["start"]), "end": int(s["end"])})
    if not spans and n:
        v = reported_version(meta)
        if v is not None:
            spans = [{"version": v, "start": 0, "end": n}]
    if isinstance(meta.get("e2e_latency"), (int, float)):
        timings = {**timings, "engine_e2e_ms": round(float(meta["e2e_latency"]) * 1000, 3)}
    finish = meta.get("finish_reason")
    return spans, timings, finish if isinstance(finish, dict) else None


class Placement(NamedTuple):
    """Where a request finally ran: ``moved_from`` is set when it left ``start_group``."""

    group: str
    replica_id: str
    url: str
    moved_from: str | None
    attempts: int


async def with_failover(
    ctx: RouterContext,
    start_group: str,
    affinity: str | None,
    send: Callable[[str], Awaitable[T]],
    *,
    min_version: int | None = None,
    may_move: bool = True,
) -> tuple[T, Placement]:
    """Run ``send(replica_url)`` on a replica in rotation, failing over as the module says.

    ``send`` raises EngineUnavailable (retry elsewhere), EngineRejected (4xx: passed up as
    422/4xx unless retryable) or ValueError (a malformed engine response: retry elsewhere).
    """
    latest = ctx.latest_version()
    group = start_group
    moved_from: str | None = None
    tried: set[str] = set()
    timeouts: dict[str, int] = {}
    groups_tried: set[str] = set()
    attempts = 0
    limit = 2 * ctx.config.max_attempts + len(ctx.fleet.groups)
    last_error = "no replica in rotation"
    registry = ctx.registry
    while True:
        # the session's own replica when it can serve (what choose_replica would pick), else
        # the policy's choice among the group's candidates
        mine = None
        if affinity is not None and group == start_group and affinity not in tried:
            mine = registry.serves(affinity, group, latest, min_version)
        if mine is not None:
            replica: Any = mine  # a Replica: replica_id and url as a ReplicaView's
        else:
            views = registry.views(group, latest, min_version=min_version)
            replica = choose_replica(views, affinity if group == start_group else None, tried)
        if replica is None:
            if min_version is not None and [
                v for v in ctx.registry.views(group, latest) if v.replica_id not in tried
            ]:
                raise unavailable(
                    f"no replica of group {group} serves weight version >= {min_version} yet "
                    f"(latest published: {latest})",
                    retry_after=1.0,
                )
            if not may_move:
                raise unavailable(f"no replica of group {group} can serve ({last_error})")
            groups_tried.add(group)
            try:
                new_group = await assign_group(ctx, exclude=groups_tried)
            except ApiError:
                raise unavailable(f"no sampler group can serve this request ({last_error})") from None
            ctx.metrics.moves.labels(group, new_group).inc()
            moved_from = moved_from or start_group
            group = new_group
            continue
        attempts += 1
        if attempts > limit:
            raise unavailable(f"gave up after {attempts - 1} attempts ({last_error})")
        rep = mine if mine is not None else registry.replicas.get(replica.replica_id)
        if rep is not None:
            rep.inflight += 1
        try:
            result = await send(replica.url)
        except EngineUnavailable as exc:
            last_error = exc.message
            if "Timeout" in exc.message and timeouts.get(replica.replica_id, 0) == 0:
                # slow to connect or answer is not dead: one more try on the same replica
                timeouts[replica.replica_id] = 1
                ctx.metrics.failovers.labels(group, "timeout_retry").inc()
                continue
            tried.add(replica.replica_id)
            ctx.registry.mark_failed(replica.replica_id, ctx.config.failure_cooldown_s, exc.message)
            ctx.metrics.failovers.labels(group, "unavailable").inc()
            continue
        except EngineRejected as exc:
            if exc.retryable:  # a sidecar that cannot meet the version constraint right now
                last_error = exc.message
                tried.add(replica.replica_id)
                ctx.metrics.failovers.labels(group, "version").inc()
                continue
            raise ApiError(
                422 if exc.status == 400 else exc.status, f"engine refused the request: {exc.message}"
            ) from None
        except ValueError as exc:
            last_error = f"bad engine response: {exc}"
            tried.add(replica.replica_id)
            ctx.metrics.failovers.labels(group, "bad_response").inc()
            continue
        finally:
            if rep is not None:
                rep.inflight -= 1
        if rep is not None and rep.ready:  # registry.touch: alive (passive health)
            now = time.monotonic()
            if now > rep.last_seen:
                rep.last_seen = now
        return result, Placement(group, replica.replica_id, replica.url, moved_from, attempts)


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


def check_vocab(ctx: RouterContext, group: str, rows: list[list[int]], field: str) -> None:
    vocab = ctx.config.vocab_size or ctx.registry.vocab_size(group)
    if vocab is None:
        return
    for r, row in enumerate(rows):
        if not row or max(row) < vocab:
            continue
        for i, t in enumerate(row):
            if t >= vocab:
                where = f"{field}[{i}]" if len(rows) == 1 else f"{field}[{r}][{i}]"
                raise ApiError(422, f"{where} = {t} is outside the vocabulary (size {vocab})")


def _ms(seconds: float) -> float:
    """Milliseconds to 3 decimals (``round(seconds * 1000, 3)`` for durations, without its
    decimal conversion)."""
    return int(seconds * 1e6 + 0.5) / 1000 if seconds >= 0 else round(seconds * 1000, 3)


async def run_turn(ctx: RouterContext, session: SessionInfo, spec: TurnSpec, index: int) -> TurnResult:
    """Generate turn ``index`` with failover. Raises :class:`ApiError` (4xx/503) when it cannot."""
    t0 = time.perf_counter()
    min_version = effective_min_version(ctx, spec.min_version, spec.max_version_age)
    check_vocab(ctx, session.group, [spec.input_ids], "input_ids")
    headers = {"Modal-Session-ID": session.session_id}
    if min_version is not None:
        headers[MIN_VERSION_HEADER] = str(min_version)

    async def send(url: str) -> tuple[Any, float]:
        e0 = time.perf_counter()
        body = await ctx.client(url).generate(spec.input_ids, spec.params, headers=headers)
        return body, time.perf_counter() - e0

    (body, engine_s), place = await with_failover(
        ctx, session.group, session.replica, send, min_version=min_version
    )
    ctx.metrics.engine_seconds.labels(place.group).observe(engine_s)
    timings = {
        "engine_ms": _ms(engine_s),
        "router_ms": _ms(time.perf_counter() - t0 - engine_s),
        "attempts": place.attempts,
    }
    group, replica_id, moved_from = place.group, place.replica_id, place.moved_from
    encoded = None
    try:
        plain = plain_stored(
            body,
            index=index,
            group=group,
            replica=replica_id,
            input_ids=spec.input_ids,
            moved_from=moved_from,
            timings=timings,
            f16=ctx.config.f16_support_logprobs,
        )
        if plain is None:
            turn = turn_from_response(
                body,
                index=index,
                group=group,
                replica=replica_id,
                input_ids=spec.input_ids,
                moved_from=moved_from,
                timings=timings,
            )
        else:
            turn, encoded = plain
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ApiError(502, f"engine {place.url} returned no usable behavior records: {exc}") from None
    spans = turn.weight_versions
    if len(spans) == 1:
        low = high = spans[0]["version"]
    else:
        versions = [s["version"] for s in spans]
        low, high = (min(versions), max(versions)) if versions else (None, None)
    return TurnResult(turn, group, replica_id, moved_from, low, high, encoded)

"""The one parser of an engine's ``/generate`` answer into the turn it records
(:func:`parse_turn`, the local engine's answers and SGLang's alike).

SGLang 0.5.23's shapes: masks in the order its sampler ranked them, most likely first
(layers/sampler.py 607-616 and 821; :func:`parse_turn` sorts each row by id, its log-probs
along); support-mode rows from ``SamplingMaskChunk.to_lists`` (sampling/sampling_mask.py
37-51); span versions as strings (utils/weight_versions.py 17-20); ``finish_reason`` one of
``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}``, ``{"type":
"abort", "message": ..., "status_code": ..., "err_type": ...}`` (managers/schedule_batch.py
279-345; an abort with an error status is answered with that status unstreamed, and streamed is
read as a refusal by :mod:`clients.engine_stream`).
"""

from __future__ import annotations

import itertools
import math
import operator
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import numpy as np

from router.schemas import TOKEN_MAX
from router.turn_data import ROUTES_SECTION, RoutedExperts, Rows, TurnData
from weight_sync.types import parse_version, reported_version

_FLOAT = {float}
_NUMBER = {float, int}
_LIST = {list}
_TOKEN = {int}


class EngineAnswer(NamedTuple):
    """What an engine's ``/generate`` answer records of a turn (:func:`read_answer`): every field
    of its :class:`TurnData` but where it ran, its place in the session and its timings.
    ``e2e_ms``: the engine's own ``e2e_latency`` in milliseconds, when it sent a plausible one."""

    output_ids: list[int]
    logprobs: list
    raw_logprobs: list
    support_ids: Rows
    support_logprobs: Rows
    weight_versions: list[dict[str, int]]
    finish_reason: dict[str, Any] | None
    sampling: dict[str, Any] | None
    sections: dict[str, bytes]
    e2e_ms: float | None


def parse_turn(
    body: Any,
    *,
    index: int,
    group: str,
    replica: str,
    input_ids: Sequence[int],
    moved_from: str | None,
    timings: dict[str, Any],
    sampling: dict[str, Any] | None = None,
    routed_experts: bool = False,
    routed_experts_start: int = 0,
) -> TurnData:
    """Turn ``index`` of a session as recorded from an engine's decoded ``/generate`` answer
    ``body`` (the local engine's or SGLang's), served by ``replica`` of ``group``; ``sampling``
    is what the engine client states about the sampling it sent (:attr:`TurnData.sampling`);
    ``input_ids`` (the whole input) are its ``append_ids`` until :mod:`router.segments` places it.

    A turn sent without a mask (``sampling`` ``{"sampling_mask": false}``, ``router/records.py``) records
    empty supports and mu = ``output_token_logprobs``; it refuses mask fields (SGLang sends none).

    Reads ``output_ids`` and from ``meta_info``: ``output_token_logprobs`` (per token
    ``[logprob, token_id, text]``: the raw log-prob, null = unknown), ``output_token_sampling_mask``
    (per token the support ids, ``[]`` = no filtering), ``output_token_sampling_logprobs`` (per
    token mu, null = unknown; or, with ``sampling_logprobs_mode: support``, per token the
    support's log-probs aligned with the mask), ``weight_versions``
    spans (else one span of ``weight_version`` over every token; in either, SGLang's ``"default"``
    names no version), ``finish_reason`` and ``e2e_latency`` (added to ``timings`` as ``engine_e2e_ms``).

    Each mask may come in any order (SGLang ranks it, most likely first): the records hold it
    sorted by id, its log-probs permuted along. Without the support's log-probs (SGLang's selected
    mode) they are unknown (NaN); where mu is absent or a list, it is
    the sampled token's support log-prob when that is known and its raw log-prob otherwise
    (also for a token with no filtering: its support is the vocabulary). Log-probs come out as
    floats (unknown: NaN; raw: None).

    With ``routed_experts`` (the request asked ``return_routed_experts`` from position
    ``routed_experts_start``), reads ``meta_info.routed_experts`` into the
    :data:`~router.turn_data.ROUTES_SECTION` section (positions ``[routed_experts_start, seqlen -
    1)``); its absence is refused: SGLang answers without the key when
    not started with ``--enable-return-routed-experts``.

    Raises ValueError naming the field (and position) when ``body`` lacks a record field or
    holds a value of the wrong type or length, and for an aborted turn (finish reason ``abort``:
    an aborted generation is never recorded). Duplicate support ids and the float32 range are
    the encoder's checks (:func:`encode_turn`)."""
    answer = read_answer(
        body,
        input_len=len(input_ids),
        sampling=sampling,
        routed_experts=routed_experts,
        routed_experts_start=routed_experts_start,
    )
    return turn_of(
        answer,
        index=index,
        group=group,
        replica=replica,
        input_ids=input_ids,
        moved_from=moved_from,
        timings=timings,
    )


def read_answer(
    body: Any,
    *,
    input_len: int,
    sampling: dict[str, Any] | None = None,
    routed_experts: bool = False,
    routed_experts_start: int = 0,
) -> EngineAnswer:
    """The records of ``body`` (:func:`parse_turn`'s reading of them, for a turn whose whole input
    is ``input_len`` tokens); ValueError as :func:`parse_turn` says. What it returns holds a few
    lists and arrays where ``body`` holds several Python objects per output token: a caller that
    reads the answer where it decoded it lets those objects go at once."""
    meta, output_ids, finish = _answer(body)
    n = len(output_ids)
    raw = _raw_logprobs(_entries(meta, "output_token_logprobs", n))
    if sampling is not None and sampling.get("sampling_mask") is False:
        masks, support_lps, logprobs = _unmasked_records(meta, raw)
    else:
        masks, support_lps, logprobs = _masked_records(meta, output_ids, raw)
    e2e = meta.get("e2e_latency")
    return EngineAnswer(
        output_ids=output_ids,
        logprobs=logprobs,
        raw_logprobs=raw,
        support_ids=masks,
        support_logprobs=support_lps,
        weight_versions=_spans(meta, n),
        finish_reason=finish,
        sampling=sampling,
        sections=_route_sections(meta, routed_experts_start, input_len + n - 1) if routed_experts else {},
        e2e_ms=round(float(e2e) * 1000, 3) if type(e2e) in _NUMBER and 0 <= e2e < 1e9 else None,
    )


def turn_of(
    answer: EngineAnswer,
    *,
    index: int,
    group: str,
    replica: str,
    input_ids: Sequence[int],
    moved_from: str | None,
    timings: dict[str, Any],
) -> TurnData:
    """The turn of :func:`parse_turn` from its :func:`read_answer` (``timings`` gets the engine's
    ``engine_e2e_ms`` when it sent one)."""
    timings = dict(timings)
    if answer.e2e_ms is not None:
        timings["engine_e2e_ms"] = answer.e2e_ms
    return TurnData(
        turn=index,
        group=group,
        replica=replica,
        append_ids=input_ids,
        output_ids=answer.output_ids,
        logprobs=answer.logprobs,
        raw_logprobs=answer.raw_logprobs,
        support_ids=answer.support_ids,
        support_logprobs=answer.support_logprobs,
        weight_versions=answer.weight_versions,
        finish_reason=answer.finish_reason,
        timings=timings,
        moved_from=moved_from,
        sampling=answer.sampling,
        sections=answer.sections,
    )


def _answer(body: Any) -> tuple[dict[str, Any], list[int], dict[str, Any]]:
    """``body``'s ``meta_info``, ``output_ids`` and finish reason (an abort refused first)."""
    if type(body) is not dict:
        raise ValueError("the engine answer is not a JSON object")
    meta = body.get("meta_info")
    if type(meta) is not dict:
        raise ValueError("the engine answer has no meta_info object")
    finish = _finish_reason(meta.get("finish_reason"))  # an abort is refused before anything else
    output_ids = body.get("output_ids")
    if type(output_ids) is not list:
        raise ValueError("output_ids is missing" if output_ids is None else "output_ids is not a list")
    _token_ids(output_ids, "output_ids", TOKEN_MAX)  # they join the context, whose ids a turn sends back
    return meta, output_ids, finish


def _route_sections(meta: dict[str, Any], start: int, end: int) -> dict[str, bytes]:
    return {ROUTES_SECTION: _routes(meta, start, end).to_section()}


def _routes(meta: dict[str, Any], start: int, end: int) -> RoutedExperts:
    """The routed experts of an answer covering positions ``[start, end)`` (ValueError naming
    what is wrong)."""
    rows = max(end - start, 0)
    import base64
    import binascii

    from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG

    text = meta.get("routed_experts")
    if text is None:
        raise ValueError(
            f"meta_info.routed_experts is missing: routes were asked of an engine not started with "
            f"{ENABLE_RETURN_ROUTED_EXPERTS_FLAG}"
        )
    if type(text) is not str:
        raise ValueError("meta_info.routed_experts is not a base64 string")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("meta_info.routed_experts is not base64") from None
    width = len(data) // 4 // rows if rows > 0 else 0
    if len(data) != 4 * rows * width or (rows > 0 and width == 0):
        raise ValueError(
            f"meta_info.routed_experts holds {len(data)} bytes, not int32 rows for {rows} positions"
        )
    return RoutedExperts(start, rows, width, data)


def _masked_records(meta: dict[str, Any], output_ids: list[int], raw: list) -> tuple[Rows, Rows, list]:
    """Supports (sorted by id), their log-probs and mu of an answer with sampling masks; the
    supports each one flat list and array (:class:`~router.turn_data.Rows`), sharing offsets."""
    masks = _entries(meta, "output_token_sampling_mask", len(output_ids))
    _rows(masks, "output_token_sampling_mask", "a list of token ids")
    offsets = [0, *itertools.accumulate(map(len, masks))]
    ids = _mask_ids(masks)
    lps, known = _support_logprobs(meta, offsets)
    logprobs = _behavior_logprobs(meta, output_ids, raw, (ids[1], offsets, lps[1]) if known else None)
    support_ids, support_lps = _sorted_supports(ids, lps, offsets)
    return support_ids, support_lps, logprobs


def _mask_ids(masks: list[list]) -> tuple[list[int], Any]:
    """Every mask's ids, row after row, as one list and one int64 array: one C conversion of the
    list (``struct``'s, which refuses anything but integers of 64 bits), the few values it would
    take for a JSON ``true`` / ``false`` (1, 0) checked for being ints. Else ValueError naming the
    first bad id."""
    flat = _flat(masks)
    try:
        ids = np.frombuffer(struct.pack(f"={len(flat)}q", *flat), dtype=np.int64)
    except struct.error:
        ids = None
    if ids is None or (len(ids) and ids.min() < 0) or not _all_of(int, flat, np.flatnonzero(ids <= 1)):
        for i, row in enumerate(masks):
            _token_ids(row, f"meta_info.output_token_sampling_mask[{i}]")
        raise ValueError("meta_info.output_token_sampling_mask holds a value that is not a token id")
    return flat, ids


def _flat(rows: list[list]) -> list:
    """The rows' values in one list (extended row by row: each row's length is known, so no
    per-value iteration and fewer reallocations than ``list(itertools.chain(...))``)."""
    flat: list = []
    for row in rows:
        flat += row
    return flat


def _all_of(kind: type, flat: list, at: Any) -> bool:
    """Whether the values of ``flat`` at the positions ``at`` are all of type ``kind`` (those a
    converter took from another JSON type: a bool as an int, an int as a float)."""
    return all(type(flat[j]) is kind for j in at.tolist())


_MASK_KEYS = ("output_token_sampling_mask", "output_token_sampling_logprobs")


def _unmasked_records(meta: dict[str, Any], raw: list) -> tuple[Rows, Rows, list]:
    """Empty supports (the whole vocabulary) and mu = the raw log-prob (NaN where unknown) of an
    answer to a request without a sampling mask; refuses mask fields nobody asked for."""
    for key in _MASK_KEYS:
        if meta.get(key) is not None:
            raise ValueError(f"meta_info.{key} is present but no sampling mask was requested")
    n = len(raw)
    logprobs = raw if None not in raw else [math.nan if x is None else x for x in raw]
    offsets = [0] * (n + 1)
    return Rows([], offsets), Rows([], offsets), list(logprobs)


_FINISH_TYPES = ("stop", "length", "abort")  # fleet.sglang_release.FINISH_TYPES


def _finish_reason(value: Any) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` (None: not given); refuses another shape and an abort."""
    if value is None:
        return None
    if type(value) is not dict or value.get("type") not in _FINISH_TYPES:
        raise ValueError(f"meta_info.finish_reason = {value!r} is not a stop, length or abort finish reason")
    if value["type"] == "abort":
        raise ValueError(f"the engine aborted the turn: {value.get('message') or 'Aborted'}")
    return value


def _sorted_supports(ids: tuple[list, Any], lps: tuple[list, Any], offsets: list[int]) -> tuple[Rows, Rows]:
    """The supports with every row in ascending id order, its log-probs permuted along: all rows
    sorted at once by (row, id), equal ids in the engine's order; as they are when every row
    already is in order. Sorted rows are built from their arrays (their lists made when read)."""
    (id_list, id_array), (lp_list, lp_array) = ids, lps
    if len(id_list) > 1:
        starts = np.zeros(len(id_list) + 1, dtype=bool)
        starts[offsets] = True
        if (id_array[1:] < id_array[:-1])[~starts[1:-1]].any():  # a pair out of order within a row
            order = _row_id_order(id_array, offsets)
            return Rows(None, offsets, id_array[order]), Rows(None, offsets, lp_array[order])
    return Rows(id_list, offsets, id_array), Rows(lp_list, offsets, lp_array)


def _row_id_order(ids: Any, offsets: list[int]) -> Any:
    """The permutation that sorts ``ids`` (non-negative int64, row ``i`` from ``offsets[i]``) by
    (row, id, position): a stable sort by (row, id). When (row, id, position) packs into one
    int64, one sort of the packed keys (unique, so any sort gives the stable order) and the
    positions read back from their low bits; else a (stable) lexsort. The keys' sort is numpy's
    ``stable`` kind (a merge of natural runs): the rows already follow each other in key order,
    so it amounts to sorting each row alone, where the default introsort sorts all keys as one."""
    n = len(ids)
    row = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    width, bits = int(ids.max()) + 1, n.bit_length()
    if (width * (len(offsets) - 1)) << bits < 1 << 63:
        keys = ((row * width + ids) << bits) | np.arange(n)
        return np.sort(keys, kind="stable") & ((1 << bits) - 1)
    return np.lexsort((ids, row))  # stable


def _entries(meta: dict[str, Any], key: str, n: int) -> list:
    """``meta[key]``, which must be a list of one entry per output token."""
    value = meta.get(key)
    if type(value) is not list:
        raise ValueError(f"meta_info.{key} is missing" if value is None else f"meta_info.{key} is not a list")
    if len(value) != n:
        raise ValueError(f"meta_info.{key} has {len(value)} entries for {n} output tokens")
    return value


def _rows(rows: list, key: str, what: str) -> None:
    """Refuses ``rows`` unless every entry is a list."""
    if not set(map(type, rows)) <= _LIST:
        i = next(i for i, row in enumerate(rows) if type(row) is not list)
        raise ValueError(f"meta_info.{key}[{i}] = {rows[i]!r} is not {what}")


_ID_MAX = (1 << 63) - 1  # what a record stores (and int64 holds)


def _token_ids(ids: list, where: str, limit: int = _ID_MAX) -> None:
    """Refuses ``ids`` unless every entry is a JSON integer in ``[0, limit]``."""
    if set(map(type, ids)) <= _TOKEN and (not ids or (min(ids) >= 0 and max(ids) <= limit)):
        return
    j = next(j for j, x in enumerate(ids) if type(x) is not int or not 0 <= x <= limit)
    raise ValueError(f"{where}[{j}] = {ids[j]!r} is not a token id (0 to {limit})")


def _floats(values: list, where: str, none: float | None) -> list:
    """``values`` (JSON numbers or null) as floats, null as ``none``; ``values`` itself when it
    already is. Refuses anything else, naming ``where[j]``."""
    kinds = set(map(type, values))
    if kinds <= _FLOAT or (none is None and kinds <= {float, type(None)}):
        return values
    out = []
    for j, x in enumerate(values):
        if x is None:
            out.append(none)
        elif type(x) is float:
            out.append(x)
        elif type(x) is int:
            try:
                out.append(float(x))
            except OverflowError:
                raise ValueError(f"{where}[{j}] = {x!r} is beyond a float's range") from None
        else:
            raise ValueError(f"{where}[{j}] = {x!r} is not a number")
    return out


def _raw_logprobs(triples: list) -> list[float | None]:
    """The first item (the raw log-prob) of every ``[logprob, token_id, text]`` entry."""
    key = "output_token_logprobs"
    _rows(triples, key, "a [logprob, token_id, text] entry")
    try:
        firsts = [t[0] for t in triples]
    except IndexError:
        i = next(i for i, t in enumerate(triples) if not t)
        raise ValueError(f"meta_info.{key}[{i}] is empty, not a [logprob, token_id, text] entry") from None
    kinds = set(map(type, firsts))
    if kinds <= {float, type(None)}:
        return firsts
    for i, x in enumerate(firsts):
        if x is not None and type(x) not in _NUMBER:
            raise ValueError(f"meta_info.{key}[{i}][0] = {x!r} is not a number")
    return _floats(firsts, f"meta_info.{key}", None)


def _support_logprobs(meta: dict[str, Any], offsets: list[int]) -> tuple[tuple[list, Any], bool]:
    """The support's log-probs, row after row as one list and one float64 array (NaN = unknown),
    and whether the engine sent them: SGLang's support-mode rows of
    ``output_token_sampling_logprobs`` (every entry a list, aligned with its mask); in selected
    mode (mu per token) they are unknown."""
    total = offsets[-1]
    key = "output_token_sampling_logprobs"
    mu = meta.get(key)
    if type(mu) is not list or not mu or not set(map(type, mu)) <= _LIST:
        return ([math.nan] * total, np.full(total, math.nan)), False  # selected mode: not returned
    rows = _entries(meta, key, len(offsets) - 1)
    _rows(rows, key, "a list of log-probs")
    got = list(map(len, rows))
    if got != (sizes := list(map(operator.sub, offsets[1:], offsets))):
        i = next(i for i, (a, b) in enumerate(zip(got, sizes, strict=True)) if a != b)
        raise ValueError(f"meta_info.{key}[{i}] has {got[i]} log-probs for {sizes[i]} support ids")
    flat = _flat(rows)
    try:  # one C conversion: refuses null, strings, lists and ints beyond a float; takes bools, ints
        values = np.frombuffer(struct.pack(f"={len(flat)}d", *flat), dtype=np.float64)
    except (struct.error, OverflowError):
        values = None
    if values is None or not _all_of(float, flat, np.flatnonzero(values == np.trunc(values))):
        flat = [x for i, row in enumerate(rows) for x in _floats(row, f"meta_info.{key}[{i}]", math.nan)]
        values = np.array(flat, dtype=np.float64)
    return (flat, values), True


def _behavior_logprobs(
    meta: dict[str, Any], output_ids: list[int], raw: list[float | None], supports: tuple | None
) -> list[float]:
    """mu per token (see :func:`parse_turn`); ``supports``: (ids, offsets, log-probs) of the
    engine's supports, in its order, when it sent their log-probs."""
    key = "output_token_sampling_logprobs"
    mu = meta.get(key)
    from_supports = mu is None  # every token's mu from its support
    if mu is not None:
        mu = _entries(meta, key, len(output_ids))
        kinds = set(map(type, mu))
        if kinds <= _FLOAT:
            return mu
        from_supports = kinds <= _LIST  # SGLang's support mode: a row for every token
    sampled, missing = _sampled_logprobs(output_ids, raw, supports)
    if from_supports:
        if missing.any():
            _not_in_support(output_ids, int(np.argmax(missing)))
        return sampled
    if kinds & _LIST:  # a row of the support in place of some tokens' mu
        for i in (i for i, x in enumerate(mu) if type(x) is list and missing[i]):
            _not_in_support(output_ids, i)
        mu = [sampled[i] if type(x) is list else x for i, x in enumerate(mu)]
    return _floats(mu, f"meta_info.{key}", math.nan)


def _not_in_support(output_ids: list[int], i: int) -> NoReturn:
    """Refuses output token ``i``: its sampled id is not in its (non-empty) support."""
    where = f"meta_info.output_token_sampling_mask[{i}]"
    raise ValueError(f"output token {output_ids[i]} (output_ids[{i}]) is not in {where}")


def _sampled_logprobs(
    output_ids: list[int], raw: list[float | None], supports: tuple | None
) -> tuple[list, Any]:
    """Per token the support log-prob of the sampled token (its first place in the row, in the
    engine's order; ``supports`` as :func:`_behavior_logprobs`), or its raw log-prob (NaN when
    unknown) where the support's log-probs are not known or the row is empty (no filtering: the
    support is the vocabulary); and per token whether it is missing from its non-empty support
    (a bool array). Every row at once."""
    n = len(output_ids)
    values = np.array([math.nan if x is None else x for x in raw] if None in raw else raw, dtype=np.float64)
    if supports is None:
        return values.tolist(), np.zeros(n, dtype=bool)
    ids, offsets, lps = supports
    sizes = np.diff(offsets)
    row = np.repeat(np.arange(n), sizes)
    hits = np.flatnonzero(ids == np.asarray(output_ids, dtype=np.int64)[row])
    hit_rows = row[hits]
    first = hits[np.concatenate(([True], hit_rows[1:] != hit_rows[:-1]))] if len(hits) else hits
    values[row[first]] = lps[first]
    missing = sizes > 0
    missing[row[first]] = False
    return values.tolist(), missing


def _spans(meta: dict[str, Any], n: int) -> list[dict[str, int]]:
    """The non-empty weight-version spans of a turn of ``n`` tokens. A span whose version is a
    string naming no integer (SGLang's ``"default"``: a server started without
    ``--weight-version``, ``arg_groups/fields/serving.py`` 172-175, whose every answer carries
    such spans, ``managers/scheduler_components/output_streamer.py`` 541-548) names no version:
    its tokens have none, as a ``weight_version`` of ``"default"`` gives every token none where
    no spans are sent."""
    value = meta.get("weight_versions")
    spans = []
    if value is not None:
        if type(value) is not list:
            raise ValueError("meta_info.weight_versions is not a list")
        for i, s in enumerate(value):
            where = f"meta_info.weight_versions[{i}]"
            if type(s) is not dict:
                raise ValueError(f"{where} = {s!r} is not a span object")
            version = _span_version(s.get("version"), f"{where}.version")
            start, end = _offset(s.get("start"), f"{where}.start"), _offset(s.get("end"), f"{where}.end")
            if version is not None and end > start:
                spans.append({"version": version, "start": start, "end": end})
    if not value and n:
        version = reported_version(meta)  # None for SGLang's "default"
        if version is not None:
            spans = [{"version": version, "start": 0, "end": n}]
    return spans


def _span_version(value: Any, where: str) -> int | None:
    """A span's version: an int, or None for a string naming no integer; ValueError when missing
    or of another type."""
    if value is None:
        raise ValueError(f"{where} is missing")
    if type(value) is str:
        return reported_version({"weight_version": value})
    return parse_version(value, where)


def _offset(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where} = {value!r} is not an output index")
    return value

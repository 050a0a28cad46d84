"""Behavior records: the turn record, the one parser of an engine answer into it, its compact
binary encoding (turns and trainer batches) and its JSON view.

* :class:`TurnData` - one recorded turn; :meth:`TurnData.to_json` is its JSON object (the turn
  answer, trajectory reads and JSON batches all serve it).
* :func:`parse_turn` - the turn an engine's ``/generate`` answer records.
* :func:`encode_turn` / :func:`encode_stored` - the turn block (and the turn as stored in it);
  :func:`encode_batch` - a trainer batch of stored blocks.
* :func:`decode_turn`, :func:`decode_turn_header`, :func:`decode_batch` - the decoders.

Behavior records are stored and served in this encoding, never as JSON lists of lists.
The decoders use nothing but the standard library (``json``, ``struct``), so a trainer can
restate or copy them; the encoder uses numpy for long varint runs (when installed) and
:mod:`core.jsonio` for headers, which changes neither the layout nor any decoded value (JSON
headers may spell a float differently from :mod:`json`, e.g. ``1e-5`` for ``1e-05``).

Primitives
    varint   unsigned LEB128 (7 bits per byte, low group first, high bit = more follows)
    f32/f16  IEEE-754 little-endian (``struct`` formats ``<f`` / ``<e``)
    json     varint byte length + UTF-8 JSON object

Turn block (``MAGIC_TURN`` = b"MFT", then format byte ``FORMAT_VERSION``)::

    b"MFT" u8 format_version u8 flags
    json     header: {"turn", "group", "replica", "finish_reason", "timings",
                      "weight_versions": [{"version", "start", "end"}], "moved_from",
                      "sampling" (only when set: {"top_k_bound": n} or {"sampling_mask": false})}
    varint   n_input,  then n_input varints (input token ids)
    varint   n_output, then n_output varints (output token ids)
    n_output f32     logprob       (log mu: renormalized over the support, the behavior log-prob)
    n_output f32     raw_logprob   (after temperature, before top-k/top-p; NaN when unknown)
    n_output varint  support size k_i (0 = no filtering: the whole vocabulary)
    per token with k_i > 0: first id as varint, then (id[j] - id[j-1] - 1) as varints
                            (ids strictly increasing, so the gaps are >= 0 and mostly tiny)
    sum(k_i) f16|f32 support log-probs, token after token, in support-id order

Optional routed-experts section (``flags`` bit 1, :data:`FLAG_ROUTES`; the header then has
``"routed_experts": {"start", "rows", "width", "bytes"}``), after the support log-probs::

    rows * width uint(bytes*8) LE  expert ids (bytes 1 or 2: every id fits; 4: int32 as SGLang sent)
    u32 LE                         the byte length of the ids above (so the block can be split
                                   from its end without the header)

Row ``j`` holds the ids of position ``start + j`` of the turn's sequence (input, then output):
``width`` = layers x top-k values in SGLang's layout (``meta_info.routed_experts``,
:mod:`core.sglang_release`: ``[seqlen - 1 - start, layers, k]``, layer after layer). The router
does not know the model, so a row is flat; the trainer reshapes it with its model's top-k.

``flags`` bit 0 set = support log-probs are float16 (else float32). The token's own ``logprob``
and ``raw_logprob`` are always float32: they enter importance ratios directly. The per-token
``weight_version`` is not repeated per token: it is the version of the span in
``weight_versions`` covering the token's index (spans are over output indices, end exclusive).
``sampling.top_k_bound`` = n says the turn asked for no finite ``top_k`` and was sampled with
``top_k = n`` (SGLang's ``--sampling-mask-max-tokens``; it returns sampling masks only for a finite
``top_k``): each support is the turn's top-p/min-p candidate set cut to its n most likely tokens.
``sampling.sampling_mask`` = false says the turn filtered nothing and was sent without a sampling
mask (:func:`core.sglang_release.sampling_request`): every support is empty (the whole
vocabulary) and ``logprob`` is the engine's ``output_token_logprobs`` value (per token ``[logprob,
token_id, text]``, SGLang's managers/tokenizer_manager.py 3098-3116), its log-prob after
temperature ``log softmax(logits / T)``, the distribution it drew from (layers/sampler.py
275-316). A block without the key is a turn sampled exactly as asked, its supports returned by
the engine.

Batch (``MAGIC_BATCH`` = b"MFB", then format byte)::

    b"MFB" u8 format_version
    json     header: {"lease_id", "held_back", "trajectories": [{"session_id", "group",
                      "reward", "metadata", "version_age", "n_turns"}]}
    then for each trajectory, for each of its n_turns turns: varint length + turn block

:func:`decode_batch` returns the same dict that the JSON form of ``POST /v1/batches/take``
serves, so a trainer may take either.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from weight_sync.types import parse_version, reported_version

try:  # optional speed-ups of the encoder (the decoder never needs them)
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

MAGIC_TURN = b"MFT"
MAGIC_BATCH = b"MFB"
FORMAT_VERSION = 1
FLAG_F16 = 0x01
FLAG_ROUTES = 0x02
MEDIA_TYPE = "application/x-mixfleet-records"


class RecordFormatError(ValueError):
    """The bytes are not a valid block of this encoding (truncated, wrong magic, bad varint)."""


@dataclass(frozen=True)
class RoutedExperts:
    """A turn's routed experts: ``rows`` positions from ``start`` of its sequence, ``width`` ids
    each (layers x top-k, SGLang's order), as ``data``: their int32 little-endian bytes (SGLang's
    ``routed_experts`` after base64). ValueError unless ``len(data) == 4 * rows * width``."""

    start: int
    rows: int
    width: int
    data: bytes

    def __post_init__(self) -> None:
        if min(self.start, self.rows, self.width) < 0 or len(self.data) != 4 * self.rows * self.width:
            raise ValueError(
                f"routed experts: {len(self.data)} bytes for {self.rows} rows of {self.width} int32 ids"
            )

    def values(self) -> list[int]:
        """The ids, row after row (standard library only)."""
        import array
        import sys

        a = array.array("i")
        a.frombytes(self.data)
        if sys.byteorder != "little":
            a.byteswap()
        return a.tolist()

    def to_json(self) -> dict[str, Any]:
        """``start``, ``rows``, ``width`` and ``data``: base64 of the int32 bytes (SGLang's encoding)."""
        import base64

        return {
            "start": self.start,
            "rows": self.rows,
            "width": self.width,
            "data": base64.b64encode(self.data).decode("ascii"),
        }


@dataclass(frozen=True)
class TurnData:
    """One recorded turn. ``support_ids[i]`` sorted ascending, unique; empty = no filtering.
    Unknown log-probs are NaN (``raw_logprobs``: None or NaN).

    Invariant, checked on construction (ValueError): ``len(output_ids) == len(logprobs) ==
    len(raw_logprobs) == len(support_ids) == len(support_logprobs)`` and ``len(support_ids[i])
    == len(support_logprobs[i])``. The order of support ids is checked by :func:`encode_turn`.
    """

    turn: int
    group: str
    replica: str
    input_ids: Sequence[int]
    output_ids: Sequence[int]
    logprobs: Sequence[float]
    raw_logprobs: Sequence[float | None]
    support_ids: Sequence[Sequence[int]]
    support_logprobs: Sequence[Sequence[float]]
    weight_versions: Sequence[dict[str, int]] = ()
    finish_reason: dict[str, Any] | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    moved_from: str | None = None
    sampling: dict[str, Any] | None = None
    routed_experts: RoutedExperts | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        lens = (len(self.logprobs), len(self.raw_logprobs), len(self.support_ids), len(self.support_logprobs))
        if any(x != n for x in lens):
            raise ValueError(f"record lengths {lens} differ from {n} output tokens")
        k_ids = list(map(len, self.support_ids))
        k_lps = list(map(len, self.support_logprobs))
        if k_ids != k_lps:
            i = next(i for i, (a, b) in enumerate(zip(k_ids, k_lps, strict=True)) if a != b)
            raise ValueError(f"token {i}: {k_ids[i]} support ids but {k_lps[i]} support log-probs")

    def versions(self) -> list[int | None]:
        """The weight version of every output token (None where no span covers it)."""
        n = len(self.output_ids)
        spans = self.weight_versions
        if len(spans) == 1 and spans[0]["start"] <= 0 and spans[0]["end"] >= n:
            return [spans[0]["version"]] * n
        out: list[int | None] = [None] * n
        for span in sorted(spans, key=lambda s: s["start"]):
            for i in range(max(0, span["start"]), min(n, span["end"])):
                if out[i] is None:
                    out[i] = span["version"]
        return out

    def version_range(self) -> tuple[int | None, int | None]:
        """The lowest and highest weight version of the turn's spans; (None, None) without spans."""
        spans = self.weight_versions
        if len(spans) == 1:
            return spans[0]["version"], spans[0]["version"]
        versions = [s["version"] for s in spans]
        return (min(versions), max(versions)) if versions else (None, None)

    def to_json(self, session_id: str | None = None, *, with_input: bool = True) -> dict[str, Any]:
        """The turn's JSON object, the one JSON view of a turn (the turn answer without
        ``input_ids``, trajectory reads and JSON batches with them, last): one record per output
        token with its weight version. Non-finite log-probs (unknown values) are None: JSON has
        no NaN."""
        logprobs = self.logprobs
        if not math.isfinite(sum(logprobs)):  # a finite sum means every term is finite
            logprobs = [x if math.isfinite(x) else None for x in logprobs]
        raws = self.raw_logprobs
        if None in raws or not math.isfinite(sum(raws)):  # type: ignore[arg-type]
            raws = [None if x is None or not math.isfinite(x) else x for x in raws]
        records = [
            {
                "token_id": tok,
                "logprob": lp,
                "raw_logprob": raw,
                "support_ids": list(ids),
                "support_logprobs": list(lps)
                if math.isfinite(sum(lps))
                else [x if math.isfinite(x) else None for x in lps],
                "weight_version": version,
            }
            for tok, lp, raw, ids, lps, version in zip(
                self.output_ids,
                logprobs,
                raws,
                self.support_ids,
                self.support_logprobs,
                self.versions(),
                strict=True,
            )
        ]
        out: dict[str, Any] = {}
        if session_id is not None:
            out["session_id"] = session_id
        out.update(
            turn=self.turn,
            group=self.group,
            replica=self.replica,
            output_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            records=records,
            weight_versions=[dict(s) for s in self.weight_versions],
            timings=dict(self.timings),
            moved_from=self.moved_from,
            sampling=None if self.sampling is None else dict(self.sampling),
        )
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts.to_json()
        if with_input:
            out["input_ids"] = list(self.input_ids)
        return out


# ---------------------------------------------------------------- engine answers

_FLOAT = {float}
_NUMBER = {float, int}
_LIST = {list}
_TOKEN = {int}


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
    is what the engine client states about the sampling it sent (:attr:`TurnData.sampling`).

    A turn sent without a mask (``sampling`` ``{"sampling_mask": false}``, module docstring) records
    empty supports and mu = ``output_token_logprobs``; it refuses mask fields (SGLang sends none).

    Reads ``output_ids`` and from ``meta_info``: ``output_token_logprobs`` (per token
    ``[logprob, token_id, text]``: the raw log-prob, null = unknown), ``output_token_sampling_mask``
    (per token the support ids, ``[]`` = no filtering), ``output_token_sampling_logprobs`` (per
    token mu, null = unknown; or, with ``sampling_logprobs_mode: support``, per token the
    support's log-probs aligned with the mask), ``output_token_sampling_support_logprobs`` (the
    local engine's support log-probs, aligned with the mask, in either mode), ``weight_versions``
    spans (else one span of ``weight_version`` over every token; SGLang's ``"default"`` means
    none), ``finish_reason`` and ``e2e_latency`` (added to ``timings`` as ``engine_e2e_ms``).

    SGLang 0.5.23's shapes: masks in the order its sampler ranked them, most likely first
    (layers/sampler.py 605-612 and 821; :func:`parse_turn` sorts each row by id, its log-probs
    along); support-mode rows from ``SamplingMaskChunk.to_lists`` (sampling/sampling_mask.py
    37-51); span versions as strings (utils/weight_versions.py 17-20); ``finish_reason`` one of
    ``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}``, ``{"type":
    "abort", "message": ...}`` (managers/schedule_batch.py 279-345).

    Without the support's log-probs they are unknown (NaN); where mu is absent or a list, it is
    the sampled token's support log-prob when that is known and its raw log-prob otherwise
    (also for a token with no filtering: its support is the vocabulary). Log-probs come out as
    floats (unknown: NaN; raw: None).

    With ``routed_experts`` (the request asked ``return_routed_experts`` from position
    ``routed_experts_start``), reads ``meta_info.routed_experts`` (:class:`RoutedExperts` of
    positions ``[routed_experts_start, seqlen - 1)``); its
    absence is refused: SGLang answers without the key when not started with
    ``--enable-return-routed-experts``.

    Raises ValueError naming the field (and position) when ``body`` lacks a record field or
    holds a value of the wrong type or length, and for an aborted turn (finish reason ``abort``:
    an aborted generation is never recorded). Duplicate support ids and the float32 range are
    the encoder's checks (:func:`encode_turn`)."""
    if type(body) is not dict:
        raise ValueError("the engine answer is not a JSON object")
    meta = body.get("meta_info")
    if type(meta) is not dict:
        raise ValueError("the engine answer has no meta_info object")
    finish = _finish_reason(meta.get("finish_reason"))  # an abort is refused before anything else
    output_ids = body.get("output_ids")
    if type(output_ids) is not list:
        raise ValueError("output_ids is missing" if output_ids is None else "output_ids is not a list")
    _token_ids(output_ids, "output_ids")
    n = len(output_ids)
    raw = _raw_logprobs(_entries(meta, "output_token_logprobs", n))
    if sampling is not None and sampling.get("sampling_mask") is False:
        masks, support_lps, logprobs = _unmasked_records(meta, raw)
    else:
        masks, support_lps, logprobs = _masked_records(meta, output_ids, raw)
    timings = dict(timings)
    e2e = meta.get("e2e_latency")
    if type(e2e) in _NUMBER and 0 <= e2e < 1e9:
        timings["engine_e2e_ms"] = round(float(e2e) * 1000, 3)
    return TurnData(
        turn=index,
        group=group,
        replica=replica,
        input_ids=input_ids,
        output_ids=output_ids,
        logprobs=logprobs,
        raw_logprobs=raw,
        support_ids=masks,
        support_logprobs=support_lps,
        weight_versions=_spans(meta, n),
        finish_reason=finish,
        timings=timings,
        moved_from=moved_from,
        sampling=sampling,
        routed_experts=_routes(meta, routed_experts_start, len(input_ids) + n - 1)
        if routed_experts
        else None,
    )


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


def _masked_records(meta: dict[str, Any], output_ids: list[int], raw: list) -> tuple[list, list, list]:
    """Supports (sorted by id), their log-probs and mu of an answer with sampling masks."""
    masks = _entries(meta, "output_token_sampling_mask", len(output_ids))
    _rows(masks, "output_token_sampling_mask", "a list of token ids")
    if not set(map(type, itertools.chain.from_iterable(masks))) <= _TOKEN:
        for i, row in enumerate(masks):
            _token_ids(row, f"meta_info.output_token_sampling_mask[{i}]")
    sizes = list(map(len, masks))
    support_lps, known = _support_logprobs(meta, sizes)
    logprobs = _behavior_logprobs(meta, output_ids, raw, masks, support_lps, known)
    masks, support_lps = _sorted_supports(masks, support_lps)
    return masks, support_lps, logprobs


_MASK_KEYS = (
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
    "output_token_sampling_support_logprobs",
)


def _unmasked_records(meta: dict[str, Any], raw: list) -> tuple[list, list, list]:
    """Empty supports (the whole vocabulary) and mu = the raw log-prob (NaN where unknown) of an
    answer to a request without a sampling mask; refuses mask fields nobody asked for."""
    for key in _MASK_KEYS:
        if meta.get(key) is not None:
            raise ValueError(f"meta_info.{key} is present but no sampling mask was requested")
    n = len(raw)
    logprobs = raw if None not in raw else [math.nan if x is None else x for x in raw]
    return [[] for _ in range(n)], [[] for _ in range(n)], list(logprobs)


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


def _sorted_supports(masks: list, support_lps: list) -> tuple[list, list]:
    """Every support row in ascending id order, its log-probs permuted along (rows already in
    order are kept as they are)."""
    out_masks = out_lps = None
    for i, row in enumerate(masks):
        ordered = sorted(row)
        if ordered == row:
            continue
        if out_masks is None:
            out_masks, out_lps = list(masks), list(support_lps)
        lps = support_lps[i]
        pairs = sorted(zip(row, lps, strict=True))
        out_masks[i] = ordered
        out_lps[i] = [x for _, x in pairs]  # type: ignore[index]
    if out_masks is None:
        return masks, support_lps
    return out_masks, out_lps  # type: ignore[return-value]


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


def _token_ids(ids: list, where: str) -> None:
    """Refuses ``ids`` unless every entry is a non-negative JSON integer."""
    if set(map(type, ids)) <= _TOKEN and (not ids or min(ids) >= 0):
        return
    j = next(j for j, x in enumerate(ids) if type(x) is not int or x < 0)
    raise ValueError(f"{where}[{j}] = {ids[j]!r} is not a token id")


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


def _support_logprobs(meta: dict[str, Any], sizes: list[int]) -> tuple[list, bool]:
    """The support's log-probs per token (NaN = unknown) and whether the engine sent them:
    the local engine's own key, else SGLang's support-mode rows of ``output_token_sampling_logprobs``
    (every entry a list)."""
    key = "output_token_sampling_support_logprobs"
    if meta.get(key) is None:
        mu = meta.get("output_token_sampling_logprobs")
        if type(mu) is not list or not mu or not set(map(type, mu)) <= _LIST:
            return [[math.nan] * k for k in sizes], False  # selected mode: not returned
        key = "output_token_sampling_logprobs"
    rows = _entries(meta, key, len(sizes))
    _rows(rows, key, "a list of log-probs")
    got = list(map(len, rows))
    if got != sizes:
        i = next(i for i, (a, b) in enumerate(zip(got, sizes, strict=True)) if a != b)
        raise ValueError(f"meta_info.{key}[{i}] has {got[i]} log-probs for {sizes[i]} support ids")
    if set(map(type, itertools.chain.from_iterable(rows))) <= _FLOAT:
        return rows, True
    return [_floats(row, f"meta_info.{key}[{i}]", math.nan) for i, row in enumerate(rows)], True


def _behavior_logprobs(
    meta: dict[str, Any],
    output_ids: list[int],
    raw: list[float | None],
    masks: list[list[int]],
    support_lps: list,
    known: bool,
) -> list[float]:
    """mu per token (see :func:`parse_turn`)."""
    key = "output_token_sampling_logprobs"
    mu = meta.get(key)
    if mu is not None:
        mu = _entries(meta, key, len(output_ids))
        if set(map(type, mu)) <= _FLOAT:
            return mu
    out = []
    for i, tok in enumerate(output_ids):
        x = None if mu is None else mu[i]
        if type(x) is float:
            out.append(x)
        elif type(x) is int:
            try:
                out.append(float(x))
            except OverflowError:
                raise ValueError(f"meta_info.{key}[{i}] = {x!r} is beyond a float's range") from None
        elif x is None and mu is not None:
            out.append(math.nan)
        elif x is None or type(x) is list:
            if known and masks[i]:
                try:
                    out.append(support_lps[i][masks[i].index(tok)])
                except ValueError:
                    raise ValueError(
                        f"output token {tok} (output_ids[{i}]) is not in "
                        f"meta_info.output_token_sampling_mask[{i}]"
                    ) from None
            else:
                out.append(math.nan if raw[i] is None else raw[i])
        else:
            raise ValueError(f"meta_info.{key}[{i}] = {x!r} is not a number")
    return out


def _spans(meta: dict[str, Any], n: int) -> list[dict[str, int]]:
    """The non-empty weight-version spans of a turn of ``n`` tokens."""
    value = meta.get("weight_versions")
    spans = []
    if value is not None:
        if type(value) is not list:
            raise ValueError("meta_info.weight_versions is not a list")
        for i, s in enumerate(value):
            where = f"meta_info.weight_versions[{i}]"
            if type(s) is not dict:
                raise ValueError(f"{where} = {s!r} is not a span object")
            version = parse_version(s.get("version"), f"{where}.version")
            start, end = _offset(s.get("start"), f"{where}.start"), _offset(s.get("end"), f"{where}.end")
            if version is None:
                raise ValueError(f"{where}.version is missing")
            if end > start:
                spans.append({"version": version, "start": start, "end": end})
    if not spans and n:
        version = reported_version(meta)  # None for SGLang's "default"
        if version is not None:
            spans = [{"version": version, "start": 0, "end": n}]
    return spans


def _offset(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where} = {value!r} is not an output index")
    return value


# ---------------------------------------------------------------- varints


_VARINT_LIMIT = 1 << 63  # what the decoder reads (at most 9 bytes of 7 bits)


def _varint(value: int, out: bytearray) -> None:
    if value < 0:
        raise ValueError(f"varint of negative value {value}")
    if value >= _VARINT_LIMIT:
        raise ValueError(f"varint of {value}: beyond 63 bits")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


_MINUS_ONE = bytes([255, *range(255)])  # bytes.translate table: b -> b - 1
_NUMPY_MIN = 384  # below this many values a Python loop beats numpy's per-call overhead


def _varints(values: Sequence[int], out: bytearray) -> None:
    if not values:
        return
    if np is not None and len(values) >= _NUMPY_MIN:
        a = _int_array(values)
        if a is not None:
            low = int(a.min())
            if low < 0:
                raise ValueError(f"varint of negative value {low}")
            out += a.astype(np.uint8).tobytes() if a.max() < 0x80 else _np_varints(a)
            return
    coded = _single_bytes(values)
    if coded is not None and coded.isascii():  # all in 0..127: one byte each
        out += coded
        return
    low = min(values)
    if low < 0:
        raise ValueError(f"varint of negative value {low}")
    _append_varints(values, out)


def _single_bytes(values: Sequence[int]) -> bytes | None:
    """``bytes(values)`` when every value is in 0..255, else None."""
    try:
        return bytes(values)
    except (ValueError, TypeError):
        return None


def _append_varints(values: Sequence[int], out: bytearray, offset: int = 0) -> None:
    """LEB128 of each ``value + offset`` (all >= 0), without a call per value up to 3 bytes."""
    append = out.append
    for v in values:
        v += offset
        if v < 0x80:
            append(v)
        elif v < 0x4000:
            append(v & 0x7F | 0x80)
            append(v >> 7)
        elif v < 0x200000:
            append(v & 0x7F | 0x80)
            append((v >> 7) & 0x7F | 0x80)
            append(v >> 14)
        else:
            _varint(v, out)


def _int_array(values: Sequence[int]) -> Any:
    """``values`` as an int64 array, or None when they are not all integers that fit."""
    try:
        a = np.asarray(values)
    except (OverflowError, ValueError, TypeError):
        return None
    return a if a.dtype.kind == "i" and a.ndim == 1 else None


def _np_varints(v: Any) -> bytes:
    """LEB128 of a non-negative int64 array, vectorized: a (values x bytes) matrix of every
    value's 7-bit groups with continuation bits, read out row by row up to each value's length."""
    sizes = np.ones(len(v), dtype=np.int64)
    for j in range(1, 10):
        more = v >= (1 << (7 * j))
        if not more.any():
            break
        sizes += more
    width = int(sizes.max())
    groups = np.empty((len(v), width), dtype=np.uint8)
    for j in range(width):
        groups[:, j] = ((v >> (7 * j)) & 0x7F) | ((sizes > j + 1) << 7)
    return groups[np.arange(width) < sizes[:, None]].tobytes()


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise RecordFormatError(f"truncated: need {n} bytes at offset {self.pos}, have {len(self.buf)}")

    def byte(self) -> int:
        self.need(1)
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        result = shift = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7
            if shift > 63:
                raise RecordFormatError(f"varint longer than 9 bytes at offset {self.pos}")

    def varints(self, n: int) -> list[int]:
        if n == 0:
            return []
        end = self.pos + n
        if end <= len(self.buf):
            chunk = self.buf[self.pos : end]
            if max(chunk) < 0x80:
                self.pos = end
                return list(chunk)
        return [self.varint() for _ in range(n)]

    def raw(self, n: int) -> memoryview:
        self.need(n)
        chunk = self.buf[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def floats(self, n: int, fmt: str) -> tuple[float, ...]:
        size = struct.calcsize(fmt)
        return struct.unpack(f"<{n}{fmt}", self.raw(n * size))

    def json(self) -> Any:
        n = self.varint()
        try:
            return json.loads(bytes(self.raw(n)))
        except ValueError as exc:
            raise RecordFormatError(f"bad JSON header: {exc}") from None


def _json(obj: Any, out: bytearray) -> None:
    """``obj`` as a length-prefixed JSON object with sorted keys (the encoder's JSON module is
    imported here, so decoding needs the standard library only)."""
    from core.jsonio import dumps

    data = dumps(obj, sort_keys=True)
    _varint(len(data), out)
    out += data


# ---------------------------------------------------------------- turns


def encode_turn(turn: TurnData, *, f16: bool = False) -> bytes:
    """The turn block of ``turn``. ``f16`` stores support log-probs as float16 (lossy, ~3
    significant digits).

    After: ``decode_turn(encode_turn(t))`` equals ``t`` exactly for float32-representable
    values (float16-rounded support log-probs when ``f16``). Raises ValueError when the turn
    cannot be encoded (support ids not strictly increasing, negative ids, a log-prob beyond
    float32's range).
    """
    return bytes(_encode(turn, f16)[0])


def encode_stored(turn: TurnData, *, f16: bool = False) -> tuple[bytes, TurnData]:
    """``(encode_turn(turn, f16=f16), stored)``: ``stored`` is ``turn`` with the float values
    the block holds (float32 / float16-rounded; unknown raw log-probs None), so an API can
    answer with what it recorded. ``stored`` equals ``decode_turn`` of the block, and is built
    through :class:`TurnData`'s own checks. Raises ValueError as :func:`encode_turn`."""
    out, lp_bytes, raw_bytes, sup_bytes = _encode(turn, f16)
    unpack = struct.unpack
    n = len(turn.output_ids)
    raws: tuple[float | None, ...] = unpack(f"<{n}f", raw_bytes)
    if not math.isfinite(sum(raws)):  # type: ignore[arg-type]
        raws = tuple(None if math.isnan(x) else x for x in raws)  # type: ignore[arg-type]
    flat = unpack(f"<{len(sup_bytes) // (2 if f16 else 4)}{'e' if f16 else 'f'}", sup_bytes)
    rows = []
    pos = 0
    for ids in turn.support_ids:
        end = pos + len(ids)
        rows.append(flat[pos:end])
        pos = end
    stored = replace(turn, logprobs=unpack(f"<{n}f", lp_bytes), raw_logprobs=raws, support_logprobs=rows)
    return bytes(out), stored


def _encode(turn: TurnData, f16: bool) -> tuple[bytearray, bytes, bytes, bytes]:
    """The block of ``turn`` and, as stored in it, the packed log-probs, raw log-probs and
    support log-probs."""
    out = bytearray(MAGIC_TURN)
    out.append(FORMAT_VERSION)
    routes = turn.routed_experts
    out.append((FLAG_F16 if f16 else 0) | (FLAG_ROUTES if routes is not None else 0))
    header = {
        "turn": turn.turn,
        "group": turn.group,
        "replica": turn.replica,
        "finish_reason": turn.finish_reason,
        "timings": turn.timings,
        "weight_versions": [dict(s) for s in turn.weight_versions],
        "moved_from": turn.moved_from,
    }
    if turn.sampling is not None:
        header["sampling"] = turn.sampling
    routes_bytes = b""
    if routes is not None:
        routes_bytes, width = _narrow_routes(routes.data)
        header["routed_experts"] = {
            "start": routes.start,
            "rows": routes.rows,
            "width": routes.width,
            "bytes": width,
        }
    _json(header, out)
    _varint(len(turn.input_ids), out)
    _varints(turn.input_ids, out)
    n = len(turn.output_ids)
    _varint(n, out)
    _varints(turn.output_ids, out)
    raws = turn.raw_logprobs
    if None in raws:
        raws = [math.nan if x is None else x for x in raws]
    try:
        lp_bytes = struct.pack(f"<{n}f", *turn.logprobs)
        raw_bytes = struct.pack(f"<{n}f", *raws)
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"log-probs: {exc}") from None
    out += lp_bytes
    out += raw_bytes
    rows = turn.support_ids
    sizes = list(map(len, rows))
    _varints(sizes, out)
    flat_ids = list(itertools.chain.from_iterable(rows))
    total = len(flat_ids)
    if total:
        out += _gap_varints(flat_ids, sizes, total)
    try:
        sup_bytes = struct.pack(
            f"<{total}e" if f16 else f"<{total}f", *itertools.chain.from_iterable(turn.support_logprobs)
        )
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"support log-probs: {exc}") from None
    out += sup_bytes
    if routes is not None:
        out += routes_bytes
        out += struct.pack("<I", len(routes_bytes))
    return out, lp_bytes, raw_bytes, sup_bytes


_ROUTE_CODES = {1: "B", 2: "H", 4: "i"}


def _narrow_routes(data: bytes) -> tuple[bytes, int]:
    """Little-endian int32 ids as the narrowest unsigned width that holds them all (1 or 2 bytes;
    4: kept as int32): ``(bytes, width)``."""
    import array
    import sys

    if np is not None:
        a = np.frombuffer(data, dtype="<i4")
        lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
        if lo >= 0 and hi < 0x10000:
            return a.astype("u1" if hi < 0x100 else "<u2").tobytes(), 1 if hi < 0x100 else 2
        return data, 4
    values = array.array("i")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    lo, hi = (min(values), max(values)) if values else (0, 0)
    if lo < 0 or hi >= 0x10000:
        return data, 4
    width = 1 if hi < 0x100 else 2
    narrow = array.array(_ROUTE_CODES[width], values)
    if sys.byteorder != "little":
        narrow.byteswap()
    return narrow.tobytes(), width


def _read_routes(r: _Reader, meta: Any) -> RoutedExperts:
    """The routed-experts section at ``r`` described by header entry ``meta``."""
    import array
    import sys

    try:
        start, rows, width, size = (int(meta[k]) for k in ("start", "rows", "width", "bytes"))
        code = _ROUTE_CODES[size]
    except (KeyError, TypeError, ValueError):
        raise RecordFormatError(f"bad routed_experts header {meta!r}") from None
    raw = bytes(r.raw(rows * width * size))
    (length,) = struct.unpack("<I", r.raw(4))
    if length != len(raw):
        raise RecordFormatError(f"routed experts section of {len(raw)} bytes says {length}")
    if size != 4:
        values = array.array(code)
        values.frombytes(raw)
        if sys.byteorder != "little":
            values.byteswap()
        wide = array.array("i", values)
        if sys.byteorder != "little":
            wide.byteswap()
        raw = wide.tobytes()
    try:
        return RoutedExperts(start, rows, width, raw)
    except ValueError as exc:
        raise RecordFormatError(str(exc)) from None


def _gap_varints(flat: list[int], sizes: list[int], total: int) -> bytes:
    """The support ids of all tokens (``flat``, ``sizes[i]`` per token), gap coded: per row
    the first id, then ``id[j] - id[j-1] - 1``; as varints. Raises ValueError unless every row
    is strictly increasing and non-negative."""
    if np is not None and total >= _NUMPY_MIN:
        a = _int_array(flat)
        if a is not None:
            gaps = np.empty_like(a)
            gaps[0] = a[0]
            np.subtract(a[1:], a[:-1], out=gaps[1:])
            gaps[1:] -= 1
            starts = np.cumsum([0, *sizes[:-1]])[np.asarray(sizes) > 0]
            gaps[starts] = a[starts]
            if gaps.min() < 0:
                raise ValueError(_gap_error(int(np.argmax(gaps < 0)), sizes))
            if gaps.max() < 0x80:
                return gaps.astype(np.uint8).tobytes()
            return _np_varints(gaps)
    # d = id[j] - id[j-1], with id[-1] = -1 at row starts (so d is the id + 1 there); gap = d - 1
    prev = [-1, *flat[:-1]]
    pos = 0
    for k in sizes:
        if k:
            prev[pos] = -1
            pos += k
    try:
        coded = bytes(map(operator.sub, flat, prev))
    except (ValueError, TypeError):  # a d beyond 0..255 (or not an int: refused below)
        coded = None
    if coded is not None:
        coded = coded.translate(_MINUS_ONE)
        if coded.isascii():  # every gap in 0..127 (a d of 0, a repeated id, became 255)
            return coded
    d = list(map(operator.sub, flat, prev))
    if min(d) < 1:
        raise ValueError(_gap_error(next(i for i, x in enumerate(d) if x < 1), sizes))
    out = bytearray()
    _append_varints(d, out, offset=-1)
    return bytes(out)


def _gap_error(at: int, sizes: list[int]) -> str:
    """The message for the support id at flat position ``at`` (rows of ``sizes``)."""
    token = bisect.bisect_right(list(itertools.accumulate(sizes)), at)
    return f"support ids of output token {token} must be non-negative and strictly increasing"


def decode_turn(data: bytes | memoryview) -> TurnData:
    """Decode a turn block. Raises :class:`RecordFormatError` on malformed input."""
    r = _Reader(data)
    turn = _decode_turn(r)
    if r.pos != len(r.buf):
        raise RecordFormatError(f"{len(r.buf) - r.pos} trailing bytes after turn block")
    return turn


def decode_turn_header(data: bytes | memoryview) -> dict[str, Any]:
    """Only the JSON header of a turn block (cheap: no per-token work)."""
    r = _Reader(data)
    _check_magic(r, MAGIC_TURN)
    r.byte()
    return r.json()


def _check_magic(r: _Reader, magic: bytes) -> None:
    got = bytes(r.raw(len(magic))) if len(r.buf) >= len(magic) else bytes(r.buf)
    if got != magic:
        raise RecordFormatError(f"bad magic {got!r}, expected {magic!r}")
    version = r.byte()
    if version != FORMAT_VERSION:
        raise RecordFormatError(f"unsupported format version {version}")


def _decode_turn(r: _Reader) -> TurnData:
    _check_magic(r, MAGIC_TURN)
    flags = r.byte()
    header = r.json()
    if not isinstance(header, dict):
        raise RecordFormatError("turn header is not a JSON object")
    input_ids = r.varints(r.varint())
    n = r.varint()
    output_ids = r.varints(n)
    logprobs = list(r.floats(n, "f"))
    raw = [None if math.isnan(x) else x for x in r.floats(n, "f")]
    sizes = r.varints(n)
    support_ids: list[list[int]] = []
    for k in sizes:
        if k == 0:
            support_ids.append([])
            continue
        gaps = r.varints(k)
        ids = [gaps[0]]
        prev = gaps[0]
        for g in gaps[1:]:
            prev = prev + g + 1
            ids.append(prev)
        support_ids.append(ids)
    total = sum(sizes)
    flat = r.floats(total, "e" if flags & FLAG_F16 else "f")
    support_lps: list[list[float]] = []
    pos = 0
    for k in sizes:
        support_lps.append(list(flat[pos : pos + k]))
        pos += k
    routes = _read_routes(r, header.get("routed_experts")) if flags & FLAG_ROUTES else None
    try:
        return TurnData(
            turn=int(header["turn"]),
            group=str(header["group"]),
            replica=str(header["replica"]),
            input_ids=input_ids,
            output_ids=output_ids,
            logprobs=logprobs,
            raw_logprobs=raw,
            support_ids=support_ids,
            support_logprobs=support_lps,
            weight_versions=[
                {"version": int(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
                for s in header.get("weight_versions") or []
            ],
            finish_reason=header.get("finish_reason"),
            timings=header.get("timings") or {},
            moved_from=header.get("moved_from"),
            sampling=header.get("sampling"),
            routed_experts=routes,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"bad turn header: {exc!r}") from None


# ---------------------------------------------------------------- batches


def encode_batch(
    lease_id: str,
    held_back: int,
    trajectories: Sequence[tuple[dict[str, Any], Sequence[bytes]]],
    trainer_version: int | None = None,
) -> bytes:
    """Encode a trainer batch from (trajectory header, stored turn blocks) pairs.

    The turn blocks are copied as stored (no re-encoding). Each header gets ``n_turns``. The
    batch header names ``trainer_version`` (the version ages are measured against) when given.
    """
    out = bytearray(MAGIC_BATCH)
    out.append(FORMAT_VERSION)
    headers = [{**h, "n_turns": len(blobs)} for h, blobs in trajectories]
    head: dict[str, Any] = {"lease_id": lease_id, "held_back": held_back, "trajectories": headers}
    if trainer_version is not None:
        head["trainer_version"] = trainer_version
    _json(head, out)
    for _, blobs in trajectories:
        for blob in blobs:
            _varint(len(blob), out)
            out += blob
    return bytes(out)


def decode_batch(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a batch into the JSON shape of ``POST /v1/batches/take``."""
    r = _Reader(data)
    _check_magic(r, MAGIC_BATCH)
    header = r.json()
    trajectories = []
    for t in header.get("trajectories", []):
        t = dict(t)
        n_turns = int(t.pop("n_turns"))
        turns = []
        for _ in range(n_turns):
            size = r.varint()
            sub = _Reader(r.raw(size))
            turns.append(_decode_turn(sub).to_json(t["session_id"]))
        t["turns"] = turns
        trajectories.append(t)
    if r.pos != len(r.buf):
        raise RecordFormatError(f"{len(r.buf) - r.pos} trailing bytes after batch")
    out = {"lease_id": header["lease_id"], "trajectories": trajectories, "held_back": header["held_back"]}
    if "trainer_version" in header:
        out["trainer_version"] = header["trainer_version"]
    return out

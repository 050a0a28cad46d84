"""Request and response bodies of the router's HTTP API (the OpenAPI schema is built from
these). Requests forbid unknown fields so a typo is a 422 naming the field, not a silent
default; floats must be finite. The scalar fields of the session and trainer bodies are strict
(pydantic's ``StrictInt``, ``StrictFloat``, ``StrictBool``): ``"5"``, ``true`` or ``5.0`` is not the
integer 5, ``"1"`` or ``true`` not a reward (an integer is a float: a reward of ``1`` is 1.0); a
bounded integer beyond 64 bits is refused naming its range (:func:`bounded_int`), an unbounded one
naming the largest integer the body can carry (:func:`unbounded_int`). Token ids are strict
too, checked in bulk (:func:`router.segments.as_ids`): ``true`` or ``"1"`` is no token id, a
422 naming its position (``[i] = true is not a token id ...``); an integral float (``3.0``) is the
id it equals in mixfleet's own bodies (:data:`TokenArray`), not in SGLang's ``/generate``, which
keeps SGLang's contract (:data:`SGLangTokenIds`). Every refusal the router itself makes is an
:class:`ErrorBody`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import numpy as np
from fastapi import Path as PathParam
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    RootModel,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.sglang_contract import generate_body_error
from core.wire import VERSION_MAX
from router.segments import Ids, as_ids

TOKEN_MAX = 2**31 - 1

MAX_JSON_DEPTH = 64


def _spelled_int(value: Any) -> Any:
    """An integral float of magnitude at least 2**63 as the integer it equals, anything else as it
    is: the body's decoder (orjson) reads an integer literal beyond 64 bits (``10**30``) as a
    float, which ``StrictInt`` would refuse as "not a valid integer" although the field's bounds
    are what it breaks."""
    if type(value) is float and abs(value) >= 2**63 and value.is_integer():
        return int(value)
    return value


def bounded_int(ge: int, le: int) -> Any:
    """A ``StrictInt`` in ``ge .. le`` (its JSON schema: ``minimum``, ``maximum``) whose value
    beyond 64 bits is refused by the bound it breaks, naming the range as for any other value
    outside it (both bounds are required, so no such value is ever accepted)."""
    return Annotated[StrictInt, Field(ge=ge, le=le), BeforeValidator(_spelled_int)]


WIRE_INT_LIMIT = 2**64
"""The body's decoder (orjson) reads an integer literal from -2**63 to ``2**64 - 1`` as an
integer, one beyond that as a float (orjson's README, "Deserialize": "it does not support
integers exceeding 64 bits"; measured: ``18446744073709551615`` is an int, ``...616`` a float)."""


def _beyond_64_bits(value: Any) -> Any:
    """``value``, unless it is an integral float the body's decoder made of an integer literal
    beyond 64 bits: a positive one is refused naming :data:`WIRE_INT_LIMIT`, a negative one is
    the integer it equals (the field's lower bound refuses it, naming the bound; without one, the
    route that reads it)."""
    if type(value) is not float or not value.is_integer():
        return value
    if value >= WIRE_INT_LIMIT:
        raise PydanticCustomError("int_too_wide", "Input should be an integer below 2**64")
    return int(value) if value < -(2**63) else value


def unbounded_int(ge: int | None, *, strict: bool = True) -> Any:
    """An integer of at least ``ge`` (None: any) with no upper bound of its own (its JSON schema:
    ``minimum``), ``StrictInt`` unless ``strict`` is false (the chat APIs' lax integers); a value
    beyond 64 bits is refused in one line naming the limit (:func:`_beyond_64_bits`), not as "not
    a valid integer": every value accepted before is accepted (only floats that no integer field
    took are refused otherwise)."""
    return Annotated[StrictInt if strict else int, Field(ge=ge), BeforeValidator(_beyond_64_bits)]


def _shallow(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` unless its objects and arrays nest more than :data:`MAX_JSON_DEPTH` levels
    (ValueError): the body's decoder takes 1,024 levels, but what is stored must be written again,
    and orjson and pydantic's serializer both stop near 255."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return value


SessionId = Annotated[
    str,
    PathParam(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="the id POST /v1/sessions returned"),
]
"""A session id in a route's path: one the router could have made, else 422 before any lookup."""

LeaseId = Annotated[
    str,
    PathParam(
        pattern=r"^[0-9a-f]{32}$",
        description="the lease_id POST /v1/batches/take returned (32 lowercase hex digits)",
    ),
]
"""A lease id in a route's path: one the router could have made (a take's lease id is
``uuid.uuid4().hex``, router/state/memory.py and router/state/redis.py ``take``), else 422 before
any lookup."""

JsonObject = Annotated[dict[str, Any], AfterValidator(_shallow)]
"""A free-form JSON object a request carries for the router to keep or pass on (session metadata,
a tool's schema), refused (422) when nested deeper than :data:`MAX_JSON_DEPTH`."""


def _token_array(value: Any) -> np.ndarray:
    """A list of token ids as one uint32 array (:func:`router.segments.as_ids`), checked in bulk;
    an integral float in 0..TOKEN_MAX (``3.0``) is the id it equals, looked for only in a list
    the bulk conversion refuses; anything else that is not an integer in 0..TOKEN_MAX (a bool, a
    string, ``2.5``) is refused with ValueError naming the first one (``[i] = true is not a
    token id ...``)."""
    if not isinstance(value, list | tuple | np.ndarray):
        raise ValueError(f"{type(value).__name__} is not a list of token ids")
    with contextlib.suppress(ValueError):
        return as_ids(value, TOKEN_MAX)
    return as_ids([_integral(x) for x in value], TOKEN_MAX)


def _integral(value: Any) -> Any:
    """An integral float in 0..TOKEN_MAX as the integer it equals, anything else as it is."""
    if isinstance(value, float) and value.is_integer() and 0 <= value <= TOKEN_MAX:
        return int(value)
    return value


def _some_token_array(value: Any) -> np.ndarray:
    """:func:`_token_array`, refusing an empty list."""
    ids = _token_array(value)
    if not len(ids):
        raise ValueError("give at least one token id")
    return ids


def _ids_schema(min_items: int = 0, max_items: int | None = None) -> dict[str, Any]:
    """The JSON schema of a list of token ids."""
    items = {"type": "integer", "minimum": 0, "maximum": TOKEN_MAX}
    schema = {"type": "array", "items": items, "minItems": min_items}
    return schema if max_items is None else {**schema, "maxItems": max_items}


def _ids_type(validate: Any, min_items: int) -> Any:
    """A list of token ids validated by ``validate`` into an array (its JSON schema: a list of at
    least ``min_items`` token ids)."""
    return Annotated[
        Any,
        PlainValidator(validate),
        PlainSerializer(lambda ids: ids.tolist(), return_type=list[int]),
        WithJsonSchema(_ids_schema(min_items)),
    ]


TokenArray = _ids_type(_token_array, 0)
"""Token ids of a turn's input, a JSON list validated into one uint32 array in bulk (a context of
100K+ ids costs no per-id Python validation and no Python list): what :class:`TurnSpec` carries
to the engine's request body. ``true``, ``false`` or ``"1"`` is refused naming its position (the
bulk conversion takes a bool as 0 or 1: only the entries it made 0 or 1 are looked at,
:func:`router.segments.as_ids`); unlike a scalar integer of the bodies (``5.0`` is not 5), an
integral float (``3.0``) is the id it equals, the rule README.md documents for token ids."""
ContextArray = _ids_type(_some_token_array, 1)
"""A :data:`TokenArray` of at least one id (a turn's full context)."""

STOP_IDS_MAX = 1024


def _stop_ids(value: Any) -> list[int]:
    """A turn's ``stop_token_ids``: token ids as :data:`TokenArray` takes them, at most
    :data:`STOP_IDS_MAX`."""
    ids = _token_array(value)
    if len(ids) > STOP_IDS_MAX:
        raise ValueError(f"{len(ids)} stop token ids, more than {STOP_IDS_MAX}")
    return ids.tolist()


TokenList = Annotated[list[int], PlainValidator(_stop_ids), WithJsonSchema(_ids_schema(0, STOP_IDS_MAX))]
"""A turn's ``stop_token_ids`` (:func:`_stop_ids`), a list."""


def _rows(value: Any, row: Callable[[Any], Any], most: int | None = None) -> list[Any]:
    """``value``, a non-empty list of at most ``most`` lists of token ids, each validated by
    ``row`` (ValueError naming the row first: ``[r][i] = ...``)."""
    if not isinstance(value, list):
        raise ValueError(f"{type(value).__name__} is not a list of lists of token ids")
    if not value:
        raise ValueError("give at least one list of token ids")
    if most is not None and len(value) > most:
        raise ValueError(f"{len(value)} lists of token ids, more than {most}")
    out = []
    for r, ids in enumerate(value):
        if not isinstance(ids, list):
            raise ValueError(f"[{r}]: {type(ids).__name__} is not a list of token ids")
        try:
            out.append(row(ids))
        except ValueError as exc:
            raise ValueError(f"[{r}]{exc}" if str(exc).startswith("[") else f"[{r}]: {exc}") from None
    return out


def _score_rows(value: Any) -> list[list[int]]:
    """The sequences of a ``/v1/score`` body: 1 to :data:`SCORE_ROWS_MAX` lists of token ids as
    :data:`TokenArray` takes them."""
    return _rows(value, lambda ids: _token_array(ids).tolist(), SCORE_ROWS_MAX)


SCORE_ROWS_MAX = 256
TokenRows = Annotated[
    list[list[int]],
    PlainValidator(_score_rows),
    WithJsonSchema({"type": "array", "items": _ids_schema(), "minItems": 1, "maxItems": SCORE_ROWS_MAX}),
]
"""Sequences of token ids (``/v1/score``), each as :data:`TokenArray` takes them."""


def _sglang_row(ids: list[Any]) -> list[Any]:
    """One sequence of ``/generate``'s ``input_ids``: non-empty, each id a JSON integer."""
    if not ids:
        raise ValueError("empty sequence")
    as_ids(ids, TOKEN_MAX)
    return ids


def _sglang_ids(value: Any) -> list[int] | list[list[int]] | None:
    """``/generate``'s ``input_ids`` as SGLang 0.5.23 takes them: null, one non-empty list of
    token ids or a list of such lists, each id a JSON integer (no bool, string or float: SGLang's
    contract gate, ``entrypoints/http_server.py`` 937-939, ``api/v1/api_types.py`` 26-27, 59-62,
    938-939, 1029-1035, and its dataclass parse, ``utils/field_validators.py`` 41-81) in
    0..TOKEN_MAX; returned as given (the body is forwarded unchanged). ValueError names the first
    id refused (``[i]``, or ``[r][i]`` in a batch)."""
    if value is None:
        return None
    if isinstance(value, list) and value and isinstance(value[0], list):
        return _rows(value, _sglang_row)
    if not isinstance(value, list):
        raise ValueError(f"{type(value).__name__} is not a list of token ids")
    if not value:
        raise ValueError("input_ids is empty")
    return _sglang_row(value)


SGLangTokenIds = Annotated[
    list[int] | list[list[int]] | None,
    PlainValidator(_sglang_ids),
    WithJsonSchema(
        {
            "anyOf": [
                _ids_schema(1),
                {"type": "array", "items": _ids_schema(1), "minItems": 1},
                {"type": "null"},
            ]
        }
    ),
]
"""``/generate``'s ``input_ids`` (:func:`_sglang_ids`): SGLang's contract, so an integral float
is refused here as SGLang refuses it."""


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class SamplingParams(_Req):
    """Sampling of one turn (SGLang semantics: top_k -1 = off, min_p 0 = off, temperature 0 =
    greedy). A turn that filters nothing (temperature > 0, top_k -1, top_p 1, min_p 0) samples
    from the whole vocabulary and its records have empty supports. ``seed`` is what SGLang's
    ``/generate`` calls ``sampling_seed``; a turn sending SGLang's name is refused (422) as any
    unknown field, its message naming ``seed``. ``max_new_tokens`` absent is SGLang's 128; null
    is no bound but the context's, as SGLang takes it (its scheduler generates up to
    ``context_len - prompt - 2`` tokens: ``core.sglang_contract.max_new_tokens_bound``)."""

    temperature: StrictFloat = Field(1.0, ge=0.0, le=100.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: bounded_int(-1, TOKEN_MAX) = -1
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: bounded_int(1, 1_000_000) | None = 128
    stop_token_ids: TokenList = Field(default_factory=list)
    seed: bounded_int(0, 2**63 - 1) | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @model_validator(mode="wrap")
    @classmethod
    def _sglang_names(cls, data: Any, handler: Any) -> Any:
        """An unknown field that is SGLang's name of one of these (``/generate``'s
        ``sampling_seed``) is refused as any unknown field (``extra="forbid"``), its message
        naming this API's field; every other error as it was."""
        try:
            return handler(data)
        except ValidationError as exc:
            errors = exc.errors()
            if not any(_sglang_name(e) for e in errors):
                raise
            line_errors: list[Any] = []
            for e in errors:
                if (ours := _sglang_name(e)) is not None:
                    message = f"Extra inputs are not permitted: the turn API calls it {ours}"
                    line_errors.append(
                        {
                            "type": PydanticCustomError("extra_forbidden", message),
                            "loc": e["loc"],
                            "input": e["input"],
                        }
                    )
                else:
                    line_errors.append({k: e[k] for k in ("type", "loc", "input", "ctx") if k in e})
            raise ValidationError.from_exception_data(exc.title, line_errors) from None


SGLANG_NAMES = {"sampling_seed": "seed"}
"""SGLang's names of :class:`SamplingParams` fields that differ from the turn API's."""


def _sglang_name(error: Any) -> str | None:
    """The turn API's name of the field an ``extra_forbidden`` error names by SGLang's name."""
    loc = error.get("loc") or ()
    if error.get("type") != "extra_forbidden" or len(loc) != 1:
        return None
    return SGLANG_NAMES.get(str(loc[0]))


class ErrorItem(BaseModel):
    """One problem of an invalid request: where (``loc``), what (``msg``), its kind (``type``)."""

    loc: list[str]
    msg: str
    type: str


class ErrorBody(BaseModel):
    """The body of every refusal the router makes (4xx) and of its 503s: ``detail`` names the
    field or problem; ``errors`` (422 only) lists each problem of an invalid request."""

    detail: str
    errors: list[ErrorItem] | None = None


class VersionConflict(ErrorBody):
    """A 409 of a turn or a take. ``detail`` always; when the turn's ``min_version`` or the take's
    ``trainer_version`` is above every version the fleet can serve (the latest published one and
    the one a running publish job publishes; with neither, the newest a replica serves;
    :func:`router.turns.check_version_bound`), also the sidecar's names for the unmet bound
    (``constraint``: ``"min_version"`` or ``"trainer_version"``, ``target_version``;
    weight_sync/types.py ``VersionUnavailable.body``), ``latest_version`` (the latest published,
    null before any publish), ``served_version`` (the newest version a live replica serves, null
    when none reports one) and ``publishing_version`` (the version a running publish job
    publishes, null when none runs)."""

    constraint: str | None = None
    target_version: int | None = None
    latest_version: int | None = None
    served_version: int | None = None
    publishing_version: int | None = None


class SGLangErrorMessage(BaseModel):
    message: str


class SGLangErrorBody(BaseModel):
    """An engine's refusal, as SGLang writes it (passed through unchanged by ``/generate``)."""

    model_config = ConfigDict(extra="allow")

    error: SGLangErrorMessage


class GenerateRefusal(RootModel[SGLangErrorBody | ErrorBody]):
    """A 400 of ``/generate``: the engine's refusal (passed through) or the router's."""


ROUTES_DOC = (
    "every turn stores its routed experts (the turn block's routed_experts section), whatever its "
    "group's record_routes; the session's group must have engines started with "
    "--enable-return-routed-experts"
)


class CreateSession(_Req):
    group: str | None = Field(
        None,
        description=(
            "the group the session starts on (default: the routing policy's choice); a turn no "
            "replica of it can serve moves the session to another group, as any session, recorded "
            "in that turn's moved_from"
        ),
    )
    metadata: JsonObject = Field(default_factory=dict)
    record_routes: StrictBool = Field(False, description=ROUTES_DOC)


class SessionCreated(BaseModel):
    """A new session: its id, its group and the base URLs of its chat APIs (an official client's
    ``base_url``; the router's chat model renders them, see docs/chat.md)."""

    session_id: str
    group: str
    record_routes: bool = Field(False, description=ROUTES_DOC)
    openai_base_url: str | None = Field(
        None,
        description="base URL of this session's OpenAI Chat Completions API "
        "(``openai.OpenAI(base_url=...)``): ``<router>/v1/sessions/<id>/openai/v1``",
    )
    anthropic_base_url: str | None = Field(
        None,
        description="base URL of this session's Anthropic Messages API "
        "(``anthropic.Anthropic(base_url=...)``): ``<router>/v1/sessions/<id>/anthropic``",
    )


class SessionOut(BaseModel):
    session_id: str
    group: str
    replica: str | None
    status: str
    turns: int
    tokens: int
    reward: float | None
    metadata: dict[str, Any]
    min_version: int | None
    max_version: int | None
    record_routes: bool = Field(False, description=ROUTES_DOC)


class SessionDeleted(BaseModel):
    session_id: str
    status: str


class TurnSpec(NamedTuple):
    """A validated turn request, as the dispatcher needs it: ``params`` are the engine's
    ``sampling_params`` (SGLang names: ``sampling_seed``, ``stop_token_ids`` only when set).
    Exactly one of ``input_ids`` (the whole context: checked against the session's stored
    context, a fork when it does not extend it) and ``append_ids`` (only the tokens appended to
    the stored context) is set; :func:`router.turns.record_turn` gives the dispatcher a spec
    whose ``input_ids`` are the engine's whole input."""

    input_ids: Ids | None
    params: dict[str, Any]
    min_version: int | None = None
    max_version_age: int | None = None
    turn: int | None = None
    append_ids: Ids | None = None
    return_support: bool = False


class TurnRequest(_Req):
    input_ids: ContextArray | None = Field(
        None,
        description="the full context, token ids, at least one (checked against the session's stored "
        "context; a turn that does not extend it is recorded as a fork)",
    )
    append_ids: TokenArray | None = Field(
        None,
        description="instead of input_ids: only the tokens appended to the session's stored context "
        "(the previous turn's input and output)",
    )
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    min_version: unbounded_int(0) | None = None
    max_version_age: unbounded_int(0) | None = None
    turn: unbounded_int(0) | None = Field(
        None, description="expected turn index; refused with 409 if not next"
    )
    return_support: StrictBool = Field(
        False,
        description="the answer's records also carry support_ids and support_logprobs (the turn "
        "stores them either way; trajectory reads and batches always carry them)",
    )

    @model_validator(mode="after")
    def _one_input(self) -> TurnRequest:
        if (self.input_ids is None) == (self.append_ids is None):
            raise ValueError("give exactly one of input_ids (the full context) and append_ids")
        return self

    def spec(self) -> TurnSpec:
        sp = self.sampling_params
        return TurnSpec(
            self.input_ids,
            _engine_params(sp),
            self.min_version,
            self.max_version_age,
            self.turn,
            self.append_ids,
            self.return_support,
        )


def _engine_params(sp: SamplingParams) -> dict[str, Any]:
    """The engine's ``sampling_params`` of a turn (SGLang names; ``min_p``, ``stop_token_ids`` and
    ``sampling_seed`` only when set): the one place they are built."""
    params: dict[str, Any] = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "max_new_tokens": sp.max_new_tokens,
    }
    if sp.min_p > 0.0:
        params["min_p"] = sp.min_p
    if sp.stop_token_ids:
        params["stop_token_ids"] = sp.stop_token_ids
    if sp.seed is not None:
        params["sampling_seed"] = sp.seed
    return params


_IN_ANSWER = "absent from a turn's answer unless it asked return_support; always in trajectory reads"


class Record(BaseModel):
    token_id: int
    logprob: float | None
    raw_logprob: float | None
    support_ids: list[int] | None = Field(None, description=_IN_ANSWER)
    support_logprobs: list[float | None] | None = Field(None, description=_IN_ANSWER)
    weight_version: int | None


class VersionSpan(BaseModel):
    version: int
    start: int
    end: int


class Fork(BaseModel):
    """A turn whose input did not extend the stored context: it starts a new segment."""

    stored: int = Field(description="Length of the stored context the input did not extend")
    common: int = Field(description="Length of the prefix the input shared with it")


class Turn(BaseModel):
    session_id: str
    turn: int
    group: str
    replica: str
    context: int = Field(
        description="Tokens of the turn's segment before its appended input (0: the segment's first turn)"
    )
    fork: Fork | None = Field(
        None, description="Set when the turn started a new segment (see router/records.py)"
    )
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    records: list[Record]
    weight_versions: list[VersionSpan]
    timings: dict[str, Any]
    moved_from: str | None = None
    sampling: dict[str, Any] | None = Field(
        None,
        description=(
            "Set when the turn was not sent exactly as asked with a sampling mask: {'top_k_bound': n} "
            "when the fleet bounded its top_k for the mask; {'sampling_mask': false} when it filtered "
            "nothing and no mask was requested (every support is empty: the whole vocabulary; "
            "logprob = the engine's log-prob after temperature). See router/records.py."
        ),
    )
    append_ids: list[int] | None = Field(
        None,
        description="The input tokens the turn appended to its segment (trajectory reads and batches); "
        "its engine input was the segment's first `context` tokens and these",
    )


class FinishRequest(_Req):
    reward: StrictFloat = Field(
        description="the trajectory's reward: a finite JSON number (an integer is taken as a float; "
        "a string or a boolean is refused)"
    )
    metadata: JsonObject = Field(default_factory=dict)


class Finished(BaseModel):
    session_id: str
    status: str
    turns: int


class Trajectory(BaseModel):
    session_id: str
    group: str
    status: str
    reward: float | None
    metadata: dict[str, Any]
    finish_metadata: dict[str, Any]
    turns: list[Turn]


class TakeRequest(_Req):
    size: bounded_int(1, 4096) = Field(
        description="the most trajectories to take: finished trajectories in queue order (those of "
        "expired leases first, redelivered), up to this many; fewer when fewer are ready by the end of "
        "`wait_s` (none: an empty batch without a lease)",
    )
    max_version_age: unbounded_int(0) | None = Field(
        None,
        description="staleness bound: a trajectory whose oldest token version is more than this many "
        "versions below `trainer_version` is held back instead of taken (kept aside, counted in "
        "`held_back`, handed out by a later take whose bound admits it); null: no bound",
    )
    wait_s: StrictFloat = Field(
        0.0,
        ge=0.0,
        le=60.0,
        description="seconds the take may wait for `size` trajectories: it answers as soon as it "
        "holds `size`, else when the wait ends, with what it holds (0: at once)",
    )
    trainer_version: bounded_int(0, VERSION_MAX) | None = Field(
        None,
        description="the trainer's weight version, which the batch's version ages (and "
        "max_version_age) are measured against. At most the latest published version, or the version "
        "a running publish job is publishing (with none published and no job, the newest version a "
        "replica serves): a higher one is a 409 naming the versions. Default: the latest published "
        "version, else the newest a replica serves, else 0",
    )


class VersionAge(BaseModel):
    min: int
    max: int
    mean: float


class BatchTrajectory(BaseModel):
    session_id: str
    group: str
    reward: float | None
    metadata: dict[str, Any]
    version_age: VersionAge
    turns: list[Turn]


class TakeResponse(BaseModel):
    lease_id: str | None = Field(
        description="the lease to acknowledge; null when the batch is empty (nothing to acknowledge)"
    )
    trajectories: list[BatchTrajectory]
    held_back: int
    trainer_version: int | None = Field(
        None, description="the trainer version the batch's version ages are measured against"
    )


class AckResponse(BaseModel):
    lease_id: str
    acked: int
    expired: int
    already_acked: bool = Field(
        default=False,
        description="the lease was acknowledged before (a retry): the counts are that acknowledgement's",
    )


class ReleaseResponse(BaseModel):
    lease_id: str
    released: int = Field(
        description=(
            "trajectories put back on the ready queue now (0: the lease was released or "
            "acknowledged already, timed out and taken again, or unknown)"
        )
    )


class QueueStats(BaseModel):
    ready: int
    pending: int
    held_back: int
    leases: int


COUNT_MAX = 2**31 - 1  # the most running / queued requests a heartbeat may report


class Heartbeat(_Req):
    """A replica's report (its sidecar's, every few seconds): strict JSON types (``ready`` a
    boolean, counts and versions integers; ``"1"`` or ``1.0`` is a 422), a version a batch can hold
    (:data:`core.wire.VERSION_MAX`), counts up to :data:`COUNT_MAX`, a finite rate."""

    replica_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
    group: str
    url: str = Field(pattern=r"^https?://\S+$", max_length=2048)
    ready: StrictBool
    active_version: bounded_int(0, VERSION_MAX) | None = None
    running: bounded_int(0, COUNT_MAX) = 0
    queued: bounded_int(0, COUNT_MAX) = 0
    tokens_per_s: StrictFloat = Field(0.0, ge=0.0)
    error: str | None = Field(None, max_length=4096)


class HeartbeatAck(BaseModel):
    replica_id: str
    in_rotation: bool
    latest_version: int | None


class ReplicaRemoved(BaseModel):
    replica_id: str
    removed: bool


class Healthz(BaseModel):
    """Router liveness: ``status`` ``ok`` (200) or ``degraded`` (503: the state store is
    unreachable)."""

    status: str
    state: bool
    replicas_in_rotation: int


class Health(BaseModel):
    """SGLang-style health: ``ok`` when at least one replica is in rotation."""

    status: str


class ContainerPinOut(BaseModel):
    """Where requests to a heartbeat replica of a Modal server are pinned (:mod:`router.pinning`):
    its container's ``host:port``, or null with the reason it is not routable."""

    upstream: str | None
    error: str | None


class ReplicaOut(BaseModel):
    replica_id: str
    url: str
    static: bool
    ready: bool
    in_rotation: bool
    active_version: int | None
    running: int
    queued: int
    inflight: int
    tokens_per_s: float
    last_seen_s: float | None
    error: str | None
    container: ContainerPinOut | None = Field(
        None, description="On Modal: the container requests to this replica are pinned to"
    )


class MismatchFigures(BaseModel):
    """Mismatch figures over a set of tokens (:meth:`router.mismatch.MismatchSums.view`)."""

    tokens: int = Field(description="Tokens counted")
    k3_kl: float = Field(description="Mean of r - 1 - log r, r = p_trainer / q_sampler (KL(q||p) estimate)")
    abs_logprob_diff_mean: float = Field(description="Mean |log p_trainer - log q_sampler|")
    extreme_share: float = Field(description="Share of tokens with r outside [0.2, 5]")
    out_of_band_share: float = Field(description="Share of tokens with r outside the configured band")
    route_tokens: int = Field(0, description="Tokens whose recorded routed experts the trainer compared")
    route_mismatch_share: float = Field(
        0.0, description="Share of those whose trainer experts differ from the recorded ones (any MoE layer)"
    )


class MismatchVersion(MismatchFigures):
    version: int


class MismatchPosition(MismatchFigures):
    bucket: str = Field(description="Token-position bucket, e.g. 0-63 or 1024+")


class GroupMismatch(MismatchFigures):
    """A group's accumulated mismatch: totals, per weight version and per token-position bucket."""

    band: list[float] = Field(description="The configured band [low, high] of p/q")
    extreme_band: list[float] = Field(description="The fixed band [0.2, 5] of p/q")
    versions: list[MismatchVersion]
    earlier: MismatchFigures = Field(
        description="The versions rolled up, below the lowest of `versions` (the state keeps the "
        "latest --keep-versions per group); counted in the totals and positions"
    )
    positions: list[MismatchPosition]


class MismatchBatchGroup(MismatchFigures):
    group: str
    version: int


class MismatchUploadResponse(BaseModel):
    lease_id: str
    tokens: int = Field(description="Tokens counted")
    skipped: int = Field(description="Tokens not counted (sampler log-prob or version unknown)")
    groups: list[MismatchBatchGroup] = Field(description="This batch's figures per (group, version)")
    already_uploaded: bool = Field(
        False,
        description="true: these bytes were uploaded for this lease before (a retry whose first answer "
        "was lost); the figures are those of that upload, counted once",
    )


class GroupOut(BaseModel):
    name: str
    accelerator: str
    weight_format: str
    kv_cache_dtype: str
    sessions_per_replica: int
    capacity: float
    ready_replicas: int
    active_sessions: int
    sessions_total: int
    tokens_total: int
    session_share: float
    token_share: float
    capacity_share: float
    window_sessions: int = Field(
        description="Sessions assigned to the group in the routing window that every router shares"
    )
    window_tokens: int = Field(description="Tokens the group generated since the window's oldest assignment")
    window_session_share: float = Field(description="The group's share of the window's sessions")
    window_token_share: float = Field(description="The group's share of the window's tokens")
    active_version: int | None
    version_lag: int | None
    cost_per_token: float
    replicas: list[ReplicaOut]
    mismatch: GroupMismatch | None = Field(
        default=None, description="Sampler-trainer mismatch from trainer log-prob uploads"
    )


class GroupsResponse(BaseModel):
    latest_version: int | None
    policy: str
    groups: list[GroupOut]


class SGLangSamplingParams(BaseModel):
    """SGLang's sampling params as ``/generate`` forwards them (the OpenAPI schema of the common
    ones; every key SGLang knows is taken, :data:`core.sglang_contract.SAMPLING_FIELDS`). Judged
    by :class:`GenerateRequest` as SGLang judges them (types, known keys, ranges), so nothing here
    bounds a value: a bound of its own would refuse what SGLang takes (``top_k = -5`` at
    temperature 0 is greedy)."""

    model_config = ConfigDict(extra="allow")

    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    max_new_tokens: StrictInt | None = None
    # JSON integers, as SGLang 0.5.23's contract takes them (api/v1/api_types.py 1021-1022, 1267-1268)
    stop_token_ids: list[StrictInt] | None = None
    sampling_seed: StrictInt | None = None


class GenerateRequest(BaseModel):
    """SGLang's native ``/generate`` body; validated here, forwarded unchanged. Everything SGLang
    0.5.23 refuses in the fields the fleet forwards is refused here first, as the router's 422
    (``body: <field>: ...``): :func:`core.sglang_contract.generate_body_error` (``stream`` a JSON
    bool, ``sampling_params`` types, keys and ranges, ``rid``, ``text``, the logprob fields), and
    ``input_ids`` by :data:`SGLangTokenIds` (naming the position as every token id of the router's
    API is named)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: SGLangTokenIds = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    stream: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _sglang_contract(cls, data: Any) -> Any:
        refused = generate_body_error(data, skip=frozenset({"input_ids"})) if isinstance(data, dict) else None
        if refused is not None:
            raise PydanticCustomError("sglang_contract", refused)
        return data

    def rows(self) -> list[tuple[str, list[int]]]:
        """Each row of ``input_ids`` with its name (``input_ids``, or ``input_ids[r]`` of a batch);
        none for a text input."""
        ids = self.input_ids
        if ids is None:
            return []
        if isinstance(ids[0], list):
            return [(f"input_ids[{r}]", row) for r, row in enumerate(ids)]  # type: ignore[misc]
        return [("input_ids", ids)]  # type: ignore[list-item]

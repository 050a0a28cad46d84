"""Request and response bodies of the router's HTTP API (the OpenAPI schema is built from
these). Requests forbid unknown fields so a typo is a 422 naming the field, not a silent
default; floats must be finite.

The hot routes first try :func:`turn_spec_fast` / :func:`generate_rows_fast`: a check of the
canonical form of a body (exact JSON types, every constraint of the model) without building a
model. They accept only bodies the pydantic model accepts with the same values, and answer
None for anything else (including bodies pydantic would coerce), which then goes through the
model and FastAPI's validation as before.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

TOKEN_MAX = 2**31 - 1
TokenId = int


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class SamplingParams(_Req):
    """Sampling of one turn (SGLang semantics: top_k -1 = off, temperature 0 = greedy)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=TOKEN_MAX)
    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stops(cls, v: list[int]) -> list[int]:
        for t in v:
            if not 0 <= t <= TOKEN_MAX:
                raise ValueError(f"token id {t} out of range")
        return v


class CreateSession(_Req):
    group: str | None = Field(None, description="pin the session to this group")
    metadata: dict[str, Any] = Field(default_factory=dict)


class SessionCreated(BaseModel):
    session_id: str
    group: str


class TurnSpec(NamedTuple):
    """A validated turn request, as the dispatcher needs it: ``params`` are the engine's
    ``sampling_params`` (SGLang names: ``sampling_seed``, ``stop_token_ids`` only when set)."""

    input_ids: list[int]
    params: dict[str, Any]
    min_version: int | None = None
    max_version_age: int | None = None
    turn: int | None = None


class TurnRequest(_Req):
    input_ids: list[int] = Field(min_length=1, description="the full context, token ids")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    min_version: int | None = Field(None, ge=0)
    max_version_age: int | None = Field(None, ge=0)
    turn: int | None = Field(None, ge=0, description="expected turn index; refused with 409 if not next")

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        for i, t in enumerate(v):
            if not 0 <= t <= TOKEN_MAX:
                raise ValueError(f"input_ids[{i}] = {t} is not a token id")
        return v

    def spec(self) -> TurnSpec:
        sp = self.sampling_params
        return TurnSpec(
            self.input_ids,
            _engine_params(sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.stop_token_ids, sp.seed),
            self.min_version,
            self.max_version_age,
            self.turn,
        )


def _engine_params(
    temperature: float, top_p: float, top_k: int, max_new_tokens: int, stops: list[int], seed: int | None
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
    }
    if stops:
        params["stop_token_ids"] = stops
    if seed is not None:
        params["sampling_seed"] = seed
    return params


_INT = {int}
_TURN_KEYS = frozenset(("input_ids", "sampling_params", "min_version", "max_version_age", "turn"))
_SP_KEYS = frozenset(("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed"))


def _token_list(v: Any, *, min_len: int, max_len: int | None = None) -> bool:
    """A list of plain ints, each a token id, of an allowed length."""
    if type(v) is not list or len(v) < min_len or (max_len is not None and len(v) > max_len):
        return False
    return not v or (set(map(type, v)) == _INT and min(v) >= 0 and max(v) <= TOKEN_MAX)


def _number(v: Any) -> bool:
    t = type(v)
    return t is int or (t is float and math.isfinite(v))


def _opt_nonneg(v: Any) -> bool:
    return v is None or (type(v) is int and v >= 0)


def turn_spec_fast(body: Any) -> TurnSpec | None:
    """``body`` (decoded JSON) as a :class:`TurnSpec` when it is a canonical valid
    :class:`TurnRequest`; None when the model has to decide (invalid or needing coercion)."""
    if type(body) is not dict or not _TURN_KEYS.issuperset(body):
        return None
    ids = body.get("input_ids")
    if not _token_list(ids, min_len=1):
        return None
    if not (
        _opt_nonneg(body.get("min_version"))
        and _opt_nonneg(body.get("max_version_age"))
        and _opt_nonneg(body.get("turn"))
    ):
        return None
    sp = body.get("sampling_params", _NO_PARAMS)
    if type(sp) is not dict or not _SP_KEYS.issuperset(sp):
        return None
    temperature = sp.get("temperature", 1.0)
    top_p = sp.get("top_p", 1.0)
    top_k = sp.get("top_k", -1)
    max_new = sp.get("max_new_tokens", 128)
    stops = sp.get("stop_token_ids", _NO_STOPS)
    seed = sp.get("seed")
    if not (
        _number(temperature)
        and 0.0 <= temperature <= 100.0
        and _number(top_p)
        and 0.0 < top_p <= 1.0
        and type(top_k) is int
        and -1 <= top_k <= TOKEN_MAX
        and top_k != 0
        and type(max_new) is int
        and 1 <= max_new <= 1_000_000
        and _token_list(stops, min_len=0, max_len=1024)
        and (seed is None or (type(seed) is int and 0 <= seed <= 2**63 - 1))
    ):
        return None
    return TurnSpec(
        ids,
        _engine_params(float(temperature), float(top_p), top_k, max_new, list(stops), seed),
        body.get("min_version"),
        body.get("max_version_age"),
        body.get("turn"),
    )


_NO_PARAMS: dict[str, Any] = {}
_NO_STOPS: list[int] = []


class Record(BaseModel):
    token_id: int
    logprob: float | None
    raw_logprob: float | None
    support_ids: list[int]
    support_logprobs: list[float | None]
    weight_version: int | None


class VersionSpan(BaseModel):
    version: int
    start: int
    end: int


class Turn(BaseModel):
    session_id: str
    turn: int
    group: str
    replica: str
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    records: list[Record]
    weight_versions: list[VersionSpan]
    timings: dict[str, Any]
    moved_from: str | None = None
    input_ids: list[int] | None = None


class FinishRequest(_Req):
    reward: float
    metadata: dict[str, Any] = Field(default_factory=dict)


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
    size: int = Field(ge=1, le=4096)
    max_version_age: int | None = Field(None, ge=0)
    wait_s: float = Field(0.0, ge=0.0, le=60.0)
    trainer_version: int | None = Field(None, ge=0, description="default: the latest published version")


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
    lease_id: str
    trajectories: list[BatchTrajectory]
    held_back: int


class AckResponse(BaseModel):
    lease_id: str
    acked: int
    expired: int


class Heartbeat(_Req):
    replica_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
    group: str
    url: str = Field(pattern=r"^https?://\S+$", max_length=2048)
    ready: bool
    active_version: int | None = Field(None, ge=0)
    running: int = Field(0, ge=0)
    queued: int = Field(0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0.0)
    error: str | None = Field(None, max_length=4096)


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
    active_version: int | None
    version_lag: int | None
    cost_per_token: float
    replicas: list[ReplicaOut]


class GroupsResponse(BaseModel):
    latest_version: int | None
    policy: str
    groups: list[GroupOut]


class SGLangSamplingParams(BaseModel):
    """SGLang sampling params as forwarded by ``/generate`` (unknown keys pass through)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    max_new_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None


class GenerateRequest(BaseModel):
    """SGLang's native ``/generate`` body; validated here, forwarded unchanged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    stream: bool = False

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v: list[int] | list[list[int]] | None) -> list[int] | list[list[int]] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("input_ids is empty")
        rows = v if isinstance(v[0], list) else [v]
        for row in rows:
            if not row:
                raise ValueError("input_ids has an empty sequence")
            for t in row:
                if not 0 <= t <= TOKEN_MAX:
                    raise ValueError(f"{t} is not a token id")
        return v

    def rows(self) -> list[list[int]]:
        if self.input_ids is None:
            return []
        return self.input_ids if isinstance(self.input_ids[0], list) else [self.input_ids]  # type: ignore[return-value]


_GEN_SP = (
    ("temperature", "number", 0.0, None),
    ("top_p", "number", 0.0, 1.0),
    ("top_k", "int", -1, None),
    ("max_new_tokens", "int", 0, None),
)


def _generate_params_fast(sp: Any) -> bool:
    if sp is None:
        return True
    if type(sp) is not dict:
        return False
    for name, kind, low, high in _GEN_SP:
        v = sp.get(name)
        if v is None:
            continue
        if not (_number(v) if kind == "number" else type(v) is int):
            return False
        if v < low or (high is not None and v > high) or (name == "top_p" and v <= 0.0):
            return False
    stops = sp.get("stop_token_ids")
    if stops is not None and not (type(stops) is list and (not stops or set(map(type, stops)) == _INT)):
        return False
    seed = sp.get("sampling_seed")
    if seed is not None and type(seed) is not int:
        return False
    # extra keys pass through unvalidated (as the model allows), but a float anywhere in them
    # must be finite for the model: leave non-finite floats to it
    return all(type(v) is not float or math.isfinite(v) for v in sp.values())


def generate_rows_fast(body: Any) -> list[list[int]] | None:
    """The token rows of ``body`` (decoded JSON) when it is a canonical valid, non-streaming
    :class:`GenerateRequest` with ``input_ids`` and no ``text``; None when the model has to
    decide."""
    if type(body) is not dict or body.get("text") is not None or body.get("stream", False) is not False:
        return None
    ids = body.get("input_ids")
    if type(ids) is not list or not ids:
        return None
    rows = ids if type(ids[0]) is list else [ids]
    for row in rows:
        if not _token_list(row, min_len=1):
            return None
    sp = body.get("sampling_params")
    if type(sp) is list:
        if not sp or not all(_generate_params_fast(p) for p in sp):
            return None
    elif not _generate_params_fast(sp):
        return None
    for v in body.values():  # extra fields: finite floats only (allow_inf_nan=False)
        if type(v) is float and not math.isfinite(v):
            return None
    return rows

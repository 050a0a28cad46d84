"""What SGLang 0.5.23 refuses in a ``/generate`` body, as one pure check the local engine
(:mod:`engine.server.protocol`) and the router's SGLang-native ``/generate``
(:mod:`router.schemas` ``GenerateRequest``) both run, so either refuses exactly what SGLang does
in the fields the fleet sends or forwards.

SGLang judges a body in three steps (paths under ``python/sglang/`` of the released wheel):

1. FastAPI parses it into the ``GenerateReqInput`` dataclass (``srt/managers/io_struct.py``
   176-268): pydantic's lax types, except ``input_ids``, whose validator takes only a list of ints
   or of lists of ints (``srt/utils/field_validators.py`` 41-81: ``"1"`` or ``3.0`` is refused).
   A ``bool`` field refuses ``null`` (``stream`` 256, ``return_text_in_logprobs`` 247), an ``int``
   one too (``routed_experts_start_len`` 268). A refusal is a **400**
   (``srt/entrypoints/http_server.py`` 635-691).
2. The contract gate decodes the parsed JSON with the generated schema decoder
   (``http_server.py`` 928-939, ``srt/entrypoints/api_contract.py`` 12-18,
   ``api/v1/api_types.py`` 1413-1496 ``decode_GenerateRequest``): an integer is a JSON integer
   (no bool, string or float, 26-27, 59-62), a float a JSON number other than a bool (22-23,
   73-76), a boolean a JSON bool (53-56); ``input_ids`` is one list of integers or a list of such
   lists (938-939, 1029-1045); ``sampling_params`` is an object or a list of objects whose every
   key is one of SGLang's sampling parameters (1256-1321: an unknown key is refused, 97-108).
   A refusal is a **400** ``{"error": "invalid type: boolean `true`, expected i64"}``.
3. The tokenizer manager builds ``SamplingParams`` (``srt/sampling/sampling_params.py`` 140-250:
   ``null`` is the default; a temperature below 1e-6 is greedy, ``top_k = 1``; ``top_k = -1``
   the whole vocabulary), then ``normalize`` (331-380: at most 32 stop strings, 32 stop regexes
   of at most 256 bytes) and ``verify`` (252-329: the ranges below)
   (``srt/managers/tokenizer_manager.py`` 1565-1567); a ``ValueError`` is a **400**
   ``{"error": {"message": ...}}`` (``http_server.py`` 984-990, 2246-2250), or, for a
   ``"stream": true`` request, an HTTP 200 stream of one :func:`stream_error_event` and
   ``[DONE]`` (949-979). SGLang checks the server-dependent fields (LoRA, ``input_embeds``, the
   context length, hidden states, ...) before an item's ``SamplingParams``: a caller that judges
   those runs step 3 itself (``through="gate"``, then :func:`batch_refusal`,
   :func:`short_list_refusal` and :func:`item_refusal` in SGLang's order); one that does not
   (the router, which forwards the body) gets no step-3 refusal SGLang would make only after
   such a field: the server names what it names first.

Each step answers its own body shape (:class:`Refusal`, :func:`error_body`): step 1 through the
``RequestValidationError`` handler, ``ErrorResponse(message, type="Bad Request", code=400)``
dumped (``{"object": "error", "message", "type", "param": null, "code": 400}``, the handler's
format for ``/generate``: only ``/v1/messages``, ``/v1/systemone`` and ``/v1/responses`` get
others; ``http_server.py`` 635-691, ``entrypoints/openai/protocol.py`` 106-111); step 2 the gate's bare
string ``{"error": "<text>"}`` (``generate_request``, ``http_server.py`` 928-939); step 3
``{"error": {"message": ...}}``.

:func:`generate_body_error` returns the first refusal as one line naming the field (``stream:
invalid type: integer `1`, expected a boolean``; ``sampling_params[1].top_k: ...``; a range in
SGLang's own words, which name the field: ``top_p must be in (0, 1], got 1.5.``), or None. It
checks the fields the fleet sends or forwards (``text``, ``input_ids``, ``rid``, ``stream``,
``sampling_params``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``token_ids_logprob``, ``return_text_in_logprobs``, ``return_sampling_mask``,
``routed_experts_start_len``) and the other top-level keys the gate decodes, as it types them
(``return_hidden_states``, the ``bootstrap_*`` keys, ``decode_tp_size``, ``routed_dp_rank``,
``disagg_prefill_dp_rank``, ``mm_hashes``, ``extra_key``, ``priority``, ``cache_salt``,
``require_reasoning``, ``lora_path``, ``session_params``, ``routing_key``,
``max_thinking_tokens``, ``session_id``, ``custom_logit_processor``, ``custom_labels``,
``return_prompt_token_ids``, ``modalities``) and the nested structs (``image_data``,
``video_data``, ``audio_data``: ``MediaInput``, api_types.py 2034-2043, 1902-1991; ``kv_hints``:
``KvHintsEnvelopeOrList``, 1598-1660; ``images_config``: ``ImagesConfig``, 1579-1587), as it types
them, and ``return_indexer_topk``, a dataclass-only bool (io_struct.py 269), as the parse types
it. Every field is typed as the dataclass types it, whose parse runs first: a value pydantic's lax
type refuses too (a number for a string field, ``2`` for a bool, ``1.5`` for an int, a scalar for
a list) is the parse's refusal, one only the gate refuses (``1`` for a bool, ``"3"`` for an int)
the gate's (the parse takes any media value, ``kv_hints`` a dict or a list of dicts and nulls,
``images_config`` a dict: io_struct.py 78-81, 158-204, 357, 378-380); and each step judges the
whole body before the next (a field the parse refuses is the answer wherever it stands in the
body, then the gate's first, then step 3's). Step 3 runs in SGLang's order
(:func:`_tokenizer_refusal`): ``normalize_batch_and_arguments`` (no input, :data:`NO_INPUT`;
``session_id`` with ``session_params``, :data:`SESSION_BOTH`; a batch's ``image_data``,
``watermark``, ``return_hidden_states``, ``extra_key`` and ``cache_salt`` lengths; ``kv_hints``,
decoded with msgspec, in its words: ``Malformed kv_hints envelope: ...``), a batch's short
per-item list (:data:`PER_ITEM_LISTS`, :data:`NO_SHORT_LIST`) or one request's ``rid`` list
(:data:`NO_RID_LIST`) in ``_init_req_state``, then each item: a watermark set both ways, a ``choice``
(:data:`NO_CHOICE`), a malformed watermark (:func:`watermark_malformed`), then ``SamplingParams``'
ranges, so a malformed ``watermark`` is named before an out-of-range ``top_p``
(tokenizer_manager.py 1553-1567). What SGLang answers with a 500 is refused here as a 400 naming
it (:attr:`Refusal.fails`), so the router refuses it too (a 422) instead of failing over as from a
failing replica. Not
checked here: the other dataclass-only keys, and what needs the server's settings (a watermark the
server must enable, ``resolve_watermark_request``; a ``lora_path``, ``max_thinking_tokens``, a
``routed_dp_rank`` other than 0, and per item ``input_embeds``, hidden states and a custom logit
processor, after which the full check makes no refusal SGLang makes later:
:func:`_server_judges`).
An **unknown** top-level key is no refusal: the dataclass parse ignores it (a stdlib dataclass,
pydantic's ``extra="ignore"``, ``io_struct.py`` 176-178) and the gate skips it
(``decode_GenerateRequest`` has no ``else``, ``api_types.py`` 1413-1496). What needs the model (a
token id's vocabulary range, ``logit_bias`` keys) is the engine's to check.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

SAMPLING_EPS = 1e-6  # sampling_params.py 42
TOP_K_ALL = 1 << 30  # sampling_params.py 43
MAX_STOP_COUNT = 32  # sampling_params.py 44
MAX_STOP_REGEX_LEN = 256  # sampling_params.py 45
MAX_STOP_REGEX_COUNT = 32  # sampling_params.py 46

SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
"""The keys of ``sampling_params`` (``api/v1/api_types.py`` 1256), in SGLang's order."""


NO_CHOICE = (
    "SGLang 0.5.23's SamplingParams has no such field (sampling/sampling_params.py 140-181), so its "
    "/generate fails on it, whatever its value (a 500)."
)
"""Why any ``sampling_params.choice`` is refused: the gate takes the key (``api_types.py``
1317-1318), then ``SamplingParams(**sampling_kwargs)`` (``tokenizer_manager.py`` 1565) raises
msgspec's TypeError, which ``/generate`` does not catch (``http_server.py`` 983-990 catch
ValueError): SGLang answers a 500, which the router would take for a failing replica and fail
over on; refused here as a 400, in step 3's body, by the engine and the router alike."""


Step = Literal["parse", "gate", "verify"]
"""Which of SGLang's three steps refuses (module docstring): the dataclass parse, the contract
gate, ``SamplingParams``' checks."""


class ContractError(ValueError):
    """One refusal: ``str(exc)`` is the line naming the field; ``step`` the step that makes it;
    ``value`` the value refused (None where none is one); ``fails``: SGLang does not refuse it
    but fails on it (:attr:`Refusal.fails`)."""

    def __init__(self, message: str, *, step: Step = "gate", value: Any = None, fails: bool = False) -> None:
        super().__init__(message)
        self.step: Step = step
        self.value = value
        self.fails = fails

    def at(self, step: Step) -> ContractError:
        """The same refusal, made by ``step``."""
        return ContractError(str(self), step=step, value=self.value, fails=self.fails)


def _unknown_field(where: str, key: str, fields: tuple[str, ...]) -> ContractError:
    """The gate's refusal of an unknown key in a struct that denies them (serde's
    ``unknown_field``, ``api_types.py`` 97-108)."""
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"{where}: unknown field `{key}`, expected one of {listed}", value=key)


@dataclass(frozen=True)
class Refusal:
    """SGLang's refusal of a ``/generate`` body: the step that makes it and its line. ``fails``:
    what SGLang does not refuse but fails on, an exception ``/generate`` does not catch (only a
    ``ValueError`` is, ``http_server.py`` 956-990): unstreamed a 500, which the fleet refuses as
    this 400 instead (:data:`NO_SHORT_LIST`, :data:`NO_CHOICE`, ...); streamed an HTTP 200 whose
    stream breaks off before any event, which the local engine answers alike
    (``engine.server.routes_generate``)."""

    step: Step
    message: str
    fails: bool = False

    @staticmethod
    def of(exc: ContractError) -> Refusal:
        """The refusal ``exc`` makes."""
        return Refusal(exc.step, str(exc), exc.fails)

    def body(self) -> dict[str, Any]:
        """The JSON body SGLang answers it with (HTTP 400): :func:`error_body`."""
        return error_body(self.step, self.message)


def error_body(step: Step, message: str) -> dict[str, Any]:
    """SGLang's 400 body for a refusal by ``step`` (module docstring): ``parse`` the request
    validation handler's ``ErrorResponse``, ``gate`` ``{"error": message}``, ``verify``
    ``{"error": {"message": message}}``."""
    if step == "parse":
        return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    if step == "gate":
        return {"error": message}
    return {"error": {"message": message}}


def stream_error_event(message: str, code: int = 400) -> dict[str, Any]:
    """The one event a ``"stream": true`` ``/generate`` answers a step-3 refusal with, before
    ``data: [DONE]``, inside an HTTP 200 ``text/event-stream`` (``http_server.py`` 949-979:
    ``serve_generate_request`` has already begun the stream when ``generate_request`` raises its
    ``ValueError``; ``code`` is the exception's ``status_code``, else 400). Steps 1 and 2 answer
    before it, with their 400 bodies (:func:`error_body`), streamed or not."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}}


def _spelled(v: Any) -> str:
    """The value as SGLang's contract names it (serde's ``Unexpected``, api_types.py 30-46)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _refuse(where: str, v: Any, expected: str) -> ContractError:
    return ContractError(f"{where}: invalid type: {_spelled(v)}, expected {expected}", value=v)


def _int(where: str, v: Any) -> int:
    if type(v) is int:
        return v
    raise _refuse(where, v, "i64")


def _float(where: str, v: Any) -> float:
    if type(v) is int or type(v) is float:
        return float(v)
    raise _refuse(where, v, "f64")


def _bool(where: str, v: Any) -> bool:
    if type(v) is bool:
        return v
    raise _refuse(where, v, "a boolean")


def _str(where: str, v: Any) -> str:
    if type(v) is str:
        return v
    raise _refuse(where, v, "a string")


def _seq(where: str, v: Any) -> list[Any]:
    if type(v) is list:
        return v
    raise _refuse(where, v, "a sequence")


def _map(where: str, v: Any) -> dict[str, Any]:
    if type(v) is dict:
        return v
    raise _refuse(where, v, "a map")


def _each(where: str, v: Any, one: Callable[[str, Any], Any]) -> None:
    for i, e in enumerate(_seq(where, v)):
        one(f"{where}[{i}]", e)


def _or_list(one: Callable[[str, Any], Any]) -> Callable[[str, Any], None]:
    """A value or a list of values (SGLang's ``...OrList``)."""

    def check(where: str, v: Any) -> None:
        if type(v) is list:
            _each(where, v, one)
        else:
            one(where, v)

    return check


def int_list(where: str, v: Any, int64: bool = True) -> list[int]:
    """``v``, a list of JSON integers (``decode_Int64List`` / ``decode_TokenIds``, api_types.py
    1021-1022, 938-939), each within int64 when ``int64`` (``input_ids``: ``array("q")``,
    field_validators.py 51-54). Checked in bulk: one pass over the types."""
    ids = _seq(where, v)
    try:
        if int64:
            array("q", ids)  # refuses a string, a float or an int beyond int64; takes a bool
        ok = bool not in map(type, ids) if int64 else set(map(type, ids)) <= {int}
    except (TypeError, OverflowError):
        ok = False
    if ok:
        return ids
    i = next(i for i, x in enumerate(ids) if type(x) is not int or (int64 and not -(2**63) <= x < 2**63))
    if type(ids[i]) is int:
        raise ContractError(f"{where}[{i}]: integer `{ids[i]}` is outside int64", value=ids[i])
    raise _refuse(f"{where}[{i}]", ids[i], "i64")


def token_ids(where: str, v: Any) -> None:
    """One list of token ids or a list of such lists (``decode_TokenIdsOrList``, api_types.py
    1029-1045: a list whose first entry is not a number is a batch)."""
    ids = _seq(where, v)
    if not ids or (type(ids[0]) in (int, float)):
        int_list(where, ids)
        return
    for r, row in enumerate(ids):
        int_list(f"{where}[{r}]", row)


def _input_ids(where: str, v: Any) -> None:
    """:func:`token_ids`, refused by the dataclass parse (step 1: ``validate_optional_list_i64_1d_2d``,
    field_validators.py 41-81, takes only a list of ints or of lists, each within int64) unless the
    value refused is a bool (Python's int there: the gate refuses it, as ``[true]``)."""
    try:
        token_ids(where, v)
    except ContractError as exc:
        raise exc if type(exc.value) is bool else exc.at("parse") from None


def _not_null(one: Callable[[str, Any], Any], expected: str) -> Callable[[str, Any], None]:
    """``one``, and ``null`` refused by the dataclass parse (step 1: a plain bool or int field)."""

    def check(where: str, v: Any) -> None:
        if v is None:
            raise _refuse(where, v, expected).at("parse")
        one(where, v)

    return check


def _nullable(one: Callable[[str, Any], Any]) -> Callable[[str, Any], None]:
    def check(where: str, v: Any) -> None:
        if v is not None:
            one(where, v)

    return check


_str_or_list = _or_list(_str)


_WATERMARK_TYPES = {"enabled": _bool, "key": _str, "context_window": _int}  # api_types.py 1384-1399


def _watermark(where: str, v: Any) -> None:
    """``decode_WatermarkRequestConfig`` (``api_types.py`` 1384-1399)."""
    for key, x in _map(where, v).items():
        if key not in _WATERMARK_TYPES:
            raise _unknown_field(where, key, tuple(_WATERMARK_TYPES))
        _nullable(_WATERMARK_TYPES[key])(f"{where}.{key}", x)


def _logit_bias(where: str, v: Any) -> None:
    for key, x in _map(where, v).items():
        _float(f"{where}.{key}", x)


_SAMPLING_TYPES: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": _int,
    "stop": _str_or_list,
    "stop_token_ids": lambda where, v: int_list(where, v, int64=False),
    "stop_regex": _str_or_list,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int,
    "n": _int,
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stream_interval": _int,
    "logit_bias": _logit_bias,
    "sampling_seed": _int,
    "custom_params": lambda where, v: None,
    "beam_width": _int,
    "watermark": _watermark,
    "choice": lambda where, v: _each(where, v, _str),
}  # api_types.py 1259-1321; every key may be null (its default)


def _verify(p: dict[str, Any]) -> None:
    """``SamplingParams.__post_init__`` defaults and ``normalize``/``verify`` (sampling_params.py
    191-250, 331-380, 252-329) on a type-checked ``sampling_params`` object, in SGLang's words."""

    def get(name: str, default: Any) -> Any:
        value = p.get(name)
        return default if value is None else value

    for name, limit in (("stop", MAX_STOP_COUNT), ("stop_regex", MAX_STOP_REGEX_COUNT)):
        value = p.get(name)
        if isinstance(value, list) and len(value) > limit:
            what = "stop strings are" if name == "stop" else "stop_regex patterns are"
            raise ContractError(f"at most {limit} {what} allowed, got {len(value)}")
    regexes = p.get("stop_regex")
    for regex in [regexes] if isinstance(regexes, str) else regexes or ():
        size = len(regex.encode("utf-8"))
        if size > MAX_STOP_REGEX_LEN:
            raise ContractError(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_LEN}-byte limit")
    temperature, top_k = float(get("temperature", 1.0)), int(get("top_k", -1))
    if 0 <= temperature < SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    beam_width = p.get("beam_width")
    if beam_width is not None and beam_width < 1:
        raise ContractError(f"beam_width must be at least 1, got {beam_width}.")
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ContractError(f"temperature must be a non-negative finite number, got {temperature}.")
    top_p, min_p = float(get("top_p", 1.0)), float(get("min_p", 0.0))
    if not 0.0 < top_p <= 1.0:
        raise ContractError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise ContractError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1:
        raise ContractError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = float(get(name, 0.0))
        if not -2.0 <= value <= 2.0:
            raise ContractError(f"{name} must be in [-2, 2], got {value}.")
    repetition = float(get("repetition_penalty", 1.0))
    if not 0.0 < repetition <= 2.0:
        raise ContractError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}.")
    min_new, max_new = int(get("min_new_tokens", 0)), p.get("max_new_tokens", 128)
    if min_new < 0:
        raise ContractError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if max_new is not None:
        if max_new < 0:
            raise ContractError(f"max_new_tokens must be at least 0, got {max_new}.")
        if not min_new <= max_new:
            raise ContractError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    seed = p.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise ContractError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if sum(p.get(g) not in (None, "") for g in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise ContractError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


def max_new_tokens_bound(max_new_tokens: int | None, input_len: int, context_len: int) -> int:
    """How many tokens SGLang lets a request of ``input_len`` prompt tokens generate at most:
    ``max_new_tokens``, or for ``null`` no bound of its own, the context's room: the scheduler's
    ``init_req_max_new_tokens`` takes ``1 << 30`` for None, capped at ``max_req_len -
    len(input) - 1`` (``srt/managers/scheduler.py`` 2693-2716), where ``max_req_len =
    min(context_len - 1, max_total_num_tokens - 1)`` (``srt/managers/tp_worker.py`` 421-424; the
    KV pool holds at least one context here); ``SamplingParams.max_new_tokens`` is
    ``Optional[int] = 128``, an explicit None stays None and ``verify`` skips its checks then
    (``srt/sampling/sampling_params.py`` 149, 285). An explicit value above the context's room
    is refused before (``tokenizer_manager.py`` 1352-1375). At least 0."""
    if max_new_tokens is not None:
        return max_new_tokens
    return max(0, min(1 << 30, (context_len - 1) - input_len - 1))


def sampling_params(where: str, v: Any) -> None:
    """One ``sampling_params`` object: its keys and their types (the contract gate); SGLang's
    ranges are step 3's (:func:`_item_refusal`). Raises :class:`ContractError`."""
    p = _map(where, v)
    for key, x in p.items():
        check = _SAMPLING_TYPES.get(key)
        if check is None:
            raise ContractError(f"{where}: unknown field `{key}` (SGLang takes {', '.join(SAMPLING_FIELDS)})")
        if x is not None:
            check(f"{where}.{key}", x)


_WATERMARK_FIELDS = frozenset(_WATERMARK_TYPES)


def _watermark_key_error(key: Any) -> str | None:
    """``parse_watermark_key`` (``srt/sampling/watermarking/config.py`` 44-53) in its words."""
    if not isinstance(key, str):
        return "watermark key must be a hex string"
    digits = key[2:] if key.lower().startswith("0x") else key
    if not 1 <= len(digits) <= 16:
        return "watermark key must contain 1 to 16 hex digits"
    if any(c not in "0123456789abcdefABCDEF" for c in digits):
        return "watermark key must contain only hex digits"
    return None


def watermark_malformed(value: Any) -> str | None:
    """``normalize_watermark_request`` (``srt/sampling/watermarking/core.py`` 163-193, run by
    ``SamplingParams.__post_init__``, ``sampling_params.py`` 236) in its words: a watermark that
    is not an object of ``enabled`` (a bool), ``key`` (:func:`_watermark_key_error`) and
    ``context_window`` (a positive integer), or None. What the server's settings refuse
    (``resolve_watermark_request``, run after ``verify``) is the engine's to judge."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "watermark must be an object"
    if set(value) - _WATERMARK_FIELDS:
        return "watermark contains unknown fields"
    enabled, key, window = value.get("enabled"), value.get("key"), value.get("context_window")
    if enabled is not None and type(enabled) is not bool:
        return "watermark enabled must be a boolean"
    refused = None if key is None else _watermark_key_error(key)
    if refused is not None:
        return refused
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        return "watermark context_window must be a positive integer"
    return None


WATERMARK_BOTH = (
    "watermark must be provided either at the request top level or inside sampling_params, not both"
)
"""``tokenizer_manager.py`` 1553-1559."""


def _item_refusal(where: str, p: dict[str, Any], top: Any) -> ContractError | None:
    """Step 3 on one item, in SGLang's order (``_create_tokenized_object``,
    ``tokenizer_manager.py`` 1553-1567): a watermark both at the top level (``top``) and in
    ``p``; ``SamplingParams(**p)``, which fails on a ``choice`` (:data:`NO_CHOICE`) and
    normalizes the watermark in ``__post_init__`` (:func:`watermark_malformed`); then
    ``normalize`` and ``verify`` (:func:`_verify`)."""
    if top is not None and p.get("watermark") is not None:
        return ContractError(WATERMARK_BOTH, step="verify")
    if "choice" in p:
        return ContractError(
            f"{where}.choice is not supported: {NO_CHOICE}", step="verify", value=p["choice"], fails=True
        )
    refused = watermark_malformed(p.get("watermark") if top is None else top)
    if refused is not None:
        return ContractError(refused, step="verify")
    try:
        _verify(p)
    except ContractError as exc:
        return exc.at("verify")
    return None


NO_SHORT_LIST = (
    "SGLang 0.5.23 takes one entry per item of a batch (managers/io_struct.py 540, 635-642, 722-747, "
    "776-848, 959-1031), and its /generate fails on a shorter list (an IndexError, a 500)."
)
"""Why a batch's per-item list shorter than the batch (:data:`PER_ITEM_LISTS`), or an empty
``sampling_params`` list, is refused: ``_handle_parallel_sampling`` reads a list's first entry
(``io_struct.py`` 540); ``_normalize_lora_paths``, ``_normalize_video_data`` /
``_normalize_audio_data`` / ``_normalize_sampling_params``, ``_normalize_logprob_params``,
``_normalize_custom_logit_processor`` and ``_normalize_bootstrap_params`` keep a list as it is
(635-642, 722-747, 776-821, 839-848, 907-947; only ``image_data``, ``watermark``,
``return_hidden_states``, ``extra_key``, ``cache_salt``, ``kv_hints`` and the rids are
length-checked), then each item's sub-request indexes it (``__getitem__``, 959-1031): an
IndexError, which ``/generate`` does not catch (``http_server.py`` 983-990 catch ``ValueError``):
a 500, which the router would take for a failing replica; refused here as a 400, in step 3's
body, by the engine and the router alike. A longer list is served: its extra entries are never
read."""

PER_ITEM_LISTS = (
    "video_data", "audio_data", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "lora_path", "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size",
)  # fmt: skip
"""A batch's lists SGLang 0.5.23 does not length-check and indexes per item, in
``__getitem__``'s order (``io_struct.py`` 959-1031): shorter than the batch, :data:`NO_SHORT_LIST`;
longer, the extra entries ignored. ``token_ids_logprob`` is one only as a list of lists (an
empty list asks for none, a flat one is every item's: 809-821, :func:`_per_item_list`)."""


NO_TEXT_AND_IDS = (
    "SGLang 0.5.23 takes a request's shape from text and each item's tokens from input_ids when both "
    "are sent (managers/io_struct.py 444-455, 479-487, 969; managers/tokenizer_manager.py 1118), and "
    "its /generate fails on input_ids that do not give one row per text (an IndexError or a "
    "TypeError, a 500)."
)
"""Why ``text`` with ``input_ids`` of another shape is refused: ``_validate_inputs`` refuses
only all of ``text``, ``input_ids`` and ``input_embeds`` (``io_struct.py`` 444-455),
``_determine_batch_size`` reads ``text`` first (479-487), each sub-request takes
``input_ids[i]`` (969) and ``_tokenize_one_request`` tokenizes nothing when ``input_ids`` is set
(``tokenizer_manager.py`` 1118). A text list with fewer rows is an IndexError in
``_init_req_state``; a flat list for a text list, or rows for one text, a TypeError when the
item is tokenized (``len``, 1336; ``array("q", ...)``, 1543-1545), which this check makes with
the short lists (:func:`_init_refusal`). A 500, which the router would take for a failing
replica; refused here as a 400, in step 3's body, by the engine and the router alike."""


def _text_and_ids_refusal(body: dict[str, Any]) -> ContractError | None:
    """``text`` sent with ``input_ids`` that do not give one row per text (:data:`NO_TEXT_AND_IDS`),
    or None; matching ones are served from ``input_ids``."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None or ids is None:
        return None
    rows = type(ids) is list and bool(ids) and type(ids[0]) is list
    if type(text) is list and (not rows or len(ids) < len(text)):
        shape = f"{len(ids)} rows" if rows else "one list of ids"
        message = f"input_ids ({shape}) for a batch of {len(text)} texts: {NO_TEXT_AND_IDS}"
    elif type(text) is str and rows:
        message = f"input_ids ({len(ids)} rows) for one text: {NO_TEXT_AND_IDS}"
    else:
        return None
    return ContractError(message, step="verify", value=ids, fails=True)


def _msgspec_type(v: Any) -> str:
    """The type as msgspec names it in a ``ValidationError``."""
    if v is None:
        return "null"
    names = {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}
    return names.get(type(v), type(v).__name__)


def _kv_hints_malformed(v: dict[str, Any]) -> str | None:
    """``decode_kv_hints_envelope`` (``srt/managers/kv_hints.py`` 44-58: ``msgspec.convert`` into
    ``KvHintsEnvelope``, 16-41) on an envelope the gate took, in msgspec's words: ``actions``
    null, a ``payload`` that is not an object, a required field missing (the actions', as each
    is converted, then the envelope's), or None."""
    if "actions" in v:
        actions = v["actions"]
        if actions is None:
            return "Expected `array`, got `null` - at `$.actions`"
        for i, action in enumerate(actions):
            payload = action.get("payload", {})
            if type(payload) is not dict:
                return f"Expected `object`, got `{_msgspec_type(payload)}` - at `$.actions[{i}].payload`"
            for name in _KV_HINT_ACTION_FIELDS:
                if name not in action:
                    return f"Object missing required field `{name}` - at `$.actions[{i}]`"
    for name in ("protocol_version", "message_id"):
        if name not in v:
            return f"Object missing required field `{name}`"
    return None


def _kv_hints_refusal(v: Any, batch: int | None) -> str | None:
    """``kv_hints`` as ``normalize_batch_and_arguments`` judges it (``io_struct.py`` 583-587 for
    one request: no list, an envelope only if truthy; 888-905 for a batch: one per item, each
    truthy one decoded, and a dict always), each envelope by :func:`_kv_hints_malformed`."""
    if v is None:
        return None
    if batch is None:
        if type(v) is list:
            return "kv_hints should be a single envelope for one request."
        envelopes = [v] if v else []
    elif type(v) is list:
        if len(v) != batch:
            return "The length of kv_hints should be equal to the batch size."
        envelopes = [x for x in v if x]
    else:
        envelopes = [v]
    for envelope in envelopes:
        refused = _kv_hints_malformed(envelope)
        if refused is not None:
            return f"Malformed kv_hints envelope: {refused}"
    return None


def _batch_size(body: dict[str, Any]) -> int | None:
    """The batch's size, or None for one request (``_determine_batch_size``, ``io_struct.py``
    473-498: a list ``text``, or ``input_ids`` whose first entry is no integer)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:
        return len(text) if type(text) is list else None
    if type(ids) is list and ids and type(ids[0]) is list:
        return len(ids)
    return None


NO_LIST_FOR_ONE = (
    "SGLang 0.5.23 reads one request's sampling_params as an object (managers/tokenizer_manager.py "
    "1354: sampling_params.get), and its /generate fails on a list there (an AttributeError, a 500); "
    "send an object, or a list with a batch."
)
"""Why a list ``sampling_params`` on one request (not a batch, no ``n`` above 1) is refused:
``_handle_parallel_sampling`` reads its first entry and keeps the request single
(``io_struct.py`` 531-557), ``_normalize_single_inputs`` keeps the list (559-562), and
``_validate_one_request`` calls ``.get`` on it after the input's length check
(``tokenizer_manager.py`` 1339-1354): an AttributeError, which ``/generate`` does not catch
(``http_server.py`` 983-990), a 500 the router would take for a failing replica; refused here
as a 400, in step 3's body, at that place (:func:`list_for_one_refusal`)."""

NO_NULL_N = (
    "SGLang 0.5.23 compares sampling_params.n with 1 (managers/io_struct.py 531-557: "
    "parallel_sample_num > 1), and its /generate fails on a null there (a TypeError, a 500); "
    "leave n out or send an integer."
)
"""Why ``"n": null`` is refused (unless ``beam_width`` above 1 sets the count to 1 first,
``io_struct.py`` 517-529): ``_handle_parallel_sampling`` takes ``get("n", 1)``, ``None``, and
compares it with 1, a TypeError in ``normalize_batch_and_arguments``: a 500."""


def _parallel_sampling_refusal(params: Any) -> ContractError | None:
    """``_handle_parallel_sampling`` (``io_struct.py`` 531-557) on a non-empty
    ``sampling_params``: a list whose entries' ``n`` differ (its words), then a null ``n``
    (:data:`NO_NULL_N`)."""
    if type(params) is dict:
        rows = [params]
    elif type(params) is list and params:
        rows = params
    else:
        return None
    n = rows[0].get("n", 1)
    if any(row.get("n", 1) != n for row in rows):
        message = "The parallel_sample_num should be the same for all samples in sample params."
        return ContractError(message, step="verify")
    if n is None and (rows[0].get("beam_width") or 1) <= 1:
        return ContractError(f"sampling_params.n is null: {NO_NULL_N}", step="verify", value=n, fails=True)
    return None


def _parallel(body: dict[str, Any]) -> bool:
    """Whether ``sampling_params.n`` (its first entry's, in a list) above 1 makes parallel samples
    (``_handle_parallel_sampling``, ``io_struct.py`` 531-557: ``parallel_sample_num > 1``;
    ``beam_width`` above 1 sets the count to 1 first, 517-529)."""
    params = body.get("sampling_params")
    first = params[0] if type(params) is list and params else params if type(params) is dict else {}
    n = first.get("n", 1)
    return type(n) is int and n > 1 and (first.get("beam_width") or 1) <= 1


def _stays_single(body: dict[str, Any]) -> bool:
    """Whether the request stays one request: no batch (:func:`_batch_size`), and no parallel
    samples (:func:`_parallel`), which make one request a batch of one (``io_struct.py``
    548-557)."""
    return _batch_size(body) is None and not _parallel(body)


def _normalized_batch(body: dict[str, Any]) -> int | None:
    """The ``batch_size`` ``_normalize_batch_inputs`` judges a batch's lists by (``io_struct.py``
    589-612), or None for a request that stays single (``_normalize_single_inputs``, 559-587):
    a batch's size, or 1 for one request that parallel samples make a batch (548-557)."""
    batch = _batch_size(body)
    return batch if batch is not None else None if _stays_single(body) else 1


def _list_for_one(body: dict[str, Any]) -> ContractError | None:
    """A list ``sampling_params`` on a request that stays single (:data:`NO_LIST_FOR_ONE`)."""
    params = body.get("sampling_params")
    if type(params) is not list or not params or not _stays_single(body):
        return None
    message = f"sampling_params is a list for one request: {NO_LIST_FOR_ONE}"
    return ContractError(message, step="verify", fails=True)


NO_RID_LIST = (
    "SGLang 0.5.23 keeps one request's rid as sent (managers/io_struct.py 559-564) and looks it up "
    "among the requests it runs (managers/tokenizer_manager.py 3817-3818, 3835), and its /generate "
    "fails on a list there (a TypeError: a list is unhashable, a 500); send a string, or a list with "
    "a batch."
)
"""Why a ``rid`` list on a request that stays single is refused: ``_normalize_single_inputs``
sets a rid only when none was sent (``io_struct.py`` 559-564), ``_validate_rid_uniqueness``
refuses only one named twice (390-397), and ``_init_req_state`` tests ``rid in
self.rid_to_state`` (``tokenizer_manager.py`` 3835), a TypeError on a list, which ``/generate``
does not catch (``http_server.py`` 983-990): a 500, which the router would take for a failing
replica; refused here as a 400, in step 3's body, at that place (:func:`_init_refusal`)."""


def _rid_list_for_one(body: dict[str, Any]) -> ContractError | None:
    """A ``rid`` list on a request that stays single (:data:`NO_RID_LIST`), or None."""
    rid = body.get("rid")
    if type(rid) is not list or not _stays_single(body):
        return None
    return ContractError(
        f"rid is a list for one request: {NO_RID_LIST}", step="verify", value=rid, fails=True
    )


ONE_VALUE_FIELDS = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
    "sampling_logprobs_mode",
)  # fmt: skip
"""One request's fields SGLang 0.5.23's scheduler reads as one value (:data:`NO_ONE_VALUE_LIST`)."""

NO_ONE_VALUE_LIST = (
    "SGLang 0.5.23 keeps one request's list here as sent (managers/io_struct.py 559-574) and its "
    "scheduler reads it as one value (managers/scheduler.py 3256-3275: compared with -1 and with the "
    "input's length; a list that holds false is true), where a TypeError ends the scheduler process "
    "and the server with it (6360-6373); send one value, or a list with a batch."
)
"""Why a list at one of :data:`ONE_VALUE_FIELDS` on a request that stays single is refused: the
gate takes it (a bool/int/string or a list of them), ``_normalize_single_inputs`` fills in only a
missing value (``io_struct.py`` 559-574), the tokenizer manager reads ``return_sampling_mask`` for
its truth only (``tokenizer_manager.py`` 1420-1435), and the scheduler compares
``logprob_start_len`` with numbers (``scheduler.py`` 3256-3275): a TypeError in
``_handle_generate_request`` (2959, dispatched uncaught at 2253), which ends the scheduler's event
loop and signals the server to quit (6360-6373), so the replica is gone, not one request refused.
A list SGLang would serve (an empty ``return_logprob``, read as false) is refused too: what it
does with each such list is decided deep in the scheduler, and a body that may end a replica is
never forwarded. Refused here as a 400 naming the field, after everything SGLang refuses before
its scheduler, and also where the full check leaves the rest to the server
(:func:`_tokenizer_refusal`)."""


def _one_value_list(body: dict[str, Any]) -> ContractError | None:
    """A list at one of :data:`ONE_VALUE_FIELDS` on a request that stays single
    (:data:`NO_ONE_VALUE_LIST`), or None."""
    if not _stays_single(body):
        return None
    for key in ONE_VALUE_FIELDS:
        value = body.get(key)
        if type(value) is list:
            message = f"{key} is a list for one request: {NO_ONE_VALUE_LIST}"
            return ContractError(message, step="verify", value=value, fails=True)
    return None


def one_value_list_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal of a list where one request's scheduler reads one value
    (:data:`NO_ONE_VALUE_LIST`), or None; a caller that makes SGLang's other step-3 checks runs
    this after all of them."""
    refused = _one_value_list(body)
    return None if refused is None else Refusal.of(refused)


def list_for_one_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal of a list ``sampling_params`` on one request (:data:`NO_LIST_FOR_ONE`), or None;
    SGLang fails on it per item after the input's length check and before the requested total's
    (``tokenizer_manager.py`` 1339-1354), so a caller that makes those checks runs this between."""
    refused = _list_for_one(body)
    return None if refused is None else Refusal.of(refused)


def _short(key: str, value: list[Any], batch: int) -> ContractError:
    message = f"{key} has {len(value)} entries for a batch of {batch}: {NO_SHORT_LIST}"
    return ContractError(message, step="verify", value=value, fails=True)


def _tokenizer_refusal(body: dict[str, Any]) -> ContractError | None:
    """Step 3 on a body both earlier steps took, in SGLang's order (``generate_request``,
    ``tokenizer_manager.py`` 903-942): :func:`_normalize_refusal`, then :func:`_init_refusal`,
    then each item in turn (:func:`_item_refusal` via :func:`_items`). Where SGLang would first
    judge a field by the server's settings (:func:`_server_judges`: ``max_thinking_tokens`` and
    ``routed_dp_rank`` before the rids are registered, the LoRA adapters after, then per item
    ``input_embeds``, hidden states, the custom logit processor), this check stops there and
    returns None: what SGLang names then is the server's to say, so a caller that forwards the
    body (the router) gets SGLang's own answer, naming what SGLang names (a ``lora_path`` before
    an out-of-range ``top_p``). Last, and also where it stopped so, a list where one request's
    scheduler reads one value (:data:`NO_ONE_VALUE_LIST`): a body that may end the replica is
    refused whatever the server would have named first."""
    refused = _before_the_scheduler(body)
    return refused if refused is not None else _one_value_list(body)


def _before_the_scheduler(body: dict[str, Any]) -> ContractError | None:
    """:func:`_tokenizer_refusal` but for what only the scheduler fails on; None also where it
    stops for a field the server judges."""
    refused = _normalize_refusal(body)
    if refused is not None or _server_judges(body, _SERVER_BEFORE_RIDS):
        return refused
    refused = _init_refusal(body)
    if refused is not None or _server_judges(body, ("lora_path",)):
        return refused
    for i, (where, p, top) in enumerate(_items(body)):
        if _server_judges(body, ("input_embeds",), i):
            return None
        refused = _list_for_one(body)  # after the input's length, which needs the model
        if refused is not None or _server_judges(body, _SERVER_PER_ITEM, i):
            return refused
        refused = _item_refusal(where, p, top)
        if refused is not None:
            return refused
    return None


_SERVER_BEFORE_RIDS = ("max_thinking_tokens", "routed_dp_rank", "data_parallel_rank")
"""What ``generate_request`` judges by the server's settings before ``_init_req_state``
(``tokenizer_manager.py`` 905-924: strict thinking, the data-parallel size)."""

_SERVER_PER_ITEM = ("token_ids_logprob", "return_hidden_states", "custom_logit_processor")
"""What ``_tokenize_one_request`` judges by the server's settings or model after the input's
length and before the item's ``SamplingParams`` (``tokenizer_manager.py`` 1393-1419: the
vocabulary, 1513-1531, the hidden-states mode, ``--enable-custom-logit-processor``);
``input_embeds`` (the radix cache, 1109-1114) comes before the input's length."""


def _asks(key: str, v: Any) -> bool:
    """Whether ``v`` at ``key`` asks the server for anything it judges by its settings (SGLang's
    tests: ``is not None`` for ``max_thinking_tokens`` and ``input_embeds``, 905, 1109; a rank
    other than 0, which every server's range holds, 915-924; ``if value:`` for ``lora_path`` and
    ``custom_logit_processor``, 3726, 1413; a hidden-states mode other than none, 1394-1398)."""
    if key in ("max_thinking_tokens", "input_embeds"):
        return v is not None
    if key in ("routed_dp_rank", "data_parallel_rank"):
        return v not in (None, 0)
    if key == "return_hidden_states":
        return v not in (None, False)
    return bool(v)


def _server_judges(body: dict[str, Any], keys: tuple[str, ...], item: int | None = None) -> bool:
    """Whether any of ``keys`` in ``body`` asks what SGLang judges by the server's settings
    (:func:`_asks`); with ``item``, as that item of a batch has it (a batch's list has one per
    item, ``io_struct.py`` 972-1000)."""
    for key in keys:
        v = body.get(key)
        if item is not None and _batch_size(body) is not None and _per_item_list(key, v):
            v = v[item] if item < len(v) else None
        if _asks(key, v):
            return True
    return False


def _per_item_list(key: str, v: Any) -> bool:
    """Whether a batch's ``v`` at ``key`` is one entry per item (``io_struct.py`` 809-821, 972-1000):
    a list, but for ``token_ids_logprob`` only a list of lists (one list of ids is every item's),
    and never ``input_embeds`` (the batch's input itself)."""
    if type(v) is not list or key == "input_embeds":
        return False
    return key != "token_ids_logprob" or (bool(v) and type(v[0]) is list)


NO_INPUT = "Either text, input_ids or input_embeds should be provided."
"""``_validate_inputs`` (``io_struct.py`` 444-455, the first check of
``normalize_batch_and_arguments``, 431): none of ``text``, ``input_ids``, ``input_embeds`` sent
(or null), or all three; a ``ValueError``, a 400 in step 3's body."""


def _inputs_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_validate_inputs`` (:data:`NO_INPUT`): no input, or all three inputs, or None."""
    sent = [body.get(key) is not None for key in ("text", "input_ids", "input_embeds")]
    if not any(sent) or all(sent):
        return ContractError(NO_INPUT, step="verify")
    return None


def _empty_ids_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_determine_batch_size`` (``io_struct.py`` 479-498): without ``text``, an empty
    ``input_ids`` is refused in its words (488-497) unless ``session_params`` names a session
    (``id``), whose history may supply the prompt; or None."""
    if body.get("text") is not None or body.get("input_ids") != []:
        return None
    session = body.get("session_params")
    if type(session) is dict and session.get("id"):
        return None
    return ContractError("input_ids cannot be empty.", step="verify", value=[])


SESSION_BOTH = "session_id and session_params cannot both be set."
"""``normalize_batch_and_arguments`` (``io_struct.py`` 433-434), after ``_determine_batch_size``
and before ``_handle_parallel_sampling``: both sent (not null), whatever their values."""


def _normalize_refusal(body: dict[str, Any]) -> ContractError | None:
    """``normalize_batch_and_arguments`` (``tokenizer_manager.py`` 903; ``io_struct.py`` 406-442),
    in its order: the inputs (:func:`_inputs_refusal`, 431), an empty ``input_ids``
    (:func:`_empty_ids_refusal`, 432), ``session_id`` with ``session_params``
    (:data:`SESSION_BOTH`, 433-434); an empty ``sampling_params`` list (read at its first entry,
    540: :data:`NO_SHORT_LIST`), ``n`` (:func:`_parallel_sampling_refusal`); for a batch, or one
    request parallel samples make a batch of one (:func:`_normalized_batch`), its lists
    (:func:`_batch_lists_refusal`), else one request's keys (:func:`_single_refusal`);
    ``kv_hints`` (583-587, 888-905); last a rid named twice (:func:`_rid_uniqueness_refusal`)."""
    refused = _inputs_refusal(body) or _empty_ids_refusal(body)
    if refused is not None:
        return refused
    if body.get("session_id") is not None and body.get("session_params") is not None:
        return ContractError(SESSION_BOTH, step="verify")
    params, rid = body.get("sampling_params"), body.get("rid")
    if params == []:
        return _short("sampling_params", params, _batch_size(body) or 1)
    refused = _parallel_sampling_refusal(params)
    if refused is not None:
        return refused
    batch = _normalized_batch(body)
    refused = _single_refusal(body) if batch is None else _batch_lists_refusal(body, batch)
    if refused is not None:
        return refused
    kv_hints = _kv_hints_refusal(body.get("kv_hints"), batch)
    if kv_hints is not None:
        return ContractError(kv_hints, step="verify")
    return _rid_uniqueness_refusal(rid)


_PARALLEL_LISTS = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
    "sampling_logprobs_mode", "token_ids_logprob",
)  # fmt: skip
"""The per-item lists ``_normalize_logprob_params`` refuses with parallel samples, in its order
(``io_struct.py`` 776-821: any list, ``token_ids_logprob`` only a list of lists)."""


def _parallel_list_refusal(body: dict[str, Any], keys: tuple[str, ...]) -> ContractError | None:
    """With parallel samples (:func:`_parallel`), the first of ``keys`` sent as one entry per
    item (:func:`_per_item_list`; an empty list too, but for ``token_ids_logprob``), refused in
    SGLang's words (``io_struct.py`` 783-788, 817-821, 839-848), or None."""
    if not _parallel(body):
        return None
    for key in keys:
        if _per_item_list(key, body.get(key)):
            message = f"Cannot use list {key} with parallel_sample_num > 1"
            return ContractError(message, step="verify", value=body.get(key))
    return None


def _batch_lists_refusal(body: dict[str, Any], batch: int) -> ContractError | None:
    """``_normalize_batch_inputs`` (``io_struct.py`` 589-612) on a batch of ``batch``
    (:func:`_normalized_batch`), in its order: a ``rid`` list of another length (759-774), the
    length of ``image_data`` (659-662; an empty list is none), ``mm_hashes``
    (:func:`_mm_hashes_refusal`), the length of the top-level ``watermark`` (749-757), with
    parallel samples a per-item logprob list (:data:`_PARALLEL_LISTS`), the length of
    ``return_hidden_states`` (823-837), with parallel samples a ``custom_logit_processor`` list
    (839-848), the lengths of ``extra_key`` and ``cache_salt`` (850-886); or None."""
    rid = body.get("rid")
    if type(rid) is list and len(rid) != batch:
        message = "The specified rids length mismatch with the batch_size for batch processing."
        return ContractError(message, step="verify", value=rid)
    return (
        _lengths_refusal(body, batch, ("image_data",))
        or _mm_hashes_refusal(body, batch)
        or _lengths_refusal(body, batch, ("watermark",))
        or _parallel_list_refusal(body, _PARALLEL_LISTS)
        or _lengths_refusal(body, batch, ("return_hidden_states",))
        or _parallel_list_refusal(body, ("custom_logit_processor",))
        or _lengths_refusal(body, batch, ("extra_key", "cache_salt"))
    )


def _image_counts(image_data: Any, batch: int) -> list[int]:
    """How many images each of a batch's requests has once ``_normalize_image_data`` normalized
    ``image_data`` (``io_struct.py`` 645-685, its length already checked): none for null or an
    empty list, one each for one image or a flat list (a null entry too, wrapped as ``[None]``),
    each row's length for a list of lists (a null row none)."""
    if image_data is None or image_data == []:
        return [0] * batch
    if type(image_data) is not list:
        return [1] * batch
    if type(image_data[0]) is list:
        return [len(row or []) for row in image_data]
    return [1] * len(image_data)


def _mm_hashes_refusal(body: dict[str, Any], batch: int) -> ContractError | None:
    """``_normalize_mm_hashes`` (``io_struct.py`` 687-720) on a batch's ``mm_hashes`` (a list:
    the gate's ``StringListOrList``), in its words: another length than the batch (696-699), then
    per request a hash that is no list for a request without exactly one image (705-713), or a
    list of another length than its images (714-718); or None. (``mm_content_hashes``, which it
    judges next, is a dataclass-only key, not checked here.)"""
    hashes = body.get("mm_hashes")
    if hashes is None:
        return None
    if len(hashes) != batch:
        message = "The length of mm_hashes should equal the batch size"
        return ContractError(message, step="verify", value=hashes)
    counts = _image_counts(body.get("image_data"), batch)
    for i, (request_hashes, count) in enumerate(zip(hashes, counts, strict=True)):
        if type(request_hashes) is not list and count != 1:
            message = f"mm_hashes[{i}] must be a list with one entry per image"
            return ContractError(message, step="verify", value=request_hashes)
        size = len(request_hashes) if type(request_hashes) is list else 1
        if size != count:
            message = f"mm_hashes[{i}] has {size} entries for {count} images"
            return ContractError(message, step="verify", value=request_hashes)
    return None


def _single_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_normalize_single_inputs`` (``io_struct.py`` 559-587) on a request that stays single
    (:func:`_normalized_batch`), before its ``kv_hints`` (:func:`_kv_hints_refusal`): an
    ``extra_key`` or ``cache_salt`` that is no string (a list: the gate takes only a string or
    strings), in its words (575-580); or None."""
    for key in ("extra_key", "cache_salt"):
        value = body.get(key)
        if value is not None and type(value) is not str:
            message = f"{key} should be a string for a single request."
            return ContractError(message, step="verify", value=value)
    return None


def _lengths_refusal(body: dict[str, Any], batch: int, keys: tuple[str, ...]) -> ContractError | None:
    """The first of ``keys`` sent as a list of another length than ``batch``, in SGLang's words
    (``io_struct.py`` 659-662, 749-757, 823-837, 850-886; an empty ``image_data`` is none), or
    None."""
    for key in keys:
        value = body.get(key)
        if type(value) is list and (value or key != "image_data") and len(value) != batch:
            return ContractError(f"The length of {key} should be equal to the batch size.", step="verify")
    return None


def _rid_uniqueness_refusal(rid: Any) -> ContractError | None:
    """``_validate_rid_uniqueness`` (``io_struct.py`` 390-397), the last check of
    ``normalize_batch_and_arguments`` (442), in its words: a ``rid`` list naming one rid twice
    (the rids named more than once, in the order first named, as a Python list)."""
    if type(rid) is not list or len(set(rid)) == len(rid):
        return None
    duplicates = [r for r, count in Counter(rid).items() if count > 1]
    return ContractError(f"Duplicate request IDs detected within the request: {duplicates}", step="verify")


def _init_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_init_req_state`` (``tokenizer_manager.py`` 926, 3818-3831), which builds every item's
    sub-request (``obj[i]``, ``io_struct.py`` 972-982) before registering the rids: a batch's
    ``video_data`` / ``audio_data`` / ``sampling_params`` list shorter than the batch, kept as
    sent (722-747), is an IndexError there (:data:`NO_SHORT_LIST`); one request's ``rid`` list
    a TypeError as its rid is looked up (:data:`NO_RID_LIST`, 3835); then ``text`` with
    ``input_ids`` of another shape (:data:`NO_TEXT_AND_IDS`)."""
    batch = _batch_size(body)
    if batch is not None:
        for key in PER_ITEM_LISTS:
            value = body.get(key)
            if _per_item_list(key, value) and len(value) < batch:
                return _short(key, value, batch)
    return _rid_list_for_one(body) or _text_and_ids_refusal(body)


def _items(body: dict[str, Any]) -> list[tuple[str, dict[str, Any], Any]]:
    """Each item's ``sampling_params`` (where it stands, the object, ``{}`` for none) and its
    top-level ``watermark`` (a batch's list has one per item, io_struct.py 749-757)."""
    batch = _batch_size(body)
    top, params = body.get("watermark"), body.get("sampling_params")
    listed = type(params) is list
    per_item = batch is not None and type(top) is list
    items = []
    count = batch if batch is not None else len(params) if listed else 1  # a longer list's rest unread
    for i in range(count):
        p = (params[i] if i < len(params) else None) if listed else params
        item_top = (top[i] if i < len(top) else None) if per_item else top
        items.append((f"sampling_params[{i}]" if listed else "sampling_params", p or {}, item_top))
    return items


def batch_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal ``normalize_batch_and_arguments`` makes of a ``/generate`` body steps 1 and 2
    took (:func:`_normalize_refusal`; ``tokenizer_manager.py`` 903, the first thing
    ``generate_request`` does), or None. For a caller that runs step 3 itself in SGLang's order,
    between its own refusals (the local engine: ``GenerateReqInput.normalize``)."""
    refused = _normalize_refusal(body)
    return None if refused is None else Refusal.of(refused)


def short_list_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal ``_init_req_state`` makes of such a body (:func:`_init_refusal`: a short
    list, :data:`NO_SHORT_LIST`), or None; SGLang makes it after the priority,
    ``max_thinking_tokens`` and ``routed_dp_rank`` (``tokenizer_manager.py`` 904-926) and
    before it registers the rids (3833-3837)."""
    refused = _init_refusal(body)
    return None if refused is None else Refusal.of(refused)


def item_refusal(body: dict[str, Any], index: int) -> Refusal | None:
    """The refusal ``_create_tokenized_object`` makes of item ``index`` of a ``/generate`` body
    steps 1 and 2 took (:func:`_item_refusal`: a watermark set both ways, a ``choice``, a
    malformed watermark, ``SamplingParams.normalize``/``verify``; ``tokenizer_manager.py``
    1548-1567), or None. SGLang runs it per item after that item's other step-3 checks (LoRA,
    ``input_embeds``, the context length, hidden states, the custom logit processor:
    ``generate_request`` 903-942, ``_tokenize_one_request`` 1096-1434), so a caller that makes
    those runs this after them."""
    where, p, top = _items(body)[index]
    refused = _item_refusal(where, p, top)
    return None if refused is None else Refusal.of(refused)


def _sampling_params_or_list(where: str, v: Any) -> None:
    if type(v) is list:
        _each(where, v, sampling_params)
    else:
        sampling_params(where, v)


_LAX_INT = TypeAdapter(int)
_LAX_BOOL = TypeAdapter(bool)


def _lax(adapter: TypeAdapter, v: Any) -> bool:
    """Whether pydantic's lax parse (what SGLang's dataclass parse runs) takes ``v`` as the
    adapter's type."""
    try:
        adapter.validate_python(v)
    except ValidationError:
        return False
    return True


def _lax_int(v: Any) -> bool:
    """Whether the dataclass parse (pydantic's lax ``int``) takes ``v`` (a bool, an integral
    float, a decimal string)."""
    return _lax(_LAX_INT, v)


def _lax_bool(v: Any) -> bool:
    """Whether the dataclass parse (pydantic's lax ``bool``) takes ``v`` (a bool, 0 or 1, one of
    its words)."""
    return _lax(_LAX_BOOL, v)


def _parsed(one: Callable[[str, Any], Any], takes: Callable[[Any], bool]) -> Callable[[str, Any], None]:
    """``one`` (the gate's check), its refusal made by the dataclass parse instead where the
    value refused is not one the parse ``takes`` (step 1 runs first). ``takes`` never: a field
    whose every gate refusal is the parse's too (a string field: pydantic takes only a string)."""

    def check(where: str, v: Any) -> None:
        try:
            one(where, v)
        except ContractError as exc:
            raise exc if takes(exc.value) else exc.at("parse") from None

    return check


def _never(v: Any) -> bool:
    return False


def _one_or_list(one: Callable[[str, Any], Any], union: str) -> Callable[[str, Any], None]:
    """A value or a list of values whose entries may be null (SGLang's ``Optional...OrList``);
    a scalar refused is named as the gate names it (``a value or an array of values for ...``)."""

    def check(where: str, v: Any) -> None:
        if type(v) is list:
            _each(where, v, _nullable(one))
            return
        try:
            one(where, v)
        except ContractError:
            raise _refuse(where, v, f"a value or an array of values for {union}") from None

    return check


def _uint(where: str, v: Any) -> int:
    if type(v) is int and v < 0:
        raise ContractError(f"{where}: invalid value: integer `{v}`, expected u64", value=v)
    return _int(where, v)


def _string_list_or_list(where: str, v: Any) -> None:
    """``decode_StringListOrList`` (api_types.py 966-972): ``[]`` or a list of strings, else a
    list of such lists."""
    if type(v) is not list:
        raise _refuse(where, v, "a value or an array of values for StringListOrList")
    if not v or type(v[0]) is str:
        _each(where, v, _str)
    else:
        _each(where, v, lambda w, row: _each(w, row, _str))


def _labels(where: str, v: Any) -> None:
    for key, x in _map(where, v).items():
        _str(f"{where}.{key}", x)


def _hidden_mode(where: str, v: Any) -> None:
    """``return_hidden_states``: the gate takes a bool or a list of bools (``decode_BoolOrList``,
    api_types.py 989-1003), the dataclass also ``"last"`` (io_struct.py 260-262, schedule_batch.py 179)."""
    if type(v) is list:
        _each(where, v, _bool)
    elif type(v) is not bool:
        raise _refuse(where, v, "a value or an array of values for BoolOrList")


_optional_int_or_list = _parsed(_one_or_list(_int, "OptionalInt64OrList"), _lax_int)
_optional_str_or_list = _parsed(_one_or_list(_str, "OptionalStringOrList"), _never)


def _lax_token_ids(v: Any) -> bool:
    """Whether the dataclass parse takes ``v`` as ``Union[List[List[int]], List[int]]``
    (io_struct.py 237): a list of pydantic's lax ints, or a list of such lists."""
    return type(v) is list and (
        all(map(_lax_int, v)) or all(type(row) is list and all(map(_lax_int, row)) for row in v)
    )


def _token_ids_logprob(where: str, v: Any) -> None:
    """:func:`token_ids`, refused by the dataclass parse where it does not take the whole value
    (:func:`_lax_token_ids`: a scalar, a row that is no list, an id such as ``1.5``); ``["3"]``
    or ``[true]`` it takes, and the gate refuses."""
    try:
        token_ids(where, v)
    except ContractError as exc:
        raise exc if _lax_token_ids(v) else exc.at("parse") from None


def _sampling_params_field(where: str, v: Any) -> None:
    """``sampling_params``: the dataclass parse takes only an object or a list of objects, any
    keys and values (``Optional[Union[List[Dict[str, Any]], Dict[str, Any]]]``, io_struct.py
    227), and refuses another shape first; then :func:`sampling_params` on each."""
    rows = v if type(v) is list else [v]
    for i, p in enumerate(rows):
        if type(p) is not dict:
            raise _refuse(f"{where}[{i}]" if type(v) is list else where, p, "a map").at("parse")
    _sampling_params_or_list(where, v)


_lax_bool_or_list = _parsed(_or_list(_bool), _lax_bool)
_lax_int_or_list = _parsed(_or_list(_int), _lax_int)


def _always(v: Any) -> bool:
    return True


_MEDIA_REF_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "url": _str,
    "detail": _nullable(_str),
    "max_dynamic_patch": _nullable(_int),
    "content_hash": _nullable(_str),
    "min_pixels": _nullable(_int),
    "max_pixels": _nullable(_int),
    "total_max_pixels": _nullable(_int),
    "fps": _nullable(_float),
    "num_frames": _nullable(_int),
    "min_frames": _nullable(_int),
    "max_frames": _nullable(_int),
    "max_tokens_per_frame": _nullable(_int),
    "max_image_tokens": _nullable(_int),
    "use_audio": _nullable(_bool),
    "image_grid_thw": _nullable(
        lambda where, v: _each(where, v, lambda w, row: int_list(w, row, int64=False))
    ),
}  # MediaRef, api_types.py 443-458, decoded 1902-1940: unknown keys refused


def _media_item(where: str, v: Any) -> None:
    """``decode_MediaItem`` (api_types.py 1986-1991): a string or a ``MediaRef`` object."""
    if type(v) is str:
        return
    if type(v) is not dict:
        raise _refuse(where, v, "one of the MediaItem shapes")
    for key, x in v.items():
        check = _MEDIA_REF_FIELDS.get(key)
        if check is None:
            raise _unknown_field(where, key, tuple(_MEDIA_REF_FIELDS))
        check(f"{where}.{key}", x)


def _media_items(where: str, v: Any) -> None:
    """``decode_MediaItems`` (api_types.py 2010-2011): a list of items or nulls."""
    _each(where, v, _nullable(_media_item))


def _media_input(where: str, v: Any) -> None:
    """``image_data`` / ``video_data`` / ``audio_data``: ``decode_MediaInput`` (api_types.py
    2034-2043): one item, a list of items (or nulls), or a list whose first entry is a list: a
    list of such lists (or nulls). The dataclass parse takes any value (its item type unions in
    PIL's ``Image``, ``Any`` at runtime: io_struct.py 78-81, 158-173), so every refusal is the
    gate's."""
    if type(v) in (str, dict):
        _media_item(where, v)
    elif type(v) is list:
        if v and type(v[0]) is list:
            _each(where, v, _nullable(_media_items))
        else:
            _media_items(where, v)
    else:
        raise _refuse(where, v, "one of the MediaInput shapes")


_KV_HINT_ACTION_FIELDS = ("action_id", "action_type", "action_version")


def _kv_hint_action(where: str, v: Any) -> None:
    """``decode_KvHintAction`` (api_types.py 1648-1660): string ids, any ``payload``."""
    for key, x in _map_as(where, v, "struct KvHintAction").items():
        if key in _KV_HINT_ACTION_FIELDS:
            _str(f"{where}.{key}", x)


def _kv_hints_envelope(where: str, v: Any) -> None:
    """``decode_KvHintsEnvelope`` (api_types.py 1626-1637): string ``protocol_version`` and
    ``message_id``, ``actions`` null or a list of actions; unknown keys ignored."""
    for key, x in _map_as(where, v, "struct KvHintsEnvelope").items():
        if key in ("protocol_version", "message_id"):
            _str(f"{where}.{key}", x)
        elif key == "actions" and x is not None:
            _each(f"{where}.{key}", x, _kv_hint_action)


def _kv_hints(where: str, v: Any) -> None:
    """``decode_KvHintsEnvelopeOrList`` (api_types.py 1598-1601, 1610-1619): one envelope or a
    list of envelopes or nulls."""
    if type(v) is list:
        _each(where, v, _nullable(_kv_hints_envelope))
    elif type(v) is dict:
        _kv_hints_envelope(where, v)
    else:
        raise _refuse(where, v, "a value or an array of values for KvHintsEnvelopeOrList")


def _lax_kv_hints(v: Any) -> bool:
    """Whether the dataclass parse takes ``v`` as ``kv_hints`` (io_struct.py 378-380: a dict, or
    a list of dicts and nulls)."""
    return type(v) is dict or (type(v) is list and all(x is None or type(x) is dict for x in v))


def _images_config(where: str, v: Any) -> None:
    """``decode_ImagesConfig`` (api_types.py 1579-1587): ``image_mode`` null or a string,
    ``prefix`` a string; unknown keys ignored."""
    for key, x in _map_as(where, v, "struct ImagesConfig").items():
        if key == "prefix" or (key == "image_mode" and x is not None):
            _str(f"{where}.{key}", x)


def _map_as(where: str, v: Any, expected: str) -> dict[str, Any]:
    if type(v) is dict:
        return v
    raise _refuse(where, v, expected)


def _parsed_whole(one: Callable[[str, Any], Any], takes: Callable[[Any], bool]) -> Callable[[str, Any], None]:
    """``one`` (the gate's check), its refusal made by the dataclass parse instead where the parse
    does not take the whole value (its type is judged as a whole: a dict whose entries the gate
    refuses still parses)."""

    def check(where: str, v: Any) -> None:
        try:
            one(where, v)
        except ContractError as exc:
            raise exc if takes(v) else exc.at("parse") from None

    return check


def _parse_only(takes: Callable[[Any], bool], expected: str) -> Callable[[str, Any], None]:
    """A dataclass-only key (the gate does not decode it): refused by the parse alone, where
    pydantic's lax type does not take the value (``null`` included)."""

    def check(where: str, v: Any) -> None:
        if not takes(v):
            raise _refuse(where, v, expected).at("parse")

    return check


# Every field is typed as the dataclass types it (io_struct.py 180-378) and its parse runs first:
# a value it refuses too (pydantic's lax types: a number for a string, 2 or "x" for a bool, 1.5 or
# "x" for an int, a scalar for a list) is the parse's refusal (step 1), one only the gate refuses
# ("3" for an int, 1 or "yes" for a bool) the gate's (step 2).
_GENERATE_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "rid": _nullable(_parsed(_str_or_list, _never)),  # io_struct.py 180
    "text": _nullable(_parsed(_str_or_list, _never)),  # io_struct.py 185
    "input_ids": _nullable(_input_ids),
    "stream": _not_null(_parsed(_bool, _lax_bool), "a boolean"),  # a plain bool field (io_struct.py 256)
    "sampling_params": _nullable(_sampling_params_field),
    "return_logprob": _nullable(_lax_bool_or_list),  # io_struct.py 230
    "logprob_start_len": _nullable(_lax_int_or_list),  # io_struct.py 233
    "top_logprobs_num": _nullable(_lax_int_or_list),  # io_struct.py 235
    "token_ids_logprob": _nullable(_token_ids_logprob),
    "return_text_in_logprobs": _not_null(_parsed(_bool, _lax_bool), "a boolean"),  # io_struct.py 247
    "return_sampling_mask": _nullable(_lax_bool_or_list),  # io_struct.py 239
    "routed_experts_start_len": _not_null(_parsed(_int, _lax_int), "i64"),  # io_struct.py 268
    # the other keys the gate decodes (api_types.py 1435-1494)
    "return_hidden_states": _not_null(
        _parsed(_hidden_mode, lambda v: v == "last" or _lax_bool(v)), "a boolean"
    ),  # io_struct.py 260-262
    "bootstrap_host": _nullable(_optional_str_or_list),
    "bootstrap_port": _nullable(_optional_int_or_list),
    "bootstrap_room": _nullable(_optional_int_or_list),
    "bootstrap_pair_key": _nullable(_optional_str_or_list),
    "decode_tp_size": _nullable(_optional_int_or_list),
    "routed_dp_rank": _nullable(_parsed(_int, _lax_int)),
    "disagg_prefill_dp_rank": _nullable(_parsed(_int, _lax_int)),
    "mm_hashes": _nullable(_parsed(_string_list_or_list, _never)),
    "extra_key": _nullable(_parsed(_str_or_list, _never)),
    "priority": _nullable(_parsed(_int, _lax_int)),
    "cache_salt": _nullable(_parsed(_str_or_list, _never)),
    "require_reasoning": _not_null(_parsed(_bool, _lax_bool), "a boolean"),  # io_struct.py 317
    "lora_path": _nullable(_optional_str_or_list),
    "routing_key": _nullable(_parsed(_str, _never)),
    "max_thinking_tokens": _nullable(_parsed(_uint, _lax_int)),
    "session_id": _nullable(_parsed(_str, _never)),
    "custom_logit_processor": _nullable(_optional_str_or_list),
    "custom_labels": _nullable(_parsed(_labels, _never)),
    "return_prompt_token_ids": _not_null(_parsed(_bool, _lax_bool), "a boolean"),  # io_struct.py 337
    # the gate takes any session_params (api_types.py 1471-1472), the dataclass a dict (io_struct.py 274)
    "session_params": _nullable(_parsed(_map, _never)),
    "modalities": _nullable(_parsed(lambda where, v: _each(where, v, _str), _never)),  # io_struct.py 272
    # the nested structs (api_types.py 1453-1460, 1473-1474, 1485-1486)
    "image_data": _nullable(_media_input),  # io_struct.py 200-204: any value parses
    "video_data": _nullable(_media_input),
    "audio_data": _nullable(_media_input),
    "kv_hints": _nullable(_parsed_whole(_kv_hints, _lax_kv_hints)),  # io_struct.py 378-380
    "images_config": _nullable(_parsed_whole(_images_config, lambda v: type(v) is dict)),  # io_struct.py 357
    # a dataclass-only bool (io_struct.py 269), read by no /generate answer on such a server
    "return_indexer_topk": _parse_only(_lax_bool, "a boolean"),
}


def generate_body_refusal(
    body: Any, skip: frozenset[str] = frozenset(), through: Step = "verify"
) -> Refusal | None:
    """The first refusal SGLang makes in the parsed ``/generate`` JSON ``body`` (one line naming
    the field, and the step that makes it), or None; the fields in ``skip`` are not looked at (a
    caller that checks them itself). A body that is not an object is the dataclass parse's.
    The steps run in turn, each over the whole body: a field the parse refuses is the answer
    wherever it stands, then the first (in the body's order) the gate refuses, then the first
    ``SamplingParams`` refuses. ``through="gate"`` stops after step 2, for a caller that runs
    step 3 itself (:func:`batch_refusal`, :func:`item_refusal`) among its own step-3 refusals."""
    if type(body) is not dict:
        return Refusal("parse", str(_refuse("body", body, "a map")))
    first: Refusal | None = None
    for key, x in body.items():
        check = _GENERATE_FIELDS.get(key)
        if check is None or key in skip:
            continue
        try:
            check(key, x)
        except ContractError as exc:
            if first is None or _STEPS.index(exc.step) < _STEPS.index(first.step):
                first = Refusal.of(exc)
    if first is not None or through != "verify":
        return first
    refused = _tokenizer_refusal(body)
    return None if refused is None else Refusal.of(refused)


_STEPS: tuple[Step, ...] = ("parse", "gate", "verify")


def generate_body_error(body: Any, skip: frozenset[str] = frozenset()) -> str | None:
    """The line of :func:`generate_body_refusal`, or None."""
    refusal = generate_body_refusal(body, skip)
    return None if refusal is None else refusal.message

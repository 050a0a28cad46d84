"""``sampling_params`` as SGLang 0.5.23 judges it: the gate's types of its keys and ``SamplingParams``'
ranges and normalization, the watermark's, and one item's step-3 refusal (:func:`item_sampling_refusal`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from core.sglang_contract.refusal import ContractError, unknown_field
from core.sglang_contract.values import (
    boolean,
    each,
    f64,
    i64,
    int_list,
    mapping,
    nullable,
    string,
    string_or_list,
)
from core.sglang_release import max_req_len

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


_WATERMARK_TYPES = {"enabled": boolean, "key": string, "context_window": i64}  # api_types.py 1384-1399


def _watermark(where: str, v: Any) -> None:
    """``decode_WatermarkRequestConfig`` (``api_types.py`` 1384-1399)."""
    for key, x in mapping(where, v).items():
        if key not in _WATERMARK_TYPES:
            raise unknown_field(where, key, tuple(_WATERMARK_TYPES))
        nullable(_WATERMARK_TYPES[key])(f"{where}.{key}", x)


def _logit_bias(where: str, v: Any) -> None:
    for key, x in mapping(where, v).items():
        f64(f"{where}.{key}", x)


_SAMPLING_TYPES: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": i64,
    "stop": string_or_list,
    "stop_token_ids": lambda where, v: int_list(where, v, int64=False),
    "stop_regex": string_or_list,
    "temperature": f64,
    "top_p": f64,
    "top_k": i64,
    "min_p": f64,
    "frequency_penalty": f64,
    "presence_penalty": f64,
    "repetition_penalty": f64,
    "min_new_tokens": i64,
    "n": i64,
    "json_schema": string,
    "regex": string,
    "ebnf": string,
    "structural_tag": string,
    "ignore_eos": boolean,
    "skip_special_tokens": boolean,
    "spaces_between_special_tokens": boolean,
    "no_stop_trim": boolean,
    "stream_interval": i64,
    "logit_bias": _logit_bias,
    "sampling_seed": i64,
    "custom_params": lambda where, v: None,
    "beam_width": i64,
    "watermark": _watermark,
    "choice": lambda where, v: each(where, v, string),
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
    """How many tokens SGLang lets a request of ``input_len`` prompt tokens generate at most: the
    scheduler's ``init_req_max_new_tokens`` takes ``max_new_tokens`` (``1 << 30`` for None: an
    explicit None stays None and ``verify`` skips its checks then, ``srt/sampling/sampling_params.py``
    149, 285) capped at ``max_req_len - len(input) - 1`` (``srt/managers/scheduler.py`` 2693-2716,
    the cap written back as the request's ``max_new_tokens``, 2736, at which it finishes with
    ``length``), where ``max_req_len`` is :func:`core.sglang_release.max_req_len`. So an explicit
    value the tokenizer manager lets through (``input_len + max_new_tokens <= context_len``,
    ``tokenizer_manager.py`` 1352-1375; above it is refused there) generates at most
    ``context_len - input_len - 2`` tokens. At least 0."""
    wanted = 1 << 30 if max_new_tokens is None else max_new_tokens
    return max(0, min(wanted, max_req_len(context_len) - input_len - 1))


def sampling_params(where: str, v: Any) -> None:
    """One ``sampling_params`` object: its keys and their types (the contract gate); SGLang's
    ranges are step 3's (:func:`item_sampling_refusal`). Raises :class:`ContractError`."""
    p = mapping(where, v)
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


def item_sampling_refusal(where: str, p: dict[str, Any], top: Any) -> ContractError | None:
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

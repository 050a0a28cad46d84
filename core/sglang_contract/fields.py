"""The top-level fields of a ``/generate`` body and their types as SGLang 0.5.23's parse and gate
type them (:data:`GENERATE_FIELDS`), the nested structs (media, ``kv_hints``, ``images_config``)
included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.sglang_contract.refusal import ContractError, unknown_field
from core.sglang_contract.sampling import sampling_params
from core.sglang_contract.values import (
    boolean,
    each,
    f64,
    i64,
    int_list,
    lax_bool,
    lax_int,
    mapping,
    never,
    not_null,
    nullable,
    one_or_list,
    or_list,
    parsed,
    refuse,
    strict_token_ids,
    string,
    string_or_list,
    token_ids,
)


def _sampling_params_or_list(where: str, v: Any) -> None:
    if type(v) is list:
        each(where, v, sampling_params)
    else:
        sampling_params(where, v)


def _uint(where: str, v: Any) -> int:
    if type(v) is int and v < 0:
        raise ContractError(f"{where}: invalid value: integer `{v}`, expected u64", value=v)
    return i64(where, v)


def _string_list_or_list(where: str, v: Any) -> None:
    """``decode_StringListOrList`` (api_types.py 966-972): ``[]`` or a list of strings, else a
    list of such lists."""
    if type(v) is not list:
        raise refuse(where, v, "a value or an array of values for StringListOrList")
    if not v or type(v[0]) is str:
        each(where, v, string)
    else:
        each(where, v, lambda w, row: each(w, row, string))


def _labels(where: str, v: Any) -> None:
    for key, x in mapping(where, v).items():
        string(f"{where}.{key}", x)


def _hidden_mode(where: str, v: Any) -> None:
    """``return_hidden_states``: the gate takes a bool or a list of bools (``decode_BoolOrList``,
    api_types.py 989-1003), the dataclass also ``"last"`` (io_struct.py 260-262, schedule_batch.py 179)."""
    if type(v) is list:
        each(where, v, boolean)
    elif type(v) is not bool:
        raise refuse(where, v, "a value or an array of values for BoolOrList")


_optional_int_or_list = parsed(one_or_list(i64, "OptionalInt64OrList"), lax_int)


_optional_str_or_list = parsed(one_or_list(string, "OptionalStringOrList"), never)


def _lax_token_ids(v: Any) -> bool:
    """Whether the dataclass parse takes ``v`` as ``Union[List[List[int]], List[int]]``
    (io_struct.py 237): a list of pydantic's lax ints, or a list of such lists."""
    return type(v) is list and (
        all(map(lax_int, v)) or all(type(row) is list and all(map(lax_int, row)) for row in v)
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
            raise refuse(f"{where}[{i}]" if type(v) is list else where, p, "a map").at("parse")
    _sampling_params_or_list(where, v)


_lax_bool_or_list = parsed(or_list(boolean), lax_bool)


_lax_int_or_list = parsed(or_list(i64), lax_int)


def _always(v: Any) -> bool:
    return True


_MEDIA_REF_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "url": string,
    "detail": nullable(string),
    "max_dynamic_patch": nullable(i64),
    "content_hash": nullable(string),
    "min_pixels": nullable(i64),
    "max_pixels": nullable(i64),
    "total_max_pixels": nullable(i64),
    "fps": nullable(f64),
    "num_frames": nullable(i64),
    "min_frames": nullable(i64),
    "max_frames": nullable(i64),
    "max_tokens_per_frame": nullable(i64),
    "max_image_tokens": nullable(i64),
    "use_audio": nullable(boolean),
    "image_grid_thw": nullable(lambda where, v: each(where, v, lambda w, row: int_list(w, row, int64=False))),
}  # MediaRef, api_types.py 443-458, decoded 1902-1940: unknown keys refused


def _media_item(where: str, v: Any) -> None:
    """``decode_MediaItem`` (api_types.py 1986-1991): a string or a ``MediaRef`` object."""
    if type(v) is str:
        return
    if type(v) is not dict:
        raise refuse(where, v, "one of the MediaItem shapes")
    for key, x in v.items():
        check = _MEDIA_REF_FIELDS.get(key)
        if check is None:
            raise unknown_field(where, key, tuple(_MEDIA_REF_FIELDS))
        check(f"{where}.{key}", x)


def _media_items(where: str, v: Any) -> None:
    """``decode_MediaItems`` (api_types.py 2010-2011): a list of items or nulls."""
    each(where, v, nullable(_media_item))


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
            each(where, v, nullable(_media_items))
        else:
            _media_items(where, v)
    else:
        raise refuse(where, v, "one of the MediaInput shapes")


KV_HINT_ACTION_FIELDS = ("action_id", "action_type", "action_version")


def _kv_hint_action(where: str, v: Any) -> None:
    """``decode_KvHintAction`` (api_types.py 1648-1660): string ids, any ``payload``."""
    for key, x in _map_as(where, v, "struct KvHintAction").items():
        if key in KV_HINT_ACTION_FIELDS:
            string(f"{where}.{key}", x)


def _kv_hints_envelope(where: str, v: Any) -> None:
    """``decode_KvHintsEnvelope`` (api_types.py 1626-1637): string ``protocol_version`` and
    ``message_id``, ``actions`` null or a list of actions; unknown keys ignored."""
    for key, x in _map_as(where, v, "struct KvHintsEnvelope").items():
        if key in ("protocol_version", "message_id"):
            string(f"{where}.{key}", x)
        elif key == "actions" and x is not None:
            each(f"{where}.{key}", x, _kv_hint_action)


def _kv_hints(where: str, v: Any) -> None:
    """``decode_KvHintsEnvelopeOrList`` (api_types.py 1598-1601, 1610-1619): one envelope or a
    list of envelopes or nulls."""
    if type(v) is list:
        each(where, v, nullable(_kv_hints_envelope))
    elif type(v) is dict:
        _kv_hints_envelope(where, v)
    else:
        raise refuse(where, v, "a value or an array of values for KvHintsEnvelopeOrList")


def _lax_kv_hints(v: Any) -> bool:
    """Whether the dataclass parse takes ``v`` as ``kv_hints`` (io_struct.py 378-380: a dict, or
    a list of dicts and nulls)."""
    return type(v) is dict or (type(v) is list and all(x is None or type(x) is dict for x in v))


def _images_config(where: str, v: Any) -> None:
    """``decode_ImagesConfig`` (api_types.py 1579-1587): ``image_mode`` null or a string,
    ``prefix`` a string; unknown keys ignored."""
    for key, x in _map_as(where, v, "struct ImagesConfig").items():
        if key == "prefix" or (key == "image_mode" and x is not None):
            string(f"{where}.{key}", x)


def _map_as(where: str, v: Any, expected: str) -> dict[str, Any]:
    if type(v) is dict:
        return v
    raise refuse(where, v, expected)


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


def _lax_content_hashes(v: Any) -> bool:
    """Whether the dataclass parse takes ``v`` as ``mm_content_hashes``
    (``Union[List[Optional[str]], List[List[Optional[str]]]]``, io_struct.py 219-221; pydantic's
    lax ``str`` takes only a string): a list of strings and nulls, or a list of such lists."""

    def strings(row: Any) -> bool:
        return type(row) is list and all(x is None or type(x) is str for x in row)

    return strings(v) or (type(v) is list and all(map(strings, v)))


def _parse_only(takes: Callable[[Any], bool], expected: str) -> Callable[[str, Any], None]:
    """A dataclass-only key (the gate does not decode it): refused by the parse alone, where
    pydantic's lax type does not take the value (``null`` included)."""

    def check(where: str, v: Any) -> None:
        if not takes(v):
            raise refuse(where, v, expected).at("parse")

    return check


# Every field is typed as the dataclass types it (io_struct.py 180-378) and its parse runs first:
# a value it refuses too (pydantic's lax types: a number for a string, 2 or "x" for a bool, 1.5 or
# "x" for an int, a scalar for a list) is the parse's refusal (step 1), one only the gate refuses
# ("3" for an int, 1 or "yes" for a bool) the gate's (step 2).
GENERATE_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "rid": nullable(parsed(string_or_list, never)),  # io_struct.py 180
    "text": nullable(parsed(string_or_list, never)),  # io_struct.py 185
    "input_ids": nullable(strict_token_ids),
    "stream": not_null(parsed(boolean, lax_bool), "a boolean"),  # a plain bool field (io_struct.py 256)
    "sampling_params": nullable(_sampling_params_field),
    "return_logprob": nullable(_lax_bool_or_list),  # io_struct.py 230
    "logprob_start_len": nullable(_lax_int_or_list),  # io_struct.py 233
    "top_logprobs_num": nullable(_lax_int_or_list),  # io_struct.py 235
    "token_ids_logprob": nullable(_token_ids_logprob),
    "return_text_in_logprobs": not_null(parsed(boolean, lax_bool), "a boolean"),  # io_struct.py 247
    "return_sampling_mask": nullable(_lax_bool_or_list),  # io_struct.py 239
    "routed_experts_start_len": not_null(parsed(i64, lax_int), "i64"),  # io_struct.py 268
    # the other keys the gate decodes (api_types.py 1435-1494)
    "return_hidden_states": not_null(
        parsed(_hidden_mode, lambda v: v == "last" or lax_bool(v)), "a boolean"
    ),  # io_struct.py 260-262
    "bootstrap_host": nullable(_optional_str_or_list),
    "bootstrap_port": nullable(_optional_int_or_list),
    "bootstrap_room": nullable(_optional_int_or_list),
    "bootstrap_pair_key": nullable(_optional_str_or_list),
    "decode_tp_size": nullable(_optional_int_or_list),
    "routed_dp_rank": nullable(parsed(i64, lax_int)),
    "disagg_prefill_dp_rank": nullable(parsed(i64, lax_int)),
    "mm_hashes": nullable(parsed(_string_list_or_list, never)),
    "extra_key": nullable(parsed(string_or_list, never)),
    "priority": nullable(parsed(i64, lax_int)),
    "cache_salt": nullable(parsed(string_or_list, never)),
    "require_reasoning": not_null(parsed(boolean, lax_bool), "a boolean"),  # io_struct.py 317
    "lora_path": nullable(_optional_str_or_list),
    "routing_key": nullable(parsed(string, never)),
    "max_thinking_tokens": nullable(parsed(_uint, lax_int)),
    "session_id": nullable(parsed(string, never)),
    "custom_logit_processor": nullable(_optional_str_or_list),
    "custom_labels": nullable(parsed(_labels, never)),
    "return_prompt_token_ids": not_null(parsed(boolean, lax_bool), "a boolean"),  # io_struct.py 337
    # the gate takes any session_params (api_types.py 1471-1472), the dataclass a dict (io_struct.py 274)
    "session_params": nullable(parsed(mapping, never)),
    "modalities": nullable(parsed(lambda where, v: each(where, v, string), never)),  # io_struct.py 272
    # the nested structs (api_types.py 1453-1460, 1473-1474, 1485-1486)
    "image_data": nullable(_media_input),  # io_struct.py 200-204: any value parses
    "video_data": nullable(_media_input),
    "audio_data": nullable(_media_input),
    "kv_hints": nullable(_parsed_whole(_kv_hints, _lax_kv_hints)),  # io_struct.py 378-380
    "images_config": nullable(_parsed_whole(_images_config, lambda v: type(v) is dict)),  # io_struct.py 357
    # a dataclass-only bool (io_struct.py 269), read by no /generate answer on such a server
    "return_indexer_topk": _parse_only(lax_bool, "a boolean"),
    # dataclass-only (io_struct.py 219-221), judged with mm_hashes by normalize_batch_and_arguments
    "mm_content_hashes": nullable(
        _parse_only(_lax_content_hashes, "a list of optional strings or of such lists")
    ),
}

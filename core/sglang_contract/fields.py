"""The top-level fields of a ``/generate`` body and their types as SGLang 0.5.23's parse and gate
type them (:data:`_GENERATE_FIELDS`), the nested structs (media, ``kv_hints``, ``images_config``)
included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.sglang_contract.refusal import ContractError, _unknown_field
from core.sglang_contract.sampling import sampling_params
from core.sglang_contract.values import (
    _bool,
    _each,
    _float,
    _input_ids,
    _int,
    _lax_bool,
    _lax_int,
    _map,
    _never,
    _not_null,
    _nullable,
    _one_or_list,
    _or_list,
    _parsed,
    _refuse,
    _str,
    _str_or_list,
    int_list,
    token_ids,
)


def _sampling_params_or_list(where: str, v: Any) -> None:
    if type(v) is list:
        _each(where, v, sampling_params)
    else:
        sampling_params(where, v)


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
    # dataclass-only (io_struct.py 219-221), judged with mm_hashes by normalize_batch_and_arguments
    "mm_content_hashes": _nullable(
        _parse_only(_lax_content_hashes, "a list of optional strings or of such lists")
    ),
}

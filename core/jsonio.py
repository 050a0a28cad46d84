"""JSON bytes in and out on the hot paths (the engine, router and sidecar clients and proxies,
turns, records, batches): the one place orjson is used. Code off those paths (configuration,
environment variables, files, command output for people) uses the standard :mod:`json`.

* :func:`loads` decodes UTF-8 JSON bytes (or text). Input only :mod:`json` accepts (``NaN``,
  ``Infinity``, as some engines write; a lone surrogate escape) is decoded by :mod:`json`, unless
  ``strict`` (request bodies: RFC 8259 JSON whose strings are Unicode, which can be written back
  as UTF-8); invalid JSON raises ``ValueError`` (``json.JSONDecodeError``).
* :func:`dumps` encodes to compact UTF-8 bytes. Non-finite floats are written as ``null`` (JSON
  has no such tokens). A numpy array (a turn's token ids, :mod:`router.segments`) is written as
  a JSON list by orjson itself, in one pass, with no Python object per element (orjson's
  ``OPT_SERIALIZE_NUMPY``; another object with ``tolist()``, such as an ``array.array`` or an
  array orjson does not take natively, is written as its list). Objects orjson cannot encode
  (integers beyond 64 bits, non-string keys) are encoded by :mod:`json` under the same rule;
  anything neither can encode raises ``TypeError``. ``sort_keys`` sorts the keys of every object,
  a dataclass's fields included (orjson writes a dataclass's fields in their order; sorted, it is
  written as ``dataclasses.asdict`` would make it, without its deep copy).
  A :data:`Fragment` (JSON text encoded once, not checked: :mod:`router.context_text`) is
  written as the text it holds, unchanged (the :mod:`json` fallback does not take it).

The bytes may differ from :mod:`json`'s in whitespace and float spelling (``1e-05`` vs
``1e-5``); the decoded values are identical.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import orjson


def loads(data: bytes | bytearray | memoryview | str, *, strict: bool = False) -> Any:
    """The value of the JSON document ``data``; ``ValueError`` when it is not JSON (``strict``:
    not RFC 8259 JSON of Unicode strings)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        if strict:
            raise
        if isinstance(data, memoryview):
            data = bytes(data)
        return json.loads(data)


def dumps(obj: Any, *, sort_keys: bool = False) -> bytes:
    """``obj`` as compact JSON bytes (non-finite floats as ``null``)."""
    try:
        return orjson.dumps(obj, default=_default, option=_SORTED if sort_keys else _OPTIONS)
    except TypeError:
        pass
    try:
        text = _std_dumps(obj, sort_keys)
    except ValueError:  # a non-finite float: null it, as orjson does
        text = _std_dumps(_finite(obj), sort_keys)
    return text.encode()


def _std_dumps(obj: Any, sort_keys: bool) -> str:
    """:mod:`json`'s compact text of ``obj`` (ValueError for a non-finite float)."""
    return json.dumps(
        obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"), sort_keys=sort_keys, default=_default
    )


Fragment = orjson.Fragment
"""``Fragment(text)``: valid JSON bytes that :func:`dumps` writes as they are."""

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_SORTED = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS


def _default(obj: Any) -> Any:
    """orjson's and :mod:`json`'s ``default``: a dataclass instance as the dict of its fields (one
    level: its values come back here), an array-like object as its list; TypeError for anything
    else."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    tolist = getattr(obj, "tolist", None)
    if tolist is None:
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")
    return tolist()


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN / infinity replaced by None (containers copied as needed)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj

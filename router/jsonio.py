"""Fast JSON for the router's hot path: orjson when installed, the standard library otherwise.

* :func:`dumps` - compact UTF-8 bytes; NaN and infinity are written as ``null`` (JSON has no
  such tokens; callers already map unknown values to None, this is the safety net). Objects
  orjson cannot serialize (non-str keys, integers beyond 64 bits) fall back to :mod:`json`
  with the same rule.
* :class:`FastJSONResponse` - a ``JSONResponse`` rendered with :func:`dumps`.

The bytes may differ from :mod:`json`'s in whitespace and float spelling (``1e-05`` vs
``1e-5``); the decoded values are identical.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

try:  # pragma: no cover - exercised whichever way the environment is built
    import orjson
except ImportError:  # pragma: no cover
    orjson = None


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN / infinity replaced by None (containers copied as needed)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _std_dumps(obj: Any) -> bytes:
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:  # NaN / inf somewhere: null them, as orjson does
        text = json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode()


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON bytes (non-finite floats as null)."""
    if orjson is None:
        return _std_dumps(obj)
    try:
        return orjson.dumps(obj)
    except TypeError:
        return _std_dumps(obj)


class FastJSONResponse(JSONResponse):
    """``JSONResponse`` with :func:`dumps` (same media type and headers)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)

"""Fast JSON for the router's hot path: orjson when installed, the standard library otherwise.

* :func:`dumps` - compact UTF-8 bytes; refuses NaN / infinity (as Starlette's ``JSONResponse``
  does) so a response never carries a non-JSON token. Objects orjson cannot serialize (non-str
  keys, integers beyond 64 bits) fall back to :mod:`json` with the same rules.
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


def _has_non_finite(obj: Any) -> bool:
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, dict):
        return any(_has_non_finite(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_non_finite(v) for v in obj)
    return False


def _std_dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON bytes. Raises ValueError on NaN or infinity."""
    if orjson is None:
        return _std_dumps(obj)
    try:
        data = orjson.dumps(obj)
    except TypeError:
        return _std_dumps(obj)
    # orjson writes NaN / inf as null; only then is the slow check worth doing
    if b"null" in data and _has_non_finite(obj):
        raise ValueError("Out of range float values are not JSON compliant")
    return data


class FastJSONResponse(JSONResponse):
    """``JSONResponse`` with :func:`dumps` (same media type and headers)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)

"""HTTP-facing errors of the router: every refusal carries a status and a message naming the
problem (the app turns them into an :class:`router.schemas.ErrorBody`, ``{"detail": message}``).

:func:`error_responses` is how a route documents the refusals it can answer with (FastAPI's
``responses=``): each status with the one error schema.
"""

from __future__ import annotations

from typing import Any

from router.schemas import ErrorBody
from router.state.base import StateError, StateUnavailable


class ApiError(Exception):
    """A refusal: ``status``, ``message`` (the body's ``detail``), ``retry_after`` (seconds, sent
    as ``Retry-After``) and ``fields``: more members of the body beside ``detail``, for a route
    that documents them (e.g. :class:`router.schemas.VersionConflict`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after: float | None = None,
        fields: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.fields = fields or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"detail": message, **fields}``."""
        return {"detail": self.message, **self.fields}


def unavailable(message: str, retry_after: float = 1.0) -> ApiError:
    return ApiError(503, message, retry_after=retry_after)


def refusal_of(exc: Exception) -> ApiError:
    """The refusal the router answers ``exc`` with, in a status or in a stream's error event: an
    :class:`ApiError` as it is; an unreachable state store 503 with ``Retry-After`` 1; another
    state error (the store's state conflicts) 409 naming its type; anything else a 500 naming its
    type only (no message, no traceback)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StateUnavailable):
        return unavailable(f"state store unavailable: {exc}")
    if isinstance(exc, StateError):
        return ApiError(409, f"{type(exc).__name__}: {exc}")
    return ApiError(500, f"internal error of the router: {type(exc).__name__}")


ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Bad request: a body that cannot be decoded, or a value the route refuses",
    401: "Missing or invalid API key",
    403: "The API key lacks the scope this route needs",
    404: "Unknown resource",
    409: "Conflicts with the resource's state",
    413: "Body larger than the router's limit",
    415: "Body of a media type the route does not take (`detail` names the one it takes)",
    422: "Invalid request: `detail` names the field, `errors` lists each problem",
    502: "An engine sent an answer the router cannot use",
    503: "Unavailable now (state store, replicas, version constraints); retry after `Retry-After` seconds",
}
_RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
}


def error_responses(
    *statuses: int, models: dict[int, type[ErrorBody]] | None = None
) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries documenting ``statuses`` with :class:`ErrorBody`, or with
    the subclass ``models`` names for a status whose body carries more fields."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        model = (models or {}).get(status, ErrorBody)
        entry: dict[str, Any] = {"model": model, "description": ERROR_DESCRIPTIONS[status]}
        if status == 503:
            entry["headers"] = _RETRY_AFTER
        out[status] = entry
    return out


AUTH = (401, 403)
"""The refusals of every route behind an API key."""
BODY = (400, 413, 422)
"""The refusals of every route that reads a JSON body (undecodable, too large, invalid)."""

"""HTTP-facing errors of the router: every refusal carries a status and a message naming the
problem (the app turns them into ``{"detail": message}``)."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def unavailable(message: str, retry_after: float = 1.0) -> ApiError:
    return ApiError(503, message, retry_after=retry_after)

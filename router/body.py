"""The size limit of a request's body, one per request (:class:`BodyLimit`), and the reader of a
body whose route sets its own limit (:func:`read_body`).

Every request's body is held to the router's ``max_body_bytes``:
:class:`router.app.EdgeMiddleware` puts the request's :class:`BodyLimit` in its ASGI scope
(:data:`SCOPE_KEY`) and enforces it as the body is received: a declared ``Content-Length`` over
it is refused at the first read, before any byte is read, and a body sent without one is
refused once its bytes pass it (413, :class:`BodyTooLarge`). The limit is read at that first
read, so a route whose body's size it knows from its own state (a trainer log-prob upload: its
lease's token count, :func:`router.trainer_logprobs.upload_size`) replaces it for its request
before reading, with :func:`read_body`; every other route keeps the generic limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import HTTPException, Request
from starlette.types import Scope

SCOPE_KEY = "mixfleet.body_limit"
"""Where :class:`router.app.EdgeMiddleware` puts a request's :class:`BodyLimit` in its scope."""


class BodyTooLarge(HTTPException):
    """413: a body of ``size`` bytes (None: not declared, and it passed the limit while read) over
    ``limit`` bytes. An ``HTTPException``, since FastAPI re-raises only those from a body read."""

    def __init__(self, size: int | None, limit: int, why: str) -> None:
        body = f"body: {size} bytes exceeds" if size is not None else "body exceeds"
        super().__init__(413, f"{body} the limit of {limit} bytes{why}")
        self.size = size
        self.limit = limit


@dataclass
class BodyLimit:
    """The limit of one request's body: ``limit`` bytes; ``why`` (empty, or ``": ..."``) says where
    a route-set limit comes from, in the 413."""

    limit: int
    why: str = ""

    def refuse_over(self, size: int, declared: bool) -> None:
        """Raise :class:`BodyTooLarge` when ``size`` bytes (declared in ``Content-Length``, or
        received so far) exceed the limit."""
        if size > self.limit:
            raise BodyTooLarge(size if declared else None, self.limit, self.why)


def declared_size(scope: Scope) -> int | None:
    """The request's ``Content-Length`` (None: absent or not an integer)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_body(request: Request, limit: int, why: str) -> memoryview:
    """The request's body, at most ``limit`` bytes (replacing the router's limit for this request;
    ``why`` says where it comes from, ``": ..."``, in the 413), read into one buffer: of the
    declared ``Content-Length`` (refused before any byte is read when over ``limit``), else of
    ``limit`` bytes, filled chunk by chunk (a chunk is dropped once copied, so the body is held
    once, plus at most one chunk). Raises :class:`BodyTooLarge`."""
    bound = request.scope.setdefault(SCOPE_KEY, BodyLimit(limit))
    bound.limit, bound.why = limit, why
    size = declared_size(request.scope)
    if size is not None:
        bound.refuse_over(size, declared=True)
    buf = bytearray(limit if size is None else size)
    pos = 0
    async for chunk in request.stream():
        bound.refuse_over(pos + len(chunk), declared=False)
        buf[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return memoryview(buf)[:pos]

"""JSON request bodies decoded by :mod:`core.jsonio` (orjson) instead of the standard library.

FastAPI reads a JSON body through Starlette's ``Request.json()`` (``json.loads``): a turn's full
context of 100K+ ids then costs several times what orjson takes. :class:`JsonRoute` is an
``APIRoute`` whose requests are :class:`JsonRequest`, whose ``json()`` is
:func:`core.jsonio.loads` (FastAPI's documented way to customize how a route reads its request:
a custom ``route_class`` whose handler wraps the request). Everything else is FastAPI's own:
the body's validation, its OpenAPI schema, and a malformed body's 422 (``json_invalid``: the
decoder's errors are ``json.JSONDecodeError``, which FastAPI reports). A body is strict JSON
(:func:`core.jsonio.loads` ``strict``): no ``NaN`` and no string that is not Unicode (a lone
surrogate escape, which no tokenizer, digest or UTF-8 answer could take).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from core.jsonio import loads


class JsonRequest(Request):
    """A request whose JSON body is decoded by :func:`core.jsonio.loads` (once per request)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body(), strict=True)
        return self._json


class JsonRoute(APIRoute):
    """A route whose handler sees :class:`JsonRequest` (``APIRouter(route_class=JsonRoute)``: every
    router of the service's routes)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(JsonRequest(request.scope, request.receive))

        return handle

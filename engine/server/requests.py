"""What every engine route shares: the engine of the app, SGLang's error body, body parsing.

The app holds its :class:`~engine.runtime.engine.Engine` at ``app.state.engine``
(:func:`engine.server.app.create_app`); routes read it with :func:`engine_of`. A body the engine
refuses raises :class:`~engine.runtime.request.RequestError`; routes answer it with
:func:`error` (HTTP 400, ``{"error": {"message": ...}}``, SGLang's shape).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from engine.runtime.engine import Engine
from engine.runtime.request import RequestError


def engine_of(request: Request) -> Engine:
    """The engine the app serves."""
    return request.app.state.engine


def error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's error body with ``status``."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def validation_message(exc: ValidationError | RequestValidationError) -> str:
    """One line naming every field pydantic refused and why."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "Invalid request: " + "; ".join(parts)


async def parse(request: Request, model: type[BaseModel], optional: bool = False) -> Any:
    """The body as ``model``; an empty body is ``model()`` when ``optional``, else refused.
    Raises :class:`RequestError` on an empty, malformed or invalid body."""
    raw = await request.body()
    if not raw.strip():
        if optional:
            return model()
        raise RequestError("The request body is empty; expected a JSON object.")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"Malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(f"The request body must be a JSON object, got {type(data).__name__}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestError(validation_message(exc)) from None

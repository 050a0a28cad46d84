"""What every engine route shares: the engine of the app, SGLang's error body, body parsing.

The app holds its :class:`~engine.runtime.engine.Engine` at ``app.state.engine``
(:func:`engine.server.app.create_app`); routes read it with :func:`engine_of`. A body the engine
refuses raises :class:`~engine.runtime.request.RequestError`; routes answer it with
:func:`refusal`, the body SGLang answers that refusal with (its three steps' shapes:
:func:`core.sglang_contract.error_body`; an empty, malformed or mistyped body is its request
validation handler's). :func:`error` is SGLang's ``{"error": {"message": ...}}`` with a status.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from core.sglang_contract import error_body
from engine.runtime.engine import Engine
from engine.runtime.request import RequestError


def engine_of(request: Request) -> Engine:
    """The engine the app serves."""
    return request.app.state.engine


def error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's error body with ``status``."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def refusal(exc: RequestError) -> JSONResponse:
    """The 400 answering ``exc`` with SGLang's body for it (:attr:`RequestError.body`), else
    ``{"error": {"message": ...}}``."""
    return JSONResponse(exc.body or {"error": {"message": str(exc)}}, status_code=400)


def _parse_refused(message: str) -> RequestError:
    """A body refused before it is a request (empty, malformed, not an object): SGLang's
    request validation handler answers it (step 1 of :mod:`core.sglang_contract`)."""
    return RequestError(message, error_body("parse", message))


def _invalid(exc: ValidationError) -> RequestError:
    """A body the model refused: SGLang's step and line where :mod:`core.sglang_contract`
    refused it (``sglang_contract``), else its request validation handler's (step 1)."""
    for err in exc.errors():
        if err.get("type") == "sglang_contract":
            ctx = err["ctx"]
            return RequestError(ctx["message"], error_body(ctx["step"], ctx["message"]))
    return _parse_refused(validation_message(exc))


def validation_message(exc: ValidationError | RequestValidationError) -> str:
    """One line naming every field pydantic refused and why."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "Invalid request: " + "; ".join(parts)


async def parse(request: Request, model: type[BaseModel]) -> Any:
    """The body as ``model``. Raises :class:`RequestError` on an empty, malformed or invalid
    body."""
    raw = await request.body()
    if not raw.strip():
        raise _parse_refused("The request body is empty; expected a JSON object.")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _parse_refused(f"Malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise _parse_refused(f"The request body must be a JSON object, got {type(data).__name__}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None

"""How SGLang 0.5.23 answers a refusal of a ``/generate`` body: the step that makes it, its
line, and the body shape of each step (the package docstring says which step is which)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Step = Literal["parse", "gate", "verify"]
"""Which of SGLang's three steps refuses (the package docstring): the dataclass parse, the contract
gate, ``SamplingParams``' checks."""


class ContractError(ValueError):
    """One refusal: ``str(exc)`` is the line naming the field; ``step`` the step that makes it;
    ``value`` the value refused (None where none is one); ``fails``: SGLang does not refuse it
    but fails on it (:attr:`Refusal.fails`)."""

    def __init__(self, message: str, *, step: Step = "gate", value: Any = None, fails: bool = False) -> None:
        super().__init__(message)
        self.step: Step = step
        self.value = value
        self.fails = fails

    def at(self, step: Step) -> ContractError:
        """The same refusal, made by ``step``."""
        return ContractError(str(self), step=step, value=self.value, fails=self.fails)


def unknown_field(where: str, key: str, fields: tuple[str, ...]) -> ContractError:
    """The gate's refusal of an unknown key in a struct that denies them (serde's
    ``unknown_field``, ``api_types.py`` 97-108)."""
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"{where}: unknown field `{key}`, expected one of {listed}", value=key)


@dataclass(frozen=True)
class Refusal:
    """SGLang's refusal of a ``/generate`` body: the step that makes it and its line. ``fails``:
    what SGLang does not refuse but fails on, an exception ``/generate`` does not catch (only a
    ``ValueError`` is, ``http_server.py`` 956-990): unstreamed a 500, which the fleet refuses as
    this 400 instead (:data:`NO_SHORT_LIST`, :data:`NO_CHOICE`, ...); streamed an HTTP 200 whose
    stream breaks off before any event, which the local engine answers alike
    (``engine.server.routes_generate``)."""

    step: Step
    message: str
    fails: bool = False

    @staticmethod
    def of(exc: ContractError) -> Refusal:
        """The refusal ``exc`` makes."""
        return Refusal(exc.step, str(exc), exc.fails)

    def body(self) -> dict[str, Any]:
        """The JSON body SGLang answers it with (HTTP 400): :func:`error_body`."""
        return error_body(self.step, self.message)


def error_body(step: Step, message: str) -> dict[str, Any]:
    """SGLang's 400 body for a refusal by ``step`` (the package docstring): ``parse`` the request
    validation handler's ``ErrorResponse``, ``gate`` ``{"error": message}``, ``verify``
    ``{"error": {"message": message}}``."""
    if step == "parse":
        return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    if step == "gate":
        return {"error": message}
    return {"error": {"message": message}}


def stream_error_event(message: str, code: int = 400) -> dict[str, Any]:
    """The one event a ``"stream": true`` ``/generate`` answers a step-3 refusal with, before
    ``data: [DONE]``, inside an HTTP 200 ``text/event-stream`` (``http_server.py`` 949-979:
    ``serve_generate_request`` has already begun the stream when ``generate_request`` raises its
    ``ValueError``; ``code`` is the exception's ``status_code``, else 400). Steps 1 and 2 answer
    before it, with their 400 bodies (:func:`error_body`), streamed or not."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}}

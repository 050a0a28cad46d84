"""The Modal-function converter: each publication runs in a deployed Modal CPU function (the
``publish`` function of ``deploy/modal_app.py``), which mounts the store's Volume and runs the
local converter there; this side waits for its result.

Read in the installed client (``modal 1.6.4``, ``modal/_functions.py``; ``modal.Function`` and
``modal.FunctionCall`` wrap them with ``synchronize_api``):

- ``_Function.from_name(app_name, name, *, version=None, environment_name=None, client=None)``
  (line 1551) is a lazy reference: nothing is contacted until it is used;
- ``_Function.spawn(*args, **kwargs) -> _FunctionCall`` (2258) starts a call without waiting for
  it; ``_FunctionCall.get(timeout=None, *, index=0)`` (2440) waits for its return value (the
  remote's exception is raised here); ``object_id`` is the call's ``fc-...`` id.

The call is ``spawn(**call_kwargs(request))``: keyword arguments of plain values (the formats
comma-separated, so that ``modal run deploy/modal_app.py::publish --checkpoint ... --version ...``
takes the same arguments from a shell), which the remote side turns back into the request
(:func:`run_request`); it needs nothing of this process. The job's events get ``remote_call``
(function and call id) before the wait and ``remote_done`` after it; the publisher's own events
stay in the function's logs. The store passed to :meth:`ModalFunctionConverter.publish` is the
router's view of the same Volume: it is only refreshed afterwards, so the router's next pointer
read sees what the function committed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import UserError
from weight_sync.converters.base import Converter, ConvertRequest
from weight_sync.publish import Event, no_events
from weight_sync.store.base import VersionStore


def parse_function_ref(ref: str) -> tuple[str, str]:
    """``"APP/FUNCTION"`` -> ``(app, function)``; :class:`UserError` naming the value otherwise."""
    app, sep, name = ref.strip().partition("/")
    if not sep or not app or not name or "/" in name:
        raise UserError(f"a Modal function is named APP/FUNCTION (e.g. mixfleet/publish), got {ref!r}")
    return app, name


def function_ref(app_name: str, name: str, environment_name: str | None = None) -> Any:
    """The lazy ``modal.Function`` reference of ``name`` in the deployed app ``app_name``."""
    import modal

    return modal.Function.from_name(app_name, name, environment_name=environment_name)


class ModalFunctionConverter(Converter):
    """Publications in the deployed Modal function ``ref`` (``APP/FUNCTION``; see the module
    docstring). ``lookup`` resolves ``(app, function, environment)`` to the function handle."""

    name = "modal"

    def __init__(
        self,
        ref: str,
        *,
        environment_name: str | None = None,
        lookup: Callable[[str, str, str | None], Any] = function_ref,
    ) -> None:
        self.ref = ref
        self.app_name, self.function_name = parse_function_ref(ref)
        self.environment_name = environment_name
        self._lookup = lookup

    def function(self) -> Any:
        """The function handle (a lazy reference: contacts nothing)."""
        return self._lookup(self.app_name, self.function_name, self.environment_name)

    def publish(
        self, store: VersionStore, request: ConvertRequest, on_event: Event = no_events
    ) -> dict[str, Any]:
        call = self.function().spawn(**call_kwargs(request))
        on_event("remote_call", {"function": self.ref, "call_id": call.object_id})
        result = call.get()
        if not isinstance(result, dict) or not isinstance(result.get("version"), int):
            raise UserError(f"the Modal function {self.ref} returned no publish result: {result!r:.200}")
        on_event("remote_done", {"function": self.ref, "call_id": call.object_id})
        refresh = getattr(store, "refresh", None)
        if refresh is not None:  # a Volume store: see what the function committed
            refresh()
        return result


def call_kwargs(request: ConvertRequest) -> dict[str, Any]:
    """The remote function's keyword arguments for ``request``: its fields, the formats joined by
    commas."""
    return {**request.to_json(), "formats": ",".join(request.formats)}


def run_request(
    store: VersionStore, kwargs: dict[str, Any], converter: Converter | None = None
) -> dict[str, Any]:
    """The remote side of a call: the request of :func:`call_kwargs`' ``kwargs`` published into
    ``store`` by ``converter`` (default: a local converter whose pool is made for this call and
    closed after it); :class:`UserError` naming a bad argument."""
    from weight_sync.converters.local import LocalConverter

    formats = kwargs.get("formats")
    if not isinstance(formats, str):
        raise UserError(f"formats must be format names joined by commas, got {formats!r}")
    request = ConvertRequest.from_json({**kwargs, "formats": [f for f in formats.split(",") if f]})
    own = converter is None
    converter = converter or LocalConverter()
    try:
        return converter.publish(store, request)
    finally:
        if own:
            converter.close()


__all__ = ["ModalFunctionConverter", "call_kwargs", "function_ref", "parse_function_ref", "run_request"]

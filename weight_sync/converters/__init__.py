"""Where publications run: the port (:mod:`weight_sync.converters.base`), its adapters (this
process's conversion pool, :mod:`.local`; a deployed Modal function, :mod:`.modal_function`),
and the factory that picks one."""

from __future__ import annotations

from weight_sync.converters.base import Converter, ConvertRequest
from weight_sync.converters.local import LocalConverter
from weight_sync.converters.modal_function import ModalFunctionConverter

CONVERT_FUNCTION_ENV = "MIXFLEET_CONVERT_FUNCTION"
"""The environment variable naming the deployed publish function (``APP/FUNCTION``) a router runs
its publications in; read by the router's command (:meth:`router.config.WeightsConfig.from_env`)."""


def open_converter(function: str | None = None, *, workers: int | None = None) -> Converter:
    """A :class:`ModalFunctionConverter` of ``function`` (``APP/FUNCTION``) when given, else a
    :class:`LocalConverter` with ``workers`` conversion processes (None: one per core and at
    least one per format; 0: in this process)."""
    if function:
        return ModalFunctionConverter(function)
    return LocalConverter(workers)


__all__ = [
    "CONVERT_FUNCTION_ENV",
    "ConvertRequest",
    "Converter",
    "LocalConverter",
    "ModalFunctionConverter",
    "open_converter",
]

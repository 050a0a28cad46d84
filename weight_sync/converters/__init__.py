"""Where publications run: the port (:mod:`weight_sync.converters.base`), its adapters (this
process's conversion pool, :mod:`.local`; a deployed Modal function, :mod:`.modal_function`),
and the factory that picks one."""

from __future__ import annotations

import os
from collections.abc import Mapping

from weight_sync.converters.base import Converter, ConvertRequest
from weight_sync.converters.local import LocalConverter
from weight_sync.converters.modal_function import ModalFunctionConverter

CONVERT_FUNCTION_ENV = "MIXFLEET_CONVERT_FUNCTION"


def open_converter(function: str | None = None, *, workers: int | None = None) -> Converter:
    """A :class:`ModalFunctionConverter` of ``function`` (``APP/FUNCTION``) when given, else a
    :class:`LocalConverter` with ``workers`` conversion processes (None: one per core and at
    least one per format; 0: in this process)."""
    if function:
        return ModalFunctionConverter(function)
    return LocalConverter(workers)


def function_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """``MIXFLEET_CONVERT_FUNCTION`` (``APP/FUNCTION``; None when unset or blank)."""
    return (environ.get(CONVERT_FUNCTION_ENV) or "").strip() or None


__all__ = [
    "CONVERT_FUNCTION_ENV",
    "ConvertRequest",
    "Converter",
    "LocalConverter",
    "ModalFunctionConverter",
    "function_from_env",
    "open_converter",
]

"""The weight formats: the one declaration of their names.

A sampler group serves one format (``fleet.specs.GroupSpec.weight_format``); the publisher
converts a BF16 checkpoint once per format (``weight_sync``); the engines load each
(``images.sglang`` maps a name to SGLang's ``--quantization``). Every other module imports these
names from here: :data:`WeightFormat` for a typed field, :data:`FORMATS` for iteration and
messages, :func:`check_format` for input from outside.
"""

from __future__ import annotations

from typing import Literal, get_args

from core.errors import UserError

WeightFormat = Literal["bf16", "fp8", "nvfp4", "mxfp4"]
"""``bf16`` (the trainer's checkpoint), ``fp8`` (E4M3, 128x128 blocks), ``nvfp4`` (ModelOpt NVFP4),
``mxfp4`` (OCP MX, experts only)."""

FORMATS: tuple[WeightFormat, ...] = get_args(WeightFormat)
"""Every format, in the order tables and messages list them."""

QUANTIZED: tuple[WeightFormat, ...] = tuple(f for f in FORMATS if f != "bf16")
"""The formats the converter quantizes into (bf16 is the source, copied as is)."""


def check_format(name: str) -> WeightFormat:
    """``name`` as a format; :class:`UserError` naming it and the known ones when it is not one."""
    if name not in FORMATS:
        raise UserError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return name  # type: ignore[return-value]

"""Plumbing shared by the quantizers: input checks, the bit view the kernels read, exact maxima, outputs.

Everything here is exact. The kernels (``_kernels``) read a weight as the bit patterns of its
floats: bfloat16 as ``uint16`` (its float32 value is those bits shifted left by 16), float32 as
``uint32``; float16 is widened to float32 first (exact). Absolute maxima are taken on those bit
patterns with the sign cleared: for non-negative IEEE floats that order is the order of their
values, so the maximum bit pattern is the bit pattern of the maximum, and NaN/Inf show up as
patterns at or above the all-ones exponent.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from core.parallel import Workers

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Elements per task when a quantizer splits a tensor across threads: large enough that the
# per-task overhead is negligible, small enough to balance the tasks over the worker threads.
CHUNK_ELEMENTS = 1 << 20

# The quantizers' chunk tasks (their own pool: a conversion never queues ahead of an engine's GEMMs).
WORKERS = Workers("weight-formats")

INF_BITS = 0x7F800000  # float32 bits of +Inf: |x| bit patterns at or above it are not finite


def describe(t: torch.Tensor) -> str:
    """``shape (N, K) bfloat16`` — how error messages name a tensor."""
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def tensors(d: dict[str, torch.Tensor], names: tuple[str, ...], where: str) -> tuple[torch.Tensor, ...]:
    """``d``'s tensors named ``names``, in that order; ``ValueError`` naming the first one missing."""
    missing = [name for name in names if name not in d]
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r}")
    return tuple(d[name] for name in names)


def check_weight(w: object, where: str) -> torch.Tensor:
    """``w`` as a contiguous tensor; raises ``ValueError`` unless it is a bf16/f16/f32 tensor."""
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{where}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{where}: tensor of {describe(w)} is not bfloat16, float16 or float32")
    if w.layout != torch.strided or w.device.type != "cpu":
        raise ValueError(f"{where}: tensor of {describe(w)} is not a dense CPU tensor")
    return w.contiguous()


def check_groups(w: torch.Tensor, group: int, where: str) -> None:
    """Raises ``ValueError`` unless ``w`` is at least 1-D with a last dim divisible by ``group``."""
    if w.dim() < 1 or w.shape[-1] % group != 0:
        raise ValueError(
            f"{where}: tensor of {describe(w)} cannot be split into groups of {group} along its last "
            f"dimension (the last dimension must be a multiple of {group})"
        )


def bits(w: torch.Tensor) -> np.ndarray:
    """The flat array the kernels read for the contiguous tensor ``w``: its bfloat16 bits as
    ``uint16`` or its float32 bits as ``uint32`` (a view, no copy); float16 is widened to
    float32 first (a copy)."""
    if w.dtype == torch.bfloat16:
        return w.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    if w.dtype == torch.float16:
        w = w.float()
    return w.reshape(-1).view(torch.int32).numpy().view(np.uint32)


def as_array(t: torch.Tensor) -> np.ndarray:
    """The flat numpy view of a contiguous output tensor (float8 as ``uint8``)."""
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.reshape(-1).numpy()


def f32_of_bits(b: int) -> float:
    """The value of the float32 bit pattern ``b``."""
    return struct.unpack("<f", struct.pack("<I", b))[0]


def raise_if_nonfinite(max_abs_bits: int, w: torch.Tensor, where: str) -> None:
    """Raises ``ValueError`` if the largest |x| bit pattern (float32) is NaN or Inf."""
    check_finite(max_abs_bits, where, describe(w))


def check_finite(max_abs_bits: int, where: str, what: str) -> None:
    """``ValueError`` naming the tensor as ``what`` if its largest |x| bit pattern is NaN or Inf."""
    if max_abs_bits >= INF_BITS:
        raise ValueError(f"{where}: tensor of {what} contains NaN or Inf")


def kernels():
    """The ``_kernels`` module, imported on first use: importing numba takes a noticeable part of a
    second, which processes that only dequantize (the engines) never pay."""
    from weight_sync.formats import _kernels

    return _kernels


def abs_max_bits(w: torch.Tensor) -> int:
    """The float32 bit pattern of ``max |w|`` over all of the contiguous tensor ``w`` (0 if empty)."""
    return abs_max_bits_of(bits(w))


def abs_max_bits_of(x: np.ndarray) -> int:
    """``abs_max_bits`` of the bit array ``x`` (see ``bits``)."""
    kernel = kernels().abs_max_bits
    tops = WORKERS.run_ranges(x.size, CHUNK_ELEMENTS, lambda i, j: kernel(x[i:j]))
    return int(max(tops, default=0))


def outputs(
    out: dict[str, torch.Tensor] | None, where: str, spec: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, torch.Tensor]:
    """The output tensors of a quantizer: ``out``'s (checked against ``spec``: name -> (shape,
    dtype); contiguous) or freshly allocated ones. Raises ``ValueError`` naming a mismatch."""
    if out is None:
        return {name: _empty(shape, dtype) for name, (shape, dtype) in spec.items()}
    got = {}
    for name, (shape, dtype) in spec.items():
        t = out.get(name)
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != dtype
            or tuple(t.shape) != tuple(shape)
            or not t.is_contiguous()
            or t.device.type != "cpu"
        ):
            have = describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
            want = f"shape {tuple(shape)} {str(dtype).removeprefix('torch.')}"
            raise ValueError(f"{where}: out[{name!r}] must be a contiguous CPU tensor of {want}, got {have}")
        got[name] = t
    return got


# The many small outputs of a converter's chunks are allocated by numpy (less per-call overhead
# than torch.empty); float8 is allocated as bytes and viewed.
_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.float32: np.float32, torch.float8_e4m3fn: np.uint8}


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[dtype]))
    return t.view(dtype) if dtype == torch.float8_e4m3fn else t

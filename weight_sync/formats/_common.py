"""Plumbing shared by the quantizers: input checks, exact absolute maxima, chunking.

Everything here is exact. Absolute maxima are taken on the integer view of the input's bits with
the sign bit cleared: for non-negative IEEE floats that order is the order of their values, so the
maximum bit pattern is the bit pattern of the maximum, and NaN/Inf show up as patterns at or above
the all-ones exponent.
"""

from __future__ import annotations

import torch

from weight_sync.formats import _parallel

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Elements handled per inner step: small enough that a step's scratch buffers stay in cache,
# large enough that torch's per-op overhead and its intra-op threads pay off.
CHUNK_ELEMENTS = 1 << 18

# dtype -> (same-width integer dtype, mask clearing the sign bit, first non-finite |x| pattern)
_BITS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}


def describe(t: torch.Tensor) -> str:
    """``shape (N, K) bfloat16`` — how error messages name a tensor."""
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


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


def int_view(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype with the width of float ``dtype``."""
    return _BITS[dtype][0]


def abs_bits(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bits of ``|x|`` as a non-negative integer tensor (int16 for 16-bit floats, else int32)."""
    itype, mask, _ = _BITS[x.dtype]
    return torch.bitwise_and(x.view(itype), mask, out=out)


def bits_to_float(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 values of the ``dtype`` bit patterns in ``bits`` (exact)."""
    return bits.view(dtype).float()


def raise_if_nonfinite(max_abs_bits: torch.Tensor, dtype: torch.dtype, w: torch.Tensor, where: str) -> None:
    """Raises ``ValueError`` if any of the |x| bit patterns is NaN or Inf."""
    if max_abs_bits.numel() and int(max_abs_bits.max()) >= _BITS[dtype][2]:
        raise ValueError(f"{where}: tensor of {describe(w)} contains NaN or Inf")


def abs_max_bits(x: torch.Tensor) -> torch.Tensor:
    """The |x| bit pattern of ``max |x|`` over all of ``x`` (0-dim int; 0 for an empty tensor)."""
    flat = x.reshape(-1)
    itype = int_view(x.dtype)
    cap = min(flat.numel(), CHUNK_ELEMENTS)

    def task(i: int, j: int) -> torch.Tensor:
        buf = _parallel.scratch(f"abs-{itype}", cap, lambda c: _Ints(itype, c))
        return abs_bits(flat[i:j], out=buf.data[: j - i]).max()

    tops = _parallel.run_ranges(flat.numel(), CHUNK_ELEMENTS, task)
    return torch.stack(tops).max() if tops else torch.zeros((), dtype=itype)


class _Ints:
    def __init__(self, itype: torch.dtype, capacity: int) -> None:
        self.capacity = capacity
        self.data = torch.empty(capacity, dtype=itype)


class GroupMax:
    """Exact ``max |x|`` over runs of ``group`` consecutive elements (``group`` a power of two).

    Torch reduces short rows (16 or 32 elements) one row at a time, several times slower than an
    elementwise pass, so this takes ``log2(group)`` elementwise maxima of the |x| bit patterns
    against themselves shifted by 1, 2, 4, ... elements: afterwards position ``i`` holds the
    maximum of ``i .. i + group - 1``, and every ``group``-th position is a group's maximum.
    Scratch for up to ``capacity`` elements of one integer dtype.
    """

    def __init__(self, itype: torch.dtype, capacity: int) -> None:
        self.capacity = capacity
        self._a = torch.empty(capacity, dtype=itype)
        self._b = torch.empty(capacity, dtype=itype)

    def bits_(self, x: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
        """Each group's max |x| bit pattern into ``out`` (``[numel / group]`` ints); returns ``out``."""
        flat = x.reshape(-1)
        n = flat.numel()
        a, b = self._a[:n], self._b[:n]
        abs_bits(flat, out=a)
        shift = 1
        while shift < group:
            torch.maximum(a[: n - shift], a[shift:], out=b[: n - shift])
            a, b = b, a
            shift *= 2
        out.copy_(a[0::group])
        return out


def group_abs_max_bits(x: torch.Tensor, group: int, where: str) -> torch.Tensor:
    """Bits of ``max |x|`` over each run of ``group`` consecutive elements, as a 1-D int tensor.

    Before: ``x`` is contiguous with ``numel % group == 0`` and ``group`` is a power of two.
    After: element ``g`` is the |x| bit pattern of the largest magnitude among
    ``x.flatten()[g*group:(g+1)*group]``. Raises ``ValueError`` if ``x`` holds NaN or Inf.
    """
    if group & (group - 1):
        raise ValueError(f"group size {group} is not a power of two")
    flat = x.reshape(-1)
    n_groups = flat.numel() // group
    itype = int_view(x.dtype)
    out = torch.empty(n_groups, dtype=itype)
    step = max(1, CHUNK_ELEMENTS // group)
    cap = min(n_groups, step) * group

    def task(g0: int, g1: int) -> None:
        gm = _parallel.scratch(f"group-max-{itype}", cap, lambda c: GroupMax(itype, c))
        gm.bits_(flat[g0 * group : g1 * group], group, out[g0:g1])

    _parallel.run_ranges(n_groups, step, task)
    raise_if_nonfinite(out, x.dtype, x, where)
    return out

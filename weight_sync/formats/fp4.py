"""FP4 E2M1 elements shared by NVFP4 and MXFP4: encode, pack, unpack, decode.

E2M1 (OCP MX v1.0 FP4): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no Inf/NaN.
Magnitude codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.

Encoding rounds to nearest with ties to even code (ties at 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
go to the values 0, 1, 1, 2, 2, 4, 4) and saturates at 6. The two formats differ only in the sign of zero:
NVFP4 (ModelOpt ``_cast_fp4``) sets the sign bit iff the scaled value is ``< 0``, so ``-0.0``
encodes as 0x0; MXFP4 (torchao ``f32_to_f4_unpacked``) copies the float sign bit, so ``-0.0``
encodes as 0x8. Packing puts two codes in a byte, element ``2i`` in the low nibble.
"""

from __future__ import annotations

import sys

import torch

from weight_sync.formats import _common, _parallel

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
E2M1_MAX = 6.0

_EXP_MASK = 0x7F800000
_ONE_BITS = 0x3F800000  # float32 1.0
# 2**22 * 2**E has a unit in the last place of 2**(E-1): the E2M1 step in [2**E, 2**(E+1))
_MAGIC = float(2**22)

if sys.byteorder != "little":  # pragma: no cover - the byte tricks below read little-endian words
    raise ImportError("weight_sync.formats.fp4 needs a little-endian machine")


class Encoder:
    """Reusable scratch for turning float32 chunks of up to ``capacity`` values into E2M1 codes.

    Use: write the scaled values into ``q[:n]``; set ``sign[:n]`` (255 = negative, 0 = not) and
    make ``q[:n]`` non-negative, with ``sign_from_q_`` or by hand; ``codes_(n)`` then fills
    ``codes[:n]`` with the 4-bit codes; ``pack_(n, out)`` packs them two per byte.
    """

    def __init__(self, capacity: int) -> None:
        capacity = max(4, -(-capacity // 4) * 4)
        self.capacity = capacity
        self.q = torch.empty(capacity, dtype=torch.float32)
        self.scratch = torch.empty(capacity, dtype=torch.int32)
        self.sign = torch.empty(capacity, dtype=torch.uint8)
        self.codes = torch.empty(capacity, dtype=torch.uint8)
        self._words = torch.empty(capacity // 4, dtype=torch.int32)

    def sign_from_q_(self, n: int, *, negative_zero_sign: bool) -> None:
        """``sign[:n]`` from the float signs in ``q[:n]``, then ``q[:n] = |q[:n]|``.

        ``negative_zero_sign`` True copies the sign bit (MXFP4: ``-0.0`` is negative); False sets
        the sign iff ``q < 0`` (NVFP4: ``-0.0`` is not).
        """
        q = self.q[:n]
        if not negative_zero_sign:
            q.add_(0.0)  # -0.0 + 0.0 == +0.0 under round-to-nearest; every q < 0 keeps its sign
        s32 = self.scratch[:n]
        torch.bitwise_right_shift(q.view(torch.int32), 31, out=s32)  # -1 where the sign bit is set
        self.sign[:n].copy_(s32)  # -1 -> 255
        q.abs_()

    def codes_(self, n: int) -> torch.Tensor:
        """``codes[:n]`` = E2M1 codes of ``q[:n]`` (all ``>= 0`` and ``< 2**100``) with ``sign[:n]``.

        Rounds to nearest-even on the E2M1 grid and saturates at 6 (code 7). ``q[:n]`` and the
        int32 scratch are clobbered. Returns the ``codes[:n]`` view.

        How: with ``E = max(floor(log2 q), 0)``, ``C = 2**(22 + E)`` has a unit in the last place
        of ``2**(E-1)``, exactly the E2M1 spacing around ``q`` (0.5 below 2, 1 in [2, 4), 2 in
        [4, 8)), so the float32 sum ``q + C`` rounds ``q`` to that grid with the FPU's
        ties-to-even, and the even mantissa of the sum is the even code. The sum's bits are
        ``((149 + E) << 23) + k`` for ``k`` grid steps (``k <= 4``), so mod 256 they are ``k``;
        the code is ``k + 2E``, and the shifted exponent bits ``2 * (E + 127)`` add ``2E - 2``
        mod 256. For ``q >= 6`` that code is at least 7 and is clamped to 7.
        """
        q = self.q[:n]
        qi = q.view(torch.int32)
        e = self.scratch[:n]
        torch.bitwise_and(qi, _EXP_MASK, out=e)
        e.clamp_(min=_ONE_BITS)  # 2**E as float32 bits
        q.add_(e.view(torch.float32), alpha=_MAGIC)  # q + 2**22 * 2**E, one rounding
        e.bitwise_right_shift_(22)  # 2 * (E + 127)
        qi.add_(e)
        codes = self.codes[:n]
        codes.copy_(qi)  # narrowing keeps the value mod 256: k + 2E - 2
        codes.add_(2).clamp_(max=7)
        codes.sub_(self.sign[:n], alpha=8)  # 255 -> + 8 (mod 256)
        return codes

    def pack_(self, n: int, out: torch.Tensor) -> None:
        """Pack ``codes[:n]`` (``n`` a multiple of 4) two per byte into ``out`` (uint8, ``n/2``), even low.

        Reads four codes as one little-endian int32 ``c0 | c1<<8 | c2<<16 | c3<<24``; ``w | w >> 4``
        holds ``c0 | c1<<4`` in byte 0 and ``c2 | c3<<4`` in byte 2, the low bytes of its two int16
        halves, which the narrowing copy keeps.
        """
        w = self.codes[:n].view(torch.int32)
        t = self._words[: n // 4]
        torch.bitwise_right_shift(w, 4, out=t)
        t.bitwise_or_(w)
        out.view(-1).copy_(t.view(torch.int16))


def _float32_checked(q: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise ValueError(f"{where}: expected a floating-point tensor")
    q = q.float().contiguous()
    if q.numel() and not bool(torch.isfinite(q).all()):
        raise ValueError(f"{where}: tensor of shape {tuple(q.shape)} contains NaN or Inf")
    return q


def encode(q: torch.Tensor, *, negative_zero_sign: bool) -> torch.Tensor:
    """E2M1 codes (uint8, one per element, values 0..15) of the already-scaled values ``q``.

    Rounds to nearest-even and saturates at 6 (see the module docstring); ``negative_zero_sign``
    selects MXFP4 (True: ``-0.0`` -> 0x8) or NVFP4 (False: ``-0.0`` -> 0x0) signs. NaN/Inf raise
    ``ValueError``. Same shape as ``q``.
    """
    q = _float32_checked(q, "fp4.encode")
    out = torch.empty(q.shape, dtype=torch.uint8)
    flat_q, flat_out = q.view(-1), out.view(-1)
    n = flat_q.numel()
    step = max(4, min(n, _common.CHUNK_ELEMENTS))
    enc = Encoder(step)
    for i in range(0, n, step):
        m = min(step, n - i)
        torch.clamp(flat_q[i : i + m], -E2M1_MAX, E2M1_MAX, out=enc.q[:m])  # -0.0 stays -0.0
        enc.sign_from_q_(m, negative_zero_sign=negative_zero_sign)
        flat_out[i : i + m].copy_(enc.codes_(m))
    return out


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim (``[..., 2B]`` -> ``[..., B]``), even index low."""
    if codes.dtype != torch.uint8 or codes.dim() < 1 or codes.shape[-1] % 2:
        raise ValueError(
            "fp4.pack: expected uint8 codes with an even last dimension, "
            f"got {codes.dtype} {tuple(codes.shape)}"
        )
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("fp4.pack: codes must be in 0..15")
    return torch.bitwise_or(codes[..., 0::2], torch.bitwise_left_shift(codes[..., 1::2], 4))


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack``: ``[..., B]`` uint8 -> ``[..., 2B]`` codes, low nibble first."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"fp4.unpack: expected uint8, got {packed.dtype}")
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=out[..., 0::2])
    torch.bitwise_right_shift(packed, 4, out=out[..., 1::2])
    return out


_TABLE = torch.tensor(E2M1_VALUES, dtype=torch.float32)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of E2M1 codes (uint8 0..15), same shape."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"fp4.decode: expected uint8 codes, got {codes.dtype}")
    flat = codes.reshape(-1)
    if flat.numel() and int(flat.max()) > 15:
        raise ValueError("fp4.decode: codes must be in 0..15")
    return _TABLE.index_select(0, flat.to(torch.int32)).view(codes.shape)


# Row b: the float32 values of byte b's low and high nibble.
_PAIRS = torch.tensor([[E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]] for b in range(256)], dtype=torch.float32)


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Float32 values of packed E2M1 bytes: ``[..., B]`` uint8 -> ``[..., 2B]`` float32.

    One table lookup per byte yields both of its values (low nibble first).
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"fp4.decode_packed: expected uint8, got {packed.dtype}")
    flat = packed.reshape(-1)
    out = torch.empty((flat.numel(), 2), dtype=torch.float32)
    step = _common.CHUNK_ELEMENTS

    def task(i: int, j: int) -> None:
        torch.index_select(_PAIRS, 0, flat[i:j].to(torch.int32), out=out[i:j])

    _parallel.run_ranges(flat.numel(), step, task)
    return out.view(*packed.shape[:-1], packed.shape[-1] * 2)

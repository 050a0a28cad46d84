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

import torch

from weight_sync.formats import _common

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
E2M1_MAX = 6.0


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
    kernel = _common.kernels().e2m1_codes
    kernel(q.reshape(-1).numpy(), negative_zero_sign, out.reshape(-1).numpy())
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

    _common.WORKERS.run_ranges(flat.numel(), step, task)
    return out.view(*packed.shape[:-1], packed.shape[-1] * 2)

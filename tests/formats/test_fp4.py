"""Shared E2M1 helpers: encode (both sign rules), pack/unpack, decode, against the scalar reference."""

from __future__ import annotations

import struct

import pytest
import torch

from tests.formats import reference as ref
from weight_sync.formats import fp4


def _neighbours(v: float) -> list[float]:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    return [struct.unpack("<f", struct.pack("<I", b))[0] for b in (bits - 1, bits, bits + 1)]


def _ref_code(q: float, negative_zero_sign: bool) -> int:
    neg = (struct.unpack("<I", struct.pack("<f", q))[0] >> 31) if negative_zero_sign else q < 0
    return ref.e2m1_magnitude(abs(q)) | (8 if neg else 0)


@pytest.mark.parametrize("negative_zero_sign", [False, True])
def test_encode_matches_reference_on_grid_ties_neighbours_and_random(negative_zero_sign):
    probes = [0.0, -0.0, 1e-45, -1e-45, 6.0, 6.5, 7.0, 7.5, 8.0, 100.0, 1e30]
    for v in ref.E2M1_POS + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]:
        probes += _neighbours(v) if v > 0 else []
    probes += [-v for v in probes]
    g = torch.Generator().manual_seed(0)
    probes += (torch.randn(5000, generator=g) * 3).tolist()
    q = torch.tensor(probes, dtype=torch.float32)
    got = fp4.encode(q, negative_zero_sign=negative_zero_sign).tolist()
    assert got == [_ref_code(v, negative_zero_sign) for v in q.tolist()]


def test_signed_zero_rules():
    q = torch.tensor([-0.0, 0.0, -1e-30])
    assert fp4.encode(q, negative_zero_sign=True).tolist() == [8, 0, 8]  # MXFP4 / torchao
    assert fp4.encode(q, negative_zero_sign=False).tolist() == [0, 0, 8]  # NVFP4 / ModelOpt


def test_pack_unpack_decode():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3).view(3, 16)
    packed = fp4.pack(codes)
    assert tuple(packed.shape) == (3, 8)
    pairs = zip(range(0, 16, 2), range(1, 16, 2), strict=True)
    assert packed[0].tolist() == [c0 | c1 << 4 for c0, c1 in pairs]
    assert torch.equal(fp4.unpack(packed), codes)
    assert fp4.decode(codes[0]).tolist() == [ref.e2m1_value(c) for c in range(16)]
    assert fp4.decode_packed(packed).tolist() == fp4.decode(codes).tolist()


def test_bad_inputs():
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp4.encode(torch.tensor([1.0, float("nan")]), negative_zero_sign=False)
    with pytest.raises(ValueError, match="even last dimension"):
        fp4.pack(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        fp4.pack(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        fp4.decode(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        fp4.unpack(torch.zeros(2))

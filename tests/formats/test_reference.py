"""The scalar reference itself, checked against torch's float8_e4m3fn cast and hand-worked cases."""

from __future__ import annotations

import math
import struct

import torch

from tests.formats import reference as ref


def _e4m3_probe_values() -> list[float]:
    """Every finite e4m3 value, the midpoints between neighbours and one float32 ulp either side."""
    finite = sorted({abs(ref.e4m3_value(c)) for c in range(0x7F)})
    out = []
    for a, b in zip(finite, finite[1:], strict=False):
        mid = (a + b) / 2
        for v in (a, mid, b):
            bits = struct.unpack("<I", struct.pack("<f", v))[0]
            for d in (-1, 0, 1):
                if bits + d >= 0:
                    out.append(struct.unpack("<f", struct.pack("<I", bits + d))[0])
    out += [448.0, 460.0, 463.99, 464.0, 470.0, 479.9, 1e6, 3e38, 2.0**-149, 2.0**-126]
    return out + [-v for v in out]


def test_e4m3_reference_matches_torch_cast_on_ties_neighbours_and_random():
    probes = _e4m3_probe_values()
    g = torch.Generator().manual_seed(0)
    rnd = (torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 4)).tolist()
    values = [ref.f32(v) for v in probes + rnd]
    got = torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    want = [ref.e4m3_code(v) for v in values]
    assert got == want


def test_e4m3_reference_hand_cases():
    assert ref.e4m3_code(1.0625) == 0x38  # tie between 1.0 and 1.125 -> even mantissa (1.0)
    assert ref.e4m3_code(1.1875) == 0x3A  # tie between 1.125 and 1.25 -> 1.25
    assert ref.e4m3_code(2.0**-10) == 0x00  # tie between 0 and the smallest subnormal -> 0
    assert ref.e4m3_code(3 * 2.0**-10) == 0x02  # tie between 1 and 2 subnormal steps -> 2
    assert ref.e4m3_code(-0.0) == 0x80
    assert ref.e4m3_code(500.0) == 0x7E and ref.e4m3_code(-1e30) == 0xFE
    assert ref.e4m3_value(0x7E) == 448.0 and ref.e4m3_value(0x01) == 2.0**-9
    assert math.isnan(ref.e4m3_value(0x7F))


def test_e2m1_reference_ties_go_to_even_codes():
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    for v, code in ties.items():
        assert ref.e2m1_magnitude(v) == code, v
        below = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0] - 1))[0]
        above = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0] + 1))[0]
        lower = max(c for c in range(8) if ref.E2M1_POS[c] < v)
        assert ref.e2m1_magnitude(below) == lower
        assert ref.e2m1_magnitude(above) == lower + 1
    assert [ref.e2m1_magnitude(v) for v in ref.E2M1_POS] == list(range(8))
    assert ref.e2m1_magnitude(6.5) == 7 and ref.e2m1_magnitude(1e30) == 7


def test_float32_rounding_helper():
    assert ref.f32(1.0 + 2.0**-24) == 1.0  # tie -> even
    assert ref.f32(1.0 + 3 * 2.0**-24) == 1.0 + 2.0**-22
    assert ref.f32(2.0**-150) == 0.0 and ref.f32(3 * 2.0**-151) == 2.0**-149
    assert ref.values_of(torch.tensor([1.5, -0.0], dtype=torch.bfloat16)) == [1.5, -0.0]

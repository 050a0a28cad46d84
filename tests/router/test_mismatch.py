"""Mismatch figures from known log-probs, checked against hand-computed values (counts exactly,
sums to the last bits of float64), and the upload encoding byte for byte (the trainer's encoder,
the router's decoder and its refusals)."""

from __future__ import annotations

import math
import re
import struct
from decimal import Decimal, localcontext

import numpy as np
import pytest

from router import mismatch
from router.mismatch import (
    BUCKET_LABELS,
    LOGPROB_FLOOR,
    LOGPROB_SLACK,
    MismatchSums,
    TurnTokens,
    batch_mismatch,
    check_band,
    group_view,
    k3_terms,
    position_bucket,
)
from router.trainer_logprobs import LogprobsFormatError, decode_trainer_logprobs
from trainer.upload import encode_trainer_logprobs

NAN = float("nan")
E = math.e

# Turn A (group g1, prompt of 62 tokens): positions 62, 63 | 64, 65.
#   q = -1, -2, -0.5, NaN; d = log p - log q = 0, 0.5, -2, (q unknown); versions 3, 3, 4, 4.
# Turn B (group g2, prompt of 1024 tokens): positions 1024, 1025.
#   q = -3, -1.25; d = (no version), 1; versions None, 7.
TURNS = [
    TurnTokens("g1", 62, [-1.0, -2.0, -0.5, NAN], [3, 3, 4, 4]),
    TurnTokens("g2", 1024, [-3.0, -1.25], [None, 7]),
]
P = np.array([-1.0, -1.5, -2.5, -1.0, -3.0, -0.25], dtype=np.float32)
BAND = (0.5, 2.0)

# Hand-computed: k3 = r - 1 - d with r = e^d.
#   d = 0   -> r = 1,      k3 = 0,             |d| = 0, inside [0.2, 5], inside [0.5, 2]
#   d = 0.5 -> r = 1.6487, k3 = e^0.5 - 1.5,   |d| = 0.5, inside both
#   d = -2  -> r = 0.1353, k3 = e^-2 + 1,      |d| = 2, outside both
#   d = 1   -> r = 2.7183, k3 = e - 2,         |d| = 1, inside [0.2, 5], outside [0.5, 2]
EXPECTED = {
    ("g1", 3, "0-63"): (2, 0.0 + (math.exp(0.5) - 1.5), 0.5, 0, 0),
    ("g1", 4, "64-255"): (1, math.exp(-2.0) + 1.0, 2.0, 1, 1),
    ("g2", 7, "1024+"): (1, E - 2.0, 1.0, 0, 1),
}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-14, abs_tol=1e-15)


def test_batch_sums_match_hand_computed_values() -> None:
    out = batch_mismatch(TURNS, P, BAND)
    assert out.tokens == 4 and out.skipped == 2  # q unknown once, version unknown once
    assert set(out.sums) == set(EXPECTED)
    for key, (n, k3, absd, extreme, oob) in EXPECTED.items():
        s = out.sums[key]
        assert (s.tokens, s.extreme, s.out_of_band) == (n, extreme, oob), key
        assert _close(s.k3, k3) and _close(s.abs_logprob_diff, absd), (key, s)


def test_group_view_means_shares_versions_and_positions() -> None:
    sums = batch_mismatch(TURNS, P, BAND).sums
    g1 = group_view(sums, "g1", BAND)
    k3_v3 = math.exp(0.5) - 1.5
    k3_v4 = math.exp(-2.0) + 1.0
    assert g1["band"] == [0.5, 2.0] and g1["extreme_band"] == [0.2, 5.0]
    assert g1["tokens"] == 3
    assert _close(g1["k3_kl"], (k3_v3 + k3_v4) / 3)
    assert _close(g1["abs_logprob_diff_mean"], 2.5 / 3)
    assert g1["extreme_share"] == 1 / 3 and g1["out_of_band_share"] == 1 / 3
    v3, v4 = g1["versions"]
    assert (v3["version"], v3["tokens"], v3["extreme_share"], v3["out_of_band_share"]) == (3, 2, 0.0, 0.0)
    assert _close(v3["k3_kl"], k3_v3 / 2) and v3["abs_logprob_diff_mean"] == 0.25
    assert (v4["version"], v4["tokens"], v4["extreme_share"], v4["out_of_band_share"]) == (4, 1, 1.0, 1.0)
    assert _close(v4["k3_kl"], k3_v4) and v4["abs_logprob_diff_mean"] == 2.0
    assert [p["bucket"] for p in g1["positions"]] == ["0-63", "64-255"]
    assert g1["positions"][0]["tokens"] == 2 and g1["positions"][1]["extreme_share"] == 1.0
    g2 = group_view(sums, "g2", BAND)
    assert g2["tokens"] == 1 and _close(g2["k3_kl"], E - 2.0)
    assert g2["extreme_share"] == 0.0 and g2["out_of_band_share"] == 1.0
    assert [p["bucket"] for p in g2["positions"]] == ["1024+"]
    empty = group_view(sums, "nobody", BAND)
    assert empty["tokens"] == 0 and empty["k3_kl"] == 0.0 and empty["versions"] == []


def test_sums_of_two_uploads_add() -> None:
    one = batch_mismatch(TURNS, P, BAND).sums[("g1", 3, "0-63")]
    two = one + one
    assert (two.tokens, two.extreme) == (4, 0) and two.k3 == 2 * one.k3
    assert MismatchSums().view()["k3_kl"] == 0.0


def test_identical_log_probs_have_no_mismatch() -> None:
    q = [-0.125, -2.0, -7.5]
    out = batch_mismatch([TurnTokens("g", 0, q, [1, 1, 1])], np.array(q, dtype=np.float32), (0.2, 5.0))
    s = out.sums[("g", 1, "0-63")]
    assert (s.tokens, s.k3, s.abs_logprob_diff, s.extreme, s.out_of_band) == (3, 0.0, 0.0, 0, 0)


def _k3_exact(d: float) -> float:
    """k3 = e^d - 1 - d of the double ``d``, brute force in 60 significant digits."""
    with localcontext() as c:
        c.prec = 60
        x = Decimal(d)  # exact
        return float(x.exp() - 1 - x)


# d = log r for r = 1 +- 1e-12 and 1 +- 1e-9 (p ~= q), small d where e^d - 1 - d in doubles comes
# out negative (+-2e-12, -3e-12, -1e-10: about -4e-17), and ordinary ones
K3_D = [
    math.log1p(1e-12),
    math.log1p(-1e-12),
    math.log1p(1e-9),
    math.log1p(-1e-9),
    2e-12,
    -3e-12,
    -1e-10,
    0.0,
    2.0**-52,
    -1e-6,
    0.5,
    -2.0,
    -9.0,
]


def test_k3_is_never_negative_and_matches_brute_force() -> None:
    d = np.array(K3_D)
    got = k3_terms(d)
    assert (got >= 0).all(), got
    for x, k in zip(K3_D, got.tolist(), strict=True):
        want = _k3_exact(x)
        # expm1(d) - d is exact to about an ulp of d: a relative bound for k3 >> ulp(d), else ulps
        assert math.isclose(k, want, rel_tol=1e-9, abs_tol=4 * math.ulp(x)), (x, k, want)


def test_batch_k3_sums_of_near_equal_log_probs_are_not_negative() -> None:
    """q = 0 makes d = p exactly: every sum is its tokens' brute-force k3, never below 0."""
    for x in K3_D[:7]:
        turns = [TurnTokens("g", 0, [0.0] * 4, [1] * 4)]
        s = batch_mismatch(turns, np.full(4, x), (0.2, 5.0)).sums[("g", 1, "0-63")]
        assert s.k3 >= 0.0 and math.isclose(s.k3, 4 * _k3_exact(x), rel_tol=1e-9, abs_tol=16 * math.ulp(x)), (
            x,
            s.k3,
        )


def test_position_buckets() -> None:
    assert BUCKET_LABELS == ("0-63", "64-255", "256-1023", "1024+")
    got = [position_bucket(x) for x in (0, 63, 64, 255, 256, 1023, 1024, 10**6)]
    assert got == ["0-63", "0-63", "64-255", "64-255", "256-1023", "256-1023", "1024+", "1024+"]


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="5 trainer log-probs for 6 output tokens"):
        batch_mismatch(TURNS, P[:5], BAND)
    bad = P.copy()
    bad[2] = np.nan
    with pytest.raises(ValueError, match="trainer log-prob 2 is not finite"):
        batch_mismatch(TURNS, bad, BAND)
    above = P.copy()
    above[3] = 5.0
    with pytest.raises(ValueError, match="trainer log-prob 3 is 5, above 0: not the log of a probability"):
        batch_mismatch(TURNS, above, BAND)
    above[3] = LOGPROB_SLACK  # a log-softmax rounded a hair above 0 is taken
    batch_mismatch(TURNS, above, BAND)
    with pytest.raises(ValueError, match="token 0: ratio p/q overflows"):
        batch_mismatch([TurnTokens("g", 0, [-1000.0], [1])], np.array([0.0]), BAND)
    for band in ((0.0, 2.0), (1.0, 2.0), (0.5, 1.0), (0.5, math.inf), (2.0, 0.5)):
        with pytest.raises(ValueError, match="0 < low < 1 < high"):
            check_band(band)


def test_a_log_prob_below_the_floor_is_refused_naming_the_token() -> None:
    """Masking constants (float32's and float16's minimum, -1e9) are refused, the floor itself and a
    very unlikely real token are taken."""
    for masked in (float(np.finfo(np.float32).min), float(np.finfo(np.float16).min), -1e9, -1e30):
        low = P.copy()
        low[4] = masked
        message = f"trainer log-prob 4 is {masked:.6g}, below -10000: a masking constant"
        with pytest.raises(ValueError, match=re.escape(message)):
            batch_mismatch(TURNS, low, BAND)
    q = [-1.0, -2.0]
    for ok in (LOGPROB_FLOOR, -60.0):
        out = batch_mismatch([TurnTokens("g", 0, q, [1, 1])], np.array([ok, -2.0], dtype=np.float32), BAND)
        assert out.tokens == 2


def test_a_batch_computed_in_chunks_sums_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sums do not depend on how the batch is cut into chunks (a turn is never split): counts
    exactly, float sums to rounding."""
    rng = np.random.default_rng(3)
    turns = [
        TurnTokens(
            f"g{i % 3}",
            int(rng.integers(0, 2000)),
            list(-rng.random(n) * 3),
            [None if rng.random() < 0.1 else int(v) for v in rng.integers(0, 3, n)],
            routes=i % 3 == 0,  # group g0 recorded routes, g1 and g2 did not
        )
        for i, n in enumerate(rng.integers(0, 40, 50))
    ]
    total = sum(len(t.logprobs) for t in turns)
    p = np.minimum(np.concatenate([t.logprobs for t in turns]) + rng.normal(0, 0.5, total), 0).astype(
        np.float32
    )
    flags = rng.integers(0, 3, total).astype(np.uint8)
    whole = batch_mismatch(turns, p, BAND, flags)
    monkeypatch.setattr(mismatch, "CHUNK_TOKENS", 7)
    cut = batch_mismatch(turns, p, BAND, flags)
    assert (cut.tokens, cut.skipped, set(cut.sums)) == (whole.tokens, whole.skipped, set(whole.sums))
    for key, s in whole.sums.items():
        c = cut.sums[key]
        assert (c.tokens, c.extreme, c.out_of_band, c.route_tokens, c.route_differ) == (
            s.tokens,
            s.extreme,
            s.out_of_band,
            s.route_tokens,
            s.route_differ,
        )
        assert math.isclose(c.k3, s.k3, rel_tol=1e-12) and math.isclose(
            c.abs_logprob_diff, s.abs_logprob_diff, rel_tol=1e-12
        )
    routed = {
        g: sum(s.route_tokens for (h, _, _), s in whole.sums.items() if h == g) for g in ("g0", "g1", "g2")
    }
    assert routed["g0"] > 0 and routed["g1"] == routed["g2"] == 0  # flags of turns without routes: ignored


def test_upload_encoding_bytes() -> None:
    lp = np.array([[-1.0, -0.5], [-0.25, -8.0]], dtype=np.float64)
    blob = encode_trainer_logprobs(lp)
    assert blob == b"MFL\x01" + (4).to_bytes(4, "little") + struct.pack("<4f", -1.0, -0.5, -0.25, -8.0)
    back = decode_trainer_logprobs(blob)
    assert back.dtype == np.float32 and back.tolist() == [-1.0, -0.5, -0.25, -8.0]
    assert decode_trainer_logprobs(encode_trainer_logprobs(np.zeros(0))).size == 0


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"MFL", "shorter than its 8-byte header"),
        (b"MFT\x01" + bytes(4), "starts with b'MFT'"),
        (b"MFL\x02" + bytes(4), "format version 2"),
        (b"MFL\x01" + (2).to_bytes(4, "little") + bytes(4), "holds 12 bytes; 2 log-probs need 16"),
        (b"MFL\x01" + (0).to_bytes(4, "little") + b"x", "holds 9 bytes; 0 log-probs need 8"),
    ],
)
def test_upload_decoder_refusals(blob: bytes, message: str) -> None:
    with pytest.raises(LogprobsFormatError, match=message.replace("(", r"\(")):
        decode_trainer_logprobs(blob)

"""The compact behavior-record encoding: exact round trips, documented byte layout, bad input."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.records import (
    RecordFormatError,
    TurnData,
    as_stored,
    decode_batch,
    decode_turn,
    decode_turn_header,
    encode_batch,
    encode_turn,
)

f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-1e4, max_value=0.0)
token = st.integers(min_value=0, max_value=300_000)


@st.composite
def turns(draw) -> TurnData:
    n = draw(st.integers(0, 12))
    out_ids = draw(st.lists(token, min_size=n, max_size=n))
    supports = [sorted(draw(st.sets(token, max_size=40))) for _ in range(n)]
    support_lps = [[draw(f32) for _ in s] for s in supports]
    raw = [draw(st.one_of(st.none(), f32)) for _ in range(n)]
    cut = draw(st.integers(0, n))
    spans = [{"version": 3, "start": 0, "end": cut}, {"version": 4, "start": cut, "end": n}] if n else []
    return TurnData(
        turn=draw(st.integers(0, 1000)),
        group=draw(st.sampled_from(["cpu-bf16", "b200-nvfp4"])),
        replica="r-0",
        input_ids=draw(st.lists(token, min_size=1, max_size=30)),
        output_ids=out_ids,
        logprobs=[draw(f32) for _ in range(n)],
        raw_logprobs=raw,
        support_ids=supports,
        support_logprobs=support_lps,
        weight_versions=spans,
        finish_reason={"type": "length", "length": n},
        timings={"engine_ms": 1.5},
        moved_from=draw(st.one_of(st.none(), st.just("cpu-fp8"))),
    )


@settings(max_examples=80, deadline=None)
@given(turns())
def test_turn_round_trip_f32_is_exact(t: TurnData) -> None:
    back = decode_turn(encode_turn(t))
    assert back.to_json() == t.to_json()
    assert as_stored(t).to_json() == back.to_json()


@settings(max_examples=40, deadline=None)
@given(turns())
def test_turn_round_trip_f16_rounds_support_logprobs_only(t: TurnData) -> None:
    back = decode_turn(encode_turn(t, f16=True))
    assert as_stored(t, f16=True).to_json() == back.to_json()
    assert list(back.output_ids) == list(t.output_ids)
    assert list(back.logprobs) == list(t.logprobs)  # token log-probs stay float32
    for got, want in zip(back.support_logprobs, t.support_logprobs, strict=True):
        # independent reference: numpy-free float16 rounding through struct
        assert got == [struct.unpack("<e", struct.pack("<e", x))[0] for x in want]


def test_byte_layout_matches_the_documented_format() -> None:
    t = TurnData(
        turn=2,
        group="g",
        replica="r",
        input_ids=[5, 300],
        output_ids=[7],
        logprobs=[-0.5],
        raw_logprobs=[-0.25],
        support_ids=[[3, 7, 200]],
        support_logprobs=[[-2.0, -0.5, -1.0]],
        weight_versions=[{"version": 1, "start": 0, "end": 1}],
    )
    data = encode_turn(t)
    assert data[:5] == b"MFT\x01\x00"
    hlen, shift, pos = 0, 0, 5
    while True:  # LEB128 header length
        b = data[pos]
        pos += 1
        hlen |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            break
    assert data[pos : pos + hlen].startswith(b'{"finish_reason":null')
    pos += hlen
    # input ids: count 2, then 5 and 300 (LEB128 0xAC 0x02)
    assert data[pos : pos + 4] == bytes([2, 5, 0xAC, 0x02])
    pos += 4
    assert data[pos : pos + 2] == bytes([1, 7])  # one output token, id 7
    pos += 2
    assert struct.unpack("<2f", data[pos : pos + 8]) == (-0.5, -0.25)
    pos += 8
    # support size 3; ids 3, 7, 200 -> first 3, gaps 3 and 192 (0xC0 0x01)
    assert data[pos : pos + 5] == bytes([3, 3, 3, 0xC0, 0x01])
    pos += 5
    assert struct.unpack("<3f", data[pos:]) == (-2.0, -0.5, -1.0)


def test_record_carries_the_version_of_its_span() -> None:
    t = TurnData(
        turn=0,
        group="g",
        replica="r",
        input_ids=[1],
        output_ids=[1, 2, 3],
        logprobs=[-1.0] * 3,
        raw_logprobs=[None] * 3,
        support_ids=[[], [], []],
        support_logprobs=[[], [], []],
        weight_versions=[{"version": 4, "start": 0, "end": 2}, {"version": 5, "start": 2, "end": 3}],
    )
    recs = decode_turn(encode_turn(t)).to_json()["records"]
    assert [r["weight_version"] for r in recs] == [4, 4, 5]
    assert all(r["raw_logprob"] is None and r["support_ids"] == [] for r in recs)


def test_batch_round_trip() -> None:
    t = TurnData(
        turn=0,
        group="g",
        replica="r",
        input_ids=[1, 2],
        output_ids=[9],
        logprobs=[-0.1],
        raw_logprobs=[-0.2],
        support_ids=[[9, 10]],
        support_logprobs=[[-0.1, -2.3]],
    )
    blob = encode_turn(t)
    header = {
        "session_id": "s1",
        "group": "g",
        "reward": 1.0,
        "metadata": {},
        "version_age": {"min": 0, "max": 0, "mean": 0.0},
    }
    batch = decode_batch(encode_batch("L1", 3, [(header, [blob, blob])]))
    assert batch["lease_id"] == "L1" and batch["held_back"] == 3
    traj = batch["trajectories"][0]
    assert traj["reward"] == 1.0 and len(traj["turns"]) == 2
    assert traj["turns"][0]["session_id"] == "s1"
    assert traj["turns"][1]["records"][0]["support_ids"] == [9, 10]
    assert math.isclose(traj["turns"][1]["records"][0]["support_logprobs"][1], -2.3, rel_tol=1e-6)


def test_header_only_decode() -> None:
    t = TurnData(
        turn=7,
        group="g",
        replica="r",
        input_ids=[1],
        output_ids=[],
        logprobs=[],
        raw_logprobs=[],
        support_ids=[],
        support_logprobs=[],
    )
    assert decode_turn_header(encode_turn(t))["turn"] == 7


@pytest.mark.parametrize(
    "blob",
    [b"", b"XYZ\x01\x00", b"MFT\x09\x00", b"MFT\x01\x00\x05{}", b"MFT\x01\x00\x02{}\x05\x01"],
)
def test_malformed_blocks_raise_format_error(blob: bytes) -> None:
    with pytest.raises(RecordFormatError):
        decode_turn(blob)


def test_inconsistent_lengths_and_unsorted_support_are_refused() -> None:
    with pytest.raises(ValueError, match="differ"):
        TurnData(
            turn=0,
            group="g",
            replica="r",
            input_ids=[1],
            output_ids=[1],
            logprobs=[],
            raw_logprobs=[],
            support_ids=[],
            support_logprobs=[],
        )
    t = TurnData(
        turn=0,
        group="g",
        replica="r",
        input_ids=[1],
        output_ids=[1],
        logprobs=[-1.0],
        raw_logprobs=[-1.0],
        support_ids=[[5, 2]],
        support_logprobs=[[-1.0, -1.0]],
    )
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_turn(t)


def test_unknown_log_probs_become_null_in_json() -> None:
    nan = float("nan")
    t = TurnData(
        turn=0,
        group="g",
        replica="r",
        input_ids=[1],
        output_ids=[4],
        logprobs=[nan],
        raw_logprobs=[None],
        support_ids=[[3, 4]],
        support_logprobs=[[nan, float("-inf")]],
    )
    rec = decode_turn(encode_turn(t)).to_json()["records"][0]
    assert rec["logprob"] is None and rec["raw_logprob"] is None and rec["support_logprobs"] == [None, None]

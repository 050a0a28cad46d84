"""Behavior records: the engine-answer parser (reads, upstream SGLang shapes, refusals naming the field),
the compact encoding (exact round trips, documented byte layout, coders, bad input)."""

from __future__ import annotations

import copy
import math
import random
import re
import struct
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.jsonio import dumps
from router import records
from router.engine_answer import parse_turn
from router.records import (
    RecordFormatError,
    decode_batch,
    decode_turn,
    decode_turn_header,
    decode_turn_outputs,
    encode_batch,
    encode_stored,
    encode_turn,
)
from router.turn_data import ROUTES_SECTION, RoutedExperts, TurnData

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
        append_ids=draw(st.lists(token, min_size=1, max_size=30)),
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
    assert encode_stored(t)[1].to_json() == back.to_json()


@settings(max_examples=40, deadline=None)
@given(turns())
def test_turn_round_trip_f16_rounds_support_logprobs_only(t: TurnData) -> None:
    back = decode_turn(encode_turn(t, f16=True))
    assert encode_stored(t, f16=True)[1].to_json() == back.to_json()
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
        append_ids=[5, 300],
        output_ids=[7],
        logprobs=[-0.5],
        raw_logprobs=[-0.25],
        support_ids=[[3, 7, 200]],
        support_logprobs=[[-2.0, -0.5, -1.0]],
        weight_versions=[{"version": 1, "start": 0, "end": 1}],
    )
    data = encode_turn(t)
    assert data[:5] == b"MFT\x02\x00"
    hlen, shift, pos = 0, 0, 5
    while True:  # LEB128 header length
        b = data[pos]
        pos += 1
        hlen |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            break
    assert data[pos : pos + hlen].startswith(b'{"context":0,"finish_reason":null')
    pos += hlen
    # appended input ids: count 2, then 5 and 300 (LEB128 0xAC 0x02)
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
        append_ids=[1],
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
        append_ids=[1, 2],
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
    second = encode_turn(replace(t, turn=1, context=3))  # after the first turn's 2 + 1 tokens
    batch = decode_batch(encode_batch("L1", 3, [(header, [blob, second])]))
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
        append_ids=[1],
        output_ids=[],
        logprobs=[],
        raw_logprobs=[],
        support_ids=[],
        support_logprobs=[],
    )
    assert decode_turn_header(encode_turn(t))["turn"] == 7


@pytest.mark.parametrize(
    "blob",
    [b"", b"XYZ\x02\x00", b"MFT\x09\x00", b"MFT\x02\x00\x05{}", b"MFT\x02\x00\x02{}\x05\x01"],
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
            append_ids=[1],
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
        append_ids=[1],
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
        append_ids=[1],
        output_ids=[4],
        logprobs=[nan],
        raw_logprobs=[None],
        support_ids=[[3, 4]],
        support_logprobs=[[nan, float("-inf")]],
    )
    rec = decode_turn(encode_turn(t)).to_json()["records"][0]
    assert rec["logprob"] is None and rec["raw_logprob"] is None and rec["support_logprobs"] == [None, None]


def test_values_beyond_what_the_decoder_reads_are_refused() -> None:
    t = TurnData(
        turn=0,
        group="g",
        replica="r",
        append_ids=[2**63],
        output_ids=[],
        logprobs=[],
        raw_logprobs=[],
        support_ids=[],
        support_logprobs=[],
    )
    with pytest.raises(ValueError, match="63 bits"):
        encode_turn(t)
    ok = TurnData(**{**t.__dict__, "append_ids": [2**63 - 1]})
    assert list(decode_turn(encode_turn(ok)).append_ids) == [2**63 - 1]


# ---------------------------------------------------------------- the encoder's coders

long_token = st.integers(0, 300_000)


@st.composite
def long_turns(draw) -> TurnData:
    """Turns long enough for the encoder's numpy coders (runs of at least ``_NUMPY_MIN`` values)."""
    n = draw(st.integers(0, 40))
    out = draw(st.lists(long_token, min_size=n, max_size=n))
    supports = [sorted(draw(st.sets(long_token, max_size=30))) for _ in range(n)]
    f = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-50, max_value=0)
    return TurnData(
        turn=draw(st.integers(0, 9)),
        group="g",
        replica="r",
        append_ids=draw(st.lists(long_token, min_size=1, max_size=600)),
        output_ids=out,
        logprobs=[draw(f) for _ in range(n)],
        raw_logprobs=[draw(st.one_of(st.none(), f)) for _ in range(n)],
        support_ids=supports,
        support_logprobs=[[draw(f) for _ in s] for s in supports],
        weight_versions=[{"version": 1, "start": 0, "end": n}] if n else [],
        # objects with their keys out of sorted order, as the engine and the router write them
        finish_reason={"type": "length", "length": n},
        timings={"engine_ms": 0.5, "attempts": 1},
        sampling={"temperature": 1.0, "max_new_tokens": n},
        fork=draw(st.sampled_from([None, {"stored": 9, "common": 2}])),
    )


@settings(max_examples=80, deadline=None)
@given(long_turns(), st.booleans())
def test_encode_stored_is_the_block_and_the_turn_it_decodes_to(t: TurnData, f16: bool) -> None:
    blob, stored = encode_stored(t, f16=f16)
    assert blob == encode_turn(t, f16=f16)
    assert stored.to_json() == decode_turn(blob).to_json()
    # the bytes too: a turn's answer is the JSON a read of its block gives (a keyed retry's answer)
    answer, read = stored.to_json("s", with_input=False), decode_turn(blob).to_json("s", with_input=False)
    assert dumps(answer) == dumps(read)


@settings(max_examples=60, deadline=None)
@given(long_turns())
def test_numpy_and_python_coders_write_the_same_bytes(t: TurnData) -> None:
    with_numpy = encode_turn(t)
    saved = records._NUMPY_MIN
    records._NUMPY_MIN = 10**9
    try:
        assert encode_turn(t) == with_numpy
    finally:
        records._NUMPY_MIN = saved
    records._NUMPY_MIN = 1
    try:
        assert encode_turn(t) == with_numpy
    finally:
        records._NUMPY_MIN = saved


def test_numpy_varints_match_leb128_for_every_length() -> None:
    values = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**35, 2**63 - 1] * 50
    python = bytearray()
    for v in values:
        records._varint(v, python)
    out = bytearray()
    records._varints(values, out)  # 500 values: the numpy path
    assert bytes(out) == bytes(python)
    # independent reference: LEB128 by its definition
    want = bytearray()
    for v in values:
        while True:
            low, v = v & 0x7F, v >> 7
            want.append(low | (0x80 if v else 0))
            if not v:
                break
    assert bytes(out) == bytes(want)


# ---------------------------------------------------------------- parsing engine answers

MASK = "output_token_sampling_mask"
MU = "output_token_sampling_logprobs"
RAW = "output_token_logprobs"

ARGS = {
    "index": 2,
    "group": "g",
    "replica": "r",
    "input_ids": [1, 2, 300],
    "moved_from": None,
    "timings": {"engine_ms": 1.0},
}


def _engine_body(rng: random.Random, n: int, *, with_none: bool = False, mode: str = "support") -> dict:
    """An engine's ``/generate`` answer for ``n`` tokens as SGLang 0.5.23 sends it: each mask
    ranked, highest log-prob first (layers/sampler.py 607-616); in ``support`` mode
    ``output_token_sampling_logprobs`` holds per token the support's log-probs aligned with the
    mask (618-624), in ``selected`` mode mu, the sampled token's support log-prob."""
    out = [rng.randrange(1000) for _ in range(n)]
    ranked = []
    for t in out:
        ids = {t, *rng.sample(range(1000), rng.randrange(0, 6))}
        ranked.append(sorted(((-rng.random() * 5, i) for i in ids), key=lambda p: (-p[0], p[1])))
    masks = [[i for _, i in row] for row in ranked]
    supp = [[lp for lp, _ in row] for row in ranked]
    raw = [[-rng.random() * 6, t, None] for t in out]
    if with_none and n:
        raw[0][0] = None
    mu = [s[m.index(t)] for s, m, t in zip(supp, masks, out, strict=True)]
    return {
        "output_ids": out,
        "meta_info": {
            "output_token_logprobs": raw,
            "output_token_sampling_mask": masks,
            "output_token_sampling_logprobs": supp if mode == "support" else mu,
            "weight_versions": [{"version": 3, "start": 0, "end": n}],
            "finish_reason": {"type": "length", "length": n},
            "e2e_latency": 0.25,
        },
    }


def _f32(xs) -> list[float]:
    return [struct.unpack("<f", struct.pack("<f", x))[0] for x in xs]


@pytest.mark.parametrize("n", [0, 1, 7, 40])
@pytest.mark.parametrize("with_none", [False, True])
@pytest.mark.parametrize("f16", [False, True])
def test_parse_turn_reads_the_engine_answer(n: int, with_none: bool, f16: bool) -> None:
    body = _engine_body(random.Random(n), n, with_none=with_none)
    meta = copy.deepcopy(body["meta_info"])
    mu = _sampled(body)
    if n > 1:  # ints where floats are expected are floats; large ids take multi-byte varints
        sampled_at = body["meta_info"][MASK][1].index(body["output_ids"][1])
        body["meta_info"][MU][1][sampled_at] = -1
        body["meta_info"][MASK][0].append(200_000)
        body["meta_info"][MU][0].append(-9)
        mu[1] = -1.0
    t = parse_turn(body, **ARGS)
    assert (t.turn, t.group, t.replica, t.moved_from, list(t.append_ids)) == (2, "g", "r", None, [1, 2, 300])
    assert list(t.output_ids) == body["output_ids"]
    assert list(t.raw_logprobs) == [x[0] for x in meta["output_token_logprobs"]]
    assert list(t.logprobs) == mu and all(type(x) is float for x in t.logprobs)
    # stored sorted by id, each log-prob along with its id
    want = [
        sorted(zip(m, r, strict=True))
        for m, r in zip(body["meta_info"][MASK], body["meta_info"][MU], strict=True)
    ]
    assert [list(x) for x in t.support_ids] == [[i for i, _ in row] for row in want]
    assert [list(x) for x in t.support_logprobs] == [[x for _, x in row] for row in want]
    if n > 1:
        assert t.support_logprobs[0][-1] == -9.0 and type(t.support_logprobs[0][-1]) is float
    assert list(t.weight_versions) == ([{"version": 3, "start": 0, "end": n}] if n else [])
    assert t.finish_reason == {"type": "length", "length": n}
    assert t.timings == {"engine_ms": 1.0, "engine_e2e_ms": 250.0}
    # what is stored: float32 log-probs, float16 or float32 support log-probs
    blob, stored = encode_stored(t, f16=f16)
    back = decode_turn(blob)
    assert stored.to_json("s") == back.to_json("s")
    assert list(back.logprobs) == _f32(mu)
    want_support = [
        [struct.unpack("<e", struct.pack("<e", x))[0] for x in row] if f16 else _f32(row)
        for row in t.support_logprobs
    ]
    assert [list(x) for x in back.support_logprobs] == want_support
    assert [rec["raw_logprob"] for rec in back.to_json()["records"]] == [
        None if x is None else _f32([x])[0] for x in t.raw_logprobs
    ]


def _variant(edit, seed: int = 9, n: int = 3, mode: str = "support") -> dict:
    body = _engine_body(random.Random(seed), n, mode=mode)
    edit(body["meta_info"])
    return body


def _sampled(body: dict) -> list[float]:
    """Per token the log-prob its support-mode row holds for the sampled id."""
    meta = body["meta_info"]
    return [
        float(row[mask.index(t)])
        for t, mask, row in zip(body["output_ids"], meta[MASK], meta[MU], strict=True)
    ]


def _unknown_at_lowest_id(m: dict, i: int) -> None:
    """Row ``i``'s log-prob of its lowest id made null (unknown)."""
    m[MU][i][m[MASK][i].index(min(m[MASK][i]))] = None


def test_parse_turn_reads_odd_and_upstream_sglang_answers() -> None:
    body = _variant(lambda m: _unknown_at_lowest_id(m, 1))
    assert math.isnan(parse_turn(body, **ARGS).support_logprobs[1][0])  # unknown
    t = parse_turn(_variant(lambda m: m[MU].__setitem__(2, None), mode="selected"), **ARGS)
    assert math.isnan(t.logprobs[2])
    assert decode_turn(encode_turn(t)).to_json()["records"][2]["logprob"] is None
    # support mode, mu a list: the sampled token's support log-prob
    body = _variant(lambda m: None)
    meta = body["meta_info"]
    i = meta[MASK][2].index(body["output_ids"][2])
    assert parse_turn(body, **ARGS).logprobs[2] == meta[MU][2][i]
    # SGLang's selected mode, without the support's log-probs: unknown (NaN), mu as sent
    body = _variant(lambda m: None, mode="selected")
    t = parse_turn(body, **ARGS)
    assert [len(x) for x in t.support_logprobs] == [len(x) for x in t.support_ids]
    assert all(math.isnan(x) for row in t.support_logprobs for x in row)
    assert list(t.logprobs) == body["meta_info"][MU]
    # ... and without mu either: the raw log-prob
    body = _variant(lambda m: m.pop(MU), mode="selected")
    assert list(parse_turn(body, **ARGS).logprobs) == [
        x[0] for x in body["meta_info"]["output_token_logprobs"]
    ]
    # versions: SGLang's string spans and weight_version; "default" names none; empty spans dropped
    body = _variant(
        lambda m: m.update(
            weight_versions=[
                {"version": "4", "start": 0, "end": 2},
                {"version": "5", "start": 2, "end": 2},
                {"version": "6", "start": 2, "end": 3},
            ]
        )
    )
    t = parse_turn(body, **ARGS)
    assert list(t.weight_versions) == [
        {"version": 4, "start": 0, "end": 2},
        {"version": 6, "start": 2, "end": 3},
    ]
    assert t.version_range() == (4, 6)
    body = _variant(lambda m: (m.pop("weight_versions"), m.update(weight_version="7")))
    assert list(parse_turn(body, **ARGS).weight_versions) == [{"version": 7, "start": 0, "end": 3}]
    body = _variant(lambda m: (m.pop("weight_versions"), m.update(weight_version="default")))
    t = parse_turn(body, **ARGS)
    assert list(t.weight_versions) == [] and t.version_range() == (None, None)
    # a server started without --weight-version answers "default" spans: its tokens have no version
    body = _variant(
        lambda m: m.update(
            weight_version="default", weight_versions=[{"version": "default", "start": 0, "end": 3}]
        )
    )
    t = parse_turn(body, **ARGS)
    assert list(t.weight_versions) == [] and t.versions() == [None, None, None]
    body = _variant(
        lambda m: m.update(
            weight_version="1",
            weight_versions=[
                {"version": "default", "start": 0, "end": 1},
                {"version": "1", "start": 1, "end": 3},
            ],
        )
    )
    t = parse_turn(body, **ARGS)
    assert list(t.weight_versions) == [{"version": 1, "start": 1, "end": 3}] and t.versions() == [None, 1, 1]
    assert parse_turn(_variant(lambda m: m.pop("finish_reason")), **ARGS).finish_reason is None
    assert "engine_e2e_ms" not in parse_turn(_variant(lambda m: m.pop("e2e_latency")), **ARGS).timings


def _set(path: tuple, value):
    def edit(m: dict) -> None:
        target = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "the engine answer is not a JSON object"),
        ({"output_ids": [1], "meta_info": "x"}, "no meta_info object"),
        ({"meta_info": {}}, "output_ids is missing"),
        ({"output_ids": (1,), "meta_info": {}}, "output_ids is not a list"),
        ({"output_ids": [1, "2"], "meta_info": {}}, r"output_ids\[1\] = '2' is not a token id"),
        ({"output_ids": [1, -2], "meta_info": {}}, r"output_ids\[1\] = -2 is not a token id"),
        (  # an output id joins the context, which holds the ids a request may send (a 500 once)
            {"output_ids": [1, 2**31], "meta_info": {}},
            r"output_ids\[1\] = 2147483648 is not a token id \(0 to 2147483647\)",
        ),
        (_variant(lambda m: m.pop(RAW)), r"meta_info\.output_token_logprobs is missing"),
        (_variant(_set((RAW,), {"a": 1})), r"meta_info\.output_token_logprobs is not a list"),
        (
            _variant(lambda m: m[RAW].pop()),
            r"meta_info\.output_token_logprobs has 2 entries for 3 output tokens",
        ),
        (
            _variant(_set((RAW, 0), ["-1.5", 3, None])),
            r"output_token_logprobs\[0\]\[0\] = '-1\.5' is not a number",
        ),
        (_variant(_set((RAW, 1), [])), r"output_token_logprobs\[1\] is empty"),
        (_variant(_set((RAW, 1), 5)), r"output_token_logprobs\[1\] = 5 is not a \[logprob"),
        (_variant(lambda m: m.pop(MASK)), r"meta_info\.output_token_sampling_mask is missing"),
        (
            _variant(_set((MASK, 2), None)),
            r"output_token_sampling_mask\[2\] = None is not a list of token ids",
        ),
        (_variant(_set((MASK, 0, 0), 1.0)), r"output_token_sampling_mask\[0\]\[0\] = 1\.0 is not a token id"),
        (
            _variant(_set((MASK, 0, 0), True)),
            r"output_token_sampling_mask\[0\]\[0\] = True is not a token id",
        ),
        (
            _variant(lambda m: (_set((MASK, 0), [0, True, 500])(m), _set((MU, 0), [-1.0, -2.0, -3.0])(m))),
            r"output_token_sampling_mask\[0\]\[1\] = True is not a token id",
        ),
        (_variant(_set((MU, 0), [])), r"sampling_logprobs\[0\] has 0 log-probs for \d+ support ids"),
        (_variant(_set((MU, 1), "x")), r"sampling_logprobs\[1\] = 'x' is not a number"),
        (_variant(_set((MU, 1, 0), "x")), r"sampling_logprobs\[1\]\[0\] = 'x' is not a number"),
        (
            _variant(_set((MU, 1, 0), 2**2000)),
            r"sampling_logprobs\[1\]\[0\] = \d+ is beyond a float's range",
        ),
        (_variant(_set((MU, 2), "x")), r"output_token_sampling_logprobs\[2\] = 'x' is not a number"),
        (_variant(_set((MU, 2), False)), r"output_token_sampling_logprobs\[2\] = False is not a number"),
        (
            _variant(lambda m: m[MU].pop()),
            r"output_token_sampling_logprobs has 2 entries for 3 output tokens",
        ),
        (
            _variant(lambda m: (_set((MASK, 0), [1001])(m), _set((MU, 0), [0.0])(m))),
            r"output token \d+ \(output_ids\[0\]\) is not in meta_info\.output_token_sampling_mask\[0\]",
        ),
        (_variant(_set(("weight_versions",), "x")), r"meta_info\.weight_versions is not a list"),
        (_variant(_set(("weight_versions", 0), 3)), r"meta_info\.weight_versions\[0\] = 3 is not a span"),
        (
            _variant(_set(("weight_versions", 0, "version"), 1.5)),
            r"meta_info\.weight_versions\[0\]\.version must be a non-negative integer, got 1\.5",
        ),
        (
            _variant(lambda m: m["weight_versions"][0].pop("version")),
            r"weight_versions\[0\]\.version is missing",
        ),
        (
            _variant(_set(("weight_versions", 0, "start"), "0")),
            r"weight_versions\[0\]\.start = '0' is not an",
        ),
    ],
)
def test_parse_turn_refuses_a_malformed_answer_naming_the_field(body, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_turn(body, **ARGS)


def test_the_encoder_refuses_what_it_cannot_store_from_a_parsed_answer() -> None:
    not_increasing = _variant(lambda m: m.update({MASK: [[5, 5]] * 3, MU: [[-1.0, -2.0]] * 3}))
    not_increasing["output_ids"] = [5, 5, 5]
    t = parse_turn(not_increasing, **ARGS)
    with pytest.raises(
        ValueError, match="support ids of output token 0 must be non-negative and strictly increasing"
    ):
        encode_stored(t)
    beyond_f32 = parse_turn(_variant(_set((MU, 0), 1e300)), **ARGS)
    with pytest.raises(ValueError, match="log-probs"):
        encode_stored(beyond_f32)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = [
    ("output_ids",),
    ("meta_info",),
    (RAW,),
    (RAW, 0),
    (RAW, 0, 0),
    (MASK,),
    (MASK, 1),
    (MASK, 1, 0),
    (MU,),
    (MU, 1),
    (MU, 1, 0),
    (MU, 2),
    ("weight_versions",),
    ("weight_versions", 0),
    ("weight_versions", 0, "version"),
    ("weight_versions", 0, "end"),
    ("weight_version",),
    ("finish_reason",),
    ("e2e_latency",),
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(FIELDS), json_values), min_size=1, max_size=3), st.booleans())
def test_any_answer_is_parsed_and_stored_or_refused_with_a_value_error(edits, f16: bool) -> None:
    body = _engine_body(random.Random(1), 3)
    for path, value in edits:
        target = body if path[0] in ("output_ids", "meta_info") else body.get("meta_info")
        try:
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
        except (TypeError, KeyError, IndexError):  # an earlier edit replaced the container
            pass
    try:
        t = parse_turn(body, **ARGS)
    except ValueError as exc:
        assert str(exc)
        return
    try:
        blob, stored = encode_stored(t, f16=f16)
    except ValueError as exc:
        assert str(exc)
        return
    assert decode_turn(blob).to_json() == stored.to_json()


def test_the_decoder_needs_only_the_standard_library(tmp_path) -> None:
    """A batch decodes in a process where orjson, numpy, aiohttp and torch cannot be imported."""
    import subprocess
    import sys

    from router.records import encode_batch, encode_turn
    from router.turn_data import TurnData

    turn = TurnData(
        turn=0,
        group="g",
        replica="r",
        append_ids=[1, 2],
        output_ids=[5, 7],
        logprobs=[-0.5, -0.25],
        raw_logprobs=[-0.75, None],
        support_ids=[[5, 9], []],
        support_logprobs=[[-0.5, -1.0], []],
        weight_versions=[{"version": 3, "start": 0, "end": 2}],
        finish_reason=None,
        timings={},
        moved_from=None,
    )
    blob = encode_batch(
        "L", 0, [({"session_id": "s", "group": "g", "reward": 1.0, "metadata": {}}, [encode_turn(turn)])]
    )
    path = tmp_path / "batch.bin"
    path.write_bytes(blob)
    code = (
        "import sys\n"
        "for m in ('orjson', 'numpy', 'aiohttp', 'torch', 'core.jsonio'):\n"
        "    sys.modules[m] = None\n"
        "from router.records import decode_batch\n"
        f"b = decode_batch(open({str(path)!r}, 'rb').read())\n"
        "print(b['trajectories'][0]['turns'][0]['records'][0]['support_ids'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[5, 9]"


def test_support_rows_are_flat_and_read_as_lists() -> None:
    """A parsed turn carries each support as one flat list and array (``Rows``): rows read as
    lists, sorted by id with their log-probs along, equal to the lists they hold."""
    from router.turn_data import Rows

    body = _engine_body(random.Random(3), 4)
    meta = body["meta_info"]
    assert any(m != sorted(m) for m in meta[MASK])  # ranked, as SGLang sends them
    t = parse_turn(body, **ARGS)
    assert type(t.support_ids) is Rows and type(t.support_logprobs) is Rows
    assert t.support_ids == [sorted(m) for m in meta[MASK]]
    for got, mask, lps in zip(t.support_logprobs, meta[MASK], meta[MU], strict=True):
        assert got == [lps[mask.index(i)] for i in sorted(mask)]
    assert replace(t, turn=3).support_ids == t.support_ids
    hand = replace(t, support_ids=[list(r) for r in t.support_ids])  # lists become Rows too
    assert type(hand.support_ids) is Rows and encode_turn(hand) == encode_turn(t)


@pytest.mark.parametrize("top", [1000, 1 << 62])
def test_ranked_supports_sort_as_each_row_sorted_alone(top: int) -> None:
    """Masks in any order (SGLang ranks them) come out with every row sorted by id and its
    log-probs along, as Python's sort of each row alone (the reference), for rows of 0 to 300 ids;
    with ids too large to pack beside their row and position (``top``) by the other sort. The
    rows' lists, made when read, equal their arrays; a row holding an id twice is refused by the
    encoder."""
    rng = random.Random(13)
    body = _engine_body(rng, 60)
    meta = body["meta_info"]
    for i, t in enumerate(body["output_ids"]):
        mask = list({t, *(rng.randrange(top) for _ in range(rng.choice([0, 1, 2, 9, 300])))})
        rng.shuffle(mask)
        meta[MASK][i] = mask
        meta[MU][i] = [-rng.random() * 5 for _ in mask]
    turn = parse_turn(body, **ARGS)
    want = [sorted(zip(m, s, strict=True)) for m, s in zip(meta[MASK], meta[MU], strict=True)]
    assert turn.support_ids == [[i for i, _ in row] for row in want]
    assert turn.support_logprobs == [[x for _, x in row] for row in want]
    assert turn.support_ids.values == turn.support_ids.array.tolist()
    assert decode_turn(encode_turn(turn)).support_ids == turn.support_ids
    meta[MASK][5] = [*meta[MASK][5], meta[MASK][5][0]]
    meta[MU][5] = [*meta[MU][5], -1.0]
    with pytest.raises(ValueError, match="strictly increasing|duplicate"):
        encode_turn(parse_turn(body, **ARGS))


def _reference_mu(body: dict) -> list[float]:
    """mu per token as :func:`parse_turn` states it, token by token: the engine's number (null:
    unknown); for a token without one (no mu key, or a list in its place) the sampled token's
    log-prob at its first place in its support when the support's log-probs are known (SGLang's
    support mode: every entry a row), its raw log-prob (None: NaN) when not or when the support is
    empty; ValueError when the token is not in its non-empty support."""
    meta, out = body["meta_info"], body["output_ids"]
    mu = meta.get(MU)
    supports = mu if mu and all(type(x) is list for x in mu) else None  # SGLang's support mode
    want = []
    for i, tok in enumerate(out):
        x = None if mu is None else mu[i]
        raw = meta[RAW][i][0]
        if type(x) in (int, float):
            want.append(float(x))
        elif x is None and mu is not None:
            want.append(math.nan)
        elif supports is None or not meta[MASK][i]:
            want.append(math.nan if raw is None else float(raw))
        elif tok not in meta[MASK][i]:
            raise ValueError(f"output token {tok} (output_ids[{i}]) is not in meta_info.{MASK}[{i}]")
        else:
            want.append(float(supports[i][meta[MASK][i].index(tok)]))
    return want


def test_behavior_log_probs_match_the_per_token_reference() -> None:
    """mu read from answers mixing every form the engines send (numbers, ints, nulls, SGLang's
    support rows, no mu at all; supports with and without log-probs, empty, holding the sampled
    token twice or not at all) equals the per-token reference, NaN for NaN, or both refuse."""
    rng = random.Random(29)
    refused = 0
    for case in range(400):
        body = _engine_body(rng, rng.choice([1, 3, 8]), with_none=case % 3 == 0)
        meta, out = body["meta_info"], body["output_ids"]
        rows = meta[MU]
        for i, tok in enumerate(out):
            shape = rng.choice(["float", "int", "null", "row", "empty", "twice", "absent"])
            if shape == "empty":
                meta[MASK][i], rows[i] = [], []
            elif shape == "twice":  # the first place in the engine's order is the one sampled
                meta[MASK][i] = [*meta[MASK][i], tok]
                rows[i] = [*rows[i], -9.0]
            elif shape == "absent":
                meta[MASK][i] = [t for t in meta[MASK][i] if t != tok] or [tok + 1]
                rows[i] = rows[i][: len(meta[MASK][i])]
        numbers = {"float": -rng.random(), "int": -rng.randrange(3), "null": None}
        shapes = [rng.choice(["float", "int", "null", "row"]) for _ in out]
        mixed = [numbers[sh] if sh in numbers else list(rows[i]) for i, sh in enumerate(shapes)]
        if rng.random() < 0.3:
            meta.pop(MU)
        elif rng.random() < 0.4:  # mu per token, some entries a row
            meta[MU] = mixed
        # else SGLang's support mode: every entry its row
        try:
            want = _reference_mu(body)
        except ValueError as exc:
            refused += 1
            with pytest.raises(ValueError, match=re.escape(str(exc))):
                parse_turn(body, **ARGS)
            continue
        got = list(parse_turn(body, **ARGS).logprobs)
        assert [repr(x) for x in got] == [repr(x) for x in want], case
    assert 40 < refused < 360


def test_float32_support_log_probs_are_answered_with_the_values_sent() -> None:
    """Support log-probs that are float32 values (as engines send them) are stored unchanged, and
    the stored turn's answer holds the very floats of the engine's answer (no new objects)."""
    body = _engine_body(random.Random(5), 6)
    meta = body["meta_info"]
    # masks whose ranking is their id order: the rows are stored as the lists the answer holds
    meta[MASK] = [sorted(m) for m in meta[MASK]]
    meta[MU] = [sorted(_f32(row), reverse=True) for row in meta[MU]]
    stored = encode_stored(parse_turn(body, **ARGS))[1]
    for rec, row in zip(stored.to_json()["records"], meta[MU], strict=True):
        assert all(a is b for a, b in zip(rec["support_logprobs"], row, strict=True))


@pytest.mark.parametrize("f16", [False, True])
def test_a_support_log_prob_beyond_the_format_is_refused_beside_unknown_ones(f16: bool) -> None:
    body = _engine_body(random.Random(7), 3)
    row = body["meta_info"][MU][0]
    row[0] = None  # unknown (NaN): no magnitude, never hides the one beyond range
    row.append(1e5 if f16 else 1e39)
    body["meta_info"][MASK][0].append(5000)
    t = parse_turn(body, **ARGS)
    with pytest.raises(ValueError, match="support log-probs: float too large"):
        encode_stored(t, f16=f16)
    row[-1] = -math.inf  # an infinity is stored as one
    assert math.isinf(
        decode_turn(encode_stored(parse_turn(body, **ARGS), f16=f16)[0]).support_logprobs[0][-1]
    )


@settings(max_examples=80, deadline=None)
@given(st.one_of(turns(), long_turns()), st.booleans(), st.booleans())
def test_turn_outputs_are_what_the_whole_decode_says(t: TurnData, f16: bool, numpy: bool) -> None:
    """:func:`decode_turn_outputs` (the mismatch's reader: it skips the token ids with one numpy
    scan, or id by id without numpy, and reads no support) gives the whole decode's group, engine
    input length, behavior log-probs, versions and whether routes were recorded."""
    routes = RoutedExperts(0, 1, 2, struct.pack("<2i", 3, 7))
    for turn in (t, replace(t, sections={ROUTES_SECTION: routes.to_section()})):
        blob = encode_turn(turn, f16=f16)
        whole = decode_turn(blob)
        saved = records.np
        records.np = saved if numpy else None
        try:
            got = decode_turn_outputs(blob)
        finally:
            records.np = saved
        assert (got.group, got.prompt_len, got.versions) == (whole.group, whole.prompt_len, whole.versions())
        assert list(got.logprobs) == list(whole.logprobs)
        assert got.routes is (turn.routed_experts is not None)


def test_turn_outputs_of_a_truncated_block_are_refused() -> None:
    t = TurnData(
        turn=0,
        group="g",
        replica="r",
        append_ids=[200_000 + i for i in range(500)],  # 3 varint bytes each: the numpy scan
        output_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        raw_logprobs=[None, None],
        support_ids=[[], []],
        support_logprobs=[[], []],
    )
    blob = encode_turn(t)
    assert list(decode_turn_outputs(blob).logprobs) == [-0.5, -0.25]
    for cut in (5, len(blob) // 2, len(blob) - 15):  # in the header, the appended ids, the log-probs
        with pytest.raises(RecordFormatError, match="truncated"):
            decode_turn_outputs(blob[:cut])

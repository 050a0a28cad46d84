"""The hot path's shortcuts agree with the general code they skip.

* ``turn_spec_fast`` / ``generate_rows_fast`` against the pydantic models (the reference): a
  body the shortcut accepts is one the model accepts with the same values, and a body the model
  refuses is never accepted by the shortcut.
* ``turn_from_response``'s plain-JSON path against its general (value by value) path.
* ``encode_stored`` against ``encode_turn`` + ``as_stored``; the numpy varint / gap coders
  against the pure-Python ones.
* The lock-free metrics against prometheus_client's Counter / Histogram exposition.
"""

from __future__ import annotations

import copy
import json
import math
import random

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router import records
from router.dispatch import turn_from_response
from router.jsonio import dumps
from router.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram
from router.records import TurnData, as_stored, decode_turn, encode_stored, encode_turn
from router.schemas import GenerateRequest, TurnRequest, generate_rows_fast, turn_spec_fast

# ---------------------------------------------------------------- request shortcuts vs models

odd = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-5, max_value=5),
    st.just(1.0),
    st.just([]),
    st.just({}),
)
token = st.one_of(st.integers(-3, 2**31 + 3), odd)
ids = st.one_of(st.lists(st.integers(0, 2**31 - 1), max_size=6), st.lists(token, max_size=4), odd)
num = st.one_of(
    st.integers(-3, 200), st.floats(allow_nan=False, allow_infinity=False, min_value=-2, max_value=200), odd
)
sampling = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "temperature": num,
            "top_p": num,
            "top_k": num,
            "max_new_tokens": num,
            "stop_token_ids": ids,
            "seed": st.one_of(st.integers(-2, 2**64), odd),
            "temprature": num,
        },
    ),
    odd,
)
turn_bodies = st.one_of(
    st.fixed_dictionaries(
        {"input_ids": ids},
        optional={
            "sampling_params": sampling,
            "min_version": st.one_of(st.integers(-2, 9), odd),
            "max_version_age": st.one_of(st.integers(-2, 9), odd),
            "turn": st.one_of(st.integers(-2, 9), odd),
            "extra": odd,
        },
    ),
    odd,
)


@settings(max_examples=600, deadline=None)
@given(turn_bodies)
def test_turn_shortcut_accepts_only_what_the_model_accepts_with_the_same_values(body) -> None:
    fast = turn_spec_fast(body)
    try:
        model = TurnRequest.model_validate(body)
    except pydantic.ValidationError:
        assert fast is None
        return
    if fast is not None:
        assert fast == model.spec()
        for name, value in fast.params.items():  # same JSON types as the model's (1.0, not 1)
            assert type(value) is type(model.spec().params[name]), name


def test_turn_shortcut_takes_the_canonical_form() -> None:
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 4, "seed": 1},
        "max_version_age": 2,
    }
    assert turn_spec_fast(body) == TurnRequest.model_validate(body).spec()
    assert turn_spec_fast({"input_ids": [1]}) == TurnRequest.model_validate({"input_ids": [1]}).spec()


gen_bodies = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "input_ids": st.one_of(ids, st.lists(ids, max_size=3)),
            "text": st.one_of(st.none(), st.text(max_size=3)),
            "sampling_params": st.one_of(sampling, st.lists(sampling, max_size=2)),
            "stream": st.one_of(st.booleans(), odd),
            "return_logprob": odd,
            "rid": odd,
        },
    ),
    odd,
)


@settings(max_examples=600, deadline=None)
@given(gen_bodies)
def test_generate_shortcut_accepts_only_what_the_model_accepts(body) -> None:
    fast = generate_rows_fast(body)
    try:
        model = GenerateRequest.model_validate(body)
    except pydantic.ValidationError:
        assert fast is None
        return
    if fast is not None:
        assert not model.stream and model.text is None
        assert fast == model.rows()


# ---------------------------------------------------------------- engine response parsing


def _engine_body(rng: random.Random, n: int, *, with_none: bool = False) -> dict:
    out = [rng.randrange(1000) for _ in range(n)]
    masks = [sorted({t, *rng.sample(range(1000), rng.randrange(0, 6))}) for t in out]
    supp = [[-rng.random() * 5 for _ in m] for m in masks]
    raw = [[-rng.random() * 6, t, None] for t in out]
    if with_none and n:
        raw[0][0] = None
    return {
        "output_ids": out,
        "meta_info": {
            "output_token_logprobs": raw,
            "output_token_sampling_mask": masks,
            "output_token_sampling_logprobs": [
                s[m.index(t)] for s, m, t in zip(supp, masks, out, strict=True)
            ],
            "output_token_sampling_support_logprobs": supp,
            "weight_versions": [{"version": 3, "start": 0, "end": n}],
            "finish_reason": {"type": "length", "length": n},
        },
    }


def _parse(body: dict) -> TurnData:
    return turn_from_response(
        body, index=2, group="g", replica="r", input_ids=[1, 2], moved_from=None, timings={"engine_ms": 1.0}
    )


@pytest.mark.parametrize("n", [0, 1, 7])
@pytest.mark.parametrize("with_none", [False, True])
def test_plain_record_parsing_equals_the_general_path(n: int, with_none: bool) -> None:
    body = _engine_body(random.Random(n), n, with_none=with_none)
    general = copy.deepcopy(body)
    # tuples are not the plain JSON form: this body takes the value-by-value path
    meta = general["meta_info"]
    meta["output_token_sampling_mask"] = tuple(meta["output_token_sampling_mask"])
    fast, slow = _parse(body), _parse(general)
    assert fast.to_json() == slow.to_json()
    assert encode_turn(fast) == encode_turn(slow)


def test_odd_engine_values_still_take_the_general_path() -> None:
    body = _engine_body(random.Random(5), 3)
    meta = body["meta_info"]
    meta["output_token_sampling_support_logprobs"][1][0] = None  # unknown support log-prob
    meta["output_token_sampling_logprobs"][2] = 1  # an int where a float is expected
    t = _parse(body)
    assert math.isnan(t.support_logprobs[1][0]) and t.logprobs[2] == 1.0
    bad = _engine_body(random.Random(6), 2)
    masks = bad["meta_info"]["output_token_sampling_mask"]
    masks[0] = [*masks[0][1:], masks[0][0]] if len(masks[0]) > 1 else [masks[0][0], masks[0][0]]
    bad["meta_info"]["output_token_sampling_support_logprobs"][0] = [-1.0] * len(masks[0])
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_turn(_parse(bad))


# ---------------------------------------------------------------- encoder paths

token_id = st.integers(0, 300_000)


@st.composite
def turns(draw) -> TurnData:
    n = draw(st.integers(0, 40))
    out = draw(st.lists(token_id, min_size=n, max_size=n))
    supports = [sorted(draw(st.sets(token_id, max_size=30))) for _ in range(n)]
    f = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-50, max_value=0)
    return TurnData(
        turn=draw(st.integers(0, 9)),
        group="g",
        replica="r",
        input_ids=draw(st.lists(token_id, min_size=1, max_size=600)),
        output_ids=out,
        logprobs=[draw(f) for _ in range(n)],
        raw_logprobs=[draw(st.one_of(st.none(), f)) for _ in range(n)],
        support_ids=supports,
        support_logprobs=[[draw(f) for _ in s] for s in supports],
        weight_versions=[{"version": 1, "start": 0, "end": n}] if n else [],
        timings={"engine_ms": 0.5},
    )


@settings(max_examples=80, deadline=None)
@given(turns(), st.booleans())
def test_encode_stored_is_encode_plus_as_stored(t: TurnData, f16: bool) -> None:
    blob, stored = encode_stored(t, f16=f16)
    assert blob == encode_turn(t, f16=f16)
    assert stored.to_json() == as_stored(t, f16=f16).to_json() == decode_turn(blob).to_json()


@settings(max_examples=60, deadline=None)
@given(turns())
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


# ---------------------------------------------------------------- metrics


def _samples(registry: CollectorRegistry, name: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name.startswith(name) and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_loop_metrics_expose_what_prometheus_client_would() -> None:
    rng = random.Random(3)
    observations = [rng.choice(LATENCY_BUCKETS) for _ in range(50)] + [rng.random() * 3 for _ in range(200)]
    ours, ref = CollectorRegistry(), CollectorRegistry()
    h = LoopHistogram("lat_seconds", "latency", ["route"], LATENCY_BUCKETS, ours)
    c = LoopCounter("things", "things", ["group"], ours)
    h_ref = Histogram("lat_seconds", "latency", ["route"], buckets=LATENCY_BUCKETS, registry=ref)
    c_ref = Counter("things", "things", ["group"], registry=ref)
    for i, x in enumerate(observations):
        route = f"/r{i % 3}"
        h.labels(route).observe(x)
        h_ref.labels(route).observe(x)
        c.labels(route).inc(i % 4)
        c_ref.labels(route).inc(i % 4)
    got, want = _samples(ours, "lat_seconds"), _samples(ref, "lat_seconds")
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-12), k
    assert _samples(ours, "things") == _samples(ref, "things")
    with pytest.raises(ValueError):
        c.labels("/r0").inc(-1)


# ---------------------------------------------------------------- one-pass parse + encode


def _turn_args() -> dict:
    return {
        "index": 2,
        "group": "g",
        "replica": "r",
        "input_ids": [1, 2, 300],
        "moved_from": None,
        "timings": {"engine_ms": 1.0},
    }


def _stored(body: dict, f16: bool):
    from router.dispatch import plain_stored

    return plain_stored(body, **_turn_args(), f16=f16)


def _general(body: dict) -> TurnData:
    return turn_from_response(body, **_turn_args())


@pytest.mark.parametrize("n", [0, 1, 7, 40])
@pytest.mark.parametrize("with_none", [False, True])
@pytest.mark.parametrize("f16", [False, True])
def test_plain_stored_is_the_general_parse_then_encode_stored(n: int, with_none: bool, f16: bool) -> None:
    body = _engine_body(random.Random(n), n, with_none=with_none)
    if n > 1:  # ints where floats are expected pack as float(); large ids take multi-byte varints
        body["meta_info"]["output_token_sampling_logprobs"][1] = -1
        body["meta_info"]["output_token_sampling_mask"][0].append(200_000)
        body["meta_info"]["output_token_sampling_support_logprobs"][0].append(-9.5)
    general = _general(copy.deepcopy(body))
    want_blob, want = encode_stored(general, f16=f16)
    got = _stored(body, f16)
    assert got is not None
    stored, encoded = got
    head = records.encode_head(stored, f16)
    assert bytes(head) + encoded == want_blob == encode_turn(general, f16=f16)
    assert stored.to_json("s") == want.to_json("s") == decode_turn(want_blob).to_json("s")
    assert stored.timings == {"engine_ms": 1.0} and stored.turn == 2
    # the API answer: the general path's bytes, and the decoded stored turn's JSON
    from router.turns import turn_json

    answer = turn_json(stored, "s")
    assert answer == turn_json(want, "s") == turn_json(as_stored(general, f16=f16), "s")
    assert json.loads(answer) == json.loads(dumps(decode_turn(want_blob).to_json("s", with_input=False)))


def test_plain_stored_leaves_odd_engine_answers_to_the_general_path() -> None:
    def variant(edit) -> dict:
        body = _engine_body(random.Random(9), 3)
        edit(body["meta_info"])
        return body

    odd_bodies = [
        variant(lambda m: m["output_token_sampling_support_logprobs"][1].__setitem__(0, None)),
        variant(lambda m: m["output_token_sampling_logprobs"].__setitem__(2, None)),
        variant(lambda m: m["output_token_sampling_logprobs"].__setitem__(2, [0.5])),
        variant(lambda m: m["output_token_sampling_mask"][0].__setitem__(0, 1.0)),
        variant(lambda m: m["output_token_sampling_mask"][0].__setitem__(0, True)),
        variant(
            lambda m: m.update(
                output_token_sampling_mask=[[5, 5]] * 3,
                output_token_sampling_support_logprobs=[[-1.0, -2.0]] * 3,
            )
        ),  # not increasing
        variant(lambda m: m["output_token_sampling_support_logprobs"].__setitem__(0, [])),  # lengths differ
        variant(lambda m: m["output_token_logprobs"].__setitem__(0, ["-1.5", 3, None])),
        variant(lambda m: m["output_token_sampling_logprobs"].__setitem__(0, 1e300)),  # beyond float32
        variant(lambda m: m.pop("output_token_sampling_support_logprobs")),
        variant(
            lambda m: (
                m["output_token_sampling_mask"].__setitem__(0, [0, True, 500]),
                m["output_token_sampling_support_logprobs"].__setitem__(0, [-1.0, -2.0, -3.0]),
            )
        ),
        {"output_ids": [1], "meta_info": "x"},
        {"output_ids": (1,), "meta_info": {}},
        [],
    ]
    for i, body in enumerate(odd_bodies):
        assert _stored(body, False) is None, i
    # the general path still reads what it can (None: unknown), and refuses the rest
    t = _general(odd_bodies[0])
    assert math.isnan(t.support_logprobs[1][0])
    assert _general(odd_bodies[4]).support_ids[0][0] == 1
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_stored(_general(odd_bodies[5]))
    with pytest.raises(ValueError, match="log-probs"):
        encode_stored(_general(odd_bodies[8]))

"""Routed experts through the router (issue 21): a group with ``record_routes`` asks its engines for
``return_routed_experts``, stores them as the optional section of the turn block and serves them
in batches; both decoders (the standard-library one and ``trainer.batch``) read them back exactly.
A recording group whose engine was started without ``--enable-return-routed-experts`` is a 502
naming the flag, never a turn silently without routes."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import numpy as np
import pytest

from router.records import (
    MEDIA_TYPE,
    RecordFormatError,
    RoutedExperts,
    TurnData,
    decode_batch,
    decode_turn,
    encode_batch,
    encode_stored,
    encode_turn,
)
from tests.engine.test_routes import _hf_routes
from tests.support.engines import engine_process
from tests.support.router import router_process, write_preset
from trainer.batch import decode_batch as trainer_decode_batch
from trainer.upload import MEDIA_TYPE as LOGPROBS
from trainer.upload import encode_trainer_logprobs

PROMPT = [5, 17, 42, 99, 3, 250, 7]
PARAMS = {"temperature": 1.0, "max_new_tokens": 6, "seed": 11}


def _turn_data(routes: RoutedExperts | None, n_in: int = 3, n_out: int = 2) -> TurnData:
    return TurnData(
        turn=0,
        group="g",
        replica="r",
        input_ids=list(range(1, n_in + 1)),
        output_ids=list(range(10, 10 + n_out)),
        logprobs=[-0.5] * n_out,
        raw_logprobs=[-0.25] * n_out,
        support_ids=[[1, 4]] * n_out,
        support_logprobs=[[-1.0, -0.5]] * n_out,
        routed_experts=routes,
    )


def _routes(values: list[int], rows: int, start: int = 0) -> RoutedExperts:
    return RoutedExperts(start, rows, len(values) // rows, struct.pack(f"<{len(values)}i", *values))


@pytest.mark.parametrize("high", [7, 300, 70000, -1], ids=["u8", "u16", "i32", "negative"])
def test_the_section_round_trips_in_both_decoders(high: int) -> None:
    values = [0, 1, 2, 3, high, 5, 6, 2, 1, 0, 3, high]  # 4 rows (3 inputs + 2 outputs - 1) of 3
    turn = _turn_data(_routes(values, 4))
    blob, stored = encode_stored(turn)
    assert decode_turn(blob).to_json() == stored.to_json() == turn.to_json()
    assert decode_turn(blob).routed_experts.values() == values
    width = 1 if 0 <= high < 256 else 2 if 0 <= high < 65536 else 4
    assert len(blob) - len(encode_turn(_turn_data(None))) <= 12 * width + 4 + 80  # + header entry
    plain = encode_turn(_turn_data(None))
    batch = encode_batch("L", 0, [({"session_id": "s1"}, [blob, plain]), ({"session_id": "s2"}, [blob])])
    std = decode_batch(batch)
    assert [t["turns"][0].get("routed_experts") for t in std["trajectories"]] == [
        {"start": 0, "rows": 4, "width": 3, "data": base64.b64encode(turn.routed_experts.data).decode()}
    ] * 2
    assert "routed_experts" not in std["trajectories"][0]["turns"][1]
    fast = trainer_decode_batch(batch)
    want = np.array(values, dtype=np.int32).reshape(4, 1, 3)
    np.testing.assert_array_equal(fast.routes(0, 3), want)
    assert fast.routes(1, 3) is None
    np.testing.assert_array_equal(fast.routes(2, 3), want)
    assert fast.token_ids.tolist() == [10, 11] * 3  # the records around the section are intact
    with pytest.raises(ValueError, match="not layers x 2"):
        fast.routes(0, 2)


def test_route_flags_are_counted_per_group_version_and_position() -> None:
    from router.mismatch import TurnTokens, batch_mismatch
    from router.trainer_logprobs import LogprobsFormatError, decode_upload

    turns = [TurnTokens("a", 3, [-1.0] * 4, [0] * 4), TurnTokens("b", 3, [-1.0] * 2, [0] * 2)]
    lps = np.full(6, -1.0, dtype=np.float32)
    flags = np.array([1, 0, 2, 1, 0, 0], dtype=np.uint8)
    got_lps, got_flags = decode_upload(encode_trainer_logprobs(lps, flags))
    assert got_lps.tolist() == lps.tolist() and got_flags.tolist() == flags.tolist()
    assert decode_upload(encode_trainer_logprobs(lps))[1] is None
    with pytest.raises(LogprobsFormatError, match="not 0, 1 or 2"):
        decode_upload(encode_trainer_logprobs(lps) + struct.pack("<I", 6) + bytes([3] * 6))
    sums = batch_mismatch(turns, lps, (0.2, 5.0), flags).sums
    a = sums[("a", 0, "0-63")]
    assert (a.tokens, a.route_tokens, a.route_differ) == (4, 3, 2)
    assert a.view()["route_mismatch_share"] == pytest.approx(2 / 3)
    b = sums[("b", 0, "0-63")]
    assert (b.route_tokens, b.route_differ) == (2, 0)
    plain = batch_mismatch(turns, lps, (0.2, 5.0)).sums[("a", 0, "0-63")]
    assert (plain.route_tokens, plain.route_differ) == (0, 0)


def test_routes_asked_from_a_start_are_recorded_from_it() -> None:
    from router.records import parse_turn

    values = list(range(2 * 4))  # positions [3, 5) of 3 inputs + 3 outputs, 4 ids each
    body = {
        "output_ids": [10, 11, 12],
        "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in (10, 11, 12)],
            "routed_experts": base64.b64encode(struct.pack("<8i", *values)).decode(),
        },
    }
    kw = dict(index=0, group="g", replica="r", input_ids=[1, 2, 3], moved_from=None, timings={})
    turn = parse_turn(
        body, sampling={"sampling_mask": False}, routed_experts=True, routed_experts_start=3, **kw
    )
    assert (turn.routed_experts.start, turn.routed_experts.rows, turn.routed_experts.width) == (3, 2, 4)
    with pytest.raises(ValueError, match="not int32 rows for 5 positions"):
        parse_turn(body, sampling={"sampling_mask": False}, routed_experts=True, **kw)


def test_a_truncated_section_is_refused() -> None:
    blob = encode_turn(_turn_data(_routes(list(range(8)), 4)))
    with pytest.raises(RecordFormatError):
        decode_turn(blob[:-5] + blob[-4:])


@pytest.fixture(scope="module")
def tiny_config(tiny_dir) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def routed_engine(tiny_dir):
    with engine_process(tiny_dir, enable_return_routed_experts=True) as url:
        yield url


@pytest.fixture(scope="module")
def client(routed_engine, engine_url, tmp_path_factory):
    d = tmp_path_factory.mktemp("routes")
    preset = write_preset(
        d / "preset.toml",
        [
            {"name": "cpu-r", "replicas": [routed_engine], "record_routes": True},
            {"name": "cpu-p", "replicas": [engine_url]},
            {"name": "cpu-bad", "replicas": [engine_url], "record_routes": True},
        ],
    )
    with (
        router_process(preset) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=120) as c,
    ):
        yield c


def _session_turn(client: httpx.Client, group: str) -> tuple[str, httpx.Response]:
    sid = client.post("/v1/sessions", json={"group": group}).json()["session_id"]
    return sid, client.post(
        f"/v1/sessions/{sid}/turns", json={"input_ids": PROMPT, "sampling_params": PARAMS}
    )


def test_a_recording_group_stores_the_engines_routes_and_serves_them_in_batches(
    client, tiny_dir, tiny_config
):
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    sid, r = _session_turn(client, "cpu-r")
    assert r.status_code == 200, r.text
    turn = r.json()
    seq = PROMPT + turn["output_ids"]
    routes = turn["routed_experts"]
    assert (routes["start"], routes["rows"], routes["width"]) == (0, len(seq) - 1, layers * k)
    got = np.frombuffer(base64.b64decode(routes["data"]), dtype="<i4").reshape(-1, layers, k)
    np.testing.assert_array_equal(got, _hf_routes(tiny_dir, seq[:-1]))
    _, plain = _session_turn(client, "cpu-p")
    assert plain.status_code == 200 and "routed_experts" not in plain.json()

    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    taken = client.post("/v1/batches/take", json={"size": 64}, headers={"Accept": MEDIA_TYPE})
    assert taken.status_code == 200
    batch = trainer_decode_batch(taken.content)
    mine = next(i for i, t in enumerate(batch.turns) if t["session_id"] == sid)
    np.testing.assert_array_equal(batch.routes(mine, k), got)
    std = decode_batch(taken.content)
    std_turn = next(t for t in std["trajectories"] if t["session_id"] == sid)["turns"][0]
    assert std_turn["routed_experts"] == routes
    # the trainer's route flags (0 agree, 1 differ, 2 none recorded) travel with its log-probs
    flags = np.full(len(batch), 2, dtype=np.uint8)
    mask = batch.turn_index == mine
    flags[mask] = [1, 0] * (int(mask.sum()) // 2) + [0] * (int(mask.sum()) % 2)
    body = encode_trainer_logprobs(batch.logprobs, flags)
    up = client.post(
        f"/v1/batches/{batch.lease_id}/trainer_logprobs", content=body, headers={"Content-Type": LOGPROBS}
    )
    assert up.status_code == 200, up.text
    group = next(g for g in up.json()["groups"] if g["group"] == "cpu-r")
    assert group["route_tokens"] == int(mask.sum())
    assert group["route_mismatch_share"] == pytest.approx((int(mask.sum()) // 2) / int(mask.sum()))
    metrics = client.get("/metrics").text
    assert f'mixfleet_mismatch_route_tokens_total{{group="cpu-r"}} {float(mask.sum())}' in metrics
    assert 'mixfleet_mismatch_route_share{group="cpu-r",version="0"}' in metrics
    assert client.post(f"/v1/batches/{batch.lease_id}/ack").status_code == 200


def test_a_recording_group_whose_engine_lacks_the_flag_is_a_502_naming_it(client):
    _, r = _session_turn(client, "cpu-bad")
    assert r.status_code == 502, r.text
    assert "--enable-return-routed-experts" in r.text

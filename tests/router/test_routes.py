"""Routed experts (issue 21) as the turn block's ``routed_experts`` section: the section round-trips
through the standard-library decoder and ``trainer.batch`` in every id width, the engine answer's
routes become the section, and an answer without them (an engine without
``--enable-return-routed-experts``) is refused naming the flag. Through the router: a group with
``record_routes`` asks its engines for ``return_routed_experts`` from the first position a turn
adds to its segment, so a segment's turns store its routes once (a 502 naming the flag for an
engine started without it, never a turn silently without routes). A session opened with
``record_routes`` gets them on a group without it whose engines have the flag; it is a 422 at
creation on a group whose engines lack it, and the policy places it only where routes are
returned."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import numpy as np
import pytest
import redis

from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG as ROUTES_FLAG
from core.wire import LOGPROBS_MEDIA_TYPE as LOGPROBS
from core.wire import RECORDS_MEDIA_TYPE as MEDIA_TYPE
from router.engine_answer import parse_turn
from router.records import (
    RecordFormatError,
    decode_batch,
    decode_turn,
    encode_batch,
    encode_stored,
    encode_turn,
)
from router.turn_data import ROUTES_SECTION, RoutedExperts, TurnData
from tests.engine.test_routes import _hf_routes
from tests.support.engines import engine_process
from tests.support.procs import free_port
from tests.support.router import router_process, write_preset
from trainer.batch import decode_batch as trainer_decode_batch
from trainer.client import RolloutClient, RouterError
from trainer.upload import encode_trainer_logprobs

PROMPT = [5, 17, 42, 99, 3, 250, 7]
PARAMS = {"temperature": 1.0, "max_new_tokens": 6, "seed": 11}


def _routes(values: list[int], rows: int, start: int = 0) -> RoutedExperts:
    return RoutedExperts(start, rows, len(values) // rows, struct.pack(f"<{len(values)}i", *values))


def _turn(routes: RoutedExperts | None, n_in: int = 3, n_out: int = 2) -> TurnData:
    return TurnData(
        turn=0,
        group="g",
        replica="r",
        append_ids=list(range(1, n_in + 1)),
        output_ids=list(range(10, 10 + n_out)),
        logprobs=[-0.5] * n_out,
        raw_logprobs=[-0.25] * n_out,
        support_ids=[[1, 4]] * n_out,
        support_logprobs=[[-1.0, -0.5]] * n_out,
        sections={} if routes is None else {ROUTES_SECTION: routes.to_section()},
    )


@pytest.mark.parametrize("high", [7, 300, 70000, -1], ids=["u8", "u16", "i32", "negative"])
def test_the_section_round_trips_in_both_decoders(high: int) -> None:
    values = [0, 1, 2, 3, high, 5, 6, 2, 1, 0, 3, high]  # 4 rows (3 inputs + 2 outputs - 1) of 3
    routes = _routes(values, 4)
    turn = _turn(routes)
    blob, stored = encode_stored(turn)
    assert decode_turn(blob).routed_experts == stored.routed_experts == routes
    assert decode_turn(blob).routed_experts.values() == values
    plain = encode_turn(_turn(None))
    batch = encode_batch("L", 0, [({"session_id": "s1"}, [blob]), ({"session_id": "s2"}, [plain])])
    std = decode_batch(batch)
    assert std["trajectories"][0]["turns"][0]["routed_experts"] == {
        "start": 0, "rows": 4, "width": 3, "data": base64.b64encode(routes.data).decode()
    }  # fmt: skip
    assert "routed_experts" not in std["trajectories"][1]["turns"][0]
    fast = trainer_decode_batch(batch)
    np.testing.assert_array_equal(fast.routes(0, 3), np.array(values, dtype=np.int32).reshape(4, 1, 3))
    assert fast.routes(1, 3) is None
    assert fast.token_ids.tolist() == [10, 11] * 2


def test_an_answers_routes_become_the_section_and_their_absence_is_refused() -> None:
    values = list(range(4 * 6))
    body = {
        "output_ids": [10, 11],
        "meta_info": {
            "output_token_logprobs": [[-0.5, 10, None], [-0.5, 11, None]],
            "routed_experts": base64.b64encode(struct.pack("<24i", *values)).decode(),
        },
    }
    kw = dict(index=0, group="g", replica="r", input_ids=[1, 2, 3], moved_from=None, timings={})
    turn = parse_turn(body, sampling={"sampling_mask": False}, routed_experts=True, **kw)
    assert (turn.routed_experts.rows, turn.routed_experts.width) == (4, 6)
    assert turn.routed_experts.values() == values
    del body["meta_info"]["routed_experts"]
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        parse_turn(body, sampling={"sampling_mask": False}, routed_experts=True, **kw)


def test_a_segments_turns_assemble_its_routes() -> None:
    from router.turn_data import TurnData as T

    first = _turn(_routes(list(range(4 * 2)), 4))  # 3 appended + 2 outputs: positions 0..3
    later = RoutedExperts(4, 3, 2, struct.pack("<6i", *range(100, 106)))  # positions 4..6
    fields = {**_turn(None, n_in=1, n_out=2).__dict__, "turn": 1, "context": 5}
    second = T(**{**fields, "sections": {ROUTES_SECTION: later.to_section()}})
    data = encode_batch("L", 0, [({"session_id": "s"}, [encode_turn(first), encode_turn(second)])])
    batch = trainer_decode_batch(data)
    seq = batch.sequence_routes(1, 2)  # 5 + 1 appended + 2 outputs = 8 positions
    assert seq.shape == (8, 1, 2)
    want = [[0, 1], [2, 3], [4, 5], [6, 7], [100, 101], [102, 103], [104, 105], [-1, -1]]
    assert seq[:, 0].tolist() == want


def test_route_flags_are_counted_per_group_version_and_position() -> None:
    """Flags count for the tokens of turns that recorded routes; a turn without recorded routes is
    in neither route figure, whatever its flags say (router/mismatch.py's contract)."""
    from router.mismatch import TurnTokens, batch_mismatch
    from router.trainer_logprobs import LogprobsFormatError, decode_upload

    turns = [
        TurnTokens("a", 3, [-1.0] * 4, [0] * 4, routes=True),
        TurnTokens("b", 3, [-1.0] * 2, [0] * 2, routes=True),
        TurnTokens("c", 3, [-1.0] * 2, [0] * 2),  # no routes recorded
    ]
    lps = np.full(8, -1.0, dtype=np.float32)
    flags = np.array([1, 0, 2, 1, 0, 0, 1, 0], dtype=np.uint8)
    got_lps, got_flags = decode_upload(encode_trainer_logprobs(lps, flags))
    assert got_lps.tolist() == lps.tolist() and got_flags.tolist() == flags.tolist()
    assert decode_upload(encode_trainer_logprobs(lps))[1] is None
    with pytest.raises(LogprobsFormatError, match="not 0, 1 or 2"):
        decode_upload(encode_trainer_logprobs(lps) + struct.pack("<I", 8) + bytes([3] * 8))
    sums = batch_mismatch(turns, lps, (0.2, 5.0), flags).sums
    a = sums[("a", 0, "0-63")]
    assert (a.tokens, a.route_tokens, a.route_differ) == (4, 3, 2)
    assert a.view()["route_mismatch_share"] == pytest.approx(2 / 3)
    b = sums[("b", 0, "0-63")]
    assert (b.route_tokens, b.route_differ) == (2, 0)
    c = sums[("c", 0, "0-63")]
    assert (c.tokens, c.route_tokens, c.route_differ) == (2, 0, 0)
    plain = batch_mismatch(turns, lps, (0.2, 5.0)).sums[("a", 0, "0-63")]
    assert (plain.route_tokens, plain.route_differ) == (0, 0)


def test_routes_asked_from_a_start_are_recorded_from_it() -> None:
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


def test_the_trainer_places_routes_from_their_start_in_the_turns_sequence() -> None:
    values = list(range(3 * 4))  # 3 rows of 1 layer x 4, from position 1 of 3 inputs + 2 outputs
    batch = trainer_decode_batch(
        encode_batch("L", 0, [({"session_id": "s"}, [encode_turn(_turn(_routes(values, 3, 1)))])])
    )
    seq = batch.sequence_routes(0, 4)
    assert seq.shape == (5, 1, 4)
    assert seq[0].tolist() == [[-1] * 4] and seq[4].tolist() == [[-1] * 4]
    np.testing.assert_array_equal(seq[1:4].reshape(-1), values)


def test_a_truncated_section_is_refused() -> None:
    blob = encode_turn(_turn(_routes(list(range(8)), 4)))
    with pytest.raises(RecordFormatError):
        decode_turn(blob[:-5] + blob[-4:])


def test_which_groups_return_routes_follows_how_their_engines_start() -> None:
    """``GroupSpec.returns_routes`` (what a session with ``record_routes`` needs) is true exactly
    when the group's engines get the flag: on Modal from ``deploy.plan``'s SGLang command line, on
    ``mixfleet up`` from the launcher's local replicas; static replicas only as declared."""
    from deploy.plan import sglang_argv
    from fleet.specs import GroupSpec
    from launcher.embedded import _replica_spec

    for kw, returns in (
        ({}, False),
        ({"record_routes": True}, True),
        ({"engine_args": (ROUTES_FLAG,)}, True),
        ({"engine_args": ("--context-length", "4096")}, False),
    ):
        gpu = GroupSpec(name="g", accelerator="H100", **kw)
        assert gpu.returns_routes is returns and (ROUTES_FLAG in sglang_argv(gpu, "/m")) is returns, kw
        static = GroupSpec(name="g", accelerator="cpu", replicas=("http://127.0.0.1:1",), **kw)
        assert static.returns_routes is returns, kw
        local = GroupSpec(name="g", accelerator="cpu", **kw)
        assert local.returns_routes and ROUTES_FLAG in _replica_spec(local, 0).engine_flags, kw


@pytest.fixture(scope="module")
def tiny_config(tiny_dir) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def routed_engine(tiny_dir):
    with engine_process(tiny_dir, enable_return_routed_experts=True) as url:
        yield url


@pytest.fixture(scope="module")
def routes_router(routed_engine, engine_url, redis_url, tmp_path_factory):
    """Round-robin over four groups, on a real redis-server: ``cpu-r`` records every turn's routes,
    ``cpu-s`` runs the same engine with the flag but records only for sessions that ask,
    ``cpu-p`` has engines without it, ``cpu-bad`` records but its engine lacks the flag; and
    ``cpu-dead``, declared with the flag, whose one replica never answers (never in rotation)."""
    d = tmp_path_factory.mktemp("routes")
    preset = write_preset(
        d / "preset.toml",
        [
            {"name": "cpu-r", "replicas": [routed_engine], "record_routes": True},
            {"name": "cpu-s", "replicas": [routed_engine], "engine_args": [ROUTES_FLAG]},
            {"name": "cpu-p", "replicas": [engine_url]},
            {"name": "cpu-bad", "replicas": [engine_url], "record_routes": True},
            {
                "name": "cpu-dead",
                "replicas": [f"http://127.0.0.1:{free_port()}"],
                "engine_args": [ROUTES_FLAG],
            },
        ],
    )
    redis.Redis.from_url(redis_url).flushdb()
    with router_process(preset, state=redis_url, policy="round_robin") as router:
        yield router


@pytest.fixture(scope="module")
def client(routes_router):
    with httpx.Client(base_url=routes_router.url, headers=routes_router.headers, timeout=120) as c:
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
    # an appended turn asks the rows from the previous turn's last output token on (context - 1)
    more = client.post(f"/v1/sessions/{sid}/turns", json={"append_ids": [11, 12], "sampling_params": PARAMS})
    assert more.status_code == 200, more.text
    seq2 = seq + [11, 12] + more.json()["output_ids"]
    later = more.json()["routed_experts"]
    assert (later["start"], later["rows"]) == (len(seq) - 1, len(seq2) - len(seq))
    whole = _hf_routes(tiny_dir, seq2[:-1])
    tail = np.frombuffer(base64.b64decode(later["data"]), dtype="<i4").reshape(-1, layers, k)
    np.testing.assert_array_equal(tail, whole[len(seq) - 1 :])

    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    taken = client.post("/v1/batches/take", json={"size": 64}, headers={"Accept": MEDIA_TYPE})
    assert taken.status_code == 200
    batch = trainer_decode_batch(taken.content)
    mine = next(i for i, t in enumerate(batch.turns) if t["session_id"] == sid)
    np.testing.assert_array_equal(batch.routes(mine, k), got)
    segment = batch.segment_routes(batch.turns[mine]["segment"], k)  # the segment's positions once
    np.testing.assert_array_equal(segment[:-1], whole)
    assert (segment[-1] == -1).all()
    np.testing.assert_array_equal(batch.sequence_routes(mine + 1, k), segment)
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


def test_a_turn_stores_the_rows_from_the_first_position_it_adds() -> None:
    from router.turns import _stored_routes, routes_start

    assert [routes_start(c) for c in (0, 1, 9)] == [0, 0, 8]
    asked = _turn(_routes(list(range(5 * 2)), 5, start=4))  # asked at context 5: positions 4..8
    assert _stored_routes(asked, 5) is asked
    moved = _stored_routes(asked, 7).routed_experts  # a concurrent turn grew the context to 7
    assert (moved.start, moved.rows, moved.values()) == (6, 3, list(range(4, 10)))
    assert _stored_routes(asked, 0) is asked  # re-placed as a fork: kept from where it was asked
    with pytest.raises(ValueError, match="no tail from 10"):
        asked.routed_experts.tail(10)


def test_a_session_with_record_routes_on_a_group_without_it_gets_routes_in_its_batch(
    routes_router, client, tiny_dir, tiny_config
):
    """``cpu-s`` does not record routes, but a session that asks gets them in every turn and in its
    batch (the trainer kit's client opens it); a session of the same group that does not ask gets
    none. The flag is the session's, kept by the Redis state store."""
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    with RolloutClient(routes_router.url, routes_router.key) as rc:
        asks = rc.create_session(group="cpu-s", record_routes=True)
        plain = rc.create_session(group="cpu-s")
        assert (asks.group, asks.record_routes, plain.record_routes) == ("cpu-s", True, False)
        for s in (asks, plain):
            assert client.get(f"/v1/sessions/{s.session_id}").json()["record_routes"] is s.record_routes
        turn = rc.turn(asks.session_id, PROMPT, PARAMS)
        seq = PROMPT + turn["output_ids"]
        routes = turn["routed_experts"]
        assert (routes["start"], routes["rows"], routes["width"]) == (0, len(seq) - 1, layers * k)
        assert "routed_experts" not in rc.turn(plain.session_id, PROMPT, PARAMS)
        for s in (asks, plain):
            rc.finish(s.session_id, 1.0)
        batch = rc.take(64)
        index = {t["session_id"]: i for i, t in enumerate(batch.turns)}
        got = batch.routes(index[asks.session_id], k)
        assert got.shape == (len(seq) - 1, layers, k)
        np.testing.assert_array_equal(got, _hf_routes(tiny_dir, seq[:-1]))
        assert batch.routes(index[plain.session_id], k) is None
        rc.ack(batch.lease_id)


def test_route_flags_count_only_for_turns_that_recorded_routes(routes_router, client) -> None:
    """A batch of a session without routes (``cpu-p``) and one with them (``cpu-r``); the trainer
    says "differ" (1) for every token: only the tokens of the turn with recorded routes are
    compared, the others are in neither figure (router/mismatch.py), whatever the flags say."""
    with RolloutClient(routes_router.url, routes_router.key) as rc:
        old = client.post("/v1/batches/take", json={"size": 64}).json()  # earlier trajectories out of the way
        if old["lease_id"]:
            assert client.post(f"/v1/batches/{old['lease_id']}/ack").status_code == 200
        sessions = {g: rc.create_session(group=g) for g in ("cpu-p", "cpu-r")}
        for s in sessions.values():
            rc.turn(s.session_id, PROMPT, PARAMS)
            rc.finish(s.session_id, 1.0)
        batch = rc.take(64)
        assert {t["session_id"] for t in batch.trajectories} == {s.session_id for s in sessions.values()}
        recorded = {t["group"]: "routes" in t for t in batch.turns}
        assert recorded == {"cpu-p": False, "cpu-r": True}
        differ = np.ones(len(batch), dtype=np.uint8)
        answer = rc.upload_trainer_logprobs(batch.lease_id, batch.logprobs, differ)
        groups = {g["group"]: g for g in answer["groups"]}
        routed = int((batch.group_index == batch.groups.index("cpu-r")).sum())
        assert (groups["cpu-r"]["route_tokens"], groups["cpu-r"]["route_mismatch_share"]) == (routed, 1.0)
        assert (groups["cpu-p"]["route_tokens"], groups["cpu-p"]["route_mismatch_share"]) == (0, 0.0)
        assert groups["cpu-p"]["tokens"] > 0  # its log-probs counted all the same
        rc.ack(batch.lease_id)


def test_record_routes_on_a_group_whose_engines_cannot_return_them_is_a_422_at_creation(
    routes_router, client
):
    r = client.post("/v1/sessions", json={"group": "cpu-p", "record_routes": True})
    assert r.status_code == 422, r.text
    assert "cpu-p" in r.text and ROUTES_FLAG in r.text
    with RolloutClient(routes_router.url, routes_router.key) as rc, pytest.raises(RouterError) as err:
        rc.create_session(group="cpu-p", record_routes=True)
    assert err.value.status == 422
    assert client.post("/v1/sessions", json={"record_routes": "maybe"}).status_code == 422


def test_the_policy_places_a_session_with_record_routes_only_where_routes_are_returned(client):
    """Round robin over the four groups places four plain sessions in a row in each, ``cpu-p``
    too; six sessions in a row asking for routes go only to the other three, twice each."""
    placed: dict[bool, list[str]] = {True: [], False: []}
    for asks in (False,) * 4 + (True,) * 6:
        r = client.post("/v1/sessions", json={"record_routes": asks})
        assert r.status_code == 200, r.text
        assert r.json()["record_routes"] is asks
        placed[asks].append(r.json()["group"])
        assert client.delete(f"/v1/sessions/{r.json()['session_id']}").status_code == 200
    assert sorted(placed[False]) == ["cpu-bad", "cpu-p", "cpu-r", "cpu-s"], placed
    assert sorted(placed[True]) == ["cpu-bad", "cpu-bad", "cpu-r", "cpu-r", "cpu-s", "cpu-s"], placed


def test_a_session_with_record_routes_fails_over_only_to_groups_that_return_them(client):
    """Four sessions in a row asking routes on ``cpu-dead`` move to the groups whose engines are
    declared with the flag, round robin: a turn that ran carries its routes, one that reached
    ``cpu-bad`` (declared, engine without the flag) is a 502 naming it; none reaches ``cpu-p``,
    where it would run without routes."""
    ran = []
    for _ in range(4):
        r = client.post("/v1/sessions", json={"group": "cpu-dead", "record_routes": True})
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        turn = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": PROMPT, "sampling_params": PARAMS})
        if turn.status_code == 502:
            assert ROUTES_FLAG in turn.text
        else:
            assert turn.status_code == 200, turn.text
            body = turn.json()
            assert (body["moved_from"], body["routed_experts"]["rows"]) == (
                "cpu-dead",
                len(PROMPT) + len(body["output_ids"]) - 1,
            )
            ran.append(body["group"])
        assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    assert len(ran) >= 2 and set(ran) <= {"cpu-r", "cpu-s"}, ran

"""The engine client and the one parser against SGLang 0.5.23's answers: response fixtures
hand-written in the release's form, not recorded (tests/fixtures/sglang_0_5_23/*.json, each naming
the lines it follows; the local engine's keys are checked against them in tests/engine)
served by a real loopback HTTP server to clients.engine.SGLangClient.generate (the one request
builder) and parsed by router.engine_answer.parse_turn (an unfiltered turn's answer without a mask
included); and a real router over the local engine, which refuses a sampling mask without a finite
top_k as SGLang does, recording a top-p-only turn."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from clients.engine import EngineAborted, EngineRejected, EngineUnavailable
from router.engine_answer import parse_turn
from router.records import decode_turn, decode_turn_header, encode_stored, encode_turn
from tests.clients.test_engine_client import Server, answer, with_client

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_0_5_23"
ARGS = {"index": 0, "group": "h100-fp8", "replica": "r0", "input_ids": [1, 2, 3, 4], "moved_from": None}


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def serve(name: str, params: dict):
    """``generate(params)`` answered by the fixture: (the Generation or the error, the request sent)."""
    fx = fixture(name)
    status = {200: "200 OK", 400: "400 Bad Request"}[fx["status"]]

    async def main():
        async with Server(lambda n: answer(status, json.dumps(fx["body"]).encode())) as srv:
            try:
                got = await with_client(srv.url, lambda c: c.generate([1, 2, 3, 4], params))
            except (EngineAborted, EngineRejected, EngineUnavailable) as exc:
                got = exc
        return got, json.loads(srv.bodies[0])

    return asyncio.run(main())


def test_a_top_p_only_turn_is_sent_with_the_mask_bound_and_recorded_so() -> None:
    gen, sent = serve(
        "selected_top_p_only", {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 3}
    )
    assert sent["sampling_params"]["top_k"] == 4096 and sent["sampling_logprobs_mode"] == "support"
    assert sent["return_sampling_mask"] is True and sent["return_logprob"] is True
    assert gen.request.top_k_bound == 4096 and gen.sampling == {"top_k_bound": 4096}
    turn = parse_turn(gen.body, timings={}, sampling=gen.sampling, **ARGS)
    meta = gen.body["meta_info"]
    # masks come most likely first; the record holds them by id, log-probs unknown in selected mode
    for i, row in enumerate(meta["output_token_sampling_mask"]):
        assert list(turn.support_ids[i]) == sorted(row)
        assert all(math.isnan(x) for x in turn.support_logprobs[i])
    assert list(turn.logprobs) == meta["output_token_sampling_logprobs"]  # mu as SGLang sent it
    assert list(turn.raw_logprobs) == [x[0] for x in meta["output_token_logprobs"]]
    assert list(turn.weight_versions) == [{"version": 7, "start": 0, "end": 3}]
    assert turn.finish_reason == {"type": "length", "length": 3} and turn.timings["engine_e2e_ms"] == 125.0
    blob, stored = encode_stored(turn)
    assert decode_turn_header(blob)["sampling"] == {"top_k_bound": 4096}
    assert decode_turn(blob).sampling == {"top_k_bound": 4096} == stored.to_json()["sampling"]


def test_support_mode_gives_the_support_log_probs_and_mu_of_the_sampled_token() -> None:
    gen, sent = serve("support_mode_two_versions", {"temperature": 0.7, "top_p": 0.95, "top_k": 20})
    assert sent["sampling_params"]["top_k"] == 20 and gen.request.top_k_bound is None and gen.sampling is None
    turn = parse_turn(gen.body, timings={}, sampling=gen.sampling, **ARGS)
    meta = gen.body["meta_info"]
    for i, tok in enumerate(gen.body["output_ids"]):
        mask, rows = meta["output_token_sampling_mask"][i], meta["output_token_sampling_logprobs"][i]
        assert turn.logprobs[i] == rows[mask.index(tok)]  # mu: the sampled token's entry
        by_id = dict(zip(mask, rows, strict=True))
        assert list(turn.support_ids[i]) == sorted(mask)
        assert list(turn.support_logprobs[i]) == [by_id[t] for t in sorted(mask)]
        assert math.fsum(math.exp(x) for x in rows) == pytest.approx(1.0, abs=1e-6)
    # string span versions across a weight update, as integers; the turn spans both
    assert list(turn.weight_versions) == [
        {"version": 7, "start": 0, "end": 2},
        {"version": 8, "start": 2, "end": 3},
    ]
    assert turn.versions() == [7, 7, 8] and turn.version_range() == (7, 8)
    assert turn.finish_reason == {"type": "stop", "matched": 151645}
    blob, stored = encode_stored(turn)
    assert "sampling" not in decode_turn_header(blob)  # sampled exactly as asked: no key
    assert decode_turn(blob).to_json() == stored.to_json()


def test_an_unfiltered_turn_is_sent_without_a_mask_and_mu_is_its_output_token_logprobs() -> None:
    params = {"temperature": 0.7, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "max_new_tokens": 4}
    gen, sent = serve("unfiltered_no_mask", params)
    assert sent == {"input_ids": [1, 2, 3, 4], "sampling_params": params, "return_logprob": True}
    assert gen.request.mask is False and gen.sampling == {"sampling_mask": False}
    turn = parse_turn(gen.body, timings={}, sampling=gen.sampling, **ARGS)
    triples = gen.body["meta_info"]["output_token_logprobs"]
    assert list(turn.logprobs) == list(turn.raw_logprobs) == [x[0] for x in triples]
    assert list(turn.support_ids) == list(turn.support_logprobs) == [[]] * 4  # the whole vocabulary
    assert list(turn.weight_versions) == [{"version": 7, "start": 0, "end": 4}]
    blob, stored = encode_stored(turn)
    assert decode_turn_header(blob)["sampling"] == {"sampling_mask": False}
    assert decode_turn(blob).to_json() == stored.to_json() and stored.sampling == {"sampling_mask": False}
    assert list(stored.logprobs) == [x[0] for x in triples]  # float32 values: stored exactly
    # per token: f32 mu + f32 raw log-prob + a 0 support size + the id's varint (1-3 bytes here)
    empty = encode_turn(
        replace(turn, output_ids=[], logprobs=[], raw_logprobs=[], support_ids=[], support_logprobs=[])
    )
    assert len(blob) - len(empty) == 4 * (4 + 4 + 1) + (2 + 1 + 3 + 3)


def test_mask_fields_must_match_the_request() -> None:
    """A no-mask turn whose answer carries mask fields, and a masked turn whose answer lacks them,
    are refused naming the field (neither is an answer SGLang gives to that request)."""
    with pytest.raises(ValueError, match="output_token_sampling_mask is present but no sampling mask"):
        parse_turn(
            fixture("support_mode_two_versions")["body"],
            timings={},
            sampling={"sampling_mask": False},
            **ARGS,
        )
    with pytest.raises(ValueError, match="meta_info.output_token_sampling_mask is missing"):
        parse_turn(fixture("unfiltered_no_mask")["body"], timings={}, sampling=None, **ARGS)
    body = fixture("unfiltered_no_mask")["body"]  # a log-prob sent as null (non-finite): unknown
    body["meta_info"]["output_token_logprobs"][1][0] = None
    turn = parse_turn(body, timings={}, sampling={"sampling_mask": False}, **ARGS)
    assert math.isnan(turn.logprobs[1]) and turn.raw_logprobs[1] is None
    assert turn.to_json()["records"][1]["logprob"] is None and turn.logprobs[0] == -1.2345678806304932


def test_an_abort_answered_200_is_unavailable_and_never_parsed_into_a_turn() -> None:
    err, _ = serve("abort_no_status", {"temperature": 1.0, "top_k": 40})
    assert isinstance(err, EngineAborted) and isinstance(err, EngineUnavailable)
    assert "aborted the generation: Abort in waiting queue" in err.message
    with pytest.raises(ValueError, match="the engine aborted the turn: Abort in waiting queue"):
        parse_turn(fixture("abort_no_status")["body"], timings={}, **ARGS)


def test_a_mask_refused_by_the_server_is_rejected_with_its_message() -> None:
    err, _ = serve("mask_refused_400", {"temperature": 1.0, "top_k": 10**9})
    assert isinstance(err, EngineRejected) and err.status == 400 and not err.retryable
    assert "finite 1 < top_k <= 4096" in err.message


@pytest.mark.parametrize(
    "finish",
    [{"type": "eos"}, "length", {"length": 3}],
)
def test_another_finish_reason_shape_is_refused(finish) -> None:
    body = fixture("selected_top_p_only")["body"]
    body["meta_info"]["finish_reason"] = finish
    with pytest.raises(ValueError, match="meta_info.finish_reason"):
        parse_turn(body, timings={}, **ARGS)


# --- through a real router over the local engine ------------------------------------------------


def test_a_top_p_only_turn_through_the_router_records_the_bound(client) -> None:
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    sp = {"temperature": 1.0, "top_p": 0.8, "max_new_tokens": 5}  # no top_k: the engine needs the bound
    r = client.post(
        f"/v1/sessions/{sid}/turns",
        json={"input_ids": [1, 2, 3], "sampling_params": sp, "return_support": True},
    )
    assert r.status_code == 200, r.text
    turn = r.json()
    assert turn["sampling"] == {"top_k_bound": 4096}
    assert all(rec["support_ids"] and rec["token_id"] in rec["support_ids"] for rec in turn["records"])
    for rec in turn["records"]:  # mu is the sampled token's support log-prob (support mode)
        assert rec["logprob"] == rec["support_logprobs"][rec["support_ids"].index(rec["token_id"])]
    traj = client.get(f"/v1/sessions/{sid}/trajectory").json()
    assert traj["turns"][0]["sampling"] == {"top_k_bound": 4096}
    sp_k = {**sp, "top_k": 7}
    r = client.post(
        f"/v1/sessions/{sid}/turns",
        json={"input_ids": [1, 2, 3], "sampling_params": sp_k, "return_support": True},
    )
    assert r.status_code == 200 and r.json()["sampling"] is None
    assert all(len(rec["support_ids"]) <= 7 for rec in r.json()["records"])

"""The rollout API end to end: a real router process in front of a real engine process."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time

import httpx
import pytest
import redis

from core.wire import RECORDS_MEDIA_TYPE as MEDIA_TYPE
from router.auth import BEARER_DOC
from router.records import decode_batch
from router.schemas import MAX_JSON_DEPTH
from tests.router.conftest import KEYS
from tests.support.metrics import samples_of
from tests.support.router import router_process, write_preset
from tests.support.state import opened

SP = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "seed": 3}
LEASE_ID = "[0-9a-f]{32}"
UNKNOWN_LEASE = "0" * 32  # well-formed, never handed out
NOT_AN_ID = "is not a token id (an integer in 0..2147483647)"


def _wait_in_rotation(client: httpx.Client, group: str, want: bool, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = {x["name"]: x for x in client.get("/v1/groups").json()["groups"]}[group]
        if (g["ready_replicas"] > 0) == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"group {group} in rotation != {want}")


def _session(client: httpx.Client, **body) -> str:
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def _check_records(turn: dict) -> None:
    assert len(turn["records"]) == len(turn["output_ids"]) > 0
    for rec, tok in zip(turn["records"], turn["output_ids"], strict=True):
        assert rec["token_id"] == tok
        assert rec["weight_version"] == 0
        ids = rec["support_ids"]
        assert ids == sorted(set(ids)) and tok in ids  # top_p 0.9 filters: a real support
        lp = rec["support_logprobs"][ids.index(tok)]
        assert math.isclose(rec["logprob"], lp, abs_tol=1e-6)  # mu = the token's renormalized log-prob
        assert math.isclose(sum(math.exp(x) for x in rec["support_logprobs"]), 1.0, abs_tol=1e-4)
        assert rec["raw_logprob"] <= rec["logprob"] + 1e-9  # renormalizing over a subset raises it


def test_session_turns_finish_take_ack(client: httpx.Client) -> None:
    _wait_in_rotation(client, "cpu-a", True)
    sid = _session(client, group="cpu-a", metadata={"task": "t1"})
    ctx = [5, 6, 7]
    outputs = []
    answers = []
    for i in range(3):
        asks = {} if i == 1 else {"return_support": True}  # turn 1: the default answer
        r = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": ctx, "sampling_params": SP, **asks})
        assert r.status_code == 200, r.text
        turn = r.json()
        assert (turn["session_id"], turn["turn"], turn["group"]) == (sid, i, "cpu-a")
        assert turn["replica"] == "cpu-a/0"
        n = len(turn["output_ids"])
        if turn["finish_reason"]["type"] == "length":
            assert n == SP["max_new_tokens"]
        else:  # the model may sample its end-of-sequence token
            assert turn["finish_reason"]["type"] == "stop" and 0 < n <= SP["max_new_tokens"]
        assert turn["weight_versions"] == [{"version": 0, "start": 0, "end": n}]
        assert {"engine_ms", "router_ms"} <= set(turn["timings"])
        if i != 1:
            _check_records(turn)
        else:  # an answer without return_support leaves the supports to trajectory reads and batches
            assert [set(rec) for rec in turn["records"]] == [
                {"token_id", "logprob", "raw_logprob", "weight_version"}
            ] * n
        outputs.append(turn["output_ids"])
        answers.append(turn)
        ctx = ctx + turn["output_ids"] + [9]
    traj = client.get(f"/v1/sessions/{sid}/trajectory").json()
    assert [t["output_ids"] for t in traj["turns"]] == outputs
    # each turn's answer is what was stored: its trajectory entry without its appended ids (and,
    # unless it asked return_support, without the records' supports)
    stored = [{k: v for k, v in t.items() if k != "append_ids"} for t in traj["turns"]]
    lean = [{k: v for k, v in rec.items() if not k.startswith("support_")} for rec in stored[1]["records"]]
    assert [stored[0], {**stored[1], "records": lean}, stored[2]] == answers
    _check_records(stored[1])
    # append-only: each turn stores only what its input added to the context
    assert [t["append_ids"] for t in traj["turns"]] == [[5, 6, 7], [9], [9]]
    assert traj["turns"][1]["context"] == 3 + len(outputs[0]) and traj["turns"][1]["fork"] is None
    r = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.75, "metadata": {"ok": 1}})
    assert r.json() == {"session_id": sid, "status": "finished", "turns": 3}

    binary = client.post(
        "/v1/batches/take", json={"size": 8, "trainer_version": 0}, headers={"Accept": MEDIA_TYPE}
    )
    assert binary.headers["content-type"] == MEDIA_TYPE
    batch = decode_batch(binary.content)
    mine = [t for t in batch["trajectories"] if t["session_id"] == sid]
    assert len(mine) == 1 and mine[0]["reward"] == 0.75
    assert mine[0]["version_age"] == {"min": 0, "max": 0, "mean": 0.0}
    assert [t["records"] for t in mine[0]["turns"]] == [t["records"] for t in traj["turns"]]
    assert re.fullmatch(LEASE_ID, batch["lease_id"])  # what router.schemas.LeaseId accepts
    first = client.post(f"/v1/batches/{batch['lease_id']}/ack").json()
    assert first["acked"] == len(batch["trajectories"]) and first["already_acked"] is False
    again = client.post(f"/v1/batches/{batch['lease_id']}/ack")  # a retry: 200, the first one's counts
    assert again.status_code == 200 and again.json() == {**first, "already_acked": True}
    assert client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1]}).status_code == 409


def _metric(text: str, series: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " "))


def test_appended_tokens_and_a_fork_through_the_api(client: httpx.Client) -> None:
    """Turns given only their appended tokens get the stored context before them (the same
    engine input, so the same tokens as a full-context turn with the same seed); a full context
    that edits history is a fork: recorded, counted, and a new segment in the batch."""
    forks = 'mixfleet_router_forks_total{group="cpu-a"}'
    text = 'mixfleet_router_context_text_total{group="cpu-a",result="%s"}'
    before = _metric(client.get("/metrics").text, forks)
    texts = [_metric(client.get("/metrics").text, text % r) for r in ("reused", "encoded")]
    sid = _session(client, group="cpu-a")
    full = _session(client, group="cpu-a")
    t0 = client.post(
        f"/v1/sessions/{sid}/turns", json={"append_ids": [5, 6, 7], "sampling_params": SP}
    ).json()
    f0 = client.post(
        f"/v1/sessions/{full}/turns", json={"input_ids": [5, 6, 7], "sampling_params": SP}
    ).json()
    assert t0["output_ids"] == f0["output_ids"] and (t0["context"], t0["fork"]) == (0, None)
    ctx = [5, 6, 7] + t0["output_ids"] + [9]
    t1 = client.post(f"/v1/sessions/{sid}/turns", json={"append_ids": [9], "sampling_params": SP}).json()
    f1 = client.post(f"/v1/sessions/{full}/turns", json={"input_ids": ctx, "sampling_params": SP}).json()
    assert t1["output_ids"] == f1["output_ids"] and t1["context"] == f1["context"] == len(ctx) - 1
    edited = [5, 8, 7] + t0["output_ids"] + [9] + t1["output_ids"]  # history re-rendered
    t2 = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": edited, "sampling_params": SP}).json()
    assert t2["context"] == 0 and t2["fork"] == {"stored": len(ctx) + len(t1["output_ids"]), "common": 1}
    assert _metric(client.get("/metrics").text, forks) == before + 1
    t3 = client.post(f"/v1/sessions/{sid}/turns", json={"append_ids": [], "sampling_params": SP}).json()
    assert (t3["context"], t3["fork"]) == (len(edited) + len(t2["output_ids"]), None)
    traj = client.get(f"/v1/sessions/{sid}/trajectory").json()
    assert [t["append_ids"] for t in traj["turns"]] == [[5, 6, 7], [9], edited, []]
    # the engine input's text: extended for t1, f1 and t3; encoded whole for the first turns and the fork
    after = [_metric(client.get("/metrics").text, text % r) for r in ("reused", "encoded")]
    assert after == [texts[0] + 3, texts[1] + 3]
    for s in (sid, full):
        assert client.post(f"/v1/sessions/{s}/finish", json={"reward": 1.0}).status_code == 200
    taken = client.post("/v1/batches/take", json={"size": 100}, headers={"Accept": MEDIA_TYPE})
    from trainer.batch import decode_batch as decode_arrays

    batch = decode_arrays(taken.content)
    mine = [i for i, t in enumerate(batch.trajectories) if t["session_id"] == sid]
    assert batch.segment_trajectory.tolist().count(mine[0]) == 2  # the fork started a second segment
    assert client.post(f"/v1/batches/{batch.lease_id}/ack").status_code == 200


def test_json_and_binary_batches_carry_the_same_trajectories(client: httpx.Client, router) -> None:
    sid = _session(client, group="cpu-a")
    client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2], "sampling_params": SP})
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    as_json = client.post("/v1/batches/take", json={"size": 100}).json()
    time.sleep(0.01)
    # the same trajectory again, after the JSON lease expired? No: lease timeout is 300 s, so
    # compare instead against the stored trajectory through the binary path of a second session
    sid2 = _session(client, group="cpu-a")
    client.post(f"/v1/sessions/{sid2}/turns", json={"input_ids": [1, 2], "sampling_params": SP})
    client.post(f"/v1/sessions/{sid2}/finish", json={"reward": 2.0})
    as_bin = decode_batch(
        client.post("/v1/batches/take", json={"size": 100}, headers={"Accept": MEDIA_TYPE}).content
    )
    j = next(t for t in as_json["trajectories"] if t["session_id"] == sid)
    b = next(t for t in as_bin["trajectories"] if t["session_id"] == sid2)
    # same seed, same input, same replica: identical tokens and records, whichever encoding
    assert [t["records"] for t in j["turns"]] == [t["records"] for t in b["turns"]]
    for lease in (as_json["lease_id"], as_bin["lease_id"]):
        assert client.post(f"/v1/batches/{lease}/ack").status_code == 200


def test_auth_scopes(router) -> None:
    url = router.url
    missing = httpx.post(f"{url}/v1/sessions", json={})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json() == {"detail": "missing API key (Authorization: Bearer <key>)"}
    basic = httpx.post(f"{url}/v1/sessions", json={}, headers={"Authorization": f"Basic {KEYS['rollout']}"})
    assert basic.status_code == 401 and basic.json() == missing.json()  # only a Bearer key counts
    bad = {"Authorization": "Bearer " + "x" * 32}
    invalid = httpx.post(f"{url}/v1/sessions", json={}, headers=bad)
    assert invalid.status_code == 401 and invalid.json() == {"detail": "invalid API key"}
    rollout = {"Authorization": f"Bearer {KEYS['rollout']}"}
    trainer = {"Authorization": f"Bearer {KEYS['trainer']}"}
    assert httpx.post(f"{url}/v1/batches/take", json={"size": 1}, headers=rollout).status_code == 403
    assert httpx.post(f"{url}/v1/sessions", json={}, headers=trainer).status_code == 403
    r = httpx.post(
        f"{url}/v1/replicas/heartbeat",
        headers=rollout,
        json={"replica_id": "x", "group": "cpu-b", "url": "http://127.0.0.1:1", "ready": True},
    )
    assert r.status_code == 403 and r.json() == {"detail": "API key lacks the 'replica' or 'admin' scope"}
    security = httpx.get(f"{url}/openapi.json").json()["components"]["securitySchemes"]
    assert security == {"HTTPBearer": {"type": "http", "scheme": "bearer", "description": BEARER_DOC}}
    assert httpx.post(f"{url}/generate", json={"input_ids": [1]}, headers=trainer).status_code == 403
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/v1/groups", headers=trainer).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"input_ids": []}, 422, "input_ids"),
        ({"input_ids": [1, 10**7]}, 422, "engine refused the request: input_ids"),  # no vocab_size configured
        ({"input_ids": [1, -3]}, 422, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, 422, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, 422, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, 422, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, 422, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, 422, "temprature"),
        (  # SGLang's name (/generate's): the message names the turn API's
            {"input_ids": [1], "sampling_params": {"sampling_seed": 3}},
            422,
            "sampling_params.sampling_seed: Extra inputs are not permitted: the turn API calls it seed",
        ),
        ({"input_ids": "abc"}, 422, "input_ids"),
        ({"input_ids": [1], "turn": 5}, 409, "turn"),
        ({}, 422, "exactly one of input_ids"),
        ({"input_ids": [1], "append_ids": [2]}, 422, "exactly one of input_ids"),
        ({"append_ids": []}, 422, "append_ids"),
        ({"append_ids": [1, -1]}, 422, "append_ids"),
    ],
)
def test_bad_turns_get_4xx_naming_the_field(client: httpx.Client, body, status, needle) -> None:
    sid = _session(client, group="cpu-a")
    r = client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]


def test_other_bad_requests(client: httpx.Client, router) -> None:
    r = client.post("/v1/sessions/nope/turns", json={"input_ids": [1]})
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    for bad in ("x" * 5000, "a.b", "%C3%A9"):  # not an id the router makes: 422 before any lookup
        r = client.get(f"/v1/sessions/{bad}")
        assert r.status_code == 422 and r.json()["detail"].startswith("session_id: String should"), r.text
        assert len(r.text) < 1000, r.text
    r = client.post("/v1/sessions", content=b'{"group": ', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "malformed JSON" in r.json()["detail"]
    r = client.post("/v1/sessions", json={"group": "gpu-z"})
    assert r.status_code == 422 and "group" in r.json()["detail"]
    big = {"input_ids": [1] * 40_000}
    r = client.post("/v1/sessions/whatever/turns", json=big)
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    sid = _session(client, group="cpu-a")
    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 409  # no turns
    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": "x"}).status_code == 422
    deep: dict = {}
    for _ in range(
        MAX_JSON_DEPTH
    ):  # one level too many: the body decodes, the router could not write it again
        deep = {"a": deep}
    for path, body in (
        ("/v1/sessions", {"metadata": deep}),
        (f"/v1/sessions/{sid}/finish", {"reward": 1.0, "metadata": deep}),
    ):
        r = client.post(path, json=body)
        assert (
            r.status_code == 422
            and f"metadata: Value error, nested deeper than {MAX_JSON_DEPTH} levels" in r.json()["detail"]
        ), r.text
    r = client.post("/v1/sessions", json={"metadata": deep["a"]})
    assert r.status_code == 200, r.text
    assert client.get(f"/v1/sessions/{r.json()['session_id']}").json()["metadata"] == deep["a"]
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    assert client.get(f"/v1/sessions/{sid}").status_code == 404
    assert client.post("/v1/batches/take", json={"size": 0}).status_code == 422
    assert client.post(f"/v1/batches/{UNKNOWN_LEASE}/ack").status_code == 404
    r = client.post("/generate", json={"input_ids": [1, 10**7], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code in (400, 422) and "vocab" in r.text
    r = client.post("/generate", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "malformed JSON" in r.json()["detail"]
    r = client.post("/generate", json={"input_ids": [], "sampling_params": {}})
    assert r.status_code == 422 and "input_ids" in r.json()["detail"]
    for path in ("/v1/sessions", "/generate"):  # a body that is not UTF-8 is not JSON: 422, one shape
        r = client.post(path, content=b"\x94\xd4", headers={"content-type": "application/json"})
        assert r.status_code == 422 and isinstance(r.json()["detail"], str), r.text


def test_sglang_generate_takes_what_sglang_takes(client: httpx.Client) -> None:
    """What SGLang 0.5.23 accepts is forwarded, not refused: temperature 0 is greedy whatever top_k
    says (sampling/sampling_params.py 245-248), null is a parameter's default, an integer is a float."""
    for params in ({"temperature": 0, "top_k": -5}, {"temperature": None, "top_k": None}, {"top_p": 1}):
        r = client.post(
            "/generate", json={"input_ids": [3, 4], "sampling_params": {**params, "max_new_tokens": 1}}
        )
        assert r.status_code == 200, (params, r.text)


def test_sglang_generate_forwards_the_top_level_fields_sglang_takes(client: httpx.Client) -> None:
    """The router refuses no top-level field SGLang 0.5.23 takes: an unknown key or one SGLang
    ignores reaches the engine and is served; a ``lora_path`` reaches it too, and the 400 is the
    engine's, in SGLang's words for a server without LoRA (tokenizer_manager.py 3723-3740)."""
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}
    extra = {"zzz_not_a_field": 1, "priority": 3, "session_id": "s", "bootstrap_host": "h", "image_data": "x"}
    r = client.post("/generate", json={**body, **extra})
    assert r.status_code == 200, r.text
    r = client.post("/generate", json={**body, "lora_path": "adapter"})
    assert r.status_code == 400 and "LoRA is not enabled" in r.text, r.text
    # text with matching input_ids: SGLang serves the ids (managers/io_struct.py 479-487, 969)
    for text in ("Hello", ""):  # an empty text too: the ids are the input
        r = client.post("/generate", json={**body, "text": text})
        assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 2, (text, r.text)
    # a batch's longer per-item lists: their extra entries never read (io_struct.py 959-1031)
    one = {"max_new_tokens": 1}
    longer = {
        "input_ids": [[3, 4], [5]],
        "sampling_params": [one, one, {"top_p": 1.5}],
        "return_logprob": [True, False, True],
        "logprob_start_len": [-1, -1, 99],
    }
    r = client.post("/generate", json=longer)
    assert r.status_code == 200 and [o["meta_info"]["prompt_tokens"] for o in r.json()] == [2, 1], r.text
    # logprob_start_len as SGLang's scheduler resolves it (managers/scheduler.py 3256-3279): any
    # value without return_logprob (ignored), the input's length with it (no input log-probs)
    for extra in ({"logprob_start_len": -5}, {"logprob_start_len": 2, "return_logprob": True}):
        r = client.post("/generate", json={**body, **extra})
        assert r.status_code == 200, (extra, r.text)
    # one past the input's length: forwarded, the scheduler's abort (a 400) in its words
    r = client.post("/generate", json={**body, "logprob_start_len": 3, "return_logprob": True})
    assert r.status_code == 400 and "req.logprob_start_len=3 is higher than the number" in r.text, r.text
    # mm_hashes matching each request's images (io_struct.py 687-720) are forwarded and served
    hashed = {"input_ids": [[3, 4], [5]], "sampling_params": one, "image_data": "x", "mm_hashes": ["a", "b"]}
    r = client.post("/generate", json=hashed)
    assert r.status_code == 200 and len(r.json()) == 2, r.text
    r = client.post("/generate", json={**hashed, "mm_content_hashes": [[None], ["sha256:x"]]})
    assert r.status_code == 200 and len(r.json()) == 2, r.text
    # one request's hashes: judged only by a multimodal processor (tokenizer_manager.py
    # 1159-1175), which a text-only model has none of: served whatever their count
    r = client.post("/generate", json={**body, "mm_hashes": ["a", "b"], "mm_content_hashes": [None, None]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        # _validate_inputs (io_struct.py 444-455): no input, or all three, in SGLang's words;
        # input_embeds alone is an input, forwarded, refused by the engine for the radix cache
        ({"input_ids": None}, 422, "Either text, input_ids or input_embeds should be provided."),
        ({"text": "a", "input_embeds": [[0.5]]}, 422, "Either text, input_ids or input_embeds"),
        ({"input_ids": None, "input_embeds": [[0.5]]}, 400, "input_embeds is provided while"),
        # session_id with session_params (io_struct.py 433-434), before a null n (550)
        ({"session_id": "s", "session_params": {}}, 422, "session_id and session_params cannot both be set."),
        (
            {"session_id": "s", "session_params": {"id": "x"}, "sampling_params": {"n": None}},
            422,
            "session_id and session_params cannot both be set.",
        ),
        # the LoRA adapters before any item's SamplingParams (tokenizer_manager.py 942, 1548-1567)
        ({"lora_path": "adapter", "sampling_params": {"top_p": 1.5}}, 400, "LoRA is not enabled"),
        ({"lora_path": "adapter", "sampling_params": {"choice": ["a"]}}, 400, "LoRA is not enabled"),
        ({"lora_path": "adapter", "sampling_params": [{}]}, 400, "LoRA is not enabled"),
        # parallel samples' lists (io_struct.py 776-821, 839-848), before the LoRA adapters
        (
            {"sampling_params": {"n": 2}, "return_logprob": [True], "lora_path": "a"},
            422,
            "Cannot use list return_logprob with parallel_sample_num > 1",
        ),
        (
            {"input_ids": [[3], [4]], "sampling_params": {"n": 2}, "custom_logit_processor": ["x", None]},
            422,
            "Cannot use list custom_logit_processor with parallel_sample_num > 1",
        ),
        ({"sampling_params": {"n": 2}, "rid": ["a", "b"]}, 422, "The specified rids length mismatch"),
        # with a rid list (not expanded, io_struct.py 759-772) a batch's lists are read repeated n
        # times only for the batch's rids: one entry serves two items at n=2; forwarded (the
        # engine does not serve n)
        (
            {"input_ids": [[3], [4]], "rid": ["a", "b"], "sampling_params": {"n": 2}, "video_data": ["v"]},
            400,
            "n=2 is not supported",
        ),
        # one request's extra_key / cache_salt: a string (io_struct.py 575-580), before the LoRA adapters
        ({"cache_salt": ["s"], "lora_path": "a"}, 422, "cache_salt should be a string for a single request."),
        # max_thinking_tokens before the rids are registered, and the short list (905-926)
        (
            {"input_ids": [[3], [4]], "max_thinking_tokens": 5, "sampling_params": [{}]},
            400,
            "max_thinking_tokens requires",
        ),
        # a rid named twice: normalize_batch_and_arguments (io_struct.py 390-397, 442), first
        (
            {"input_ids": [[3], [4]], "rid": ["x", "x"], "lora_path": "a"},
            422,
            "Duplicate request IDs detected within the request: ['x']",
        ),
        # a short list (_init_req_state, 3818-3831) before the LoRA adapters: SGLang's 500
        ({"input_ids": [[3], [4]], "lora_path": "a", "sampling_params": [{}]}, 422, "1 entries for a batch"),
        # per item: the vocabulary (token_ids_logprob, 1513-1531) before its SamplingParams
        (
            {"token_ids_logprob": [10**9], "sampling_params": {"top_p": 1.5}},
            400,
            "token_ids_logprob contains out-of-vocabulary token id 1000000000",
        ),
        # per item: hidden states before its SamplingParams, the first item's all before the second's
        ({"return_hidden_states": True, "sampling_params": {"top_p": 1.5}}, 400, "hidden states"),
        (
            {
                "input_ids": [[3], [4]],
                "return_hidden_states": [False, True],
                "sampling_params": [{"top_p": 1.5}, {}],
            },
            422,
            "top_p must be in",
        ),
    ],
)
def test_sglang_generate_names_what_sglang_names_first(
    client: httpx.Client, body: dict, status: int, named: str
) -> None:
    """A body SGLang 0.5.23 would refuse for a field it judges by the server's settings (a
    ``lora_path``, ``max_thinking_tokens``, hidden states) before an item's sampling ranges is not
    refused by the router for the ranges: it is forwarded, and the answer (the engine's 400, in
    SGLang's words for a server started as the fleet starts it) names what SGLang names; what
    SGLang refuses before such a field (a short list) or in an earlier item is still the router's
    422 (core.sglang_contract ``tokenizer_refusal``)."""
    r = client.post("/generate", json={"input_ids": [3, 4], **body})
    text = r.json()["detail"] if r.status_code == 422 else r.text
    assert r.status_code == status and named in text, r.text


def test_sglang_generate_refuses_choice_before_any_replica(client: httpx.Client) -> None:
    """``sampling_params.choice``: SGLang 0.5.23's gate takes it and its ``/generate`` then fails
    with a 500 (:data:`core.sglang_contract.NO_CHOICE`), which the router would take for a failing
    replica and fail over on; the router refuses it itself, a 422 naming it, and no request reaches
    a replica."""

    def sent() -> float:
        samples = samples_of(client.get("/metrics").text)
        names = ("mixfleet_router_generate_requests_total", "mixfleet_router_failovers_total")
        return sum(v for (name, _), v in samples.items() if name in names)

    before = sent()
    for stream in (False, True):  # streamed too: SGLang's stream would break off (no event)
        body = {"input_ids": [3, 4], "sampling_params": {"choice": ["a", "b"]}, "stream": stream}
        r = client.post("/generate", json=body)
        assert r.status_code == 422 and "sampling_params.choice is not supported" in r.json()["detail"], (
            r.text
        )
    assert sent() == before


@pytest.mark.parametrize(
    ("body", "named"),
    [
        # SGLang 0.5.23 answers a 500 (core.sglang_contract.NO_SHORT_LIST)
        (
            {"input_ids": [[3], [4]], "video_data": ["https://example.invalid/a.mp4"]},
            "video_data has 1 entries",
        ),
        ({"input_ids": [3, 4], "sampling_params": []}, "sampling_params has 0 entries for a batch of 1"),
        ({"text": ["a", "b"], "input_ids": [[3]]}, "takes a request's shape from text"),
        ({"input_ids": [3, 4], "sampling_params": [{}]}, "sampling_params is a list for one request"),
        ({"input_ids": [3, 4], "sampling_params": {"n": None}}, "sampling_params.n is null"),
        ({"input_ids": [3, 4], "rid": ["a"]}, "rid is a list for one request"),
        # a list where one request's scheduler reads one value may end the replica: refused
        # even where the server would judge another field first (core.sglang_contract.NO_ONE_VALUE_LIST)
        (
            {"input_ids": [3, 4], "return_logprob": True, "logprob_start_len": [0]},
            "logprob_start_len is a list for one request",
        ),
        ({"input_ids": [3, 4], "return_logprob": [False]}, "return_logprob is a list for one request"),
        # a logprob_start_len below -1 that asks for log-probs may end the replica (an assertion in
        # its scheduler, core.sglang_contract.NO_LOGPROB_START_BELOW): refused, a LoRA adapter too
        (
            {"input_ids": [3, 4], "return_logprob": True, "logprob_start_len": -2, "lora_path": "a"},
            "logprob_start_len=-2 with return_logprob: SGLang 0.5.23",
        ),
        (
            {"input_ids": [[3], [4]], "return_logprob": [False, True], "logprob_start_len": [-5, -3]},
            "logprob_start_len=-3 with return_logprob (item 1)",
        ),
        (
            {"input_ids": [3, 4], "top_logprobs_num": [1], "lora_path": "a"},
            "top_logprobs_num is a list for one request",
        ),
        (
            {"input_ids": [[3], [4]], "return_logprob": [True]},
            "return_logprob has 1 entries for a batch of 2",
        ),
        ({"input_ids": [[3], [4]], "lora_path": [None]}, "lora_path has 1 entries for a batch of 2"),
        ({"input_ids": [[3], [4]], "bootstrap_room": []}, "bootstrap_room has 0 entries for a batch of 2"),
        # parallel samples make one request a batch of one: an empty list is SGLang's IndexError
        (
            {"input_ids": [3, 4], "sampling_params": {"n": 2}, "bootstrap_host": []},
            "bootstrap_host has 0 entries for a batch of 1",
        ),
        ({"input_ids": [3, 4], "sampling_params": {"n": 2}, "lora_path": []}, "lora_path has 0 entries"),
        (
            {"input_ids": [[3], [4]], "sampling_params": [{}]},
            "sampling_params has 1 entries for a batch of 2",
        ),
        # the gate's, the parse's and the tokenizer manager's refusals of the nested structs
        ({"input_ids": [3, 4], "image_data": {"url": "u", "zoom": 2}}, "image_data: unknown field `zoom`"),
        ({"input_ids": [3, 4], "kv_hints": 5}, "kv_hints: invalid type: integer `5`"),
        ({"input_ids": [[3], [4]], "mm_hashes": ["a"]}, "The length of mm_hashes should equal the batch"),
        # mm_content_hashes, dataclass-only (io_struct.py 219-221), judged after mm_hashes (687-720)
        (
            {"input_ids": [[3], [4]], "mm_content_hashes": [None]},
            "The length of mm_content_hashes should equal the batch size",
        ),
        (
            {"input_ids": [3, 4], "sampling_params": {"n": 2}, "mm_content_hashes": [["a"]]},
            "mm_content_hashes[0] has 1 entries for 0 images",
        ),
        ({"input_ids": [3, 4], "mm_content_hashes": "a"}, "mm_content_hashes: invalid type"),
        (
            {"input_ids": [[3], [4]], "image_data": [["u"], None], "mm_hashes": [["a"], ["b"]]},
            "mm_hashes[1] has 1 entries for 0 images",
        ),
        ({"input_ids": [3, 4], "kv_hints": {"message_id": "m"}}, "Malformed kv_hints envelope"),
        (
            {"input_ids": [3, 4], "images_config": {"prefix": None}},
            "images_config.prefix: invalid type: null",
        ),
        ({"input_ids": [3, 4], "return_indexer_topk": None}, "return_indexer_topk: invalid type: null"),
        # a malformed watermark, named before a range as SGLang names it
        (
            {"input_ids": [3, 4], "watermark": {"key": "zz"}, "sampling_params": {"top_p": 1.5}},
            "watermark key",
        ),
    ],
)
def test_sglang_generate_refuses_the_nested_structs_before_any_replica(
    client: httpx.Client, body: dict, named: str
) -> None:
    """What SGLang 0.5.23 refuses in the nested ``/generate`` structs, or answers with a 500 (a
    batch's short ``video_data`` or ``sampling_params`` list), the router refuses itself: a 422
    naming it, and no request reaches a replica (core.sglang_contract)."""

    def sent() -> float:
        samples = samples_of(client.get("/metrics").text)
        names = ("mixfleet_router_generate_requests_total", "mixfleet_router_failovers_total")
        return sum(v for (name, _), v in samples.items() if name in names)

    before = sent()
    for stream in (False, True):  # streamed too: SGLang's stream would break off (no event)
        r = client.post("/generate", json={**body, "stream": stream})
        assert r.status_code == 422 and named in r.json()["detail"], r.text
    assert sent() == before


def test_sglang_generate_passthrough_sticks_to_a_key(client: httpx.Client) -> None:
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
        "return_logprob": True,
    }
    r = client.post("/generate", json=body, headers={"X-Session-ID": "agent-7"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3
    again = client.post("/generate", json=body, headers={"X-SMG-Routing-Key": "agent-7"}).json()
    assert again["output_ids"] == out["output_ids"]  # greedy, same replica
    assert client.get("/model_info").json()["model_type"] == "qwen3_moe"
    assert "mixfleet_router" in client.get("/server_info").json()
    assert client.get("/health").status_code == 200


def test_heartbeat_replica_joins_then_times_out_and_the_session_moves(
    client: httpx.Client, engine_url
) -> None:  # noqa: E501
    """A sidecar-registered replica serves group cpu-b; when its heartbeats stop it leaves
    rotation, and the next turn of a cpu-b session moves to cpu-a, recorded as a move."""
    other_name = engine_url.replace("127.0.0.1", "localhost")  # the same engine, as another replica
    hb = {
        "replica_id": "side-1",
        "group": "cpu-b",
        "url": other_name,
        "ready": True,
        "active_version": 0,
        "running": 0,
        "queued": 0,
        "tokens_per_s": 0.0,
        "error": None,
    }
    r = client.post("/v1/replicas/heartbeat", json=hb)
    assert r.status_code == 200 and r.json()["in_rotation"] is True
    assert client.post("/v1/replicas/heartbeat", json={**hb, "group": "nope"}).status_code == 422
    # a preset's replica cannot be taken over by a heartbeat naming its id (it moved it before)
    taken = client.post("/v1/replicas/heartbeat", json={**hb, "replica_id": "cpu-a/0"})
    assert taken.status_code == 409 and "'cpu-a/0' is listed in the preset" in taken.json()["detail"], (
        taken.text
    )
    cpu_a = next(g for g in client.get("/v1/groups").json()["groups"] if g["name"] == "cpu-a")
    assert [r["url"] for r in cpu_a["replicas"]] == [engine_url.rstrip("/")], cpu_a
    for field, bad in [("ready", "yes"), ("ready", 1), ("active_version", 2**63), ("active_version", "0"),
                       ("running", 1.0), ("queued", 2**31), ("tokens_per_s", "1")]:  # fmt: skip
        r = client.post("/v1/replicas/heartbeat", json={**hb, "replica_id": "side-bad", field: bad})
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", field], (field, bad, r.text)
    groups = client.get("/v1/groups").json()["groups"]
    assert "side-bad" not in {x["replica_id"] for g in groups for x in g["replicas"]}
    sid = _session(client, group="cpu-b")
    t0 = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2], "sampling_params": SP}).json()
    assert (t0["group"], t0["replica"], t0["moved_from"]) == ("cpu-b", "side-1", None)
    _wait_in_rotation(client, "cpu-b", False)  # heartbeat timeout is 2 s
    t1 = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2, 3], "sampling_params": SP})
    assert t1.status_code == 200, t1.text
    assert (t1.json()["group"], t1.json()["moved_from"]) == ("cpu-a", "cpu-b")
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["group"] == "cpu-a" and info["turns"] == 2
    traj = client.get(f"/v1/sessions/{sid}/trajectory").json()
    assert [t["moved_from"] for t in traj["turns"]] == [None, "cpu-b"]
    assert client.delete("/v1/replicas/side-1").status_code == 200


def _serving(client: httpx.Client, engine_url: str, version: int) -> dict:
    """Heartbeat a ``cpu-b`` replica (the engine under another name) reporting ``version``: the
    newest version a replica serves, while nothing is published. Returns its heartbeat."""
    hb = {
        "replica_id": f"side-v{version}",
        "group": "cpu-b",
        "url": engine_url.replace("127.0.0.1", "localhost"),
    }
    assert client.post(
        "/v1/replicas/heartbeat", json={**hb, "ready": True, "active_version": version}
    ).is_success
    return hb


def test_too_old_trajectories_are_held_back_and_counted(client: httpx.Client, engine_url) -> None:
    """Nothing is published; a replica serving version 5 makes trainer_version 5 one the fleet
    serves, and the engine's version-0 trajectory 5 versions old."""
    sid = _session(client, group="cpu-a")
    client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1], "sampling_params": SP})
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.0})
    try:
        _serving(client, engine_url, 5)
        r = client.post("/v1/batches/take", json={"size": 50, "trainer_version": 5, "max_version_age": 2})
        r = r.json()
        assert sid not in [t["session_id"] for t in r["trajectories"]] and r["held_back"] >= 1
        assert client.get("/v1/batches/stats").json()["held_back"] >= 1
        assert "mixfleet_router_trajectories_held_back" in client.get("/metrics").text
        _serving(client, engine_url, 5)
        drained = client.post("/v1/batches/take", json={"size": 50, "trainer_version": 5}).json()
    finally:
        assert client.delete("/v1/replicas/side-v5").status_code == 200
    got = {t["session_id"]: t for t in drained["trajectories"]}
    assert got[sid]["version_age"]["min"] == 5 and drained["held_back"] == 0
    for lease in (r["lease_id"], drained["lease_id"]):
        client.post(f"/v1/batches/{lease}/ack")


def test_a_trainer_version_above_every_servable_version_is_a_409_and_takes_nothing(
    client: httpx.Client, engine_url
) -> None:
    """As a turn's min_version: nothing is published and the engine serves 0, so trainer_version 7
    is a 409 naming the versions, before anything is taken; 2**63 is beyond what a batch carries
    (the kit's int64 versions): 422; once a replica serves 9, 7 is taken."""
    sid = _session(client, group="cpu-a")
    client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1], "sampling_params": SP})
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.5})
    ready = client.get("/v1/batches/stats").json()["ready"]
    r = client.post("/v1/batches/take", json={"size": 50, "trainer_version": 7})
    assert r.status_code == 409, r.text
    assert r.json() == {
        "detail": "trainer_version 7 cannot be met: no version is published and the newest a replica "
        "serves is 0; publish it first or ask for a lower one",
        "constraint": "trainer_version",
        "target_version": 7,
        "latest_version": None,
        "served_version": 0,
        "publishing_version": None,
    }
    for too_big in (2**63, 10**30):
        r = client.post("/v1/batches/take", json={"size": 50, "trainer_version": too_big})
        assert r.status_code == 422 and r.json()["detail"].startswith("trainer_version: Input should be"), (
            r.text
        )
    assert client.get("/v1/batches/stats").json()["ready"] == ready  # nothing was taken
    try:
        _serving(client, engine_url, 9)
        taken = client.post("/v1/batches/take", json={"size": 50, "trainer_version": 7})
    finally:
        assert client.delete("/v1/replicas/side-v9").status_code == 200
    assert taken.status_code == 200, taken.text
    got = {t["session_id"]: t for t in taken.json()["trajectories"]}
    assert got[sid]["version_age"]["min"] == 7
    assert client.post(f"/v1/batches/{taken.json()['lease_id']}/ack").status_code == 200
    spec = client.get("/openapi.json").json()
    conflict = spec["paths"]["/v1/batches/take"]["post"]["responses"]["409"]
    assert conflict["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/VersionConflict"
    fields = spec["components"]["schemas"]["TakeRequest"]["properties"]
    assert fields["trainer_version"]["anyOf"][0]["maximum"] == float(2**63 - 1)  # JSON writes it as a float
    for name in ("size", "wait_s", "max_version_age", "trainer_version"):
        assert len(fields[name]["description"]) > 60, name


def test_a_trainer_version_that_a_running_publish_job_publishes_is_taken(
    engine_url, redis_url, tmp_path
) -> None:
    """A trainer that has started publishing version v measures its next batch against v while the
    job runs (its ages are v's): taken, whichever router holds the job (here the test, as another
    router sharing the real redis-server); v + 1 is a 409 naming the job's version; once the job
    lock is free, v is above every version again."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    redis.Redis.from_url(redis_url).flushdb()
    view = {"job_id": "j1", "kind": "publish", "run_id": "r", "version": 3, "state": "running"}

    async def job(hold: bool) -> None:
        async with opened(redis_url) as store:
            if hold:
                assert await store.acquire_job_lock("j1", 60.0)
                await store.put_job("j1", view, 10)
            else:
                assert await store.release_job_lock("j1")

    with (
        router_process(preset, state=redis_url) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
    ):
        sid = _session(c, group="cpu-a")
        assert c.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1], "sampling_params": SP}).is_success
        assert c.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).is_success
        asyncio.run(job(hold=True))
        r = c.post("/v1/batches/take", json={"size": 8, "trainer_version": 4})
        assert r.status_code == 409 and r.json()["publishing_version"] == 3, r.text
        assert "a running publish job publishes 3" in r.json()["detail"]
        taken = c.post("/v1/batches/take", json={"size": 8, "trainer_version": 3}).json()
        assert [t["version_age"]["min"] for t in taken["trajectories"]] == [3]
        assert c.post(f"/v1/batches/{taken['lease_id']}/ack").status_code == 200
        asyncio.run(job(hold=False))
        r = c.post("/v1/batches/take", json={"size": 8, "trainer_version": 3})
        assert r.status_code == 409 and r.json()["publishing_version"] is None, r.text


def test_lease_ids_in_paths_are_validated_before_any_lookup(client: httpx.Client) -> None:
    """A lease id no take could have made (32 lowercase hex digits, uuid4().hex) is a 422 naming
    lease_id, short, on ack and on the log-prob upload; a well-formed unknown one is a 404."""
    upload = {"Content-Type": "application/x-mixfleet-logprobs"}
    empty = b"MFL\x01" + bytes(4)  # an upload of no log-probs
    for bad in ("x" * 5000, "%00%FF", "a.b", "0" * 31, "A" * 32, "0" * 33, "no-such-lease"):
        for r in (
            client.post(f"/v1/batches/{bad}/ack"),
            client.post(f"/v1/batches/{bad}/trainer_logprobs", content=empty, headers=upload),
        ):
            assert r.status_code == 422 and r.json()["detail"].startswith("lease_id: String should"), r.text
            assert len(r.text) < 1000 and "xxxxxxxxxx" not in r.text, r.text
    r = client.post(f"/v1/batches/{UNKNOWN_LEASE}/trainer_logprobs", content=empty, headers=upload)
    assert r.status_code == 404 and UNKNOWN_LEASE in r.json()["detail"]
    spec = client.get("/openapi.json").json()
    for path in ("/v1/batches/{lease_id}/ack", "/v1/batches/{lease_id}/trainer_logprobs"):
        [param] = spec["paths"][path]["post"]["parameters"]
        assert param["schema"]["pattern"] == f"^{LEASE_ID}$", param


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/batches/take", {"size": "5"}, "size"),
        ("/v1/batches/take", {"size": True}, "size"),
        ("/v1/batches/take", {"size": 5.0}, "size"),
        ("/v1/batches/take", {"size": 1, "wait_s": "0"}, "wait_s"),
        ("/v1/batches/take", {"size": 1, "wait_s": False}, "wait_s"),
        ("/v1/batches/take", {"size": 1, "max_version_age": "2"}, "max_version_age"),
        ("/v1/batches/take", {"size": 1, "trainer_version": True}, "trainer_version"),
        ("/v1/batches/take", {"size": 1, "trainer_version": "0"}, "trainer_version"),
        ("/v1/score", {"input_ids": [[1, 2]], "logprob_start_len": "0"}, "logprob_start_len"),
        ("/v1/sessions", {"record_routes": 1}, "record_routes"),
        ("/v1/sessions", {"record_routes": "true"}, "record_routes"),
        ("{sid}/finish", {"reward": "1"}, "reward"),
        ("{sid}/finish", {"reward": True}, "reward"),
        ("{sid}/turns", {"input_ids": [1], "min_version": "0"}, "min_version"),
        ("{sid}/turns", {"input_ids": [1], "turn": True}, "turn"),
        ("{sid}/turns", {"input_ids": [1], "return_support": 1}, "return_support"),
        ("{sid}/turns", {"input_ids": [1], "sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens"),
        ("{sid}/turns", {"input_ids": [1], "sampling_params": {"temperature": True}}, "temperature"),
        ("{sid}/turns", {"input_ids": [1], "sampling_params": {"seed": 1.0}}, "seed"),
        # token ids too, each refusal naming the position (router.schemas.TokenArray)
        ("{sid}/turns", {"input_ids": [5, True]}, f"input_ids: Value error, [1] = true {NOT_AN_ID}"),
        ("{sid}/turns", {"input_ids": [0, 1, False]}, f"input_ids: Value error, [2] = false {NOT_AN_ID}"),
        ("{sid}/turns", {"input_ids": [5, "1"]}, f'input_ids: Value error, [1] = "1" {NOT_AN_ID}'),
        ("{sid}/turns", {"append_ids": [True]}, f"append_ids: Value error, [0] = true {NOT_AN_ID}"),
        ("{sid}/turns", {"input_ids": [1], "sampling_params": {"stop_token_ids": [2, True]}}, "[1] = true"),
        (
            "/v1/score",
            {"input_ids": [[1, 2], [3, True]]},
            f"input_ids: Value error, [1][1] = true {NOT_AN_ID}",
        ),
        ("/v1/score", {"input_ids": [["1"]]}, f'input_ids: Value error, [0][0] = "1" {NOT_AN_ID}'),
        # SGLang's /generate refuses them as SGLang 0.5.23 does, an integral float too
        ("/generate", {"input_ids": [5, True]}, f"input_ids: Value error, [1] = true {NOT_AN_ID}"),
        ("/generate", {"input_ids": [[5], ["1"]]}, f'input_ids: Value error, [1][0] = "1" {NOT_AN_ID}'),
        ("/generate", {"input_ids": [5, 3.0]}, f"input_ids: Value error, [1] = 3.0 {NOT_AN_ID}"),
        ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [True]}}, "stop_token_ids"),
        # and the rest of what SGLang 0.5.23 refuses in what it forwards (core.sglang_contract)
        (
            "/generate",
            {"input_ids": [5], "stream": 1},
            "body: stream: invalid type: integer `1`, expected a boolean",
        ),
        ("/generate", {"input_ids": [5], "stream": "true"}, 'stream: invalid type: string "true"'),
        ("/generate", {"input_ids": [5], "stream": None}, "stream: invalid type: null"),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"top_k": 3.0}},
            "sampling_params.top_k: invalid type",
        ),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"max_new_tokens": "4"}},
            "sampling_params.max_new_tokens",
        ),
        ("/generate", {"input_ids": [5], "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
        ("/generate", {"input_ids": [5], "sampling_params": {"max_tokens": 4}}, "unknown field `max_tokens`"),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"top_k": 0}},
            "top_k must be -1 (disable) or at least 1",
        ),
        ("/generate", {"input_ids": [5], "sampling_params": {"min_p": 1.5}}, "min_p must be in [0, 1]"),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"repetition_penalty": 0}},
            "repetition_penalty must be",
        ),
        (
            "/generate",
            {"input_ids": [[5], [6]], "sampling_params": [{}, {"temperature": "0"}]},
            "sampling_params[1]",
        ),
        ("/generate", {"input_ids": [5], "return_logprob": 1}, "return_logprob: invalid type"),
        # the other top-level keys SGLang's gate decodes (api/v1/api_types.py 1435-1494)
        ("/generate", {"input_ids": [5], "lora_path": 5}, "lora_path: invalid type: integer `5`"),
        ("/generate", {"input_ids": [5], "priority": "3"}, 'priority: invalid type: string "3"'),
        ("/generate", {"input_ids": [5], "return_hidden_states": "last"}, "return_hidden_states"),
    ],
)
def test_numbers_and_booleans_of_session_and_trainer_bodies_are_strict(
    client: httpx.Client, path: str, body: dict, field: str
) -> None:
    """A string, a boolean or a float where the body wants an integer (or a string or boolean where
    it wants a number, a number where it wants a boolean) is a 422 naming the field, and changes
    nothing: the session stays open and turnless, nothing is taken."""
    sid = _session(client, group="cpu-a")
    ready = client.get("/v1/batches/stats").json()["ready"]
    r = client.post(path.replace("{sid}", f"/v1/sessions/{sid}"), json=body)
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"], r.text
    info = client.get(f"/v1/sessions/{sid}").json()
    assert (info["status"], info["turns"]) == ("open", 0)
    assert client.get("/v1/batches/stats").json()["ready"] == ready
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "detail"),
    [
        ("/v1/batches/take", {"size": 10**30}, "size: Input should be less than or equal to 4096"),
        ("/v1/batches/take", {"size": -(10**30)}, "size: Input should be greater than or equal to 1"),
        ("/v1/batches/take", {"size": 2**64}, "size: Input should be less than or equal to 4096"),
        (
            "{sid}/turns",
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**30}},
            "sampling_params.max_new_tokens: Input should be less than or equal to 1000000",
        ),
        # unbounded fields name the largest integer a body carries (router.schemas.unbounded_int)
        (
            "/v1/batches/take",
            {"size": 1, "max_version_age": 10**30},
            "max_version_age: Input should be an integer below 2**64",
        ),
        (
            "{sid}/turns",
            {"input_ids": [1], "min_version": 2**64},
            "min_version: Input should be an integer below 2**64",
        ),
        (
            "{sid}/turns",
            {"input_ids": [1], "turn": -(10**30)},
            "turn: Input should be greater than or equal to 0",
        ),
        (
            "/v1/score",
            {"input_ids": [[1, 2]], "logprob_start_len": 10**30},
            "logprob_start_len: Input should be an integer below 2**64",
        ),
    ],
)
def test_an_integer_beyond_64_bits_is_refused_naming_the_range(
    client: httpx.Client, path: str, body: dict, detail: str
) -> None:
    """The body's decoder reads an integer beyond 64 bits as a float; a bounded field refuses it
    naming its range, as it refuses the first integer past its bound, an unbounded one naming the
    limit (a negative one: its lower bound), not as "not an integer"."""
    sid = _session(client, group="cpu-a")
    r = client.post(path.replace("{sid}", f"/v1/sessions/{sid}"), json=body)
    assert r.status_code == 422 and r.json()["detail"].startswith(detail), r.text
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200


def test_an_unbounded_integer_field_still_takes_every_64_bit_integer(client: httpx.Client) -> None:
    """The limit refuses nothing that was taken before: ``2**64 - 1`` (the largest integer the
    body's decoder reads as one) is still a valid ``max_version_age``."""
    r = client.post("/v1/batches/take", json={"size": 1, "max_version_age": 2**64 - 1})
    assert r.status_code == 200, r.text
    if r.json()["lease_id"] is not None:
        assert client.post(f"/v1/batches/{r.json()['lease_id']}/ack").status_code == 200


def test_an_integer_reward_is_a_float_reward(client: httpx.Client) -> None:
    sid = _session(client, group="cpu-a")
    assert client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1], "sampling_params": SP}).is_success
    r = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1})
    assert r.status_code == 200, r.text
    reward = client.get(f"/v1/sessions/{sid}").json()["reward"]
    assert reward == 1.0 and isinstance(reward, float)


def test_openapi_and_metrics(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path in (
        "/v1/sessions",
        "/v1/sessions/{session_id}/turns",
        "/v1/sessions/{session_id}/finish",
        "/v1/sessions/{session_id}/trajectory",
        "/v1/batches/take",
        "/v1/batches/{lease_id}/ack",
        "/v1/groups",
        "/v1/replicas/heartbeat",
        "/generate",
        "/healthz",
        "/metrics",
    ):
        assert path in spec["paths"], path
    turn_req = spec["components"]["schemas"]["TurnRequest"]["properties"]
    assert {"input_ids", "append_ids", "sampling_params", "min_version", "max_version_age"} <= set(turn_req)
    text = client.get("/metrics").text
    for name in (
        "mixfleet_router_request_seconds_bucket",
        "mixfleet_router_turns_total",
        "mixfleet_router_forks_total",
        "mixfleet_router_tokens_total",
        "mixfleet_group_capacity",
        "mixfleet_group_active_sessions",
        "mixfleet_group_active_version",
        "mixfleet_router_leases_total",
    ):
        assert name in text, name
    # requests are timed by route template and status class: a turn of this test's own (not one
    # an earlier test left), observed as its request ends, just after its answer was sent
    sid = _session(client, group="cpu-a")
    turn = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2], "sampling_params": SP})
    assert turn.status_code == 200, turn.text
    want = 'mixfleet_router_request_seconds_count{route="/v1/sessions/{session_id}/turns",status="2xx"}'
    deadline = time.monotonic() + 10
    while want not in (text := client.get("/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.1)
    counts = [x for x in text.splitlines() if x.startswith("mixfleet_router_request_seconds_count")]
    assert want in text, counts
    groups = client.get("/v1/groups").json()["groups"]
    a = next(g for g in groups if g["name"] == "cpu-a")
    assert a["capacity"] == 8 and a["active_version"] == 0 and a["tokens_total"] > 0


def test_a_body_over_the_limit_is_413_naming_it_declared_or_streamed(client: httpx.Client) -> None:
    """The router's ``--max-body-bytes`` (65536 here): a declared Content-Length over it and a
    chunked body that passes it are both a JSON 413 naming the limit, on the token API and the
    chat API; nothing is stored, and the request metrics count them as 4xx."""
    sid = _session(client, group="cpu-a")
    body = json.dumps({"input_ids": [1] * 40_000, "sampling_params": SP}).encode()
    declared = client.post(f"/v1/sessions/{sid}/turns", content=body)
    streamed = client.post(
        f"/v1/sessions/{sid}/turns", content=iter([body[i : i + 4096] for i in range(0, len(body), 4096)])
    )
    assert "content-length" not in streamed.request.headers  # sent chunked
    chat = client.post(
        f"/v1/sessions/{sid}/openai/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x" * 70_000}]},
    )
    for r, size in ((declared, f"{len(body)} bytes"), (streamed, "body"), (chat, "bytes")):
        assert r.status_code == 413, r.text
        assert size in r.json()["detail"] and "limit of 65536 bytes" in r.json()["detail"], r.text
    assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 0
    want = 'mixfleet_router_request_seconds_count{route="/v1/sessions/{session_id}/turns",status="4xx"}'
    deadline = time.monotonic() + 10
    while want not in (text := client.get("/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert want in text


def test_streaming_generate_passes_through(client: httpx.Client) -> None:
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "stream": True,
    }
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1].strip() == "data: [DONE]"
    assert len(events) >= 2


def test_a_streamed_generate_the_engine_refuses_is_its_error_event_passed_through(
    client: httpx.Client,
) -> None:
    """A ``"stream": true`` body the router forwards and the engine's tokenizer manager refuses
    (here ``lora_path``, which the router forwards: SGLang 0.5.23 refuses it on a server without
    ``--enable-lora``, tokenizer_manager.py 3723-3740) is answered as SGLang answers it, inside a
    200 stream (entrypoints/http_server.py 949-979): one error event naming the problem with
    code 400, then ``[DONE]``, passed through to the caller unchanged, the replica kept (a
    request's fault, no failover)."""
    body = {"input_ids": [3, 4, 5], "lora_path": "adapter", "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 2 and events[1].strip() == "data: [DONE]", events
    error = json.loads(events[0].removeprefix("data:"))["error"]
    assert error["code"] == 400 and error["retryable"] is False and error["type"] == "invalid_request_error"
    assert "LoRA adapter 'adapter' was requested, but LoRA is not enabled" in error["message"], error
    ok = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}}
    assert client.post("/generate", json=ok).status_code == 200  # the replica still serves


def test_a_min_version_above_every_servable_version_is_a_409_naming_the_versions(
    client: httpx.Client, engine_url
) -> None:
    """Nothing is published here and the engine serves version 0: min_version 7 is the caller's
    conflict (409 with the versions, nothing asked of a replica); once a replica reports 9, 7 is
    servable but not by the session's group yet (503, retry); 0 is served."""
    sid = _session(client, group="cpu-a")
    r = client.post(
        f"/v1/sessions/{sid}/turns", json={"input_ids": [1], "sampling_params": SP, "min_version": 7}
    )
    assert r.status_code == 409 and "Retry-After" not in r.headers, r.text
    assert r.json() == {
        "detail": "min_version 7 cannot be met: no version is published and the newest a replica "
        "serves is 0; publish it first or ask for a lower one",
        "constraint": "min_version",
        "target_version": 7,
        "latest_version": None,
        "served_version": 0,
        "publishing_version": None,
    }
    hb = {"replica_id": "side-v9", "group": "cpu-b", "url": engine_url.replace("127.0.0.1", "localhost")}
    assert client.post("/v1/replicas/heartbeat", json={**hb, "ready": True, "active_version": 9}).is_success
    try:
        r = client.post(
            f"/v1/sessions/{sid}/turns", json={"input_ids": [1], "sampling_params": SP, "min_version": 7}
        )
        assert r.status_code == 503 and ">= 7" in r.json()["detail"] and "Retry-After" in r.headers
    finally:
        assert client.delete("/v1/replicas/side-v9").status_code == 200
    ok = client.post(
        f"/v1/sessions/{sid}/turns", json={"input_ids": [1], "sampling_params": SP, "min_version": 0}
    )
    assert ok.status_code == 200 and ok.json()["records"][0]["weight_version"] == 0
    assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 1  # the refused turns left no trace
    spec = client.get("/openapi.json").json()
    conflict = spec["paths"]["/v1/sessions/{session_id}/turns"]["post"]["responses"]["409"]
    ref = conflict["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/VersionConflict"
    fields = spec["components"]["schemas"]["VersionConflict"]["properties"]
    assert {"detail", "constraint", "target_version", "latest_version", "served_version"} <= set(fields)
    assert "publishing_version" in fields


def test_an_empty_take_has_no_lease(client: httpx.Client) -> None:
    while True:  # drain what earlier tests left
        batch = client.post("/v1/batches/take", json={"size": 4096, "trainer_version": 0}).json()
        if not batch["trajectories"]:
            break
        assert client.post(f"/v1/batches/{batch['lease_id']}/ack").status_code == 200
    assert batch == {
        "lease_id": None,
        "trajectories": [],
        "held_back": batch["held_back"],
        "trainer_version": batch["trainer_version"],
    }
    binary = client.post("/v1/batches/take", json={"size": 8}, headers={"Accept": MEDIA_TYPE})
    assert decode_batch(binary.content)["lease_id"] is None
    assert client.get("/v1/batches/stats").json()["leases"] == 0  # nothing to acknowledge
    r = client.post(f"/v1/batches/{UNKNOWN_LEASE}/ack")
    assert r.status_code == 404 and UNKNOWN_LEASE in r.json()["detail"]
    spec = client.get("/openapi.json").json()
    lease = spec["components"]["schemas"]["TakeResponse"]["properties"]["lease_id"]
    assert {"type": "null"} in lease["anyOf"] and "null" in lease["description"]


def _sessions_created(client: httpx.Client, group: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'mixfleet_router_sessions_created_total{{group="{group}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sessions_created_is_a_counter(client: httpx.Client) -> None:
    before = _sessions_created(client, "cpu-a")
    for _ in range(3):
        _session(client, group="cpu-a")
    assert _sessions_created(client, "cpu-a") == before + 3
    text = client.get("/metrics").text
    assert "# TYPE mixfleet_router_sessions_created_total counter" in text
    assert not [line for line in text.splitlines() if "_created{" in line or "_created " in line]


def test_health_answers_its_documented_json(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}
    spec = client.get("/openapi.json").json()
    ok = spec["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert ok == {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}}


def test_every_refusal_is_documented_with_the_one_error_schema(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert set(schemas["ErrorBody"]["required"]) == {"detail"}
    seen = set()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                if not status.startswith("4"):
                    continue
                seen.add(status)
                ref = response["content"]["application/json"]["schema"]["$ref"]
                expected = {
                    ("/generate", "400"): "GenerateRefusal",
                    ("/v1/sessions/{session_id}/turns", "409"): "VersionConflict",  # an ErrorBody and more
                    ("/v1/batches/take", "409"): "VersionConflict",
                }.get((path, status), "ErrorBody")
                assert ref == f"#/components/schemas/{expected}", (method, path, status)
            if op.get("security"):  # every route behind a key documents both auth refusals
                assert {"401", "403"} <= set(op["responses"]), (method, path)
    assert {"400", "401", "403", "404", "409", "413", "422"} <= seen
    turn = spec["paths"]["/v1/sessions/{session_id}/turns"]["post"]["responses"]
    assert {"401", "403", "404", "409", "413", "422", "503"} <= set(turn)
    # a 422 as documented: detail names the field, errors lists each problem
    sid = _session(client, group="cpu-a")
    r = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [], "sampling_params": {"top_p": 0}})
    body = r.json()
    assert r.status_code == 422 and isinstance(body["detail"], str) and len(body["errors"]) == 2
    assert {tuple(e["loc"]) for e in body["errors"]} == {
        ("body", "input_ids"),
        ("body", "sampling_params", "top_p"),
    }


def test_score_on_an_empty_list_of_groups_is_a_422_not_every_group(client: httpx.Client) -> None:
    """``groups: []`` names no group to score on; it was read as "every group" (null's meaning),
    so a trainer whose filter left no group had every replica of the fleet score its sequences."""
    r = client.post("/v1/score", json={"input_ids": [[1, 2, 3]], "groups": []})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("groups:"), r.text


# Values of the /generate fields where SGLang 0.5.23 refuses, serves, fails with a 500 or dies in
# its scheduler (docs/sglang-contract.md rows 25-28): the router must answer each body itself or
# forward it to an engine that answers it, never fail over (an engine's 5xx or broken stream).
_FUZZ_FIELDS: dict[str, list] = {
    "n": [1, 2, None, "2"],
    "return_logprob": [True, False, [True], [True, False], None],
    "logprob_start_len": [-5, -1, 0, 2, 3, 4, [0], [0, 1]],
    "top_logprobs_num": [-1, 0, 2, [1], [1, 1, 1]],
    "return_sampling_mask": [True, [True]],
    "sampling_logprobs_mode": ["support", "selected", "bogus", ["support"]],
    "rid": ["r", ["a", "b"], ["a", "a"], ["a"], 7],
    "lora_path": [[], "x", [None, None]],
    "video_data": [[], [None]],
    "mm_content_hashes": [["h"], [["h"]], 3],
    "routed_experts_start_len": [0, 2, 9],
    "return_routed_experts": [True],
    "token_ids_logprob": [[1], [10**9]],
    "stream": [True, False],
}


def _fuzz_body(rng) -> dict:
    """A random /generate body: one or two prompts, a sampling_params object or list of either
    length, and a few of :data:`_FUZZ_FIELDS` (each a value drawn from its pool)."""
    batch = rng.random() < 0.5
    ids = [[3, 4, 5], [6, 7]] if batch else [3, 4, 5]
    params = {"max_new_tokens": rng.choice([1, 2]), "top_k": rng.choice([-1, 2, 4096]), "top_p": 0.9}
    body = {
        "input_ids": ids,
        "sampling_params": rng.choice([params, [params], [params, params], [params] * 3]),
    }
    for key in rng.sample(sorted(_FUZZ_FIELDS), rng.randint(1, 4)):
        body[key] = rng.choice(_FUZZ_FIELDS[key])
    return body


def _other_rids(body: dict) -> dict:
    """``body`` with each string rid suffixed (duplicates stay duplicates)."""
    rid = body.get("rid")
    if isinstance(rid, str):
        return {**body, "rid": rid + "-again"}
    if isinstance(rid, list):
        return {**body, "rid": [x + "-again" if isinstance(x, str) else x for x in rid]}
    return body


def _answer(http: httpx.Client, url: str, body: dict) -> tuple[str, int]:
    """What ``url`` answered ``body``: ``served``, ``refused`` (a 4xx, or a stream whose first event
    is an error: SGLang's step-3 refusal inside the stream) or ``fails`` (a 5xx, or a stream broken
    off: what SGLang answers with a 500 or dies on); and the status."""
    with http.stream("POST", url, json=body, timeout=60) as r:
        try:
            text = b"".join(r.iter_bytes()).decode()
        except httpx.RemoteProtocolError:  # the connection closed inside the chunked body
            return "fails", r.status_code
    if r.status_code != 200:
        return ("refused" if r.status_code < 500 else "fails"), r.status_code
    if not body.get("stream"):
        return "served", 200
    if '"error"' in text.split("\n", 1)[0]:
        return "refused", 200
    return ("served" if text.rstrip().endswith("data: [DONE]") else "fails"), 200


def test_sglang_generate_answers_fringe_bodies_as_the_engine(client: httpx.Client, engine_url: str) -> None:
    """200 seeded random /generate bodies over the fields SGLang judges in its fringe cases, each
    sent to the engine (SGLang's stand-in) and through the router: what the engine serves the
    router serves; what the engine refuses the router refuses (its own 422, or the engine's refusal
    passed on); what SGLang answers with a 500 or dies on (the engine breaks the stream off) the
    router refuses itself, with a 422; and no request failed over (no forwarded body made the engine
    answer a 5xx)."""

    def failovers() -> float:
        samples = samples_of(client.get("/metrics").text)
        return sum(v for (name, _), v in samples.items() if name == "mixfleet_router_failovers_total")

    rng = random.Random(20261207)
    before = failovers()
    kinds: dict[str, int] = {}
    with httpx.Client() as direct:
        for _ in range(200):
            body = _fuzz_body(rng)
            engine, status = _answer(direct, engine_url + "/generate", body)
            # the router's copy under other rids: the engine may still hold the first's
            router, answered = _answer(client, "/generate", _other_rids(body))
            if engine == "fails":  # the router must not forward it
                agrees = answered == 422
            else:  # its own 422 only for what the engine refuses too
                agrees = router == engine or (engine == "refused" and answered == 422)
            assert agrees, (engine, status, body, router, answered)
            kinds[engine] = kinds.get(engine, 0) + 1
    assert failovers() == before
    assert set(kinds) == {"fails", "served", "refused"}, kinds  # the draw reaches each kind

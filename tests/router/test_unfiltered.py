"""Turns that filter nothing (temperature > 0, top_k -1, top_p 1, min_p 0), end to end: a real
router in front of a real engine, through a recording proxy that shows what the engine received
and answered. Such a turn goes to the engine exactly as asked, without a sampling mask; its
records have empty supports (the whole vocabulary) and mu = the engine's ``output_token_logprobs``
exactly; its stored block is a few bytes per token; the trainer's decoder reads the empty rows.
Filtered and greedy turns through the same path still ask for the mask."""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np
import pytest

from core.wire import RECORDS_MEDIA_TYPE as MEDIA_TYPE
from router.records import decode_turn
from tests.support.recorder import Recorder, recording_proxy
from tests.support.router import router_process, write_preset
from trainer.batch import decode_batch as trainer_decode_batch

UNFILTERED = {"temperature": 0.8, "top_k": -1, "top_p": 1.0, "max_new_tokens": 24, "seed": 5}
PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def proxy(engine_url) -> Recorder:
    with recording_proxy(engine_url) as rec:
        yield rec


@pytest.fixture(scope="module")
def client(proxy, tmp_path_factory):
    d = tmp_path_factory.mktemp("unfiltered")
    preset = write_preset(d / "preset.toml", [{"name": "cpu-rec", "replicas": [proxy.url]}])
    with (
        router_process(preset) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
    ):
        yield c


def _turn(client: httpx.Client, proxy: Recorder, sp: dict) -> tuple[dict, dict, dict]:
    """A turn of a new session: (its JSON, the /generate body the engine got, the engine's answer)."""
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    before = len(proxy.exchanges("/generate"))
    r = client.post(
        f"/v1/sessions/{sid}/turns", json={"input_ids": PROMPT, "sampling_params": sp, "return_support": True}
    )
    assert r.status_code == 200, r.text
    sent, answer = proxy.exchanges("/generate")[before]
    assert len(proxy.exchanges("/generate")) == before + 1
    return r.json(), json.loads(sent), json.loads(answer)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_an_unfiltered_turn_asks_no_mask_and_records_the_engines_log_probs(client, proxy) -> None:
    turn, sent, answer = _turn(client, proxy, UNFILTERED)
    # sent as asked: no top_k bound, no mask, no sampling_logprobs_mode (SGLang refuses it alone)
    assert sent["sampling_params"] == {
        "temperature": 0.8,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 24,
        "sampling_seed": 5,
    }
    assert "return_sampling_mask" not in sent and "sampling_logprobs_mode" not in sent
    assert sent["return_logprob"] is True
    meta = answer["meta_info"]
    assert not any(k.startswith("output_token_sampling") for k in meta)  # SGLang's no-mask answer
    assert turn["sampling"] == {"sampling_mask": False}
    assert turn["output_ids"] == answer["output_ids"] and len(turn["records"]) == len(answer["output_ids"])
    for rec, (lp, tok, text) in zip(turn["records"], meta["output_token_logprobs"], strict=True):
        assert (rec["token_id"], text) == (tok, None)
        assert rec["support_ids"] == [] and rec["support_logprobs"] == []  # the whole vocabulary
        assert rec["logprob"] == rec["raw_logprob"] == _f32(lp)  # mu: the engine's value, as float32
        assert rec["weight_version"] == 0


def test_an_unfiltered_turns_block_is_a_few_bytes_per_token_and_the_trainer_reads_it(client, proxy) -> None:
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    r = client.post(
        f"/v1/sessions/{sid}/turns",
        json={"input_ids": PROMPT, "sampling_params": UNFILTERED, "return_support": True},
    )
    turn = r.json()
    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    taken = client.post("/v1/batches/take", json={"size": 64}, headers={"Accept": MEDIA_TYPE})
    assert taken.status_code == 200
    data = taken.content
    blocks = _turn_blocks(data)
    block = next(b for b in blocks if decode_turn(b).output_ids == turn["output_ids"])
    n = len(turn["output_ids"])
    # per output token: f32 mu, f32 raw log-prob, a 0 support size and the id (< 2**14: 2 bytes)
    assert len(block) - _bytes_before_outputs(block) <= 1 + n * (4 + 4 + 1 + 2)
    batch = trainer_decode_batch(data)
    mine = batch.trajectory_index == [t["session_id"] for t in batch.trajectories].index(sid)
    assert np.all(np.diff(batch.support_offsets)[mine] == 0)  # every row empty: the whole vocabulary
    assert batch.logprobs[mine].tolist() == [rec["logprob"] for rec in turn["records"]]
    assert client.post(f"/v1/batches/{_lease(data)}/ack").status_code == 200


@pytest.mark.parametrize(
    ("sp", "top_k", "sampling"),
    [
        ({"temperature": 0.8, "top_p": 0.9}, 4096, {"top_k_bound": 4096}),
        ({"temperature": 0.8, "min_p": 0.05}, 4096, {"top_k_bound": 4096}),
        ({"temperature": 0.8, "top_k": 12}, 12, None),
        ({"temperature": 0.0}, -1, None),
    ],
    ids=json.dumps,
)
def test_filtered_and_greedy_turns_ask_for_the_mask(client, proxy, sp, top_k, sampling) -> None:
    turn, sent, answer = _turn(client, proxy, {**sp, "max_new_tokens": 6})
    assert sent["return_sampling_mask"] is True and sent["sampling_logprobs_mode"] == "support"
    assert sent["sampling_params"]["top_k"] == top_k and turn["sampling"] == sampling
    masks = answer["meta_info"]["output_token_sampling_mask"]
    for rec, mask in zip(turn["records"], masks, strict=True):
        assert rec["token_id"] in rec["support_ids"] and rec["support_ids"] == sorted(mask)
        if sp["temperature"] == 0.0:  # greedy: SGLang's top_k 1, a one-token support, mu = 0
            assert rec["support_ids"] == [rec["token_id"]] and rec["logprob"] == 0.0


def test_a_ranked_mask_is_recorded_sorted_by_id_with_its_log_probs(client, proxy) -> None:
    """The engine answers as SGLang 0.5.23 does in support mode: each mask ranked, most likely
    first, ``output_token_sampling_logprobs`` rows aligned with it, no other mask key
    (layers/sampler.py 607-624). The records hold each support sorted by id with the log-prob the
    engine sent for each id (as float32), and mu the sampled id's: a reference computed here
    from the engine's answer alone."""
    turn, sent, answer = _turn(client, proxy, {"temperature": 1.5, "top_k": 12, "max_new_tokens": 12})
    assert sent["sampling_logprobs_mode"] == "support"
    meta = answer["meta_info"]
    assert "output_token_sampling_support_logprobs" not in meta
    masks, rows = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert all(row == sorted(row, reverse=True) for row in rows)  # ranked, highest first
    assert any(mask != sorted(mask) for mask in masks)  # so the records' order is the parser's
    for rec, tok, mask, row in zip(turn["records"], answer["output_ids"], masks, rows, strict=True):
        by_id = sorted(zip(mask, row, strict=True))
        assert rec["support_ids"] == [i for i, _ in by_id]
        assert rec["support_logprobs"] == [_f32(x) for _, x in by_id]
        assert rec["token_id"] == tok and rec["logprob"] == _f32(row[mask.index(tok)])


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _turn_blocks(batch: bytes) -> list[bytes]:
    """The stored turn blocks of a binary batch (layout: router/records.py)."""
    size, pos = _varint(batch, 4)
    head = json.loads(batch[pos : pos + size])
    pos += size
    blocks = []
    for _ in range(sum(t["n_turns"] for t in head["trajectories"])):
        size, pos = _varint(batch, pos)
        blocks.append(batch[pos : pos + size])
        pos += size
    return blocks


def _lease(batch: bytes) -> str:
    size, pos = _varint(batch, 4)
    return json.loads(batch[pos : pos + size])["lease_id"]


def _bytes_before_outputs(block: bytes) -> int:
    """Bytes of a turn block up to its output-count varint: magic, format, flags, header, inputs."""
    size, pos = _varint(block, 5)
    pos += size
    n_in, pos = _varint(block, pos)
    for _ in range(n_in):
        _, pos = _varint(block, pos)
    return pos

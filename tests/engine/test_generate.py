"""``/generate`` on a real engine process: response shape, behavior records, seeds, prefix scoring
(against ``transformers``), streaming, batches, continuous batching, metrics and info routes."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch

from clients.engine import error_message
from core.sglang_release import sampling_request
from tests.engine.conftest import StreamReader, generate, sse_events
from tests.engine.stats import chi_square_p
from tests.support.engines import engine_process
from weight_sync.base_model import VOCAB_SIZE

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def reconstruct_support(raw: list[tuple[float, int]], top_k: int, top_p: float) -> list[int]:
    """SGLang's joint top-k / top-p rule over the full raw distribution, written independently:
    the support ranked as SGLang sends its mask, most likely first, equal ones by ascending id."""
    ranked = sorted(raw, key=lambda x: (-x[0], x[1]))
    k = len(ranked) if top_k == -1 else top_k
    keep, mass = [], 0.0
    for rank, (lp, tok) in enumerate(ranked):
        if rank >= k or (top_p < 1.0 and mass >= top_p):
            break
        keep.append(tok)
        mass += math.exp(lp)
    return keep


def test_behavior_record_invariants(engine: str, client: httpx.Client, tiny_config: dict[str, Any]) -> None:
    vocab = tiny_config["vocab_size"]
    top_k, top_p, temp = 20, 0.9, 0.8
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "temperature": temp,
            "top_p": top_p,
            "top_k": top_k,
            "max_new_tokens": 24,
            "ignore_eos": True,
            "sampling_seed": 11,
        },
        "return_logprob": True,
        "top_logprobs_num": vocab,
        "return_sampling_mask": True,
    }
    out = generate(client, engine, **body)
    # the same seeded draws with the support's log-probs (sampling_logprobs_mode: support)
    support = generate(client, engine, **body, sampling_logprobs_mode="support")
    ids, meta = out["output_ids"], out["meta_info"]
    assert support["output_ids"] == ids
    assert support["meta_info"]["output_token_sampling_mask"] == meta["output_token_sampling_mask"]
    n = len(ids)
    assert n == 24 == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["cached_tokens"] == 0
    # every generate answer's counts (managers/tokenizer_manager.py 2507-2513, 2552-2559): no
    # reasoning parser, no retraction
    assert meta["reasoning_tokens"] == 0 and meta["num_retractions"] == 0
    assert meta["weight_version"] == "0" and meta["weight_versions"] == [
        {"version": "0", "start": 0, "end": 24}
    ]
    masks = meta["output_token_sampling_mask"]
    mus = meta["output_token_sampling_logprobs"]
    support_lps = support["meta_info"]["output_token_sampling_logprobs"]
    assert len(masks) == len(mus) == len(support_lps) == meta["output_token_sampling_mask_length"] == n
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    for i, tok in enumerate(ids):
        mask, lps = masks[i], support_lps[i]
        assert len(set(mask)) == len(mask) and len(lps) == len(mask)
        # ranked as SGLang's sampler packs a mask (layers/sampler.py 607-616): highest first
        assert lps == sorted(lps, reverse=True)
        assert tok in mask
        assert mus[i] == lps[mask.index(tok)]
        assert math.fsum(math.exp(x) for x in lps) == pytest.approx(1.0, abs=1e-9)
        raw = [(lp, t) for lp, t, _ in meta["output_top_logprobs"][i]]
        assert len(raw) == vocab
        raw_by_id = {t: lp for lp, t in raw}
        # output_token_logprobs: after temperature, before filtering.
        assert meta["output_token_logprobs"][i][0] == pytest.approx(raw_by_id[tok], abs=1e-12)
        assert math.fsum(math.exp(lp) for lp, _ in raw) == pytest.approx(1.0, abs=1e-6)
        assert mask == reconstruct_support(raw, top_k, top_p)
        log_z = math.log(math.fsum(math.exp(raw_by_id[t]) for t in mask))
        assert lps == pytest.approx([raw_by_id[t] - log_z for t in mask], abs=1e-9)


def test_text_input_and_greedy(engine: str, client: httpx.Client) -> None:
    body = {
        "text": "Hello",
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_sampling_mask": True,
    }
    a = generate(client, engine, **body)
    b = generate(client, engine, **body)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["prompt_tokens"] == 5  # byte-level tokenizer
    assert isinstance(a["text"], str)
    meta = a["meta_info"]
    for i, tok in enumerate(a["output_ids"]):
        best = meta["output_top_logprobs"][i][0]
        assert best[1] == tok  # greedy = argmax of the raw distribution
        assert meta["output_token_sampling_mask"][i] == [tok]
        assert meta["output_token_sampling_logprobs"][i] == 0.0


def test_text_with_input_ids_is_served_from_the_ids(engine: str, client: httpx.Client) -> None:
    """``text`` and ``input_ids`` sent together: SGLang 0.5.23 refuses neither (``_validate_inputs``
    refuses only all three inputs, managers/io_struct.py 444-455), takes the shape from ``text``
    (479-487) and each item's tokens from ``input_ids`` (969; tokenizer_manager.py 1118); ids that
    do not give one row per text fail there with a 500, refused here as a 400 naming it
    (core.sglang_contract.NO_TEXT_AND_IDS)."""
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    ids = generate(client, engine, input_ids=PROMPT, sampling_params=greedy)
    both = generate(client, engine, text="Hello", input_ids=PROMPT, sampling_params=greedy)
    assert both["output_ids"] == ids["output_ids"]
    assert both["meta_info"]["prompt_tokens"] == len(PROMPT)
    empty = generate(client, engine, text="", input_ids=PROMPT, sampling_params=greedy)  # an empty text too
    assert empty["output_ids"] == ids["output_ids"]
    rows = generate(client, engine, text=["a", "b"], input_ids=[PROMPT, [65, 66, 67]], sampling_params=greedy)
    assert [o["meta_info"]["prompt_tokens"] for o in rows] == [len(PROMPT), 3]
    assert rows[0]["output_ids"] == ids["output_ids"]
    for body in (
        {"text": ["a", "b"], "input_ids": [PROMPT]},
        {"text": ["a", "b"], "input_ids": PROMPT},
        {"text": "a", "input_ids": [PROMPT, PROMPT]},
    ):
        r = client.post(engine + "/generate", json=body)
        assert r.status_code == 400 and "takes a request's shape from text" in r.text, (body, r.text)


def test_sampling_seed_reproduces(engine: str, client: httpx.Client) -> None:
    def run(seed: int) -> dict[str, Any]:
        return generate(
            client,
            engine,
            input_ids=PROMPT,
            return_logprob=True,
            sampling_params={
                "temperature": 1.0,
                "max_new_tokens": 32,
                "ignore_eos": True,
                "sampling_seed": seed,
            },
        )

    a, b, c = run(5), run(5), run(6)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert a["output_ids"] != c["output_ids"]


def _hf_logprobs(model_dir: Path, ids: list[int], temperature: float) -> list[float]:
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    lps = torch.log_softmax(logits / temperature, dim=-1)
    return [float(lps[j - 1, ids[j]]) for j in range(1, len(ids))]


def test_prefix_scoring_matches_transformers(engine: str, client: httpx.Client, tiny_dir: Path) -> None:
    ids = [256, *PROMPT, 33, 10, 65]
    for temperature in (1.0, 0.5):
        out = generate(
            client,
            engine,
            input_ids=ids,
            return_logprob=True,
            logprob_start_len=0,
            sampling_params={"max_new_tokens": 0, "temperature": temperature},
        )
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        got = meta["input_token_logprobs"]
        assert [t for _, t, _ in got] == ids
        assert got[0][0] is None
        ref = _hf_logprobs(tiny_dir, ids, temperature)
        assert [lp for lp, _, _ in got[1:]] == pytest.approx(ref, abs=2e-4)
        tail = generate(
            client,
            engine,
            input_ids=ids,
            return_logprob=True,
            logprob_start_len=4,
            sampling_params={"max_new_tokens": 0, "temperature": temperature},
        )
        assert tail["meta_info"]["input_token_logprobs"] == got[4:]


def test_stream_matches_non_stream(engine: str, client: httpx.Client) -> None:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_params": {
            "temperature": 0.9,
            "top_p": 0.95,
            "top_k": 4096,  # a sampling mask needs a finite top_k (SGLang 0.5.23)
            "max_new_tokens": 12,
            "ignore_eos": True,
            "sampling_seed": 3,
        },
    }
    whole = generate(client, engine, **body)
    reader = StreamReader(engine, body)
    last = reader.result()
    chunks = reader.chunks
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 12 and len(chunks) >= 2
    for c in chunks:
        assert whole["output_ids"][: len(c["output_ids"])] == c["output_ids"]
    assert last["output_ids"] == whole["output_ids"]
    for key in (
        "output_token_logprobs",
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
        "finish_reason",
        "weight_versions",
    ):
        assert last["meta_info"][key] == whole["meta_info"][key]


# meta_info's keys, in the order SGLang 0.5.23's tokenizer manager writes them for a finished
# output of a server started with --enable-metrics, as the fleet starts it (images/sglang.py):
# managers/tokenizer_manager.py 2507-2518 (the scheduler's timings,
# observability/req_time_stats.py 1213-1236), the log-prob keys (2520-2529, 2866-2973) and the
# mask's (2531-2551), 2552-2576, 2753-2772 (req_time_stats.py 507-533), 2024-2029
HEAD_KEYS = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
             "forward_entry_time", "prefill_finished_time", "queue_time"]  # fmt: skip
COUNT_KEYS = ["reasoning_tokens", "completion_tokens", "cached_tokens"]
FINISH_KEYS = ["weight_versions", "cached_tokens_details", "dp_rank", "e2e_latency", "request_received_ts",
               "first_token_latency", "api_server_dispatch_finish_ts", "request_finished_ts",
               "decode_throughput", "response_sent_to_client_ts"]  # fmt: skip
LOGPROB_KEYS = ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]
TOP_KEYS = ["input_top_logprobs", "output_top_logprobs"]
MASK_KEYS = [
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
    "output_token_sampling_mask_length",
]


@pytest.mark.parametrize(
    ("asks", "between"),
    [
        ({}, []),
        ({"return_logprob": True}, LOGPROB_KEYS),
        ({"return_logprob": True, "top_logprobs_num": 2}, LOGPROB_KEYS + TOP_KEYS),
        ({"return_sampling_mask": True}, MASK_KEYS),
        (
            {"return_logprob": True, "top_logprobs_num": 2, "return_sampling_mask": True},
            LOGPROB_KEYS + TOP_KEYS + MASK_KEYS,
        ),  # fmt: skip
    ],
)
def test_an_answers_meta_info_holds_sglangs_keys_in_sglangs_order(
    engine: str, client: httpx.Client, asks: dict[str, Any], between: list[str]
) -> None:
    """An unstreamed answer's ``meta_info``: SGLang's keys in its order, ``cached_tokens_details``
    null (no cached tokens: scheduler_components/output_streamer.py 102-133, 529), the request's
    timings as floats on one clock (``*_ts`` and ``*_time`` are wall-clock stamps)."""
    before = time.time()
    params = {"max_new_tokens": 4, "ignore_eos": True, "top_k": 8}
    meta = generate(client, engine, input_ids=PROMPT, sampling_params=params, **asks)["meta_info"]
    after = time.time()
    assert list(meta) == HEAD_KEYS + between + COUNT_KEYS + FINISH_KEYS
    assert meta["cached_tokens_details"] is None and meta["dp_rank"] is None and meta["weight_version"] == "0"
    stamps = [
        meta[k]
        for k in ("request_received_ts", "api_server_dispatch_finish_ts", "forward_entry_time",
                  "prefill_finished_time", "request_finished_ts", "response_sent_to_client_ts")
    ]  # fmt: skip
    assert all(type(x) is float for x in stamps)
    assert before - 1 <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after + 1
    assert 0 <= meta["queue_time"] <= meta["first_token_latency"] <= meta["e2e_latency"] <= after - before + 1
    assert meta["decode_throughput"] > 0


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_0_5_23"
# the hand-written SGLang 0.5.23 answers the router's parser tests read
# (tests/router/test_sglang_0_5_23.py) whose "request" names what of a request shapes meta_info
ANSWER_FIXTURES = sorted(
    p.stem for p in FIXTURES.glob("*.json") if "request" in json.loads(p.read_text(encoding="utf-8"))
)


@pytest.mark.parametrize("name", ANSWER_FIXTURES)
def test_an_answers_meta_info_keys_are_the_sglang_fixtures(
    engine: str, client: httpx.Client, name: str
) -> None:
    """The engine's ``meta_info`` keys, in order, for the kind of request a fixture of SGLang
    0.5.23's answer was written for (its ``request``: log-probs, sampling mask and mode;
    unstreamed, finished after as many tokens) are the fixture's: the fixtures the router's parser
    is tested on and the stand-in the fleet runs on cannot drift apart."""
    fx = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    params = {"max_new_tokens": len(fx["body"]["output_ids"]), "ignore_eos": True, "top_k": 8}
    meta = generate(client, engine, input_ids=PROMPT, sampling_params=params, **fx["request"])["meta_info"]
    assert list(meta) == list(fx["body"]["meta_info"])


def test_the_sglang_fixtures_without_a_request_are_a_refusal_and_the_abort_echo() -> None:
    """Every fixture of a finished output names its request (so the test above covers it); of the
    others, the abort SGLang's scheduler echoes (``abort_no_status``, managers/tokenizer_manager.py
    3577-3642: no ``prompt_tokens``) has its engine check below, and the 400's body is no
    ``meta_info``."""
    assert len(ANSWER_FIXTURES) == 3
    others = sorted(p.stem for p in FIXTURES.glob("*.json") if p.stem not in ANSWER_FIXTURES)
    assert others == ["abort_no_status", "mask_refused_400"]
    assert json.loads((FIXTURES / "mask_refused_400.json").read_text(encoding="utf-8"))["status"] == 400


def _queued(client: httpx.Client, url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while client.get(url + "/server_info").json()["internal_states"][0]["num_queue_reqs"] != n:
        assert time.monotonic() < deadline, f"never {n} queued"
        time.sleep(0.01)


def test_an_abort_of_a_waiting_request_is_sglangs_echo_and_of_a_running_one_a_whole_answer(
    engine: str, client: httpx.Client, tiny_dir: Path
) -> None:
    """SGLang 0.5.23's scheduler echoes the abort of a request in its waiting queue (never run,
    or retracted) to the tokenizer manager (managers/scheduler.py 5686-5706), which answers it
    with what it was sent so far in the short ``meta_info`` of ``abort_no_status`` (keys in its
    order; ``response_sent_to_client_ts`` after them when nothing was sent before,
    tokenizer_manager.py 2019-2029, 3577-3642), finish reason "Abort in waiting queue"; a
    decoding request's abort finishes in its output stream, a whole answer."""
    fixture = json.loads((FIXTURES / "abort_no_status.json").read_text(encoding="utf-8"))["body"]
    echo_keys = list(fixture["meta_info"])
    long = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 3}
    body = {"input_ids": PROMPT, "sampling_params": long, "return_logprob": True}
    # retracted, streamed: the tokens it was sent, the fixture's keys exactly
    stream = StreamReader(engine, {**body, "rid": "echo-retracted"})
    stream.wait_for(3)
    assert client.post(engine + "/pause_generation", json={"mode": "retract"}).status_code == 200
    try:
        shown = stream.settled()
        assert client.post(engine + "/abort_request", json={"rid": "echo-retracted"}).status_code == 200
        last, echo = stream.chunks[shown - 1], stream.result()
        meta = echo["meta_info"]
        assert list(meta) == echo_keys
        assert meta["finish_reason"] == fixture["meta_info"]["finish_reason"]
        assert echo["output_ids"] == last["output_ids"] and echo["text"] == last["text"]
        n = len(echo["output_ids"])
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"] == n >= 3
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
        assert meta["output_token_logprobs"] == last["meta_info"]["output_token_logprobs"]
    finally:
        assert client.post(engine + "/continue_generation", json={}).status_code == 200
    # never run (queued behind the one request the engine runs at a time), unstreamed: nothing sent
    with engine_process(tiny_dir, max_running_requests=1) as one:
        running = StreamReader(one, {**body, "rid": "occupies"})
        running.wait_for(1)
        answers: list[dict[str, Any]] = []
        waiting = threading.Thread(
            target=lambda: answers.append(generate(client, one, **body, rid="echo-waiting"))
        )
        waiting.start()
        _queued(client, one, 1)
        assert client.post(one + "/abort_request", json={"rid": "echo-waiting"}).status_code == 200
        waiting.join(60)
        assert client.post(one + "/abort_request", json={"rid": "occupies"}).status_code == 200
        running.result()
    (never_run,) = answers
    meta = never_run["meta_info"]
    assert list(meta) == [*echo_keys, "response_sent_to_client_ts"]
    assert never_run["output_ids"] == [] and never_run["text"] == "" and meta["completion_tokens"] == 0
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 0}]
    assert meta["input_token_logprobs"] == meta["output_token_logprobs"] == []
    # decoding: a whole answer
    running = StreamReader(engine, {**body, "rid": "echo-running"})
    running.wait_for(3)
    assert client.post(engine + "/abort_request", json={"rid": "echo-running"}).status_code == 200
    meta = running.result()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "prompt_tokens" in meta and "dp_rank" in meta


def test_a_streams_earlier_chunks_carry_what_sglang_sends_before_the_finish(
    engine: str, client: httpx.Client
) -> None:
    """A stream's chunks before the last: no ``weight_versions`` (computed only for a finished
    request, output_streamer.py 540-554), so ``weight_version`` is the tokenizer manager's
    (tokenizer_manager.py 2511), no ``e2e_latency`` nor finish timings (2742-2772), and only the
    first chunk carries ``response_sent_to_client_ts`` (2052-2058); the last chunk is a whole
    answer's, its ``response_sent_to_client_ts`` the first chunk's."""
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    reader = StreamReader(engine, {"input_ids": PROMPT, "sampling_params": params})
    last = reader.result()
    *early, _ = reader.chunks
    assert early, "the stream sent its finish alone"
    for i, chunk in enumerate(early):
        meta = chunk["meta_info"]
        sent = ["response_sent_to_client_ts"] if i == 0 else []
        assert list(meta) == HEAD_KEYS + COUNT_KEYS + ["cached_tokens_details", "dp_rank"] + sent
        assert meta["weight_version"] == "0" and meta["finish_reason"] is None
    meta = last["meta_info"]
    sent_early = FINISH_KEYS[:7] + ["response_sent_to_client_ts"] + FINISH_KEYS[7:9]
    assert list(meta) == HEAD_KEYS + COUNT_KEYS + sent_early
    assert meta["response_sent_to_client_ts"] == early[0]["meta_info"]["response_sent_to_client_ts"]
    assert [(str(s["version"]), s["start"], s["end"]) for s in meta["weight_versions"]] == [("0", 0, 6)]


@pytest.mark.parametrize("interval", [1, 3])
def test_a_streams_text_holds_back_what_sglangs_detokenizer_holds_back(
    engine: str, client: httpx.Client, interval: int
) -> None:
    """A chunk before the finish sends what SGLang 0.5.23's detokenizer has sent so far: text
    that ends in U+FFFD (the tiny model's tokens are bytes, many of them no whole character) is
    held back to its last space until more ids complete it (managers/detokenizer_manager.py
    391-417, sglang/utils.py 345-361), so no such chunk ends in U+FFFD and each is a prefix of
    the next; the last chunk's text is the whole answer's."""
    held = 0
    for seed in range(4):
        params = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0, "sampling_seed": seed,
                  "stream_interval": interval}  # fmt: skip
        body = {"input_ids": PROMPT, "sampling_params": params}
        whole = generate(client, engine, **body)
        reader = StreamReader(engine, body)
        last = reader.result()
        assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
        texts = [c["text"] for c in reader.chunks]
        for i, chunk in enumerate(reader.chunks[:-1]):
            shorter = {**params, "max_new_tokens": len(chunk["output_ids"])}
            full = generate(client, engine, input_ids=PROMPT, sampling_params=shorter)
            assert full["output_ids"] == chunk["output_ids"]
            assert not texts[i].endswith("\ufffd") and whole["text"].startswith(texts[i])
            assert texts[i + 1].startswith(texts[i])
            held += texts[i] != full["text"]
    assert held, "no chunk held text back: the case is not exercised"


def test_batch_request(engine: str, client: httpx.Client) -> None:
    prompts = [PROMPT, PROMPT[:3], [65]]
    out = generate(
        client,
        engine,
        input_ids=prompts,
        rid=["a", "b", "c"],
        sampling_params=[{"max_new_tokens": n, "ignore_eos": True} for n in (2, 3, 4)],
    )
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [8, 3, 1]
    assert [len(o["output_ids"]) for o in out] == [2, 3, 4]
    # one rid for a batch: "<rid>_<i>" (_normalize_rid, managers/io_struct.py 759-765)
    out = generate(client, engine, input_ids=prompts[:2], rid="r", sampling_params={"max_new_tokens": 1})
    assert [o["meta_info"]["id"] for o in out] == ["r_0", "r_1"]


SHORT_LISTS = [
    # a batch's lists SGLang 0.5.23 indexes per item without checking their length (io_struct.py
    # 959-1031): a shorter one is its IndexError, a 500 (core.sglang_contract.NO_SHORT_LIST)
    ("return_logprob", [True]),
    ("logprob_start_len", [-1]),
    ("top_logprobs_num", []),
    ("token_ids_logprob", [[3]]),
    ("return_sampling_mask", [False]),
    ("sampling_logprobs_mode", [None]),
    ("lora_path", [None]),
    ("custom_logit_processor", [None]),
    ("bootstrap_host", ["h"]),
    ("decode_tp_size", [1]),
]


def test_a_batchs_per_item_lists_are_read_as_sglang_reads_them(engine: str, client: httpx.Client) -> None:
    """A batch's per-item list that SGLang 0.5.23 does not length-check is read at entry ``i``
    for item ``i`` (io_struct.py ``__getitem__`` 959-1031): a longer one is served, its extra
    entries never read (an out-of-range ``top_p`` or ``logprob_start_len`` there included); a
    shorter one is SGLang's IndexError, a 500, refused as a 400 naming it (streamed, the stream
    breaks off). ``return_hidden_states`` is length-checked, in SGLang's words (823-837)."""
    greedy = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    body = {
        "input_ids": [PROMPT, PROMPT[:3]],
        "sampling_params": [greedy, greedy, {"top_p": 1.5}],
        "return_logprob": [True, False, True],
        "top_logprobs_num": [2, 0, 5],
        "logprob_start_len": [-1, -1, 99],
        "custom_logit_processor": [None, None, "x"],
        "return_sampling_mask": [False, False, True],
    }
    out = generate(client, engine, **body)
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(PROMPT), 3]
    assert len(out[0]["meta_info"]["output_top_logprobs"][0]) == 2
    assert (
        "output_token_logprobs" not in out[1]["meta_info"] or not out[1]["meta_info"]["output_token_logprobs"]
    )
    for key, short in SHORT_LISTS:
        bad = {"input_ids": [PROMPT, PROMPT], key: short}
        r = client.post(engine + "/generate", json=bad)
        named = f"{key} has {len(short)} entries for a batch of 2: SGLang 0.5.23 takes one entry per item"
        assert r.status_code == 400 and named in r.json()["error"]["message"], (key, r.text)
        streamed = {**bad, "stream": True}  # SGLang's stream breaks off before any event
        with (
            client.stream("POST", engine + "/generate", json=streamed) as r,
            pytest.raises(httpx.RemoteProtocolError),
        ):
            r.read()
    r = client.post(
        engine + "/generate", json={"input_ids": [PROMPT, PROMPT], "return_hidden_states": [False] * 3}
    )
    assert r.status_code == 400, r.text
    assert (
        r.json()["error"]["message"]
        == "The length of return_hidden_states should be equal to the batch size."
    )


def test_stop_token_ids(engine: str, client: httpx.Client) -> None:
    """A stop id ends the output with SGLang's stop shape; ``ignore_eos`` turns the request's stop
    ids off as it turns EOS off (``_check_token_based_finish`` returns first,
    managers/schedule_batch.py 1856-1858); a stop id drawn as the last token ``max_new_tokens``
    allows is a stop, not a length finish (``update_finish_state`` checks it first, 2029-2042)."""
    greedy = {"temperature": 0, "max_new_tokens": 6}
    first = generate(client, engine, input_ids=PROMPT, sampling_params=greedy)
    assert first["meta_info"]["finish_reason"]["type"] == "length"  # no EOS among them
    first = first["output_ids"]
    stop = first[2]
    k = first.index(stop)
    out = generate(client, engine, input_ids=PROMPT, sampling_params={**greedy, "stop_token_ids": [stop]})
    assert out["output_ids"] == first[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    ignored = {**greedy, "stop_token_ids": [stop], "ignore_eos": True}
    out = generate(client, engine, input_ids=PROMPT, sampling_params=ignored)
    assert out["output_ids"] == first
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    last = {**greedy, "max_new_tokens": k + 1, "stop_token_ids": [stop]}
    out = generate(client, engine, input_ids=PROMPT, sampling_params=last)
    assert out["output_ids"] == first[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def _sglang_texts(tokenizer: Any, prompt: list[int], output: list[int], trim: bool) -> dict[int, str]:
    """A reference of SGLang 0.5.23's detokenizer (managers/detokenizer_manager.py 346-430) for a
    stream at ``stream_interval`` 1 (an output at each token, the last with the finish): the text
    sent so far after each output's count of ids. It decodes ``ids[surr:]`` and ``ids[surr:read]``
    after the prompt's last 5 ids (managers/schedule_batch.py 163, 1788-1806) and sends the
    difference (held back to its last space while it ends in U+FFFD, sglang/utils.py 345-361:
    the tiny model's text has no newline nor CJK character at a hold-back here)."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    ids, surr, read = prompt[-5:], 0, len(prompt[-5:])
    committed, sent_offset, sent, texts = "", 0, "", {}
    for n, token in enumerate(output, 1):
        ids = [*ids, token]
        finished = n == len(output)
        read_ids = ids[surr:-1] if finished and trim else ids[surr:]
        new = decode(read_ids)[len(decode(ids[surr:read])) :]
        if finished:
            sent += (committed + new)[sent_offset:]
        elif new and not new.endswith("\ufffd"):
            sent += new[sent_offset - len(committed) :]
            committed, surr, read, sent_offset = committed + new, read, len(ids), len(committed + new)
        else:
            printable = new[: new.rfind(" ") + 1]
            sent += printable[sent_offset - len(committed) :]
            sent_offset = len(committed) + len(printable)
        texts[n] = sent
    return texts


def test_the_text_is_decoded_after_the_prompts_last_ids(
    engine: str, client: httpx.Client, tiny_dir: Path
) -> None:
    """An output's ``text``, unstreamed and each streamed chunk, is what SGLang 0.5.23's
    detokenizer sends: the output decoded after the prompt's last 5 ids, so a prompt that ends
    inside a character (the lead byte of a 3-byte one) and an output that completes it reads as
    the output past that character (:func:`_sglang_texts`, the ``tokenizers`` library's decode),
    not the output's own bytes decoded alone, which begin with U+FFFD."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    prompt = [*PROMPT, 0xE4]  # "Hello, w" and the lead byte of a 3-byte character
    differs = 0
    for seed in range(12):
        params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0, "sampling_seed": seed,
                  "skip_special_tokens": False}  # fmt: skip
        body = {"input_ids": prompt, "sampling_params": params}
        whole = generate(client, engine, **body)
        texts = _sglang_texts(tokenizer, prompt, whole["output_ids"], trim=False)
        assert whole["text"] == texts[6], (seed, whole["output_ids"])
        reader = StreamReader(engine, body)
        reader.result()
        for chunk in reader.chunks:
            assert chunk["text"] == texts[len(chunk["output_ids"])], (seed, chunk["output_ids"])
        differs += whole["text"] != tokenizer.decode(whole["output_ids"], skip_special_tokens=False)
    assert differs, "no output completed the prompt's character: the case is not exercised"


def test_the_text_drops_the_matched_stop_id_unless_no_stop_trim(engine: str, client: httpx.Client) -> None:
    """``text`` decodes the output without the stop id or EOS that finished it, streamed or not;
    ``no_stop_trim`` keeps it; ``output_ids`` keep it either way (SGLang's detokenizer
    ``trim_matched_stop``, managers/detokenizer_manager.py 194-226, 334-339)."""
    greedy = {"temperature": 0, "max_new_tokens": 6}
    first = generate(client, engine, input_ids=PROMPT, sampling_params=greedy)["output_ids"]
    k = 3
    stop = first[k]
    assert stop not in first[:k]
    upto = {
        n: generate(client, engine, input_ids=PROMPT, sampling_params={**greedy, "max_new_tokens": n})["text"]
        for n in (k, k + 1)
    }
    assert upto[k] != upto[k + 1]
    for no_trim, text in ((None, upto[k]), (False, upto[k]), (True, upto[k + 1])):
        trim = {} if no_trim is None else {"no_stop_trim": no_trim}
        params = {**greedy, "stop_token_ids": [stop], **trim}
        out = generate(client, engine, input_ids=PROMPT, sampling_params=params)
        assert out["output_ids"] == first[: k + 1] and out["text"] == text, (no_trim, out)
        last = StreamReader(engine, {"input_ids": PROMPT, "sampling_params": params}).result()
        assert last["text"] == text and last["output_ids"][-1:] == [stop], (no_trim, last)


def test_an_answer_is_written_as_sglangs_orjson_writes_it(engine: str, client: httpx.Client) -> None:
    """A ``/generate`` answer's bytes, whole and each streamed event, are what SGLang 0.5.23's
    ``dumps_json`` (orjson, ``utils/json_response.py`` 12-17; ``entrypoints/http_server.py`` 956,
    974, 987) writes for the same value: raw UTF-8, not ASCII escapes (the output's text here holds
    U+FFFD), orjson's float spelling."""
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6},
    }
    r = client.post(engine + "/generate", json=body)
    assert r.status_code == 200 and "\ufffd" in r.json()["text"], r.text
    assert r.content == orjson.dumps(r.json(), option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    with client.stream("POST", engine + "/generate", json={**body, "stream": True}) as s:
        events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    for event in events[:-1]:
        assert event.encode() == orjson.dumps(orjson.loads(event)), event


def test_requests_join_the_running_batch(engine: str, client: httpx.Client) -> None:
    """Short requests sent mid-decode run in the same steps as the long one and finish first."""
    steps0 = client.get(engine + "/server_info").json()["internal_states"][0]["steps"]
    long = StreamReader(
        engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    )
    long.wait_for(5)
    results: list[dict[str, Any]] = []

    def short(i: int) -> None:
        with httpx.Client(timeout=60, trust_env=False) as c:
            results.append(
                generate(
                    c,
                    engine,
                    input_ids=[65 + i, 66],
                    sampling_params={"max_new_tokens": 40, "ignore_eos": True},
                )
            )

    threads = [threading.Thread(target=short, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3 and all(len(r["output_ids"]) == 40 for r in results)
    assert not long.done, "the long request should still be decoding"
    final = long.result()
    assert len(final["output_ids"]) == 400
    steps = client.get(engine + "/server_info").json()["internal_states"][0]["steps"] - steps0
    # Sequentially the four requests take >= 400 + 3 * 40 steps; batched, the shorts ride along.
    assert steps < 400 + 3 * 40, steps


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 6},
        {"temperature": 1.0, "top_p": 0.95, "top_k": 12},
        {"temperature": 0.9, "min_p": 0.05},
    ],
    ids=json.dumps,
)
def test_engine_frequencies_match_recorded_mu(
    engine: str, client: httpx.Client, tiny_config: dict[str, Any], params: dict[str, Any]
) -> None:
    """Fixed prefix, many seeded samples, each sent as the engine client sends it
    (:func:`core.sglang_release.sampling_request`: a mask unless the turn filters nothing): token
    counts agree with exp(recorded mu) (chi-square); mu is the mask's selected log-prob, or for an
    unfiltered request ``output_token_logprobs``."""
    n = 1200
    vocab = tiny_config["vocab_size"]
    request = sampling_request(params)
    out = generate(
        client,
        engine,
        input_ids=[PROMPT] * n,
        return_sampling_mask=request.mask,
        return_logprob=True,
        top_logprobs_num=[vocab] + [0] * (n - 1),  # the full raw distribution, once
        sampling_params=[
            {**request.params, "max_new_tokens": 1, "sampling_seed": 1000 + i} for i in range(n)
        ],
    )
    first = out[0]["meta_info"]
    assert request.mask == ("output_token_sampling_mask" in first)
    if request.mask and first["output_token_sampling_mask"][0]:
        # the first item again, with the support's log-probs (sampling_logprobs_mode: support)
        again = generate(
            client,
            engine,
            input_ids=PROMPT,
            return_sampling_mask=True,
            sampling_logprobs_mode="support",
            sampling_params={**request.params, "max_new_tokens": 1, "sampling_seed": 1000},
        )["meta_info"]
        assert again["output_token_sampling_mask"] == first["output_token_sampling_mask"]
        expected = dict(
            zip(
                again["output_token_sampling_mask"][0],
                (math.exp(x) for x in again["output_token_sampling_logprobs"][0]),
                strict=True,
            )
        )
    else:  # no filter: the support is the whole vocabulary and mu is the raw log-prob
        expected = {t: math.exp(lp) for lp, t, _ in first["output_top_logprobs"][0]}
    counts = dict.fromkeys(expected, 0)
    for o in out:
        tok = o["output_ids"][0]
        counts[tok] += 1  # KeyError = a token outside the recorded support
        meta = o["meta_info"]
        mu = (
            meta["output_token_sampling_logprobs"][0] if request.mask else meta["output_token_logprobs"][0][0]
        )
        assert math.exp(mu) == pytest.approx(expected[tok], rel=1e-5, abs=1e-9)
    assert len(counts) > 2, "the distribution is too peaked to test anything"
    p = chi_square_p([counts[t] for t in expected], [n * q for q in expected.values()])
    assert p > 1e-3, (params, counts)


def test_a_request_without_a_mask_answers_as_sglang(
    engine: str, client: httpx.Client, tiny_dir: Path
) -> None:
    """No ``return_sampling_mask``: SGLang's meta_info has no ``output_token_sampling_*`` key
    (managers/tokenizer_manager.py 2531-2551) and ``output_token_logprobs`` holds ``[logprob,
    token_id, null]`` per token (3098-3116), the log-prob after temperature, ``log softmax(logits /
    T)`` (layers/sampler.py 275-316): checked against transformers at T = 0.7."""
    temperature = 0.7
    params = {"temperature": temperature, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3}
    out = generate(client, engine, input_ids=PROMPT, return_logprob=True, sampling_params=params)
    meta, ids = out["meta_info"], out["output_ids"]
    assert not [k for k in meta if k.startswith("output_token_sampling")]
    triples = meta["output_token_logprobs"]
    assert [(t, text) for _, t, text in triples] == [(t, None) for t in ids] and len(ids) == 12
    ref = _hf_logprobs(tiny_dir, [*PROMPT, *ids], temperature)[len(PROMPT) - 1 :]
    assert [lp for lp, _, _ in triples] == pytest.approx(ref, abs=2e-4)
    plain = _hf_logprobs(tiny_dir, [*PROMPT, *ids], 1.0)[len(PROMPT) - 1 :]
    assert max(abs(a - b) for a, b in zip(ref, plain, strict=True)) > 1e-2  # T mattered


def test_support_mode_returns_the_support_log_probs_per_token(engine: str, client: httpx.Client) -> None:
    """``sampling_logprobs_mode: support`` (SGLang 0.5.23): output_token_sampling_logprobs holds,
    per token, the support's log-probs aligned with the mask; the sampled token's entry is mu of the
    same seeded draw in the default (selected) mode. Greedy turns (top_k normalized to 1) pass."""
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 30, "max_new_tokens": 6, "ignore_eos": True}
    body = {"input_ids": PROMPT, "return_logprob": True, "return_sampling_mask": True}
    selected = generate(client, engine, **body, sampling_params={**params, "sampling_seed": 11})
    support = generate(
        client,
        engine,
        **body,
        sampling_logprobs_mode="support",
        sampling_params={**params, "sampling_seed": 11},
    )
    assert support["output_ids"] == selected["output_ids"]
    s_meta, m_meta = support["meta_info"], selected["meta_info"]
    for i, tok in enumerate(support["output_ids"]):
        mask, rows = s_meta["output_token_sampling_mask"][i], s_meta["output_token_sampling_logprobs"][i]
        assert isinstance(rows, list) and len(rows) == len(mask) > 0
        assert rows == sorted(rows, reverse=True)  # ranked, as SGLang's mask (layers/sampler.py 607-616)
        assert rows[mask.index(tok)] == m_meta["output_token_sampling_logprobs"][i]
        assert math.fsum(math.exp(x) for x in rows) == pytest.approx(1.0, abs=1e-6)
    greedy = generate(client, engine, **body, sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert [len(m) for m in greedy["meta_info"]["output_token_sampling_mask"]] == [1, 1]


BAD = [
    ({"input_ids": [1, VOCAB_SIZE]}, "outside the vocabulary"),
    ({"input_ids": [-1, 3]}, "outside the vocabulary"),
    ({"input_ids": [[1, 2], [300]]}, "input_ids[1] has token id 300"),
    ({"input_ids": []}, "empty"),
    ({"text": ""}, "empty"),
    ({"input_ids": [1] * 2048}, "longer than the model's context length"),
    ({"input_ids": [1] * 2000, "sampling_params": {"max_new_tokens": 100}}, "maximum context length"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature must be"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1]"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p must be"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
    (
        {"input_ids": [1], "sampling_params": {"repetition_penalty": 3}},
        "repetition_penalty must be in (0, 2]",
    ),
    (
        {"input_ids": [1], "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}},
        "min_new_tokens must be",
    ),
    ({"input_ids": [1], "sampling_params": {"temperature": 0.5, "top_k": -2}}, "top_k must be"),
    # SGLang 0.5.23's dataclass parse and contract gate (core/sglang_contract/): JSON types, named
    ({"input_ids": [1, True]}, "input_ids[1]: invalid type: boolean `true`, expected i64"),
    ({"input_ids": [True]}, "input_ids[0]: invalid type: boolean `true`"),
    ({"input_ids": ["1"]}, 'input_ids[0]: invalid type: string "1"'),
    ({"input_ids": [3.0]}, "input_ids[0]: invalid type: floating point `3.0`, expected i64"),
    ({"input_ids": [[1], [2, 3.0]]}, "input_ids[1][1]: invalid type: floating point `3.0`"),
    (
        {"input_ids": [1], "sampling_params": {"stop_token_ids": [1, True]}},
        "sampling_params.stop_token_ids[1]",
    ),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": ["2"]}}, "sampling_params.stop_token_ids[0]"),
    ({"input_ids": [1], "stream": 1}, "stream: invalid type: integer `1`, expected a boolean"),
    ({"input_ids": [1], "stream": "true"}, 'stream: invalid type: string "true"'),
    ({"input_ids": [1], "stream": None}, "stream: invalid type: null"),
    (
        {"input_ids": [1], "sampling_params": {"top_k": 3.0}},
        "sampling_params.top_k: invalid type: floating point",
    ),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
    ({"input_ids": [1], "sampling_params": {"temperature": True}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 5}}, "sampling_params: unknown field `max_tokens`"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_k": 1.5}]}, "sampling_params[1].top_k"),
    ({"input_ids": [1], "return_logprob": 1}, "return_logprob: invalid type: integer `1`"),
    ({"input_ids": [1], "logprob_start_len": 0.0}, "logprob_start_len: invalid type: floating point"),
    # the scheduler's abort of a start past the input (managers/scheduler.py 3275-3279), its words
    (
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3},
        "req.logprob_start_len=3 is higher than the number of input tokens len(req.origin_input_ids)=2. "
        "Please use a smaller logprob_start_len.",
    ),
    ({"input_ids": "abc"}, 'input_ids: invalid type: string "abc", expected a sequence'),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    # _validate_inputs (managers/io_struct.py 444-455): no input, or all three, in its words
    ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": [1], "text": "a", "input_embeds": [[0.5]]}, "Either text, input_ids or input_embeds"),
    # normalize_batch_and_arguments' words (managers/io_struct.py 759-774, 390-397)
    ({"input_ids": [[1], [2]], "rid": ["x"]}, "The specified rids length mismatch with the batch_size"),
    (
        {"input_ids": [[1], [2]], "rid": ["x", "x"]},
        "Duplicate request IDs detected within the request: ['x']",
    ),
    # SGLang 0.5.23's sampling-mask rules (managers/scheduler.py, managers/tokenizer_manager.py)
    ({"input_ids": [1], "return_sampling_mask": True}, "finite 1 < top_k <= 4096; got top_k=1073741824"),
    (
        {"input_ids": [1], "return_sampling_mask": True, "sampling_params": {"top_k": 4097}},
        "finite 1 < top_k <= 4096; got top_k=4097",
    ),
    ({"input_ids": [1], "sampling_logprobs_mode": "support"}, "only be set when return_sampling_mask=true"),
    (
        {"input_ids": [1], "return_sampling_mask": True, "sampling_logprobs_mode": "all"},
        "sampling_logprobs_mode",
    ),
]


def test_bad_input_is_a_400_and_the_server_keeps_serving(engine: str, client: httpx.Client) -> None:
    raw_bodies = [
        (b'{"input_ids": [1, 2', "Malformed JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "temperature must be"),
        (b"", "empty"),
    ]
    cases = [(json.dumps(b).encode(), msg) for b, msg in BAD] + raw_bodies
    for body, msg in cases:
        r = client.post(engine + "/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert msg in error_message(400, r.content), (body, r.text)  # whichever SGLang shape
    ok = generate(client, engine, input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(ok["output_ids"]) == 2
    load = client.get(engine + "/server_info").json()["internal_states"][0]
    assert load["num_running_reqs"] == 0 and load["num_queue_reqs"] == 0


def test_what_sglang_accepts_is_served(engine: str, client: httpx.Client) -> None:
    """What SGLang 0.5.23 takes is not refused: a top_k of 0 with temperature 0 (greedy first,
    sampling/sampling_params.py 245-248), a stop token id outside the vocabulary (never checked:
    it never matches), null for a sampling parameter (its default), an integer where a float goes."""
    for params in (
        {"temperature": 0, "top_k": 0},
        {"temperature": 0.0, "top_k": -5},
        {"stop_token_ids": [VOCAB_SIZE + 7]},
        {"temperature": None, "top_k": None, "top_p": None, "min_p": None, "stop_token_ids": None},
        {"temperature": 1, "top_p": 1, "min_p": 0},
    ):
        out = generate(
            client,
            engine,
            input_ids=[1, 2],
            sampling_params={**params, "max_new_tokens": 2, "ignore_eos": True},
        )
        assert len(out["output_ids"]) == 2, params
    # a top_logprobs_num of 0 or below asks for no top log-probs (layers/logprob_processor.py 434,
    # 929; managers/tokenizer_manager.py 2873, 3042 answer them only above 0): served as 0
    asked = {"input_ids": [1, 2], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    none = generate(client, engine, **asked, top_logprobs_num=0)["meta_info"]
    negative = generate(client, engine, **asked, top_logprobs_num=-3)["meta_info"]
    assert sorted(negative) == sorted(none) and len(negative["output_token_logprobs"]) == 2
    # logprob_start_len as SGLang 0.5.23's scheduler resolves it (managers/scheduler.py 3256-3279):
    # ignored without return_logprob; with it, -1 and the input's length answer no input log-probs
    plain = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    for start in (-7, 3, 99):
        meta = generate(client, engine, **plain, logprob_start_len=start)["meta_info"]
        assert "input_token_logprobs" not in meta, start
    asked = {**plain, "return_logprob": True, "top_logprobs_num": 2}
    for start in (-1, 2):
        meta = generate(client, engine, **asked, logprob_start_len=start)["meta_info"]
        assert (meta["input_token_logprobs"], meta["input_top_logprobs"]) == ([], []), (start, meta)
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 1, start
        assert meta["output_token_logprobs_length"] == 1, meta  # tokenizer_manager.py 2868-2870


SHAPES = [
    # step 1, the dataclass parse: FastAPI's validation handler, ErrorResponse (http_server.py)
    (b'{"input_ids": [1, 2', "parse"),
    (b"[1, 2]", "parse"),
    (b'{"input_ids": ["1"]}', "parse"),
    (b'{"input_ids": [1, 3.0]}', "parse"),
    (b'{"input_ids": [1], "stream": null}', "parse"),
    # step 2, the contract gate: a bare string
    (b'{"input_ids": [1, true]}', "gate"),
    (b'{"input_ids": [1], "stream": 1}', "gate"),
    (b'{"input_ids": [1], "sampling_params": {"max_tokens": 5}}', "gate"),
    (b'{"input_ids": [1], "sampling_params": {"top_k": 3.0}}', "gate"),
    # step 3, SamplingParams and the tokenizer manager's checks: {"error": {"message"}}
    (b'{"input_ids": [1], "sampling_params": {"top_p": 1.5}}', "verify"),
    (b'{"sampling_params": {}}', "verify"),  # _validate_inputs, io_struct.py 444-455
    (b'{"input_ids": [1], "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}}', "verify"),
    (json.dumps({"input_ids": [VOCAB_SIZE]}).encode(), "verify"),
    # the other top-level keys the gate decodes: a value the dataclass parse refuses too is its
    (b'{"input_ids": [1], "lora_path": 5}', "parse"),
    (b'{"input_ids": [1], "priority": 1.5}', "parse"),
    (b'{"input_ids": [1], "return_hidden_states": null}', "parse"),
    (b'{"input_ids": [1], "session_params": 5}', "parse"),
    (b'{"input_ids": [1], "priority": "3"}', "gate"),
    (b'{"input_ids": [1], "return_hidden_states": "last"}', "gate"),
    (b'{"input_ids": [1], "max_thinking_tokens": -1}', "gate"),
    # and what the tokenizer manager refuses on a server started as the fleet starts SGLang
    (b'{"input_ids": [1], "lora_path": "adapter"}', "verify"),
    (b'{"input_ids": [1], "return_hidden_states": true}', "verify"),
    (b'{"input_ids": [1], "watermark": {"enabled": true}}', "verify"),
    (b'{"input_ids": [1], "sampling_params": {"watermark": {}}}', "verify"),
    # the older fields: pydantic's lax parse of the dataclass (io_struct.py 180-268) refuses first
    (b'{"input_ids": [1], "rid": 5}', "parse"),
    (b'{"text": 5}', "parse"),
    (b'{"text": ["a", 1]}', "parse"),
    (b'{"input_ids": [1], "stream": 2}', "parse"),
    (b'{"input_ids": [1], "stream": " true"}', "parse"),
    (b'{"input_ids": [1], "return_logprob": [2]}', "parse"),
    (b'{"input_ids": [1], "return_logprob": "on"}', "gate"),
    (b'{"input_ids": [1], "logprob_start_len": 1.5}', "parse"),
    (b'{"input_ids": [1], "top_logprobs_num": "2"}', "gate"),
    (b'{"input_ids": [1], "token_ids_logprob": 5}', "parse"),
    (b'{"input_ids": [1], "token_ids_logprob": [[1], 2]}', "parse"),
    (b'{"input_ids": [1], "token_ids_logprob": ["3"]}', "gate"),
    (b'{"input_ids": [1], "sampling_params": 5}', "parse"),
    (b'{"input_ids": [1], "sampling_params": [{"top_p": 1.5}, 5]}', "parse"),
    (b'{"input_ids": [1], "return_text_in_logprobs": "x"}', "parse"),
    (b'{"input_ids": [1], "return_sampling_mask": 3}', "parse"),
    (b'{"input_ids": [1], "routed_experts_start_len": 1.5}', "parse"),
    (b'{"input_ids": [1], "routed_experts_start_len": "2"}', "gate"),
    # each step judges the whole body before the next: a later field can be the earlier step's
    (b'{"input_ids": [1], "stream": 1, "rid": 5}', "parse"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 1.5}, "stream": 1}', "gate"),
]


def _shape(body: Any) -> str:
    """Which of SGLang's three error bodies ``body`` is (core.sglang_contract.error_body)."""
    if isinstance(body, dict) and set(body) == {"object", "message", "type", "param", "code"}:
        assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request", body
        return "parse"
    if isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str):
        return "gate"
    if isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == {"message"}:
        return "verify"
    return f"unknown: {body!r}"


def test_each_refusal_answers_the_body_shape_sglang_answers_it_with(
    engine: str, client: httpx.Client
) -> None:
    """SGLang 0.5.23 answers a ``/generate`` refusal in the shape of the step that makes it: its
    request validation handler's ErrorResponse for the dataclass parse (malformed JSON, a body
    that is no object, an ``input_ids`` entry that is not an int, ``stream: null``), the contract
    gate's bare ``{"error": "<text>"}`` (a bool id, ``stream: 1``, an unknown or mistyped sampling
    key), ``{"error": {"message"}}`` for SamplingParams' ranges and the tokenizer manager's
    checks. The engine answers the same; the fleet's client reads the message of each."""
    for raw, step in SHAPES:
        r = client.post(engine + "/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert _shape(r.json()) == step, (raw, r.text)
        message = error_message(400, r.content)
        assert message and not message.startswith("{"), (raw, message)  # the text, not the body


TOP_LEVEL_REFUSED = [
    # SGLang 0.5.23 refuses these on a server started as the fleet starts it, in these words
    ({"lora_path": "adapter"}, "LoRA adapter 'adapter' was requested, but LoRA is not enabled."),
    ({"lora_path": [None]}, "LoRA adapter 'None' was requested, but LoRA is not enabled."),
    ({"input_embeds": [[0.5, 0.5]]}, "input_embeds is provided while disable_radix_cache is False."),
    ({"return_hidden_states": True}, "The server is not configured to return hidden states."),
    ({"return_hidden_states": [False, True]}, "The server is not configured to return hidden states."),
    ({"custom_logit_processor": "{}"}, "The server is not configured to enable custom logit processor."),
    ({"max_thinking_tokens": 4}, "max_thinking_tokens requires the server to be launched with"),
    ({"routed_dp_rank": 1}, "routed_dp_rank=1 out of range [0, 1)"),
    ({"data_parallel_rank": 2}, "routed_dp_rank=2 out of range [0, 1)"),
    ({"priority": 1 << 63}, "priority must be a signed 64-bit integer"),
    # SGLang honours these; this engine does not implement them
    ({"token_ids_logprob": [3, 4]}, "token_ids_logprob=[3, 4] is not supported by the mixfleet CPU engine."),
    ({"session_params": {"id": "s"}}, "session_params="),
    ({"return_flat_raw_top_logprobs": True}, "return_flat_raw_top_logprobs=True is not supported"),
    ({"return_flat_raw_output_top_logprobs": True}, "return_flat_raw_output_top_logprobs=True"),
    ({"return_prompt_token_ids": True}, "return_prompt_token_ids=True is not supported"),
    ({"positional_embed_overrides": {}}, "positional_embed_overrides={} is not supported"),
    ({"multi_item_delimiter_indices": [1]}, "multi_item_delimiter_indices=[1] is not supported"),
    ({"token_indices_to_pool": [0]}, "token_indices_to_pool=[0] is not supported"),
    # and their types, as SGLang's parse and contract gate judge them (core/sglang_contract/)
    ({"lora_path": 5}, "lora_path: invalid type: integer `5`"),
    ({"priority": "3"}, 'priority: invalid type: string "3", expected i64'),
    ({"bootstrap_port": [1, "x"]}, "bootstrap_port[1]: invalid type"),
    ({"return_hidden_states": "last"}, 'return_hidden_states: invalid type: string "last"'),
    ({"custom_labels": {"team": 1}}, "custom_labels.team: invalid type: integer `1`"),
]

SERVED_AS_SGLANG_SERVES = {
    # what SGLang ignores on such a server (a text-only model, one data-parallel rank, no
    # disaggregation, HiCache or priority scheduling), and a key it does not know
    "zzz_not_a_field": {"x": 1},
    "image_data": "https://example.invalid/cat.png",
    "modalities": ["image"],
    "bootstrap_host": "10.0.0.1",
    "bootstrap_room": 7,
    "priority": 3,
    "session_id": "s-1",
    "routing_key": "k",
    "extra_key": "e",
    "cache_salt": "salt",
    "custom_labels": {"team": "rl"},
    "require_reasoning": False,
    "log_metrics": False,
    "return_entropy": True,
    "routed_dp_rank": 0,
    # and every refused field at the value that asks for nothing
    "lora_path": None,
    "input_embeds": None,
    "return_hidden_states": False,
    "custom_logit_processor": None,
    "max_thinking_tokens": None,
    "token_ids_logprob": None,
    "session_params": None,
    "return_flat_raw_top_logprobs": False,
    "return_prompt_token_ids": False,
    "positional_embed_overrides": None,
}


def test_top_level_fields_the_engine_cannot_serve_are_refused_by_name(
    engine: str, client: httpx.Client
) -> None:
    """A top-level ``/generate`` field is not silently ignored where SGLang 0.5.23 would refuse it
    (LoRA, ``input_embeds``, hidden states, a custom logit processor, a thinking budget or a
    data-parallel rank other than 0 on a server started as the fleet starts SGLang: a 400 in
    SGLang's words, tokenizer_manager.py 905-924, 1109-1114, 1394-1419, 3723-3740) or honour it
    with a meaning this engine cannot reproduce (a 400 naming it); its type is SGLang's gate's.
    What SGLang ignores on such a server, an unknown key included, is served."""
    for fields, msg in TOP_LEVEL_REFUSED:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, **fields}
        r = client.post(engine + "/generate", json=body)
        assert r.status_code == 400, (fields, r.status_code, r.text)
        assert msg in error_message(400, r.content), (fields, r.text)
    out = generate(
        client,
        engine,
        input_ids=[1, 2],
        sampling_params={"max_new_tokens": 2, "ignore_eos": True},
        **SERVED_AS_SGLANG_SERVES,
    )
    assert len(out["output_ids"]) == 2


WATERMARK_REFUSED = [
    # SGLang 0.5.23 on a server without --enable-watermark (watermarking/core.py 163-242,
    # tokenizer_manager.py 213-225, 1553-1568), in its words
    (
        {"watermark": {"enabled": True}},
        "request watermarking requires the server to enable --enable-watermark",
    ),
    ({"sampling_params": {"watermark": {"key": "0xab"}}}, "requires the server to enable --enable-watermark"),
    ({"sampling_params": {"watermark": {}}}, "request watermark must set enabled or key"),
    ({"watermark": {"context_window": 2}}, "request watermark must set enabled or key"),
    ({"watermark": {"enabled": False, "key": "ab"}}, "key cannot be combined with enabled=false"),
    (
        {"watermark": {"enabled": False, "context_window": 5}},
        "cannot exceed the server's watermark context_window",
    ),
    ({"watermark": {"context_window": 0}}, "watermark context_window must be a positive integer"),
    ({"watermark": {"key": "xyz"}}, "watermark key must contain only hex digits"),
    ({"watermark": {"key": 7}}, "watermark key must be a hex string"),
    ({"watermark": {"enabled": 1}}, "watermark enabled must be a boolean"),
    ({"watermark": {"seed": 1}}, "watermark contains unknown fields"),
    ({"watermark": "on"}, "watermark must be an object"),
    (
        {"watermark": {"enabled": False}, "sampling_params": {"watermark": {"enabled": False}}},
        "watermark must be provided either at the request top level or inside sampling_params, not both",
    ),
    (
        {"input_ids": [[1], [2]], "watermark": [None]},
        "The length of watermark should be equal to the batch size.",
    ),
    ({"input_ids": [[1], [2]], "watermark": [None, {"enabled": True}]}, "--enable-watermark"),
]

WATERMARK_SERVED = [
    {"watermark": None},
    {"watermark": {"enabled": False}},
    {"sampling_params": {"watermark": {"enabled": False, "context_window": 4, "key": None}}},
    {"input_ids": [[1], [2]], "watermark": [None, {"enabled": False}]},
]


def test_a_watermark_is_refused_as_sglang_refuses_it_without_enable_watermark(
    engine: str, client: httpx.Client
) -> None:
    """A watermark is never silently dropped: SGLang 0.5.23 started as the fleet starts it (no
    ``--enable-watermark``, a CUDA-only flag) refuses every watermark that asks for one, and the
    malformed ones, in these words (step 3's ``{"error": {"message"}}``); one that asks for none
    (``null``, ``enabled: false`` without a key, a window of at most 4) is served."""
    base = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    for fields, msg in WATERMARK_REFUSED:
        params = {**base["sampling_params"], **fields.get("sampling_params", {})}
        body = {**base, **fields, "sampling_params": params}
        r = client.post(engine + "/generate", json=body)
        assert r.status_code == 400, (fields, r.status_code, r.text)
        assert _shape(r.json()) == "verify" and msg in error_message(400, r.content), (fields, r.text)
    for fields in WATERMARK_SERVED:
        params = {**base["sampling_params"], **fields.get("sampling_params", {})}
        r = client.post(engine + "/generate", json={**base, **fields, "sampling_params": params})
        assert r.status_code == 200, (fields, r.text)


def test_a_malformed_watermark_is_named_before_sampling_params_ranges(
    engine: str, client: httpx.Client
) -> None:
    """SGLang 0.5.23 builds an item's ``SamplingParams`` after refusing a watermark set both ways
    (tokenizer_manager.py 1553-1559), and ``__post_init__`` normalizes the watermark
    (sampling_params.py 236, watermarking/core.py 163-193) before ``verify`` judges the ranges
    (tokenizer_manager.py 1565-1567): a malformed watermark is named before an out-of-range
    ``top_p``; what the server's settings refuse (``resolve_watermark_request``, 1568) after it."""
    top_p = {"top_p": 1.5}
    cases = [
        (
            {"watermark": {"key": "zz"}, "sampling_params": top_p},
            "watermark key must contain only hex digits",
        ),
        ({"watermark": "on", "sampling_params": top_p}, "watermark must be an object"),
        (
            {"watermark": {"enabled": True}, "sampling_params": {**top_p, "watermark": {"enabled": True}}},
            "not both",
        ),
        ({"sampling_params": {**top_p, "watermark": {"context_window": 0}}}, "must be a positive integer"),
        ({"input_ids": [[1], [2]], "watermark": [None], "sampling_params": top_p}, "The length of watermark"),
        (
            {"input_ids": [[1], [2]], "watermark": [None, {"seed": 1}], "sampling_params": [{}, {}]},
            "unknown fields",
        ),
        # an item's ranges before a later item's watermark; the server's settings after verify
        (
            {"input_ids": [[1], [2]], "watermark": [None, {"seed": 1}], "sampling_params": top_p},
            "top_p must be in",
        ),
        ({"watermark": {"enabled": True}, "sampling_params": top_p}, "top_p must be in (0, 1], got 1.5."),
    ]
    for fields, msg in cases:
        body = {"input_ids": [1, 2], **fields}
        r = client.post(engine + "/generate", json=body)
        assert r.status_code == 400 and _shape(r.json()) == "verify", (fields, r.text)
        assert msg in error_message(400, r.content), (fields, r.text)


MEDIA = "https://example.invalid/cat.png"
ACTION = {"action_id": "a", "action_type": "t", "action_version": "1"}
ENVELOPE = {"protocol_version": "1", "message_id": "m", "actions": [{**ACTION, "payload": {}}]}

NESTED_REFUSED = [
    # the gate (api_types.py 1453-1486): MediaInput 2034-2043, MediaRef 1905-1940 (unknown keys
    # refused); the dataclass parse takes any media value (io_struct.py 78-81, 158-204)
    (
        {"image_data": 5},
        "gate",
        "image_data: invalid type: integer `5`, expected one of the MediaInput shapes",
    ),
    (
        {"image_data": {"url": MEDIA, "zoom": 2}},
        "gate",
        "image_data: unknown field `zoom`, expected one of `url`",
    ),
    (
        {"video_data": [MEDIA, [MEDIA]]},
        "gate",
        "video_data[1]: invalid type: sequence, expected one of the MediaItem",
    ),
    ({"audio_data": [[MEDIA], "x"]}, "gate", 'audio_data[1]: invalid type: string "x", expected a sequence'),
    ({"image_data": {"url": None}}, "gate", "image_data.url: invalid type: null, expected a string"),
    (
        {"image_data": {"url": MEDIA, "fps": "2"}},
        "gate",
        'image_data.fps: invalid type: string "2", expected f64',
    ),
    ({"image_data": {"url": MEDIA, "image_grid_thw": [[1, 2.0]]}}, "gate", "image_data.image_grid_thw[0][1]"),
    # kv_hints: the dataclass parse takes a dict or a list of dicts and nulls (io_struct.py 378-380),
    # the gate its KvHintsEnvelope (1598-1660); then normalize_batch_and_arguments decodes it with
    # msgspec (io_struct.py 583-587, 888-905, kv_hints.py 44-58): a 400 in its words
    ({"kv_hints": 5}, "parse", "kv_hints: invalid type: integer `5`"),
    (
        {"kv_hints": [ENVELOPE, 5]},
        "parse",
        "kv_hints[1]: invalid type: integer `5`, expected struct KvHintsEnvelope",
    ),
    (
        {"kv_hints": {"message_id": 5}},
        "gate",
        "kv_hints.message_id: invalid type: integer `5`, expected a string",
    ),
    (
        {"kv_hints": {"actions": [None]}},
        "gate",
        "kv_hints.actions[0]: invalid type: null, expected struct KvHintAction",
    ),
    ({"kv_hints": [ENVELOPE]}, "verify", "kv_hints should be a single envelope for one request."),
    (
        {"kv_hints": {"message_id": "m"}},
        "verify",
        "Malformed kv_hints envelope: Object missing required field `protocol_version`",
    ),
    (
        {"kv_hints": {**ENVELOPE, "actions": None}},
        "verify",
        "Malformed kv_hints envelope: Expected `array`, got `null` - at `$.actions`",
    ),
    (
        {"kv_hints": {**ENVELOPE, "actions": [{**ACTION, "payload": 5}]}},
        "verify",
        "Malformed kv_hints envelope: Expected `object`, got `int` - at `$.actions[0].payload`",
    ),
    (
        {"kv_hints": {"actions": [{}]}},
        "verify",
        "Object missing required field `action_id` - at `$.actions[0]`",
    ),
    ({"input_ids": [[1], [2]], "kv_hints": {}}, "verify", "Object missing required field `protocol_version`"),
    (
        {"input_ids": [[1], [2]], "kv_hints": [ENVELOPE]},
        "verify",
        "The length of kv_hints should be equal to the batch size.",
    ),
    # images_config: the dataclass a dict (io_struct.py 357), the gate ImagesConfig (1579-1587)
    (
        {"images_config": "x"},
        "parse",
        'images_config: invalid type: string "x", expected struct ImagesConfig',
    ),
    (
        {"images_config": {"prefix": None}},
        "gate",
        "images_config.prefix: invalid type: null, expected a string",
    ),
    # return_indexer_topk: a dataclass-only bool (io_struct.py 269), the parse's alone
    ({"return_indexer_topk": None}, "parse", "return_indexer_topk: invalid type: null, expected a boolean"),
    (
        {"return_indexer_topk": 2},
        "parse",
        "return_indexer_topk: invalid type: integer `2`, expected a boolean",
    ),
    # a batch's media lists (io_struct.py 645-685, 722-738, 972-975): image_data's length is
    # checked, a short video_data / audio_data is SGLang's 500 (NO_SHORT_LIST), refused here
    (
        {"input_ids": [[1], [2]], "image_data": [MEDIA]},
        "verify",
        "The length of image_data should be equal to the batch size.",
    ),
    # mm_hashes (io_struct.py 687-720): after image_data's length, one hash or a list per request,
    # as many as its images (none without image_data, one for one image or a flat list's entry)
    (
        {"input_ids": [[1], [2]], "image_data": [MEDIA], "mm_hashes": ["a"]},
        "verify",
        "The length of image_data should be equal to the batch size.",
    ),
    (
        {"input_ids": [[1], [2]], "mm_hashes": ["a"], "watermark": [None], "lora_path": "a"},
        "verify",
        "The length of mm_hashes should equal the batch size",
    ),
    ({"input_ids": [[1], [2]], "mm_hashes": ["a", "b"]}, "verify", "mm_hashes[0] must be a list with one"),
    (
        {"input_ids": [[1], [2]], "image_data": [[MEDIA, MEDIA], None], "mm_hashes": [["a"], []]},
        "verify",
        "mm_hashes[0] has 1 entries for 2 images",
    ),
    (
        {"input_ids": [[1], [2]], "image_data": [[MEDIA], None], "mm_hashes": [["a"], ["b"]]},
        "verify",
        "mm_hashes[1] has 1 entries for 0 images",
    ),
    ({"sampling_params": {"n": 2}, "mm_hashes": [[], []]}, "verify", "The length of mm_hashes should equal"),
    # then mm_content_hashes alike (io_struct.py 689), typed by the dataclass parse (219-221)
    (
        {"input_ids": [[1], [2]], "mm_hashes": [[], []], "mm_content_hashes": [None]},
        "verify",
        "The length of mm_content_hashes should equal the batch size",
    ),
    (
        {"input_ids": [[1], [2]], "image_data": [MEDIA, MEDIA], "mm_content_hashes": [["a"], ["b", None]]},
        "verify",
        "mm_content_hashes[1] has 2 entries for 1 images",
    ),
    ({"mm_content_hashes": [1]}, "parse", "mm_content_hashes: invalid type"),
    ({"mm_content_hashes": ["a", ["b"]]}, "parse", "mm_content_hashes: invalid type"),
    ({"input_ids": [[1], [2]], "video_data": [MEDIA]}, "verify", "video_data has 1 entries for a batch of 2"),
    ({"input_ids": [[1], [2]], "audio_data": []}, "verify", "audio_data has 0 entries for a batch of 2"),
    # so is a short sampling_params list, or an empty one (io_struct.py 540, 740-747, 982)
    (
        {"sampling_params": []},
        "verify",
        "sampling_params has 0 entries for a batch of 1: SGLang 0.5.23 takes",
    ),
    (
        {"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}]},
        "verify",
        "sampling_params has 1 entries for a batch of 2: SGLang 0.5.23 takes",
    ),
]

NESTED_SERVED = [
    # what SGLang ignores on a text-only model without HiCache (tokenizer_manager.py 612-637,
    # 1159-1163; kv_hints only reach HiCache backends; images_config only the OCR processor;
    # return_indexer_topk is read by no /generate answer)
    {"image_data": [[MEDIA, {"url": MEDIA, "detail": "low", "image_grid_thw": [[1, 2, 2]]}], None]},
    {"video_data": [MEDIA, None], "audio_data": {"url": MEDIA, "use_audio": True}},
    {"kv_hints": ENVELOPE},
    {"kv_hints": {}},
    # one request's mm_hashes / mm_content_hashes: judged only by a multimodal processor
    # (tokenizer_manager.py 1159-1175, 1240-1242), which a text-only model has none of
    {"mm_hashes": ["a", "b"], "mm_content_hashes": [None, "sha256:x", None]},
    {
        "kv_hints": {
            **ENVELOPE,
            "x": 1,
            "actions": [{"action_id": "a", "action_type": "t", "action_version": "1"}],
        }
    },
    {"images_config": {"image_mode": None, "prefix": "p", "other": 1}},
    {"return_indexer_topk": True},
    {"return_indexer_topk": 1},
    {
        "input_ids": [[1], [2]],
        "image_data": [],
        "video_data": [MEDIA, MEDIA, MEDIA],
        "kv_hints": [ENVELOPE, None],
    },
    # mm_hashes matching the images (io_struct.py 687-720); one request's SGLang does not judge
    {"input_ids": [[1], [2]], "image_data": MEDIA, "mm_hashes": ["a", "b"]},
    {"input_ids": [[1], [2]], "image_data": MEDIA, "mm_hashes": [["a"], ["b"]]},
    {"input_ids": [[1], [2]], "image_data": [MEDIA, None], "mm_hashes": ["a", "b"]},
    {"input_ids": [[1], [2]], "image_data": [[MEDIA, MEDIA], None], "mm_hashes": [["a", "b"], []]},
    {"input_ids": [[1], [2]], "mm_hashes": [[], []]},
    {"mm_hashes": ["a", "b"]},
]


def test_the_nested_structs_are_judged_as_sglang_judges_them(engine: str, client: httpx.Client) -> None:
    """``image_data`` / ``video_data`` / ``audio_data``, ``kv_hints``, ``images_config`` and
    ``return_indexer_topk`` are refused where SGLang 0.5.23 refuses them, by the step that does
    (the parse, the gate, the tokenizer manager's normalization: core.sglang_contract), in its
    words and its body shape, and ignored where SGLang started as the fleet starts it (a
    text-only model, no HiCache) ignores them."""
    for fields, step, msg in NESTED_REFUSED:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, **fields}
        r = client.post(engine + "/generate", json=body)
        assert r.status_code == 400, (fields, r.status_code, r.text)
        assert _shape(r.json()) == step and msg in error_message(400, r.content), (fields, r.text)
    for fields in NESTED_SERVED:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, **fields}
        r = client.post(engine + "/generate", json=body)
        assert r.status_code == 200, (fields, r.text)


def test_beam_search_and_choice_are_refused_by_name(engine: str, client: httpx.Client) -> None:
    """``beam_width`` above 1 asks SGLang 0.5.23 for beam search (sampling_params.py 166-168),
    which this engine does not implement: a 400 naming it; null or 1 is one sample. ``choice``
    SGLang's gate takes (api_types.py 1317-1318) but its ``SamplingParams`` has no such field
    (sampling_params.py 140-181): ``SamplingParams(**kwargs)`` raises a TypeError there, a 500
    for any value (tokenizer_manager.py 1565, http_server.py 983-990); here a 400 naming it."""
    refused = [
        ({"beam_width": 2}, "sampling_params.beam_width=2 is not supported by the mixfleet CPU engine."),
        ({"choice": ["a", "b"]}, "sampling_params.choice is not supported"),
        ({"choice": []}, "sampling_params.choice is not supported"),
        ({"choice": None}, "sampling_params.choice is not supported"),
    ]
    for params, msg in refused:
        r = client.post(engine + "/generate", json={"input_ids": [1, 2], "sampling_params": params})
        assert r.status_code == 400 and msg in error_message(400, r.content), (params, r.text)
    for beam_width in (None, 1):
        params = {"beam_width": beam_width, "max_new_tokens": 2, "ignore_eos": True}
        out = generate(client, engine, input_ids=[1, 2], sampling_params=params)
        assert len(out["output_ids"]) == 2


FAILS_IN_SGLANG = [
    {"input_ids": [1, 2], "sampling_params": {"choice": ["a", "b"]}},  # NO_CHOICE
    {"input_ids": [[1], [2]], "video_data": [MEDIA]},  # NO_SHORT_LIST
    {"input_ids": [[1], [2]], "sampling_params": [{}]},
    {"input_ids": [1, 2], "sampling_params": [{}]},  # NO_LIST_FOR_ONE
    {"input_ids": [1, 2], "sampling_params": {"n": None}},  # NO_NULL_N
    {"text": ["a", "b"], "input_ids": [[1]]},  # NO_TEXT_AND_IDS
]


def test_what_sglang_fails_on_breaks_a_stream_off_as_sglangs_does(engine: str, client: httpx.Client) -> None:
    """What SGLang 0.5.23 fails on rather than refuses (an IndexError, TypeError or
    AttributeError of ``generate_request``: unstreamed a 500, refused here as a 400 naming it) is,
    streamed, no error event: ``stream_results`` catches only a ``ValueError``
    (entrypoints/http_server.py 949-979), so the exception leaves the 200 stream, and the server
    closes the connection before any event or ``[DONE]``. The engine keeps serving."""
    for body in FAILS_IN_SGLANG:
        plain = client.post(engine + "/generate", json=body)
        assert plain.status_code == 400 and "SGLang 0.5.23" in plain.text, (body, plain.text)
        with client.stream("POST", engine + "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                r.read()
    ok = generate(client, engine, input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(ok["output_ids"]) == 2


def test_a_stream_sends_a_chunk_every_stream_interval_tokens(engine: str, client: httpx.Client) -> None:
    """``sampling_params.stream_interval`` is honoured as SGLang 0.5.23's output streamer does
    (output_streamer.py 455-469): the first token at once, then a chunk once ``stream_interval``
    tokens are unsent, and the finish; so every chunk but the last holds 1, 6, 11, ... tokens
    (chunks may coalesce, in SGLang too: tokenizer_manager.py 1985-1993, the last pending one)."""
    params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.0, "stream_interval": 5}
    body = {"input_ids": PROMPT, "sampling_params": params}
    whole = generate(client, engine, **body)
    reader = StreamReader(engine, body)
    last = reader.result()
    lengths = [len(c["output_ids"]) for c in reader.chunks]
    assert set(lengths[:-1]) <= {1, 6, 11} and lengths[-1] == 16, lengths
    assert last["output_ids"] == whole["output_ids"]


def test_a_null_max_new_tokens_generates_up_to_the_context(engine: str, client: httpx.Client) -> None:
    """``max_new_tokens: null`` is no bound of its own, as in SGLang 0.5.23 (the scheduler takes
    ``1 << 30`` capped at ``max_req_len - len(input) - 1``, ``max_req_len = context_len - 1``:
    core.sglang_contract.max_new_tokens_bound), not the 128 an absent one means: a prompt 10
    tokens short of the context generates 8 and ends by length, where 128 would not fit."""
    context = client.get(engine + "/server_info").json()["context_length"]
    prompt = [1 + i % 50 for i in range(context - 10)]
    sp = {"max_new_tokens": None, "ignore_eos": True, "temperature": 0}
    out = generate(client, engine, input_ids=prompt, sampling_params=sp)
    assert len(out["output_ids"]) == 8 and out["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 8,
    }
    absent = generate(
        client, engine, input_ids=[1, 2], sampling_params={"ignore_eos": True, "temperature": 0}
    )
    assert len(absent["output_ids"]) == 128  # absent: SGLang's default


def test_the_last_six_tokens_of_the_context_are_refused_and_an_explicit_max_new_tokens_is_capped(
    engine: str, client: httpx.Client
) -> None:
    """SGLang 0.5.23's scheduler aborts a prompt of ``max_req_input_len`` tokens or more,
    ``max_req_len - 5`` = ``context_len - 6`` (managers/tp_worker.py 568-572; managers/utils.py
    259-289, called at managers/scheduler.py 3245-3253: ``set_finish_with_abort``, a 400, one event
    streamed), which its tokenizer manager let through (only ``n >= context_len`` is refused
    there); and it caps an explicit ``max_new_tokens`` too at ``max_req_len - n - 1``
    (scheduler.py 2693-2716), so a prompt 20 short of the context asking 20 tokens, which the
    tokenizer manager's total check lets through, generates 18."""
    context = client.get(engine + "/server_info").json()["context_length"]
    sp = {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0}
    served = generate(client, engine, input_ids=[1] * (context - 7), sampling_params=sp)
    assert len(served["output_ids"]) == 1
    for n in (context - 6, context - 1):
        body = {"input_ids": [1] * n, "sampling_params": sp}
        message = (
            f"Input length ({n} tokens) exceeds the maximum allowed length ({context - 6} tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )
        plain = client.post(engine + "/generate", json=body)
        assert plain.status_code == 400 and plain.json()["error"]["message"] == message, plain.text
        r = client.post(engine + "/generate", json={**body, "stream": True})
        events = sse_events(r.text)
        assert r.status_code == 200 and len(events) == 2 and events[1] == "[DONE]", r.text
        reason = events[0]["meta_info"]["finish_reason"]
        assert reason == {
            "type": "abort",
            "message": message,
            "status_code": 400,
            "err_type": "BadRequestError",
        }
    prompt = [1 + i % 50 for i in range(context - 20)]
    capped = generate(client, engine, input_ids=prompt, sampling_params={**sp, "max_new_tokens": 20})
    assert len(capped["output_ids"]) == 18
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 18}
    over = client.post(
        engine + "/generate", json={"input_ids": prompt, "sampling_params": {**sp, "max_new_tokens": 21}}
    )
    assert over.status_code == 400 and "Requested token count exceeds" in over.text, over.text


def test_metrics_use_sglang_names(engine: str, client: httpx.Client) -> None:
    generate(client, engine, input_ids=PROMPT, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    text = client.get(engine + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            samples[name_labels.split("{")[0]] = float(value)
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:generation_tokens_total",
        "sglang:prompt_tokens_total",
        "sglang:time_to_first_token_seconds_count",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:e2e_request_latency_seconds_sum",
    ):
        assert name in samples, name
    assert samples["sglang:generation_tokens_total"] >= 3
    assert samples["sglang:prompt_tokens_total"] >= len(PROMPT)
    assert samples["sglang:e2e_request_latency_seconds_count"] >= 1
    assert 'model_name="' in text


def test_info_and_health_routes(engine: str, client: httpx.Client, tiny_dir: Path) -> None:
    info = client.get(engine + "/model_info").json()
    assert info["model_path"] == str(tiny_dir.resolve()) and info["is_generation"] is True
    assert info["weight_version"] == "0"
    assert client.get(engine + "/get_model_info").json() == info
    assert client.get(engine + "/get_weight_version").json() == {"weight_version": "0"}
    server = client.get(engine + "/server_info").json()
    assert server["weight_version"] == "0" and server["internal_states"][0]["paused"] is None
    assert server["weight_format"] == "bf16"  # the local engine's own fact
    assert client.get(engine + "/health").status_code == 200
    assert client.get(engine + "/health_generate").status_code == 200
    assert client.post(engine + "/flush_cache").status_code == 200


def test_the_mask_limit_is_the_engines_flag(tiny_dir: Path) -> None:
    """``--sampling-mask-max-tokens N`` (SGLang's flag): a mask request's top_k may be N, not N + 1."""
    body = {"input_ids": PROMPT, "return_sampling_mask": True}
    with engine_process(tiny_dir, sampling_mask_max_tokens=8) as url, httpx.Client(timeout=60) as c:
        ok = c.post(url + "/generate", json={**body, "sampling_params": {"top_k": 8, "max_new_tokens": 2}})
        assert ok.status_code == 200 and all(
            len(m) <= 8 for m in ok.json()["meta_info"]["output_token_sampling_mask"]
        )
        bad = c.post(url + "/generate", json={**body, "sampling_params": {"top_k": 9, "max_new_tokens": 2}})
        assert (
            bad.status_code == 400 and "finite 1 < top_k <= 8; got top_k=9" in bad.json()["error"]["message"]
        )


STEP3_ORDER = [
    # two step-3 problems in one body: SGLang 0.5.23 names the one it checks first
    # (tokenizer_manager.py generate_request 903-942, _tokenize_one_request 1096-1434, then the
    # item's SamplingParams 1548-1567); each pair's second problem alone is refused too
    # normalize_batch_and_arguments: the input's presence before the rest (io_struct.py 431-442)
    ({"input_ids": None, "kv_hints": []}, "Either text, input_ids or input_embeds should be provided."),
    ({"text": "a", "input_embeds": [[0.5]], "lora_path": "a"}, "Either text, input_ids or input_embeds"),
    # input_embeds alone is an input: refused later, for the radix cache (tokenizer_manager.py 1109)
    ({"input_ids": None, "input_embeds": [[0.5]], "lora_path": "a"}, "LoRA is not enabled"),
    ({"input_ids": None, "input_embeds": [[0.5]]}, "input_embeds is provided while disable_radix_cache"),
    # then _determine_batch_size's empty input_ids and session_id with session_params (io_struct.py
    # 432-434), before _handle_parallel_sampling (a null n) and everything after
    ({"input_ids": [], "session_id": "s", "session_params": {}}, "input_ids cannot be empty."),
    (
        {"session_id": "s", "session_params": {}, "sampling_params": {"n": None}},
        "session_id and session_params",
    ),
    (
        {"input_ids": [], "session_id": "s", "session_params": {"id": "x"}, "lora_path": "a"},
        "session_id and session_params cannot both be set.",
    ),
    ({"input_ids": None, "session_id": "s", "session_params": {}}, "Either text, input_ids or input_embeds"),
    ({"lora_path": "a", "sampling_params": {"top_p": 1.5}}, "LoRA is not enabled"),
    ({"max_thinking_tokens": 5, "sampling_params": {"top_k": 0}}, "--enable-strict-thinking"),
    ({"routed_dp_rank": 1, "sampling_params": {"min_p": 2.0}}, "routed_dp_rank=1 out of range"),
    ({"max_thinking_tokens": 5, "lora_path": "a"}, "--enable-strict-thinking"),
    ({"input_embeds": [[0.5]], "sampling_params": {"temperature": -1.0}}, "input_embeds is provided"),
    ({"return_hidden_states": True, "sampling_params": {"top_p": 0.0}}, "not configured to return hidden"),
    ({"custom_logit_processor": "x", "sampling_params": {"top_p": 2.0}}, "custom logit processor"),
    ({"input_ids": [1] * 2000, "sampling_params": {"max_new_tokens": 100, "top_p": 2.0}}, "maximum context"),
    ({"input_ids": [1] * 2048, "sampling_params": {"min_p": 2.0}}, "longer than the model's context"),
    (
        {"input_ids": [1] * 2000, "return_hidden_states": True, "sampling_params": {"max_new_tokens": 100}},
        "maximum",
    ),
    ({"lora_path": "a", "return_hidden_states": True}, "LoRA is not enabled"),
    # a rid named twice: the last check of normalize_batch_and_arguments (io_struct.py 442),
    # after kv_hints, before everything generate_request checks next
    (
        {"input_ids": [[1], [2]], "rid": ["x", "x"], "lora_path": "a", "max_thinking_tokens": 3},
        "Duplicate request IDs detected within the request: ['x']",
    ),
    ({"input_ids": [[1], [2]], "rid": ["x", "x"], "kv_hints": [None]}, "The length of kv_hints"),
    # a list sampling_params on one request: SGLang's 500 reading it (tokenizer_manager.py 1354),
    # after the input's length, before hidden states (core.sglang_contract.NO_LIST_FOR_ONE)
    ({"sampling_params": [{}], "return_hidden_states": True}, "sampling_params is a list for one request"),
    ({"input_ids": [1] * 2048, "sampling_params": [{}]}, "longer than the model's context"),
    ({"sampling_params": [{"top_p": 1.5}], "lora_path": "a"}, "LoRA is not enabled"),
    # a rid list on one request: SGLang's 500 looking it up in _init_req_state (tokenizer_manager.py
    # 3835), after max_thinking_tokens, before the LoRA adapters (core.sglang_contract.NO_RID_LIST)
    ({"rid": ["a"], "lora_path": "a"}, "rid is a list for one request"),
    ({"rid": ["a"], "max_thinking_tokens": 3}, "--enable-strict-thinking"),
    ({"rid": ["a", "a"], "max_thinking_tokens": 3}, "Duplicate request IDs detected within the request"),
    ({"rid": [], "sampling_params": {"top_p": 1.5}}, "rid is a list for one request"),
    # _handle_parallel_sampling (io_struct.py 531-557), in normalize_batch_and_arguments
    ({"sampling_params": {"n": None}, "lora_path": "a"}, "sampling_params.n is null"),
    (
        {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]},
        "The parallel_sample_num should be the same for all samples in sample params.",
    ),
    # parallel samples (n > 1) make one request a batch of one (io_struct.py 548-557), whose
    # per-item lists _normalize_batch_inputs judges in its order (589-612): a rid list's length
    # (759-774), image_data's and watermark's (659-662, 749-757), a list logprob field (776-821),
    # return_hidden_states' length (823-837), a list custom_logit_processor (839-848), extra_key's
    # length (850-866), all before the LoRA adapters and the engine's own "n not supported"
    (
        {"sampling_params": {"n": 2}, "return_logprob": [True], "lora_path": "a"},
        "Cannot use list return_logprob",
    ),
    ({"sampling_params": {"n": 2}, "rid": ["a", "b"]}, "The specified rids length mismatch"),
    (
        {"sampling_params": {"n": 2}, "logprob_start_len": [0], "top_logprobs_num": [1]},
        "Cannot use list logprob_start_len with parallel_sample_num > 1",
    ),
    (
        {"sampling_params": {"n": 2}, "sampling_logprobs_mode": ["selected"]},
        "Cannot use list sampling_logprobs",
    ),
    ({"sampling_params": {"n": 2}, "return_sampling_mask": []}, "Cannot use list return_sampling_mask"),
    ({"sampling_params": {"n": 2}, "token_ids_logprob": [[3]]}, "Cannot use list token_ids_logprob"),
    (
        {"sampling_params": {"n": 2}, "token_ids_logprob": [3], "custom_logit_processor": ["x"]},
        "Cannot use list custom_logit_processor with parallel_sample_num > 1",
    ),
    (
        {"sampling_params": {"n": 2}, "watermark": [None, None], "return_logprob": [True]},
        "The length of watermark",
    ),
    (
        {
            "input_ids": [[1], [2]],
            "sampling_params": {"n": 2},
            "top_logprobs_num": [1, 1],
            "return_hidden_states": [True],
        },
        "Cannot use list top_logprobs_num",
    ),
    (
        {"sampling_params": {"n": 2}, "return_hidden_states": [True, True], "custom_logit_processor": ["x"]},
        "The length of return_hidden_states should be equal to the batch size.",
    ),
    (
        {"sampling_params": {"n": 2}, "custom_logit_processor": [None], "extra_key": ["a", "b"]},
        "Cannot use list custom_logit_processor",
    ),
    ({"sampling_params": {"n": 2}, "extra_key": ["a", "b"]}, "The length of extra_key should be equal"),
    # one request's extra_key / cache_salt must be a string (io_struct.py 575-580), before its
    # kv_hints (583-587) and the LoRA adapters; with parallel samples a list of one is taken
    ({"extra_key": ["a"], "kv_hints": [], "lora_path": "a"}, "extra_key should be a string for a single"),
    ({"cache_salt": [], "kv_hints": []}, "cache_salt should be a string for a single request."),
    ({"extra_key": "a", "cache_salt": ["a"]}, "cache_salt should be a string for a single request."),
    ({"sampling_params": {"n": 2}, "extra_key": ["a"], "cache_salt": ["b"]}, "n=2 is not supported"),
    ({"sampling_params": {"n": 2}, "kv_hints": [None, None]}, "The length of kv_hints"),
    # ... whose per-item lists _init_req_state indexes, repeated n times (io_struct.py 636-642,
    # 722-747, 907-947): an empty one is SGLang's IndexError (NO_SHORT_LIST), before the LoRA
    # adapters and the engine's "n not supported"
    ({"sampling_params": {"n": 2}, "lora_path": []}, "lora_path has 0 entries for a batch of 1: SGLang"),
    ({"sampling_params": {"n": 2}, "video_data": [], "lora_path": "a"}, "video_data has 0 entries"),
    ({"sampling_params": {"n": 3}, "audio_data": []}, "audio_data has 0 entries for a batch of 1"),
    ({"sampling_params": {"n": 2}, "bootstrap_room": [], "rid": ["r"]}, "bootstrap_room has 0 entries"),
    ({"sampling_params": {"n": 2}, "decode_tp_size": [1]}, "n=2 is not supported"),
    ({"sampling_params": {"n": 2, "beam_width": 2}, "return_logprob": True}, "n=2 is not supported"),
    # max_thinking_tokens before _init_req_state builds the items (a short list's IndexError)
    ({"input_ids": [[1], [2]], "max_thinking_tokens": 5, "sampling_params": [{}]}, "max_thinking_tokens"),
    # a batch: each item in turn, all its checks before the next item's
    (
        {
            "input_ids": [[1], [2]],
            "return_hidden_states": [False, True],
            "sampling_params": [{"top_p": 1.5}, {}],
        },
        "top_p must be in",
    ),
    # what this engine does not implement only after all SGLang refuses
    ({"token_ids_logprob": [3], "sampling_params": {"top_p": 1.5}}, "top_p must be in"),
    # token_ids_logprob's ids: after the context length, before hidden states and the ranges
    # (tokenizer_manager.py 1393, 1513-1531), in SGLang's words, not "not supported"
    (
        {"token_ids_logprob": [3, 10**9], "return_hidden_states": True, "sampling_params": {"top_p": 1.5}},
        "token_ids_logprob contains out-of-vocabulary token id 1000000000; valid range is [0, ",
    ),
    ({"input_ids": [1] * 2048, "token_ids_logprob": [10**9]}, "longer than the model's context"),
    ({"token_ids_logprob": [[3]]}, "token_ids_logprob must be a flat list of integers."),
    ({"input_ids": [[1], [2]], "token_ids_logprob": [[3], [-1]]}, "out-of-vocabulary token id -1"),
    # a list where one request's scheduler reads one value: it may end SGLang's server
    # (core.sglang_contract.NO_ONE_VALUE_LIST), refused after everything SGLang refuses before
    # its scheduler; a one-entry list too (the engine served its entry)
    ({"return_logprob": True, "logprob_start_len": [0]}, "logprob_start_len is a list for one request"),
    ({"return_logprob": [True]}, "return_logprob is a list for one request"),
    ({"return_logprob": []}, "return_logprob is a list for one request"),
    ({"top_logprobs_num": [1, 2], "return_logprob": True}, "top_logprobs_num is a list for one request"),
    ({"return_sampling_mask": [False], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1]"),
    ({"sampling_logprobs_mode": ["support"]}, "sampling_logprobs_mode is a list for one request"),
    ({"return_logprob": [True], "input_ids": [1] * 2048}, "longer than the model's context"),
    ({"return_logprob": [True], "lora_path": "a"}, "LoRA is not enabled"),
    # a logprob_start_len below -1 with return_logprob: SGLang's scheduler may fail an assertion and
    # end the server (core.sglang_contract.NO_LOGPROB_START_BELOW), refused after all it refuses
    # first, the scheduler's aborts included (managers/scheduler.py 3160-3182 before 3256-3279)
    ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len=-2 with return_logprob: SGLang"),
    ({"return_logprob": True, "logprob_start_len": -2, "sampling_params": {"top_p": 1.5}}, "top_p must be"),
    # ... whatever else the scheduler would abort the request for first (core.sglang_contract)
    ({"return_logprob": True, "logprob_start_len": -2, "return_sampling_mask": True}, "logprob_start_len=-2"),
    (
        {"input_ids": [[1], [2]], "return_logprob": [False, True], "logprob_start_len": [-5, -3]},
        "logprob_start_len=-3 with return_logprob (item 1): SGLang",
    ),
    # the scheduler's sampling-mask abort before its logprob_start_len one (3160-3182, 3275-3279)
    ({"return_logprob": True, "logprob_start_len": 5, "return_sampling_mask": True}, "requires top_k=1"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_step3_refusals_come_in_sglang_order(engine: str, client: httpx.Client, stream: bool) -> None:
    """A body with two problems SGLang's tokenizer manager refuses is refused for the one SGLang
    checks first: the LoRA adapters, ``max_thinking_tokens``, ``routed_dp_rank`` for the whole
    request, then per item ``input_embeds``, the context length, hidden states, the custom logit
    processor, and only then the item's ``SamplingParams`` ranges."""
    for fields, msg in STEP3_ORDER:
        body = {"input_ids": [1, 2], **fields, "stream": stream}
        r = client.post(engine + "/generate", json={**body, "stream": False})
        text = error_message(r.status_code, r.content)
        if stream:  # the error event, or, where SGLang fails (its 500), a stream broken off
            text = _events_or_unstreamed(client, engine, body, text)
        assert msg in text, (fields, r.status_code, text[:300])


def _events_or_unstreamed(client: httpx.Client, url: str, body: dict[str, Any], unstreamed: str) -> str:
    """The streamed answer's events; where the stream breaks off (what SGLang fails on,
    :func:`test_what_sglang_fails_on_breaks_a_stream_off_as_sglangs_does`), the unstreamed
    refusal, which must name SGLang's failure."""
    with client.stream("POST", url + "/generate", json=body) as r:
        try:
            return r.read().decode()
        except httpx.RemoteProtocolError:
            assert "SGLang 0.5.23" in unstreamed, unstreamed
            return unstreamed


def test_a_streamed_scheduler_abort_is_the_items_output_then_done(engine: str, client: httpx.Client) -> None:
    """What SGLang 0.5.23's scheduler aborts with a 400 when it takes a request (the sampling-mask
    rule, managers/scheduler.py 3160-3182; a ``logprob_start_len`` past the input, 3275-3279) is,
    streamed, no error event: the item's output whose ``finish_reason`` is the abort with its
    ``status_code`` (``FINISH_ABORT.to_json``, managers/schedule_batch.py 332-345; the mask's
    without an ``err_type``, disaggregation/utils.py 1926-1930), one event of an HTTP 200 stream,
    then ``[DONE]`` (managers/tokenizer_manager.py 1891-1922, 2041-2048;
    entrypoints/http_server.py 951-975); in a batch the other items run on (2211-2228). The
    mask's runs nothing (no id, the real ``prompt_tokens``: managers/scheduler.py 3513-3518); the
    start's runs a one-token prefill of input ``[0]`` first, so its event carries the id drawn
    (:func:`test_a_streamed_set_finish_with_abort_is_a_one_token_prefill_of_input_0`).
    Unstreamed it is a 400 with the message, a batch's too."""
    mask = "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got top_k="
    start = "req.logprob_start_len=3 is higher than the number of input tokens len(req.origin_input_ids)=2."
    for body, message, err_type, drawn, prompt_tokens in (
        ({"return_sampling_mask": True}, mask, None, 0, 2),
        ({"return_logprob": True, "logprob_start_len": 3}, start, "BadRequestError", 1, 1),
    ):
        body = {"input_ids": [1, 2], **body}
        r = client.post(engine + "/generate", json={**body, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        events = sse_events(r.text)
        assert len(events) == 2 and events[1] == "[DONE]" and "error" not in events[0], r.text
        reason = events[0]["meta_info"]["finish_reason"]
        assert message in reason.pop("message") and len(events[0]["output_ids"]) == drawn, r.text
        if not drawn:
            assert events[0]["output_ids"] == [], r.text
        assert events[0]["meta_info"]["prompt_tokens"] == prompt_tokens, r.text
        assert events[0]["meta_info"]["completion_tokens"] == drawn, r.text
        assert reason == {"type": "abort", "status_code": 400, "err_type": err_type}, r.text
        # the mask's abort never reaches a forward: no forward stamps (observability/
        # req_time_stats.py 1223-1230), its queue time 0
        forwarded = {"forward_entry_time", "prefill_finished_time"} <= set(events[0]["meta_info"])
        assert forwarded == bool(drawn) and (drawn or events[0]["meta_info"]["queue_time"] == 0.0), r.text
        plain = client.post(engine + "/generate", json=body)
        assert plain.status_code == 400 and message in plain.json()["error"]["message"], plain.text
    batch = {
        "input_ids": [[1, 2], [3]],
        "return_logprob": True,
        "logprob_start_len": [0, 5],
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
    }
    r = client.post(engine + "/generate", json={**batch, "stream": True})
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text
    last = {e["index"]: e for e in events[:-1]}  # each item's last event
    assert last[1]["meta_info"]["finish_reason"]["status_code"] == 400, r.text
    assert "req.logprob_start_len=5 is higher" in last[1]["meta_info"]["finish_reason"]["message"]
    assert last[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}, r.text
    assert len(last[0]["meta_info"]["input_token_logprobs"]) == 2, r.text
    plain = client.post(engine + "/generate", json=batch)
    assert plain.status_code == 400 and "req.logprob_start_len=5 is higher" in plain.text, plain.text


def test_a_streamed_set_finish_with_abort_is_a_one_token_prefill_of_input_0(
    engine: str, client: httpx.Client
) -> None:
    """A ``logprob_start_len`` past the input, streamed: SGLang 0.5.23's scheduler aborts the item
    with ``Req.set_finish_with_abort`` (managers/scheduler.py 3275-3279; schedule_batch.py
    2221-2238: input ``[0]``, ``return_logprob`` off, ``to_finish`` the abort) and runs it: the
    prefill's result appends the drawn id and ``update_finish_state`` finishes it with
    ``to_finish`` at once (scheduler_components/batch_result_processor.py 363-369;
    schedule_batch.py 2011-2014), so its one event is the output of a one-token prefill of
    ``[0]`` under the request's other sampling parameters: that id and its text, ``prompt_tokens``
    1 (``len(origin_input_ids)``, output_streamer.py 493), ``completion_tokens`` 1 (525), no
    cached tokens (no prefix matched by one token), the weight-version span of the one token, and
    the asked log-prob keys empty (the tokenizer manager reads the client's ``return_logprob``,
    tokenizer_manager.py 2520-2529, 2868-2870; the streamer sends nothing for a request whose
    ``return_logprob`` is off, output_streamer.py 647-653); a sampling mask asked for is the
    drawn id's. The id is the one a plain request of ``[0]`` asking one token draws."""
    for params, extra in (
        ({"temperature": 0.0, "max_new_tokens": 5}, {"top_logprobs_num": 2}),
        (
            {"temperature": 1.0, "top_k": 5, "sampling_seed": 7, "max_new_tokens": 3},
            {"return_sampling_mask": True},
        ),
    ):
        stub = {"input_ids": [0], "sampling_params": {**params, "max_new_tokens": 1}, **extra}
        plain = client.post(engine + "/generate", json=stub)
        assert plain.status_code == 200, plain.text
        want = plain.json()
        body = {
            "input_ids": [3, 1, 4, 1],
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": 5,
            "stream": True,
            **extra,
        }
        r = client.post(engine + "/generate", json=body)
        events = sse_events(r.text)
        assert r.status_code == 200 and len(events) == 2 and events[1] == "[DONE]", r.text
        (event,) = events[:1]
        assert event["output_ids"] == want["output_ids"] and len(want["output_ids"]) == 1, r.text
        assert event["text"] == want["text"], r.text
        meta = event["meta_info"]
        assert meta["finish_reason"]["status_code"] == 400 and meta["finish_reason"]["type"] == "abort"
        assert "req.logprob_start_len=5 is higher" in meta["finish_reason"]["message"], r.text
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (1, 1, 0), r.text
        assert meta["weight_versions"] == want["meta_info"]["weight_versions"], r.text
        assert meta["weight_version"] == want["meta_info"]["weight_version"], r.text
        assert meta["input_token_logprobs"] == meta["output_token_logprobs"] == [], r.text
        assert meta["output_token_logprobs_length"] == 0, r.text
        if "top_logprobs_num" in extra:
            assert meta["input_top_logprobs"] == meta["output_top_logprobs"] == [], r.text
        if "return_sampling_mask" in extra:
            assert meta["output_token_sampling_mask"] == want["meta_info"]["output_token_sampling_mask"], (
                r.text
            )
            assert meta["output_token_sampling_mask_length"] == 1, r.text
        extra_keys = set(meta) - set(want["meta_info"]) - {"input_token_logprobs", "output_token_logprobs"}
        assert extra_keys <= {"output_token_logprobs_length", "input_top_logprobs", "output_top_logprobs"}


def test_a_streamed_step3_refusal_is_an_error_event_inside_a_200(engine: str, client: httpx.Client) -> None:
    """SGLang 0.5.23 answers a ``"stream": true`` request its tokenizer manager refuses (a
    ValueError of ``generate_request``) inside the stream it has begun: HTTP 200
    ``text/event-stream``, one event ``{"error": {"message", "type": "invalid_request_error",
    "code": 400, "retryable": false}}``, then ``[DONE]`` (entrypoints/http_server.py 949-979), a
    batch too; the request parse and the contract gate refuse before it, as 400s in their shapes
    (http_server.py 635-691, 928-939)."""
    step3 = [
        {"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}},
        {"input_ids": [1] * 2000, "sampling_params": {"max_new_tokens": 100}},
        {"input_ids": [1, 2], "lora_path": "a"},
        {"input_ids": [[1], [2]], "sampling_params": [{}, {"top_k": 0}]},
        {"input_ids": [[1], [2]], "watermark": [None]},  # normalize_batch_and_arguments
        {"input_ids": [1, 2], "sampling_params": {"n": 2}},  # not implemented here: step 3 too
    ]
    for body in step3:
        r = client.post(engine + "/generate", json={**body, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        events = [e for e in r.text.split("\n\n") if e]
        assert len(events) == 2 and events[1] == "data: [DONE]", r.text
        error = json.loads(events[0].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "code", "retryable"}, error
        assert (error["type"], error["code"], error["retryable"]) == ("invalid_request_error", 400, False)
        plain = client.post(engine + "/generate", json=body)  # the same message unstreamed
        assert plain.status_code == 400 and error["message"] == error_message(400, plain.content)
    for raw, step in [
        (b'{"input_ids": [1, true], "stream": true}', "gate"),
        (b'{"input_ids": ["x"], "stream": true}', "parse"),
        (b'{"input_ids": [1], "sampling_params": {"topp": 1}, "stream": true}', "gate"),
    ]:
        r = client.post(engine + "/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and _shape(r.json()) == step, (raw, r.text)

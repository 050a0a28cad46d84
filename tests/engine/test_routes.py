"""Routed experts (SGLang 0.5.23's ``return_routed_experts``): the engine's routes equal a brute-force
top-k of ``transformers``' router logits over the same checkpoint, in SGLang's shape and encoding,
only with ``--enable-return-routed-experts``, and with SGLang's refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from core.sglang_release import decode_routed_experts
from tests.engine.conftest import generate, sse_events
from tests.support.engines import engine_process

PROMPTS = ([5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 2, 2, 2, 9, 81])


def _hf_routes(model_dir: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), layers, k]: top-k of softmax(router logits) of every MoE layer (transformers,
    float32), in descending probability."""
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    per_layer = [torch.topk(torch.softmax(r.float(), dim=-1), k, dim=-1).indices for r in out.router_logits]
    return torch.stack(per_layer, dim=1).numpy().astype(np.int32)


def _routes(body: dict, layers: int, k: int) -> np.ndarray:
    flat = decode_routed_experts(body["meta_info"]["routed_experts"])
    return np.asarray(flat, dtype=np.int32).reshape(-1, layers, k)


@pytest.fixture(scope="module")
def routed_engine(tiny_dir: Path) -> Iterator[str]:
    with engine_process(tiny_dir, enable_return_routed_experts=True) as url:
        yield url


def test_model_routes_equal_transformers_top_k(tiny_dir: Path, tiny_config: dict) -> None:
    from engine.model.model import load_model

    model = load_model(str(tiny_dir))
    ids = list(PROMPTS[0])
    cache = model.new_sequence()
    # a prefill chunk, then one token at a time, as the scheduler feeds them
    _, first = model.forward_routed([torch.tensor(ids[:4])], [cache])
    rest = [model.forward_routed([torch.tensor([t])], [cache])[1][0] for t in ids[4:]]
    got = torch.cat([first[0], *rest]).numpy()
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    assert got.shape == (len(ids), layers, k) and got.dtype == np.int32
    np.testing.assert_array_equal(got, _hf_routes(tiny_dir, ids))


def test_generate_returns_routes_of_prompt_and_output(
    routed_engine: str, client: httpx.Client, tiny_dir: Path, tiny_config: dict
) -> None:
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    bodies = generate(
        client,
        routed_engine,
        input_ids=[list(p) for p in PROMPTS],
        sampling_params={"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3},
        return_routed_experts=True,
    )
    for prompt, body in zip(PROMPTS, bodies, strict=True):
        seq = list(prompt) + body["output_ids"]
        got = _routes(body, layers, k)
        assert got.shape == (len(seq) - 1, layers, k)  # SGLang: [start, seqlen - 1)
        np.testing.assert_array_equal(got, _hf_routes(tiny_dir, seq[:-1]))


def test_start_len_cuts_the_rows(routed_engine: str, client: httpx.Client, tiny_config: dict) -> None:
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    full = generate(
        client, routed_engine, input_ids=list(PROMPTS[0]), sampling_params=params, return_routed_experts=True
    )
    cut = generate(
        client,
        routed_engine,
        input_ids=list(PROMPTS[0]),
        sampling_params=params,
        return_routed_experts=True,
        routed_experts_start_len=len(PROMPTS[0]),
    )
    assert cut["output_ids"] == full["output_ids"]
    np.testing.assert_array_equal(_routes(cut, layers, k), _routes(full, layers, k)[len(PROMPTS[0]) :])
    plain = generate(client, routed_engine, input_ids=list(PROMPTS[0]), sampling_params=params)
    assert "routed_experts" not in plain["meta_info"]


def test_streamed_routes_come_with_the_last_chunk(routed_engine: str, tiny_config: dict) -> None:
    from tests.engine.conftest import StreamReader

    body = {
        "input_ids": list(PROMPTS[1]),
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_routed_experts": True,
    }
    reader = StreamReader(routed_engine, body)
    last = reader.result()
    assert all("routed_experts" not in c["meta_info"] for c in reader.chunks[:-1])
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    assert _routes(last, layers, k).shape[0] == len(PROMPTS[1]) + 3 - 1


def test_start_len_outside_the_prompt_is_refused(routed_engine: str, client: httpx.Client) -> None:
    for start, words in (
        (-1, "is lower than 0"),
        (len(PROMPTS[0]) + 1, "is higher than the number of input"),
    ):
        r = client.post(
            routed_engine + "/generate",
            json={
                "input_ids": list(PROMPTS[0]),
                "return_routed_experts": True,
                "routed_experts_start_len": start,
            },
        )
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def _one_event(client: httpx.Client, url: str, body: dict) -> dict:
    """The one event of a streamed ``/generate`` of ``body`` that answers 200 with it and
    ``[DONE]``."""
    r = client.post(url + "/generate", json=body)
    events = sse_events(r.text)
    assert r.status_code == 200 and len(events) == 2 and events[1] == "[DONE]", r.text
    return events[0]


def test_a_streamed_start_past_the_prompt_is_a_one_token_prefill_of_input_0(
    routed_engine: str, client: httpx.Client, tiny_config: dict
) -> None:
    """Streamed, SGLang 0.5.23 aborts an item whose ``routed_experts_start_len`` lies past its
    prompt with ``set_finish_with_abort`` and a start of 0 (managers/scheduler.py 3300-3319), then
    runs it as a one-token prefill of ``[0]`` finished with the abort after its first token
    (schedule_batch.py 2221-2238, 2011-2014): its one event carries that token, ``prompt_tokens``
    1, and the routes of ``[start, seqlen - 1)`` = the stub's one position
    (scheduler_components/batch_result_processor.py 136-160) -- what a plain request of ``[0]``
    asking one token answers."""
    params = {"temperature": 0.0, "max_new_tokens": 4}
    want = generate(
        client,
        routed_engine,
        input_ids=[0],
        sampling_params={**params, "max_new_tokens": 1},
        return_routed_experts=True,
    )
    body = {
        "input_ids": list(PROMPTS[1]),
        "sampling_params": params,
        "return_routed_experts": True,
        "routed_experts_start_len": len(PROMPTS[1]) + 1,
        "stream": True,
    }
    event = _one_event(client, routed_engine, body)
    meta = event["meta_info"]
    assert meta["finish_reason"]["status_code"] == 400, event
    assert "is higher than the number of input tokens" in meta["finish_reason"]["message"], event
    assert event["output_ids"] == want["output_ids"] and event["text"] == want["text"], event
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (1, 1), event
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    assert _routes(event, layers, k).shape[0] == 1
    assert np.array_equal(_routes(event, layers, k), _routes(want, layers, k))


@pytest.mark.parametrize("start", [0, 2])
def test_a_streamed_logprob_abort_carries_the_routes_of_its_stub(
    routed_engine: str, client: httpx.Client, tiny_config: dict, start: int
) -> None:
    """Streamed, an item whose ``logprob_start_len`` lies past its prompt is aborted by SGLang
    0.5.23's scheduler before its routed-experts start is judged (managers/scheduler.py 3275-3280
    return before 3300-3319), keeping that start; it runs as a one-token prefill of ``[0]``
    (schedule_batch.py 2221-2238) and, finished, collects the rows ``[min(start, seqlen - 1),
    seqlen - 1)`` of its ``seqlen`` 2 (scheduler_components/batch_result_processor.py 136-160,
    381; state_capturer/base.py 173-188): the stub's one row from 0, none from 1 on, which the
    detokenizer encodes as ``""`` (detokenizer_manager.py 432-448, 466) and the tokenizer manager
    still answers under ``routed_experts`` (it skips only None, tokenizer_manager.py 2602-2609),
    before ``dp_rank``."""
    params = {"temperature": 0.0, "max_new_tokens": 4}
    want = generate(client, routed_engine, input_ids=[0], sampling_params={**params, "max_new_tokens": 1},
                    return_routed_experts=True)  # fmt: skip
    body = {
        "input_ids": list(PROMPTS[1]),
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": len(PROMPTS[1]) + 1,
        "return_routed_experts": True,
        "routed_experts_start_len": start,
        "stream": True,
    }
    event = _one_event(client, routed_engine, body)
    meta = event["meta_info"]
    assert "logprob_start_len" in meta["finish_reason"]["message"], event
    keys = list(meta)
    assert (
        keys.index("cached_tokens_details") + 1 == keys.index("routed_experts") == keys.index("dp_rank") - 1
    )
    layers, k = tiny_config["num_hidden_layers"], tiny_config["num_experts_per_tok"]
    if start == 0:
        assert np.array_equal(_routes(event, layers, k), _routes(want, layers, k))
        assert _routes(event, layers, k).shape[0] == 1
    else:
        assert meta["routed_experts"] == "", event


def test_without_the_flag_no_routes(engine: str, client: httpx.Client) -> None:
    """SGLang without --enable-return-routed-experts has no capturer: the key is absent."""
    body = generate(
        client,
        engine,
        input_ids=list(PROMPTS[0]),
        sampling_params={"max_new_tokens": 2},
        return_routed_experts=True,
    )
    assert "routed_experts" not in body["meta_info"]
    assert client.get(engine + "/server_info").json()["enable_return_routed_experts"] is False

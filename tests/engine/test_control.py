"""Control routes on real engine processes, row by row of docs/sglang-contract.md: weight updates
(retract + update + continue, spans; the in_place update refused by its flush as SGLang refuses
it; an unpaused update waits for requests in flight; the old version keeps serving on a path
without weights, and a load that fails ends the engine), /flush_cache and its refusals,
/update_weight_version, pause modes, abort, client disconnects."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.sglang_release import FLUSH_OK_TEXT, FLUSH_REFUSED_TEXT, UPDATE_NOT_FLUSHED_MESSAGE
from tests.engine.conftest import StreamReader, generate, sse_events
from tests.support.engines import engine_process
from tests.support.models import make_model_dir
from tests.support.procs import free_port, mixfleet_argv

PROMPT = [84, 104, 101, 32, 113]
LONG = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 42}
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def other_dir(model_root: Path) -> Path:
    """Another checkpoint of the same architecture (different seed): "version 2"."""
    return make_model_dir(model_root, "tiny", "bf16", seed=7)


@pytest.fixture(scope="module")
def v1_engine(tiny_dir: Path) -> Iterator[str]:
    with engine_process(tiny_dir, weight_version=1) as url:
        yield url


def load(client: httpx.Client, url: str) -> dict[str, Any]:
    return client.get(url + "/server_info").json()["internal_states"][0]


def wait_until(pred: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _waiting(client: httpx.Client, url: str) -> tuple[int, int, int]:
    """The engine's queued, paused and pause-waiting requests (those its admission holds)."""
    state = load(client, url)
    return state["num_queue_reqs"], state["num_paused_reqs"], state["num_pause_waiting_reqs"]


def _update(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(url + "/update_weights_from_disk", json=body)


def _model_version(client: httpx.Client, url: str) -> str:
    return client.get(url + "/model_info").json()["weight_version"]


def _validation_refused(r: httpx.Response) -> bool:
    """Whether ``r`` is SGLang's request validation refusal: 400 with its ``ErrorResponse``
    (entrypoints/http_server.py 635-691), in that key order."""
    body = r.json()
    keys = ["object", "message", "type", "param", "code"]
    return r.status_code == 400 and list(body) == keys and body["object"] == "error" and body["code"] == 400


def test_retract_update_continue_recomputes_under_the_new_weights(
    tiny_dir: Path, other_dir: Path, client: httpx.Client
) -> None:
    """The fleet's activation: a request retracted mid-decode is re-prefilled under the new
    weights; its spans cut where the pause held it, and each side is exactly what an engine on
    that version computes (greedy: v1's continuation before the cut, v2's continuation of the
    prefix after it). The update's default flush succeeds after a retract."""
    long_greedy = {**GREEDY, "max_new_tokens": 200}
    with engine_process(tiny_dir, weight_version=1) as url:
        ref_v1 = generate(client, url, input_ids=PROMPT, sampling_params=long_greedy, return_logprob=True)
        stream = StreamReader(
            url, {"input_ids": PROMPT, "sampling_params": long_greedy, "return_logprob": True}
        )
        stream.wait_for(20)
        assert client.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        stream.settled()
        k = len(stream.chunks[-1]["output_ids"])
        assert stream.chunks[-1]["meta_info"]["num_retractions"] == 0  # drawn before the retraction
        r = _update(client, url, {"model_path": str(other_dir), "weight_version": "2"})
        assert r.status_code == 200, r.text
        assert r.json()["success"] is True and "Weight version updated to 2" in r.json()["message"]
        assert _model_version(client, url) == "2"
        assert len(stream.chunks[-1]["output_ids"]) == k, "tokens arrived while paused"
        assert client.post(url + "/continue_generation", json={}).status_code == 200
        final = stream.result()
        swapped = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    out, meta = final["output_ids"], final["meta_info"]
    # the retract pause counted, as SGLang's Req.reset_for_retract counts it (schedule_batch.py 2049-2052)
    assert meta["num_retractions"] == 1 and ref_v1["meta_info"]["num_retractions"] == 0
    assert meta["weight_versions"] == [
        {"version": "1", "start": 0, "end": k},
        {"version": "2", "start": k, "end": 200},
    ]
    assert meta["weight_version"] == "2"
    lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert out[:k] == ref_v1["output_ids"][:k]
    assert lps[:k] == [lp for lp, _, _ in ref_v1["meta_info"]["output_token_logprobs"][:k]]
    # The engine started on the new checkpoint computes what the swapped one computes.
    with engine_process(other_dir, weight_version=2) as fresh_url:
        tail = generate(
            client,
            fresh_url,
            input_ids=PROMPT + out[:k],
            sampling_params={**GREEDY, "max_new_tokens": 200 - k},
            return_logprob=True,
        )
        fresh = generate(client, fresh_url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert out[k:] == tail["output_ids"]
    assert lps[k:] == pytest.approx([lp for lp, _, _ in tail["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert swapped["output_ids"] == fresh["output_ids"]
    assert swapped["meta_info"]["output_token_logprobs"] == fresh["meta_info"]["output_token_logprobs"]
    assert swapped["meta_info"]["output_token_logprobs"] != ref_v1["meta_info"]["output_token_logprobs"][:16]
    assert swapped["meta_info"]["weight_versions"] == [{"version": "2", "start": 0, "end": 16}]


def test_a_continue_sent_while_an_update_loads_resumes_after_the_swap(
    tiny_dir: Path, other_dir: Path, client: httpx.Client
) -> None:
    """A ``/continue_generation`` that comes while a paused engine loads an update (a sidecar
    restarted mid-activation sends one as it starts) takes effect after the swap, as SGLang's
    scheduler reads it after the update it runs in its loop: the retracted request resumes on the
    new weights only, so the update's flush succeeds and the spans cut where the pause held it. It
    resumed at once: the request ran on the old weights, the swap came under it unflushed (400)."""
    long_greedy = {**GREEDY, "max_new_tokens": 200}
    with engine_process(tiny_dir, weight_version=1, env={"MIXFLEET_ENGINE_FAULTS": "1"}) as url:
        assert client.post(url + "/debug/fault", json={"load_delay_s": 2.0}).status_code == 200
        stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": long_greedy})
        stream.wait_for(20)
        assert client.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        stream.settled()
        k = len(stream.chunks[-1]["output_ids"])
        done: dict[str, Any] = {}

        def update() -> None:
            done["update"] = _update(client, url, {"model_path": str(other_dir), "weight_version": "2"})

        updating = threading.Thread(target=update)
        updating.start()
        time.sleep(0.5)  # the load has begun (it takes 2 s)
        sent_at = time.monotonic()
        assert client.post(url + "/continue_generation", json={}).status_code == 200
        waited = time.monotonic() - sent_at
        updating.join(60)
        final = stream.result()
    assert done["update"].status_code == 200 and done["update"].json()["success"] is True, done["update"].text
    assert waited >= 1.0  # behind the rest of the 2 s load (its answer and the update's may cross)
    assert final["meta_info"]["weight_versions"] == [
        {"version": "1", "start": 0, "end": k},
        {"version": "2", "start": k, "end": 200},
    ]


def test_old_protocol_in_place_update_under_load_is_refused_as_sglang_refuses(
    v1_engine: str, client: httpx.Client, tiny_dir: Path
) -> None:
    """SGLang 0.5.23: after an in_place pause the running batch stays, so the update's default
    flush is refused: 400 ``success: false`` with weight_updater.py's message, after the weights
    were swapped and the scheduler stamps the new version (tokens after the pause carry it), while
    /model_info keeps the old one; /flush_cache is refused too (400). /update_weight_version then
    moves /model_info."""
    url = v1_engine
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": LONG})
    stream.wait_for(10)
    assert client.post(url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    stream.settled()
    k = len(stream.chunks[-1]["output_ids"])
    try:
        r = _update(client, url, {"model_path": str(tiny_dir), "weight_version": "7"})  # the old request
        assert r.status_code == 400, r.text
        assert r.json() == {"success": False, "message": UPDATE_NOT_FLUSHED_MESSAGE, "num_paused_requests": 0}
        assert _model_version(client, url) == "1"
        flush = client.post(url + "/flush_cache")
        assert flush.status_code == 400 and flush.text == FLUSH_REFUSED_TEXT
    finally:
        assert client.post(url + "/continue_generation", json={}).status_code == 200
    final = stream.result()
    assert final["meta_info"]["weight_versions"] == [
        {"version": "1", "start": 0, "end": k},
        {"version": "7", "start": k, "end": 300},
    ]
    assert _model_version(client, url) == "1"
    r = client.post(url + "/update_weight_version", json={"new_version": "1", "abort_all_requests": False})
    assert r.status_code == 200 and r.json()["success"] is True
    out = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY)
    assert out["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 16}]
    assert _model_version(client, url) == "1"


def test_update_without_pause_waits_for_requests_in_flight(
    v1_engine: str, client: httpx.Client, tiny_dir: Path
) -> None:
    """SGLang takes its model-update lock's writer side for an unpaused update: requests in flight
    finish under the old weights first (one span), then the update runs, and its flush succeeds."""
    url = v1_engine
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": LONG})
    stream.wait_for(10)
    assert len(stream.chunks[-1]["output_ids"]) < 300  # in flight when the update is sent
    r = _update(client, url, {"model_path": str(tiny_dir), "weight_version": "2"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    final = stream.result()  # a swap under it would have cut its spans
    assert final["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 300}]
    assert _model_version(client, url) == "2"
    r = _update(client, url, {"model_path": str(tiny_dir), "weight_version": "1"})
    assert r.status_code == 200 and _model_version(client, url) == "1"


def test_update_with_abort_all_requests_aborts_first(
    v1_engine: str, client: httpx.Client, tiny_dir: Path
) -> None:
    """tokenizer_manager.py 2298-2299: ``abort_all_requests`` aborts every request before the
    update (which then need not wait for them)."""
    url = v1_engine
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 1500}})
    stream.wait_for(5)
    body = {"model_path": str(tiny_dir), "weight_version": "1", "abort_all_requests": True}
    r = _update(client, url, body)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    final = stream.result()
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(final["output_ids"]) < 1500


def test_flush_cache_refused_while_requests_run_or_wait_unpaused(
    v1_engine: str, client: httpx.Client
) -> None:
    """http_server.py /flush_cache: 200 with SGLang's text when idle; 400 "Flush cache failed."
    while a request runs; while paused in retract mode waiting requests are ignored (200); with
    ``timeout`` the flush waits for idle."""
    url = v1_engine
    ok = client.post(url + "/flush_cache")
    assert ok.status_code == 200 and ok.text == FLUSH_OK_TEXT
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 200}})
    stream.wait_for(5)
    refused = client.post(url + "/flush_cache")
    assert refused.status_code == 400 and refused.text == FLUSH_REFUSED_TEXT
    assert client.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
    assert load(client, url)["num_queue_reqs"] == 1
    assert client.post(url + "/flush_cache").status_code == 200
    assert client.post(url + "/continue_generation", json={}).status_code == 200
    waited = client.post(url + "/flush_cache", params={"timeout": 120})
    assert waited.status_code == 200
    assert len(stream.result()["output_ids"]) == 200


def test_update_weight_version_aborts_by_default_and_stamps_the_new_version(
    v1_engine: str, client: httpx.Client
) -> None:
    url = v1_engine
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": LONG})
    stream.wait_for(5)
    r = client.post(url + "/update_weight_version", json={"new_version": "3"})
    assert r.status_code == 200 and r.json() == {
        "success": True,
        "message": "Weight version updated to 3",
        "new_version": "3",
    }
    assert stream.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert _model_version(client, url) == "3"
    out = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY)
    assert out["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 16}]
    bad = client.post(url + "/update_weight_version", json={"new_version": "v4"})
    assert bad.status_code == 400 and bad.json()["success"] is False
    client.post(url + "/update_weight_version", json={"new_version": "1"}).raise_for_status()


MODEL_INFO_KEYS = [
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "is_generation",
    "preferred_sampling_params",
    "weight_version",
    "load_format",
    "reasoning_parser",
    "tool_call_parser",
    "disaggregation_mode",
    "has_image_understanding",
    "has_audio_understanding",
    "model_type",
    "architectures",
]


def test_weight_routes_answer_and_refuse_as_sglang(tiny_dir: Path, client: httpx.Client) -> None:
    """A version sent as a JSON number, or a body without its required field, is refused by
    SGLang's request validation (the fields are strings: managers/io_struct.py 1978, 2157); an
    update answers "Succeeded to update model weights." plus the version as sent
    (scheduler_components/weight_updater.py 141, tokenizer_manager.py 2318-2320) and moves
    /model_info's model_path and served_model_name to the path as sent (2365-2370), while its
    tokenizer_path and /server_info stay the start-up ones; /model_info has SGLang's keys in
    its order; /update_weight_version echoes the version as sent (entrypoints/http_server.py
    1538-1547)."""
    with engine_process(tiny_dir, weight_version=1) as url:
        for path, body in (
            ("/update_weights_from_disk", {"model_path": str(tiny_dir), "weight_version": 2}),
            ("/update_weight_version", {"new_version": 2}),
            ("/update_weight_version", {}),
        ):
            assert _validation_refused(client.post(url + path, json=body)), (path, body)
        info = client.get(url + "/model_info").json()
        assert list(info) == MODEL_INFO_KEYS and info["weight_version"] == "1"
        start = {k: info[k] for k in ("model_path", "served_model_name", "tokenizer_path")}
        assert start == dict.fromkeys(start, str(tiny_dir))
        parsers = (info["reasoning_parser"], info["tool_call_parser"])
        assert (info["load_format"], info["disaggregation_mode"], parsers) == ("auto", "null", (None, None))
        sent = f"{tiny_dir}/"
        r = _update(client, url, {"model_path": sent, "weight_version": "2"})
        assert r.status_code == 200 and r.json() == {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to 2.",
            "num_paused_requests": 0,
        }
        info = client.get(url + "/model_info").json()
        assert (info["model_path"], info["served_model_name"], info["weight_version"]) == (sent, sent, "2")
        assert info["tokenizer_path"] == str(tiny_dir)
        server = client.get(url + "/server_info").json()
        assert (server["model_path"], server["weight_version"]) == (str(tiny_dir), "1")  # start-up args
        r = _update(client, url, {"model_path": sent})
        assert r.json()["message"] == "Succeeded to update model weights."


def test_control_routes_answer_and_refuse_as_sglang(v1_engine: str, client: httpx.Client) -> None:
    """Every control body is required and validated (FastAPI ``Body()``; entrypoints/
    http_server.py 1721-1731, 1831-1855): an empty or mistyped one, or a flush timeout below 0
    (1025-1028), is the request validation handler's 400 (635-691). /abort_request takes a null
    rid (managers/io_struct.py 86-89, 2293-2296) and answers 200 without body or content type;
    /flush_cache's text has no content type (1029-1041); pause and continue answer their JSON."""
    url = v1_engine
    for path in ("/pause_generation", "/continue_generation", "/abort_request"):
        assert _validation_refused(client.post(url + path)), path
    assert _validation_refused(client.post(url + "/pause_generation", json={"mode": "later"}))
    assert _validation_refused(client.post(url + "/abort_request", json={"abort_all": "maybe"}))
    assert _validation_refused(client.post(url + "/flush_cache", params={"timeout": -1}))
    r = client.post(url + "/abort_request", json={"rid": None})
    assert r.status_code == 200 and r.content == b"" and "content-type" not in r.headers
    r = client.post(url + "/flush_cache")
    assert r.status_code == 200 and r.text == FLUSH_OK_TEXT and "content-type" not in r.headers
    for path, body, done in (
        ("/pause_generation", {"mode": "retract"}, "paused"),
        ("/continue_generation", {"torch_empty_cache": False}, "continued"),
    ):
        r = client.post(url + path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert r.json() == {"message": f"Generation {done} successfully.", "status": "ok"}


def _bad_checkpoints(src: Path, root: Path) -> list[tuple[str, str]]:
    """(directory, expected message part) for paths SGLang refuses before touching any weight."""
    empty = root / "no-weights"
    empty.mkdir()
    shutil.copy(src / "config.json", empty / "config.json")
    return [
        (str(root / "missing"), "Failed to get weights iterator: model path"),
        (str(empty), "Failed to get weights iterator: Cannot find any model weights"),
    ]


def test_bad_weight_updates_keep_the_old_version_serving(
    v1_engine: str, client: httpx.Client, tiny_dir: Path, tmp_path: Path
) -> None:
    url = v1_engine
    before = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    for path, message in _bad_checkpoints(tiny_dir, tmp_path):
        r = client.post(url + "/update_weights_from_disk", json={"model_path": path, "weight_version": "9"})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["success"] is False and message in r.json()["message"], (path, r.text)
    for body in (b"{not json", b'{"weight_version": "3"}', b'{"model_path": "x", "weight_version": 3}'):
        r = client.post(url + "/update_weights_from_disk", content=body)
        assert r.status_code == 400 and _validation_refused(r), r.text  # SGLang's body validation
    r = client.post(url + "/update_weights_from_disk", json={"model_path": "x", "weight_version": "v3"})
    assert r.status_code == 400 and r.json()["success"] is False, r.text  # versions are integers here
    assert client.get(url + "/get_weight_version").json() == {"weight_version": "1"}
    after = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert after["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 16}]


def test_an_update_reads_only_tensors_and_a_failed_load_ends_the_engine(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """As SGLang 0.5.23 reloads: a new config.json is not read (another architecture's name and
    a deeper model in the config alone load the same tensors), and a load that fails once weight
    files were found (a truncated shard) ends the engine without an answer."""
    relabelled = tmp_path / "relabelled"
    shutil.copytree(tiny_dir, relabelled)
    cfg = json.loads((relabelled / "config.json").read_text())
    cfg |= {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": cfg["num_hidden_layers"] + 1}
    (relabelled / "config.json").write_text(json.dumps(cfg))
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_dir, truncated)
    shard = next(truncated.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    log = tmp_path / "engine.log"
    with engine_process(tiny_dir, weight_version=1, log=log) as url, httpx.Client(timeout=60.0) as client:
        before = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
        r = client.post(
            url + "/update_weights_from_disk", json={"model_path": str(relabelled), "weight_version": "2"}
        )
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        after = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["weight_versions"] == [{"version": "2", "start": 0, "end": 16}]
        with pytest.raises(httpx.TransportError):
            client.post(
                url + "/update_weights_from_disk", json={"model_path": str(truncated), "weight_version": "3"}
            )
        with pytest.raises(httpx.TransportError):
            client.get(url + "/health", timeout=5.0)
    assert "Scheduler hit an exception: update_weights_from_disk" in log.read_text()


def _reference(client: httpx.Client, url: str) -> list[int]:
    return generate(client, url, input_ids=PROMPT, sampling_params=LONG)["output_ids"]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_then_continue_resumes_exactly(v1_engine: str, client: httpx.Client, mode: str) -> None:
    url = v1_engine
    reference = _reference(client, url)
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": LONG})
    stream.wait_for(20)
    r = client.post(url + "/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    frozen = stream.settled()
    time.sleep(0.5)
    assert len(stream.chunks) == frozen, "tokens arrived while paused"
    state = load(client, url)
    assert state["paused"] == mode and state["num_running_reqs"] == 0
    if mode == "in_place":
        assert state["num_paused_reqs"] == 1 and state["num_queue_reqs"] == 0
    else:
        assert state["num_paused_reqs"] == 0 and state["num_queue_reqs"] == 1
    assert client.post(url + "/continue_generation", json={}).status_code == 200
    final = stream.result()
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert final["output_ids"] == reference
    if mode == "retract":
        assert "sglang:num_retracted_requests_total" in client.get(url + "/metrics").text


def test_pause_abort_aborts_and_holds_new_requests(v1_engine: str, client: httpx.Client) -> None:
    url = v1_engine
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": LONG})
    stream.wait_for(10)
    assert client.post(url + "/pause_generation", json={"mode": "abort"}).status_code == 200
    final = stream.result()
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 10 <= len(final["output_ids"]) < 300
    assert len(final["output_ids"]) == final["meta_info"]["completion_tokens"]
    waiting: list[dict[str, Any]] = []
    t = threading.Thread(
        target=lambda: waiting.append(
            generate(httpx.Client(timeout=60, trust_env=False), url, input_ids=PROMPT, sampling_params=GREEDY)
        )
    )
    t.start()
    wait_until(lambda: load(client, url)["num_pause_waiting_reqs"] == 1)  # outside the scheduler
    time.sleep(0.3)
    assert not waiting, "a request ran while generation was paused"
    assert client.post(url + "/continue_generation", json={}).status_code == 200
    t.join(60)
    assert len(waiting) == 1 and len(waiting[0]["output_ids"]) == 16


def test_a_request_sent_while_paused_waits_outside_the_scheduler_where_an_abort_misses_it(
    v1_engine: str, client: httpx.Client
) -> None:
    """SGLang 0.5.23's tokenizer manager registers a request before it waits out a pause
    (managers/tokenizer_manager.py 926, 938-939) and sends it to the scheduler only after
    ``/continue_generation`` (2282-2286): an ``/abort_request`` of it marks it aborted and ends
    no scheduler request (2241-2265), so it runs to its end once generation continues, and a
    second abort is ignored (2249-2250). A streamed request whose client goes away while it
    waits is dropped unsent (958-966, 3850-3873)."""
    url = v1_engine
    answers: list[dict[str, Any]] = []
    held = threading.Thread(
        target=lambda: answers.append(
            generate(
                httpx.Client(timeout=60, trust_env=False),
                url,
                input_ids=PROMPT,
                sampling_params=GREEDY,
                rid="held",
            )
        )
    )
    gone = {"input_ids": PROMPT, "sampling_params": LONG, "stream": True, "rid": "gone"}
    assert client.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
    try:
        held.start()
        wait_until(lambda: load(client, url)["num_pause_waiting_reqs"] == 1)
        assert load(client, url)["num_queue_reqs"] == 0
        for _ in range(2):
            assert client.post(url + "/abort_request", json={"rid": "held"}).status_code == 200
        with httpx.Client(timeout=60, trust_env=False) as c, c.stream("POST", url + "/generate", json=gone):
            wait_until(lambda: load(client, url)["num_pause_waiting_reqs"] == 2)
        wait_until(lambda: load(client, url)["num_pause_waiting_reqs"] == 1)
    finally:
        assert client.post(url + "/continue_generation", json={}).status_code == 200
    held.join(60)
    (answer,) = answers
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    state = load(client, url)
    assert state["num_running_reqs"] == state["num_queue_reqs"] == 0  # "gone" never ran


def test_health_generate_answers_503_while_paused_as_sglangs_generation_check(
    tiny_dir: Path, client: httpx.Client
) -> None:
    """SGLang 0.5.23's ``/health_generate`` (entrypoints/http_server.py 218, 721-799;
    docs/sglang-contract.md row 23): 200 once the scheduler answers anything after the check
    began, 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds without; paused, in every mode, the
    scheduler answers nothing, so a 503, the check's request leaving nothing queued; a pause that
    ends within the timeout lets the check answer 200. ``/health`` keeps answering 200."""
    with engine_process(tiny_dir, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}) as url:
        generate(client, url, input_ids=PROMPT, sampling_params=GREEDY)  # a first forward is slow
        assert client.get(url + "/health_generate").status_code == 200
        for mode in ("abort", "retract", "in_place"):
            assert client.post(url + "/pause_generation", json={"mode": mode}).status_code == 200
            t0 = time.monotonic()
            assert client.get(url + "/health_generate").status_code == 503
            assert time.monotonic() - t0 >= 2.0
            assert client.get(url + "/health").status_code == 200
            # the check's request is cancelled as the 503 goes out: its abort reaches the scheduler after
            wait_until(lambda: _waiting(client, url) == (0, 0, 0))
            assert client.post(url + "/continue_generation", json={}).status_code == 200
        assert client.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        answers: list[int] = []
        check = threading.Thread(
            target=lambda: answers.append(client.get(url + "/health_generate").status_code)
        )
        check.start()
        wait_until(lambda: load(client, url)["num_pause_waiting_reqs"] == 1)  # the check's request waits
        assert client.post(url + "/continue_generation", json={}).status_code == 200
        check.join(30)
        assert answers == [200]
        assert load(client, url)["num_queue_reqs"] == 0


def test_a_rid_already_running_is_refused_as_sglang_refuses_it(v1_engine: str, client: httpx.Client) -> None:
    """A request whose rid a running request holds: SGLang 0.5.23's ValueError "Duplicate request
    ID detected: <rid>" (managers/tokenizer_manager.py 3833-3837), a 400 ``{"error": {"message"}}``
    unstreamed and, streamed, the error event with code 400 inside a 200 (entrypoints/
    http_server.py 956-973), which the router reads as the request's fault, not the replica's; the
    running request goes on."""
    url = v1_engine
    long = {**LONG, "max_new_tokens": 1500}
    running = StreamReader(url, {"input_ids": PROMPT, "rid": "taken", "sampling_params": long})
    running.wait_for(3)
    plain = client.post(url + "/generate", json={"input_ids": PROMPT, "rid": "taken"})
    assert plain.status_code == 400 and plain.json() == {
        "error": {"message": "Duplicate request ID detected: taken"}
    }, plain.text
    streamed = client.post(url + "/generate", json={"input_ids": PROMPT, "rid": "taken", "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and len(events) == 2, streamed.text
    assert events[0] == {
        "error": {
            "message": "Duplicate request ID detected: taken",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    assert not running.done  # still running: the refusals did not touch it
    assert client.post(url + "/abort_request", json={"rid": "taken"}).status_code == 200
    assert running.result()["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_batch_with_a_rid_already_running_is_refused_whole(v1_engine: str, client: httpx.Client) -> None:
    """A batch one of whose rids a running request holds is refused whole, streamed or not, before
    any item runs or is streamed: SGLang 0.5.23's ``_init_req_state`` checks every rid of the
    request before registering any (managers/tokenizer_manager.py 3818-3837), and does so before
    the LoRA adapters (926 before 942), so the duplicate is named first."""
    url = v1_engine
    running = StreamReader(
        url, {"input_ids": PROMPT, "rid": "held", "sampling_params": {**LONG, "max_new_tokens": 1500}}
    )
    running.wait_for(3)
    batch = {"input_ids": [PROMPT, PROMPT], "rid": ["free", "held"], "sampling_params": GREEDY}
    streamed = client.post(url + "/generate", json={**batch, "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and len(events) == 2, streamed.text
    assert events[0]["error"] == {
        "message": "Duplicate request ID detected: held",
        "type": "invalid_request_error",
        "code": 400,
        "retryable": False,
    }
    plain = client.post(url + "/generate", json=batch)
    assert plain.json() == {"error": {"message": "Duplicate request ID detected: held"}}, plain.text
    with_lora = client.post(url + "/generate", json={"input_ids": PROMPT, "rid": "held", "lora_path": "a"})
    assert with_lora.json() == {"error": {"message": "Duplicate request ID detected: held"}}, with_lora.text
    assert not running.done
    # the other item never ran: its rid is free
    free = generate(client, url, input_ids=PROMPT, rid="free", sampling_params=GREEDY)
    assert free["meta_info"]["id"] == "free"
    assert client.post(url + "/abort_request", json={"rid": "held"}).status_code == 200
    assert running.result()["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_request_by_rid_and_on_disconnect(v1_engine: str, client: httpx.Client) -> None:
    url = v1_engine
    stream = StreamReader(url, {"input_ids": PROMPT, "rid": "victim", "sampling_params": LONG})
    stream.wait_for(5)
    assert client.post(url + "/abort_request", json={"rid": "victim"}).status_code == 200
    final = stream.result()
    assert final["meta_info"]["id"] == "victim"
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(final["output_ids"]) < 300
    # Unknown rids are a no-op, as in SGLang.
    assert client.post(url + "/abort_request", json={"rid": "nobody"}).status_code == 200
    # A streaming client that goes away frees its slot.
    with (
        httpx.Client(timeout=60, trust_env=False) as c,
        c.stream(
            "POST",
            url + "/generate",
            json={"input_ids": PROMPT, "stream": True, "sampling_params": {**LONG, "max_new_tokens": 1500}},
        ) as r,
    ):
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    wait_until(lambda: load(client, url)["num_running_reqs"] == 0, timeout=20)
    # A non-streaming one too.
    t = threading.Thread(target=lambda: _disconnecting_request(url), daemon=True)
    t.start()
    wait_until(lambda: load(client, url)["num_running_reqs"] == 1, timeout=20)
    t.join(20)
    wait_until(lambda: load(client, url)["num_running_reqs"] == 0, timeout=20)
    text = client.get(url + "/metrics").text
    aborted = [line for line in text.splitlines() if line.startswith("sglang:num_aborted_requests_total")]
    assert aborted and float(aborted[0].rsplit(" ", 1)[1]) >= 3


def test_an_abort_takes_every_request_whose_rid_starts_with_a_rid_the_engine_holds(
    v1_engine: str, client: httpx.Client
) -> None:
    """SGLang's tokenizer manager sends an abort only for a rid it holds exactly
    (``tokenizer_manager.py`` 2246-2253); its scheduler then aborts every request whose rid starts
    with it (``scheduler.py`` 5688, 5800)."""
    url = v1_engine
    streams = {rid: StreamReader(url, {"input_ids": PROMPT, "rid": rid, "sampling_params": LONG})
               for rid in ("job", "job-2", "other")}  # fmt: skip
    for stream in streams.values():
        stream.wait_for(3)
    assert client.post(url + "/abort_request", json={"rid": "jo"}).status_code == 200  # held by none
    for stream in streams.values():  # each goes on generating
        stream.wait_for(len(stream.chunks) + 3)
        assert not stream.done
    assert client.post(url + "/abort_request", json={"rid": "job"}).status_code == 200
    for rid in ("job", "job-2"):
        assert streams[rid].result()["meta_info"]["finish_reason"]["type"] == "abort", rid
    assert not streams["other"].done
    assert client.post(url + "/abort_request", json={"rid": "other"}).status_code == 200
    assert streams["other"].result()["meta_info"]["finish_reason"]["type"] == "abort"


def _disconnecting_request(url: str) -> None:
    with httpx.Client(timeout=1.0, trust_env=False) as c, pytest.raises(httpx.TimeoutException):
        c.post(
            url + "/generate", json={"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 1500}}
        )


def test_eos_stops_unless_ignored(tiny_dir: Path, tmp_path: Path, client: httpx.Client) -> None:
    """The model's eos_token_id ends a generation with SGLang's stop shape; ignore_eos overrides it."""
    with engine_process(tiny_dir) as url:
        greedy = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    eos = greedy[3]
    eos_dir = tmp_path / "eos"
    shutil.copytree(tiny_dir, eos_dir)
    cfg = json.loads((eos_dir / "config.json").read_text())
    (eos_dir / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [*cfg["eos_token_id"], eos]}))
    with engine_process(eos_dir) as url:
        stopped = generate(client, url, input_ids=PROMPT, sampling_params={**GREEDY, "ignore_eos": False})
        ignored = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY)
    k = greedy.index(eos)
    assert stopped["output_ids"] == greedy[: k + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert ignored["output_ids"] == greedy
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 16}


def test_cli_refuses_a_bad_model_dir_in_one_line(tmp_path: Path) -> None:
    for args, message in (
        (["--model", str(tmp_path / "nowhere")], "does not exist"),
        (["--model", str(tmp_path), "--threads", "0"], "--threads must be at least 1"),
    ):
        proc = subprocess.run(
            mixfleet_argv("engine", "--port", str(free_port()), *args),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mixfleet engine: error:") and message in lines[0], (
            lines
        )


def test_fp8_kv_cache_flag(tiny_dir: Path, client: httpx.Client) -> None:
    with engine_process(tiny_dir, kv_cache_dtype="fp8_e4m3", weight_version=5) as url:
        info = client.get(url + "/server_info").json()
        assert info["kv_cache_dtype"] == "fp8_e4m3" and info["weight_version"] == "5"
        out = generate(client, url, input_ids=PROMPT, sampling_params=GREEDY)
        assert len(out["output_ids"]) == 16
        assert out["meta_info"]["weight_versions"] == [{"version": "5", "start": 0, "end": 16}]


def _flush(url: str, timeout: float = 0.0) -> tuple[int, str, float]:
    """``POST /flush_cache`` (``?timeout=`` when given) on its own client: status, body, and the
    ``time.monotonic()`` of the answer."""
    with httpx.Client(timeout=120.0, trust_env=False) as c:
        r = c.post(url + "/flush_cache", params={"timeout": timeout} if timeout else None)
    return r.status_code, r.text, time.monotonic()


def test_timed_flush_counts_waiting_requests_even_while_paused(v1_engine: str, client: httpx.Client) -> None:
    """SGLang 0.5.23: a flush with ``?timeout=`` > 0 goes through the scheduler's flush wrapper
    (managers/scheduler.py 1834, built at 1340-1344 with ``is_fully_idle=self.is_fully_idle``),
    whose idle check has no ``ignore_waiting`` (scheduler_components/flush_wrapper.py 33-37,
    45-60; scheduler.py 5337-5360): under a ``retract`` pause with the retracted request waiting
    it is deferred and, its timeout passed, answered 400 "Timed out waiting for idle state."
    (entrypoints/http_server.py 1025-1041), while a plain flush ignores the waiting request
    (``is_fully_idle(ignore_waiting=self._engine_paused)``, scheduler.py 5518-5548) and succeeds.
    A timed flush still deferred when generation continues is answered 200 once the request is
    done."""
    from core.sglang_release import FLUSH_TIMEOUT_MESSAGE

    url = v1_engine
    stream = StreamReader(url, {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 200}})
    stream.wait_for(5)
    answers: list[tuple[int, str, float]] = []
    waiter = threading.Thread(target=lambda: answers.append(_flush(url, 120.0)), daemon=True)
    assert client.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
    try:
        assert load(client, url)["num_queue_reqs"] == 1
        t0 = time.monotonic()
        timed = client.post(url + "/flush_cache", params={"timeout": 1.0})
        assert (timed.status_code, timed.text) == (400, FLUSH_TIMEOUT_MESSAGE)
        assert time.monotonic() - t0 >= 1.0
        plain = client.post(url + "/flush_cache")
        assert (plain.status_code, plain.text) == (200, FLUSH_OK_TEXT)
        waiter.start()
        time.sleep(1.0)
        assert not answers, "a timed flush was answered while a request waited"
    finally:
        assert client.post(url + "/continue_generation", json={}).status_code == 200
    final = stream.result()
    waiter.join(120)
    assert answers and answers[0][:2] == (200, FLUSH_OK_TEXT)
    assert len(final["output_ids"]) == 200

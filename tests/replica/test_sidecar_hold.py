"""An activation holds new generations in the sidecar (:mod:`replica.hold`): the real ``mixfleet
sidecar`` before a real local engine whose loads take 6 s (``/debug/fault``), so an activation
keeps the engine paused that long. A request aborted in that window (the router aborts a turn
whose client went away) ends in the sidecar and never reaches the engine, where SGLang 0.5.23
(and the engine after it, :mod:`engine.runtime.admission`) would hold it out of the abort's
reach and run it to its end after the pause (streamed or not). The others are judged by their
version constraint once the hold opens: one that asks for the version being activated is served
at it, one that asks for the old one exactly is refused (409), where it would have run on the new
weights."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.engine import parse_prometheus
from core.sglang_release import WAITING_ABORT
from tests.support.engines import engine_process
from tests.support.procs import free_port, mixfleet_argv, process, wait_http
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore

PROMPT = [256, 72, 101, 108, 108, 111, 33, 10]


def _until(pred: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _state(c: httpx.Client, engine: str) -> dict[str, Any]:
    return c.get(engine + "/server_info").json()["internal_states"][0]


def _paused(c: httpx.Client, engine: str) -> str | None:
    return _state(c, engine)["paused"]


def _held(c: httpx.Client, sidecar: str) -> int:
    return c.get(sidecar + "/v1/status").json()["held"]


def _tokens(c: httpx.Client, engine: str) -> float:
    return parse_prometheus(c.get(engine + "/metrics").text).get("sglang:generation_tokens_total", 0.0)


@pytest.mark.timeout(300)
def test_a_request_aborted_during_an_activation_ends_in_the_sidecar_and_never_runs(
    tiny_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    c = httpx.Client(timeout=120, trust_env=False)
    with engine_process(tiny_dir, env={"MIXFLEET_ENGINE_FAULTS": "1"}) as engine:
        assert c.post(engine + "/debug/fault", json={"load_delay_s": 6.0}).status_code == 200
        argv = mixfleet_argv(
            "sidecar", "--engine", engine, "--group", "g", "--format", "bf16", "--store", str(store),
            "--run", "run", "--port", str(port), "--replica-id", "g-0", "--staging-dir", str(tmp_path / "st"),
        )  # fmt: skip
        with process(argv, log=tmp_path / "sidecar.log") as proc:
            sidecar = f"http://127.0.0.1:{port}"
            wait_http(f"{sidecar}/health", timeout=60, proc=proc)
            before = _tokens(c, engine)
            publish_checkpoint(LocalStore(store), "run", 1, tiny_dir, ["bf16"], workers=0)
            c.post(sidecar + "/v1/wake")
            _until(lambda: _paused(c, engine) == "retract", "the sidecar never paused its engine")
            answers: dict[str, httpx.Response] = {}

            def send(rid: str, params: dict[str, Any], headers: dict[str, str], stream: bool = False) -> None:
                body = {"input_ids": PROMPT, "sampling_params": params, "rid": rid, "stream": stream}
                answers[rid] = c.post(sidecar + "/generate", json=body, headers=headers)

            def waiting() -> int:  # in the sidecar's hold or at the engine's pause
                return _held(c, sidecar) + _state(c, engine)["num_pause_waiting_reqs"]

            long = {"max_new_tokens": 200, "ignore_eos": True}
            gone = threading.Thread(target=send, args=("gone", long, {}))
            streamed = threading.Thread(target=send, args=("gone-streamed", long, {}, True))
            gone.start(), streamed.start()
            _until(lambda: waiting() == 2, "the requests never waited")
            short, min_1 = {"max_new_tokens": 8, "ignore_eos": True}, {"X-Mixfleet-Min-Version": "1"}
            kept = threading.Thread(target=send, args=("kept", short, min_1))
            stale = threading.Thread(target=send, args=("stale", short, {"X-Mixfleet-Exact-Version": "0"}))
            kept.start(), stale.start()
            _until(lambda: waiting() == 4 or answers.keys() & {"kept", "stale"}, "the others never waited")
            assert _held(c, sidecar) == 4
            for rid in ("gone", "gone-streamed"):
                aborted = c.post(sidecar + "/abort_request", json={"rid": rid})
                assert aborted.status_code == 200 and aborted.content == b""
            gone.join(60), streamed.join(60)
            assert _paused(c, engine) == "retract"  # answered while the engine is still paused
            answer = answers["gone"].json()
            assert answer["output_ids"] == [] and answer["meta_info"]["finish_reason"] == WAITING_ABORT
            assert answer["meta_info"]["id"] == "gone"
            events = [
                line[6:] for line in answers["gone-streamed"].text.splitlines() if line.startswith("data: ")
            ]
            assert len(events) == 2 and events[1] == "[DONE]", events  # one event, as SGLang streams it
            assert json.loads(events[0])["meta_info"]["finish_reason"] == WAITING_ABORT
            assert _state(c, engine)["num_pause_waiting_reqs"] == 0
            kept.join(60), stale.join(60)
            refused = answers["stale"]  # it would have run on version 1: judged when the hold opened
            assert refused.status_code == 409, refused.text
            assert refused.json()["applied_version"] == 1
            served = answers["kept"]
            assert served.status_code == 200, served.text  # held, not refused for its version
            meta = served.json()["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "1"
            assert c.get(sidecar + "/v1/status").json()["active_version"] == 1
            assert _tokens(c, engine) - before == 8  # the aborted request never ran
    c.close()

"""The sidecar as its replica's HTTP front, through the engine client: the real ``mixfleet
sidecar`` process before a real local engine proxies ``/generate`` (whole and streamed) and the
info routes unchanged, answers health and both metric sets, and refuses the engine's control
routes; the sidecar client reads its state and wakes it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clients.engine import EngineRejected, SGLangClient, make_http_client
from clients.sidecar import SidecarClient
from tests.support.engines import engine_process
from tests.support.procs import free_port, mixfleet_argv, process, wait_http

PROMPT = [256, 72, 101, 108, 108, 111, 33, 10]
BODY = {
    "input_ids": PROMPT,
    "sampling_params": {
        "temperature": 0.9,
        "top_k": 8,
        "max_new_tokens": 5,
        "ignore_eos": True,
        "sampling_seed": 3,
    },
    "return_logprob": True,
    "return_sampling_mask": True,
}


# the timings every answer carries, which differ from one request to the next (SGLang 0.5.23 with
# --enable-metrics: managers/tokenizer_manager.py 2515-2518, 2757-2772, 2024-2029)
TIMINGS = {
    "forward_entry_time", "prefill_finished_time", "queue_time", "request_received_ts", "first_token_latency",
    "api_server_dispatch_finish_ts", "request_finished_ts", "decode_throughput", "response_sent_to_client_ts",
}  # fmt: skip


@pytest.fixture(scope="module")
def replica(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(engine URL, sidecar URL) of one replica on an empty store (ready at the engine's version)."""
    work = tmp_path_factory.mktemp("sidecar-proxy")
    (work / "store").mkdir()
    port = free_port()
    with engine_process(tiny_dir, weight_version=2) as engine:
        argv = mixfleet_argv(
            "sidecar", "--engine", engine, "--group", "g", "--format", "bf16", "--store", str(work / "store"),
            "--run", "run", "--port", str(port), "--replica-id", "g-0", "--staging-dir", str(work / "st"),
        )  # fmt: skip
        with process(argv, log=work / "sidecar.log") as proc:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", timeout=60, proc=proc)
            yield engine, url


def test_generate_is_proxied_unchanged_whole_and_streamed(replica: tuple[str, str]) -> None:
    engine, sidecar = replica
    with httpx.Client(timeout=120.0, trust_env=False) as c:
        direct = c.post(engine + "/generate", json=BODY)
        proxied = c.post(sidecar + "/generate", json=BODY)
        assert proxied.status_code == direct.status_code == 200
        assert proxied.headers["content-type"] == direct.headers["content-type"]
        strip = {"e2e_latency", "id"} | TIMINGS
        a, b = direct.json(), proxied.json()
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 5
        assert {k: v for k, v in a["meta_info"].items() if k not in strip} == {
            k: v for k, v in b["meta_info"].items() if k not in strip
        }
        events = []
        with c.stream("POST", sidecar + "/generate", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["output_ids"] == a["output_ids"]
        bad_body = {**BODY, "sampling_params": {"temperature": -1}}
        bad, direct_bad = (
            c.post(sidecar + "/generate", json=bad_body),
            c.post(engine + "/generate", json=bad_body),
        )
        assert bad.status_code == direct_bad.status_code == 400 and bad.content == direct_bad.content
        # bytes the engine judges as sent, not as the sidecar would re-encode them (it served a NaN
        # temperature as null, sent 10**29 on as 1e+29, and failed on a lone surrogate itself)
        plain = json.dumps(BODY)
        for raw in (
            plain.replace('"temperature": 0.9', '"temperature": NaN'),
            plain.replace('"max_new_tokens": 5', '"max_new_tokens": 100000000000000000000000000000'),
            plain[:-1] + ', "rid": "\\ud800"}',
        ):
            got, want = (c.post(url + "/generate", content=raw) for url in (sidecar, engine))
            assert (got.status_code, got.content) == (want.status_code, want.content), got.text
        constrained = plain[:-1] + ', "min_version": 2, "rid": "\\ud800"}'  # re-encoded: strict JSON only
        refused = c.post(sidecar + "/generate", content=constrained)
        assert refused.status_code == 400 and "must be strict JSON" in refused.text, refused.text
        met = c.post(sidecar + "/generate", json={**BODY, "min_version": 2})
        assert met.status_code == 200 and met.json()["output_ids"] == a["output_ids"], met.text
        assert c.get(sidecar + "/v1/status").json()["in_flight"] == 0


def test_info_health_metrics_and_control_routes(replica: tuple[str, str]) -> None:
    engine, sidecar = replica
    with httpx.Client(timeout=30.0, trust_env=False) as c:
        assert c.get(sidecar + "/model_info").json() == c.get(engine + "/model_info").json()
        assert c.get(sidecar + "/get_model_info?x=1").json() == c.get(engine + "/get_model_info").json()
        assert c.get(sidecar + "/server_info").json()["weight_version"] == "2"
        health = c.get(sidecar + "/health")
        assert health.status_code == 200 and health.json()["active_version"] == 2
        metrics = c.get(sidecar + "/metrics").text
        assert "mixfleet_replica_active_version" in metrics and "sglang:" not in metrics
        assert "sglang:num_running_reqs" in c.get(sidecar + "/engine/metrics").text
        refused = c.post(sidecar + "/pause_generation", json={"mode": "in_place"})
        assert refused.status_code == 403 and "only its sidecar" in refused.json()["error"]["message"]
        for body in ({"abort_all": True}, {"rid": "x", "abort_all": True}, {}):
            refused = c.post(sidecar + "/abort_request", json=body)
            assert refused.status_code == 403 and "only its sidecar" in refused.json()["error"]["message"]
        aborted = c.post(sidecar + "/abort_request", json={"rid": "no-such-request"})
        assert aborted.status_code == 200 and aborted.content == b""
        assert "content-type" not in aborted.headers  # as the engine (SGLang) answers it
        status = c.get(sidecar + "/v1/status").json()
        assert status["engine_url"] == engine and status["ready"] and status["engine_ok"]


def test_sidecar_client_reads_status_and_wakes_and_a_plain_engine_refuses(replica: tuple[str, str]) -> None:
    engine, sidecar = replica

    async def main() -> tuple[dict, dict, int]:
        http = make_http_client()
        try:
            client = SidecarClient(SGLangClient(http, sidecar))
            status, woken = await client.status(), await client.wake()
            with pytest.raises(EngineRejected) as plain:
                await SidecarClient(SGLangClient(http, engine)).status()
            return status, woken, plain.value.status
        finally:
            await http.close()

    status, woken, plain_status = asyncio.run(main())
    assert status["replica_id"] == "g-0" and status["active_version"] == 2 and status["engine_url"] == engine
    assert woken["ok"] is True and "desired_version" in woken
    assert plain_status == 404

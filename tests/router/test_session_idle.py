"""``--session-idle-timeout`` abandons a session without activity, never one whose turn is running:
a real router (memory state, then Redis) in front of a real engine whose answers a loopback
stand-in holds back (:mod:`tests.support.scripted`, ``delay_s``) for several idle timeouts. The slow
turn is recorded; a session created beside it and left alone is abandoned meanwhile."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from tests.support.procs import redis_server
from tests.support.router import router_process, write_preset
from tests.support.scripted import scripted_engine

IDLE_S = 1.0
HOLD_S = 4.0  # the engine's answer: four idle timeouts, several sweeps (one a second)


@pytest.fixture(scope="module")
def slow_engine(engine_url):
    with scripted_engine(engine_url) as scripted:
        scripted.delay_s = HOLD_S
        yield scripted


@pytest.mark.parametrize("state", ["memory", "redis"])
def test_a_turn_outlasting_the_idle_timeout_is_recorded_and_an_idle_session_is_abandoned(
    slow_engine, tmp_path, state: str
) -> None:
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "replicas": [slow_engine.url]}])
    args = ("--session-idle-timeout", str(IDLE_S))
    with (
        redis_server() if state == "redis" else contextlib.nullcontext("memory") as url,
        router_process(preset, state=url, extra_args=args) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as http,
    ):
        busy = http.post("/v1/sessions", json={}).json()["session_id"]
        idle = http.post("/v1/sessions", json={}).json()["session_id"]
        t0 = time.monotonic()
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        turn = http.post(f"/v1/sessions/{busy}/turns", json=body)
        assert time.monotonic() - t0 >= HOLD_S
        assert turn.status_code == 200, turn.text
        assert http.get(f"/v1/sessions/{idle}").status_code == 404  # abandoned while the turn ran
        stored = http.get(f"/v1/sessions/{busy}/trajectory").json()["turns"]
        assert [t["output_ids"] for t in stored] == [turn.json()["output_ids"]]
        assert http.post(f"/v1/sessions/{busy}/finish", json={"reward": 1.0}).status_code == 200

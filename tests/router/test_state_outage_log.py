"""While the state store is down, the router's background poll says so once, not every poll: a
real router on a real redis-server that is stopped for two polls and started again logs one line
naming the state URL and the error when Redis goes, one when it is back, and no traceback
(requests meanwhile answer 503). Only the first state call that finds Redis gone waits the
adapter's 20 s ``outage_s``; the poll's calls after it give up after its 2 s ``poll_s``, which
the logged error names, so the polls go on every few seconds (the test waits for two)."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from tests.support.procs import redis_process, wait_for_text
from tests.support.router import redis_router_files, router_process

DOWN = "is unavailable"
BACK = "is available again"


@pytest.mark.slow
def test_a_state_store_outage_is_logged_once_when_it_starts_and_once_when_it_ends(tmp_path) -> None:
    preset, port, state, data, log = redis_router_files(tmp_path)
    with contextlib.ExitStack() as stack:
        redis = contextlib.ExitStack()
        stack.callback(redis.close)
        redis.enter_context(redis_process(port, data, appendonly=True))
        router = stack.enter_context(
            router_process(
                preset,
                state=state,
                log=log,
                extra_args=("--session-idle-timeout", "10", "--compact-interval", "1"),
            )
        )
        time.sleep(1.5)
        assert DOWN not in log.read_text(errors="replace")
        redis.close()
        with httpx.Client(base_url=router.url, headers=router.headers, timeout=30) as c:
            r = c.post("/v1/sessions", json={"group": "cpu-a"})
            assert r.status_code == 503 and "state store unavailable" in r.json()["detail"], r.text
        wait_for_text(log, DOWN, timeout=120)
        # the rest of that poll (idle sweep, compaction: 2 s each) and the whole next one
        time.sleep(15)
        body = log.read_text(errors="replace")
        lines = [line for line in body.splitlines() if DOWN in line]
        assert len(lines) == 1, body[-3000:]
        assert f"state store {state} {DOWN}" in lines[0] and "redis: " in lines[0], lines[0]
        assert "not answering for 2 s" in lines[0], lines[0]  # a poll's call, Redis known down
        assert "Traceback" not in body and "poll failed" not in body, body[-3000:]
        redis.enter_context(redis_process(port, data, appendonly=True))
        body = wait_for_text(log, BACK)
        assert [line for line in body.splitlines() if BACK in line] == [
            next(line for line in body.splitlines() if f"state store {state} {BACK}" in line)
        ]
        time.sleep(2.5)
        body = log.read_text(errors="replace")
        assert body.count(BACK) == 1 and body.count(DOWN) == 1 and "Traceback" not in body, body[-3000:]

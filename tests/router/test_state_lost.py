"""A Redis that loses its data (restarted without persistence) is said, not silent: the router
warns at start that its Redis persists nothing, and logs one error naming the state URL once
Redis comes back empty (every open session, unacknowledged trajectory and lease it held is gone,
so their turns, finishes and acks answer 404). A Redis with an append-only file keeps them: no
warning, no error."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.procs import free_port, redis_process
from tests.support.router import router_process, write_preset

LOST = "lost its data"
NOTHING = "persists nothing"


def _wait_for(log: Path, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = log.read_text(errors="replace")
        if text in body:
            return body
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in the router's log:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.mark.parametrize("appendonly", [False, True], ids=["no-persistence", "appendonly"])
def test_a_redis_restart_that_lost_the_state_is_logged_as_an_error(tmp_path, appendonly) -> None:
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    port = free_port()
    state = f"redis://127.0.0.1:{port}/0"
    data = Path(tempfile.mkdtemp(prefix="redis-", dir=tmp_path))
    log = tmp_path / "router.log"
    with contextlib.ExitStack() as stack:
        redis = contextlib.ExitStack()
        stack.callback(redis.close)
        redis.enter_context(redis_process(port, data, appendonly=appendonly))
        stack.enter_context(router_process(preset, state=state, log=log))
        time.sleep(2.5)  # a few polls: each checks the state's marker
        before = log.read_text(errors="replace")
        assert (NOTHING in before) is not appendonly, before[-3000:]
        assert LOST not in before, before[-3000:]
        redis.close()
        redis.enter_context(redis_process(port, data, appendonly=appendonly))
        if appendonly:
            time.sleep(3)
            assert LOST not in log.read_text(errors="replace")
            return
        body = _wait_for(log, LOST)
        line = next(line for line in body.splitlines() if LOST in line)
        assert f"state store {state} lost its data" in line and "appendonly yes" in line, line
        time.sleep(2)
        assert log.read_text(errors="replace").count(LOST) == 1

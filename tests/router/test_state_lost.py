"""A Redis that loses its data (restarted without persistence) is said, not silent: the router
warns at start that its Redis persists nothing, and logs one error naming the state URL once
Redis comes back empty (every open session, unacknowledged trajectory and lease it held is gone,
so their turns, finishes and acks answer 404) and counts it once in
``mixfleet_router_state_data_lost_total``. A Redis with an append-only file keeps them: no
warning, no error, a count of 0."""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import re
import time

import httpx
import pytest

from tests.support.metrics import samples_of
from tests.support.procs import redis_process, wait_for_text
from tests.support.router import redis_router_files, router_process
from tests.support.state import opened

LOST = "lost its data"
NOTHING = "persists nothing"
COUNTER = ("mixfleet_router_state_data_lost_total", ())


def _losses(router) -> float:
    """The router's ``mixfleet_router_state_data_lost_total``, scraped."""
    r = httpx.get(f"{router.url}/metrics", headers=router.headers, timeout=30)
    assert r.status_code == 200, r.text
    return samples_of(r.text)[COUNTER]


@pytest.mark.parametrize("appendonly", [False, True], ids=["no-persistence", "appendonly"])
def test_a_redis_restart_that_lost_the_state_is_logged_as_an_error(tmp_path, appendonly) -> None:
    preset, port, state, data, log = redis_router_files(tmp_path)
    with contextlib.ExitStack() as stack:
        redis = contextlib.ExitStack()
        stack.callback(redis.close)
        redis.enter_context(redis_process(port, data, appendonly=appendonly))
        router = stack.enter_context(router_process(preset, state=state, log=log))
        time.sleep(2.5)  # a few polls: each checks the state's marker
        before = log.read_text(errors="replace")
        assert (NOTHING in before) is not appendonly, before[-3000:]
        assert LOST not in before, before[-3000:]
        assert _losses(router) == 0
        redis.close()
        redis.enter_context(redis_process(port, data, appendonly=appendonly))
        if appendonly:
            time.sleep(3)
            assert LOST not in log.read_text(errors="replace")
            assert _losses(router) == 0
            return
        body = wait_for_text(log, LOST)
        line = next(line for line in body.splitlines() if LOST in line)
        assert f"state store {state} lost its data" in line and "appendonly yes" in line, line
        time.sleep(2)
        assert log.read_text(errors="replace").count(LOST) == 1
        assert _losses(router) == 1  # once per loss found, not once per poll since


def _lost_clause(response: httpx.Response) -> str:
    """What a 404 for an unknown session says after ``unknown session '<id>'``."""
    assert response.status_code == 404, response.text
    body = response.json()
    detail = body["detail"] if "detail" in body else body["error"]["message"]  # the chat APIs' shapes
    assert detail.startswith("unknown session 's1'"), detail
    return detail.removeprefix("unknown session 's1'")


def test_after_the_state_lost_its_data_a_404_for_an_unknown_session_says_when(tmp_path, tiny_dir) -> None:
    """A session created before the loss is gone: its read, turn, finish, trajectory, delete and
    both chat APIs' turns and models answer 404 saying when this router found the store lost its
    data; before the loss, a 404 for an unknown session says only that."""
    preset, port, state, data, log = redis_router_files(tmp_path)
    with contextlib.ExitStack() as stack:
        redis = contextlib.ExitStack()
        stack.callback(redis.close)
        redis.enter_context(redis_process(port, data))
        chat = ("--chat-model", str(tiny_dir))
        router = stack.enter_context(router_process(preset, state=state, log=log, extra_args=chat))
        c = stack.enter_context(httpx.Client(base_url=router.url, headers=router.headers, timeout=60))
        assert _lost_clause(c.get("/v1/sessions/s1")) == ""  # no loss seen: the plain 404
        asyncio.run(_create(state, "s1"))
        assert c.get("/v1/sessions/s1").status_code == 200
        redis.close()
        redis.enter_context(redis_process(port, data))
        wait_for_text(log, LOST)
        found = time.time()
        turn = {"append_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        message = [{"role": "user", "content": "hi"}]
        answers = [
            c.get("/v1/sessions/s1"),
            c.post("/v1/sessions/s1/turns", json=turn),
            c.post("/v1/sessions/s1/finish", json={"reward": 1.0}),
            c.get("/v1/sessions/s1/trajectory"),
            c.delete("/v1/sessions/s1"),
            c.post("/v1/sessions/s1/openai/v1/chat/completions", json={"model": "m", "messages": message}),
            c.post(
                "/v1/sessions/s1/anthropic/v1/messages",
                json={"model": "m", "max_tokens": 2, "messages": message},
            ),
            c.get("/v1/sessions/s1/openai/v1/models/m"),
        ]
        clauses = {_lost_clause(r) for r in answers}
        assert len(clauses) == 1, clauses
        clause = clauses.pop()
        match = re.fullmatch(r" \(the state store lost its data at (.+) UTC\)", clause)
        assert match, clause
        at = calendar.timegm(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
        assert found - 30 <= at <= found + 1, (clause, found)


async def _create(state: str, sid: str) -> None:
    async with opened(state) as store:
        await store.create_session(sid, "cpu-a", {}, now=time.time())

"""A concurrent agent harness for reliability tests: N sessions x T turns through a router.

Each agent opens a session, runs T token-in-token-out turns (context = previous context +
previous output + one marker token), then finishes with a reward. It behaves as a careful
client: it sends the expected turn index, retries 503s and connection errors, and after a
retry that finds its turn already recorded (409 on ``turn``) it reads the recorded turn
instead of generating twice. Everything it received is kept for the test to compare against
what the trainer gets.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRY_STATUSES = (502, 503, 504)


@dataclass
class AgentLog:
    session_id: str = ""
    group: str = ""
    contexts: list[list[int]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    retries: int = 0


async def _call(
    client: httpx.AsyncClient, method: str, url: str, log: AgentLog, deadline: float, **kw: Any
) -> httpx.Response:
    while True:
        try:
            r = await client.request(method, url, **kw)
            if r.status_code not in RETRY_STATUSES:
                return r
        except httpx.TransportError:
            pass
        log.retries += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"{method} {url}: still failing at the deadline")
        await asyncio.sleep(0.2)


async def run_agent(
    client: httpx.AsyncClient,
    index: int,
    turns: int,
    sampling: dict[str, Any],
    progress: list[int],
    deadline: float,
) -> AgentLog:
    log = AgentLog()
    r = await _call(client, "POST", "/v1/sessions", log, deadline, json={"metadata": {"agent": index}})
    r.raise_for_status()
    log.session_id, log.group = r.json()["session_id"], r.json()["group"]
    context = [1 + index % 200, 2, 3]
    for t in range(turns):
        body = {
            "input_ids": context,
            "sampling_params": {**sampling, "seed": index * 100 + t},
            "turn": t,
            "return_support": True,
        }
        r = await _call(client, "POST", f"/v1/sessions/{log.session_id}/turns", log, deadline, json=body)
        if r.status_code == 409 and "turn" in r.json().get("detail", ""):
            traj = (
                await _call(client, "GET", f"/v1/sessions/{log.session_id}/trajectory", log, deadline)
            ).json()
            turn = traj["turns"][t]  # recorded by the attempt whose answer was lost
        else:
            assert r.status_code == 200, r.text
            turn = r.json()
        log.contexts.append(context)
        log.turns.append(turn)
        progress[0] += 1
        context = context + turn["output_ids"] + [7]
    r = await _call(
        client, "POST", f"/v1/sessions/{log.session_id}/finish", log, deadline, json={"reward": float(index)}
    )
    assert r.status_code == 200 or (r.status_code == 409 and "finished" in r.text), r.text
    log.finished = True
    return log


async def run_agents(
    url: str,
    headers: dict[str, str],
    sessions: int,
    turns: int,
    sampling: dict[str, Any],
    progress: list[int],
    timeout: float = 300.0,
) -> list[AgentLog]:
    deadline = time.monotonic() + timeout
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as client:
        return list(
            await asyncio.gather(
                *(run_agent(client, i, turns, sampling, progress, deadline) for i in range(sessions))
            )
        )


def take_all(url: str, headers: dict[str, str], expect: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Take (and acknowledge) finished trajectories until ``expect`` arrived or time is up."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        while len(got) < expect and time.monotonic() < deadline:
            r = c.post("/v1/batches/take", json={"size": 128, "wait_s": 1.0})
            if r.status_code in RETRY_STATUSES:
                time.sleep(0.2)
                continue
            r.raise_for_status()
            batch = r.json()
            got.extend(batch["trajectories"])
            if batch["trajectories"]:
                assert c.post(f"/v1/batches/{batch['lease_id']}/ack").json()["acked"] == len(
                    batch["trajectories"]
                )
    return got


def check_exact(logs: list[AgentLog], trajectories: list[dict[str, Any]], turns: int, max_new: int) -> int:
    """Every agent's session arrives exactly once with exactly its turns: the same tokens and
    records it received, the contexts it sent, one record per token. Returns the token count."""
    by_id: dict[str, dict[str, Any]] = {}
    for t in trajectories:
        assert t["session_id"] not in by_id, f"trajectory {t['session_id']} delivered twice"
        by_id[t["session_id"]] = t
    assert set(by_id) == {log.session_id for log in logs}, "trajectories lost or foreign"
    tokens = 0
    for log in logs:
        assert log.finished
        traj = by_id[log.session_id]
        assert len(traj["turns"]) == turns, (log.session_id, len(traj["turns"]))
        segment: list[int] = []
        for i, (turn, got) in enumerate(zip(traj["turns"], log.turns, strict=True)):
            assert turn["turn"] == i and turn["fork"] is None  # an agent only appends
            assert turn["context"] == len(segment)
            segment = segment + turn["append_ids"]
            assert segment == log.contexts[i]
            segment = segment + turn["output_ids"]
            assert turn["output_ids"] == got["output_ids"]
            assert turn["records"] == got["records"]
            n = len(turn["output_ids"])
            assert len(turn["records"]) == n
            reason = turn["finish_reason"]["type"]
            assert (reason == "length" and n == max_new) or (reason == "stop" and 0 < n <= max_new), turn
            tokens += n
    return tokens

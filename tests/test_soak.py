"""The soak benchmark's short mode: the production fleet (Redis with its append-only file, a router
of two workers, one supervised replica per group behind a pass-through proxy) under token agents,
chat agents (the official ``openai`` client on each session's OpenAI API, one streaming) and a
trainer, with one round of every fault. Nothing accepted may be lost, duplicated or cut short, and
no chat turn may fork."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_short_soak_loses_nothing_through_every_fault(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--short", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["lost"], report["duplicated"], report["incomplete"]) == (0, 0, 0), report
    assert not report["drain_timed_out"]
    names = ["engine_kill", "sidecar_kill", "router_worker_kill", "redis_restart", "publish_kill"]
    assert [f["name"] for f in report["faults"]] == [*names, "slow", "errors"]
    assert all(f["recovered_at"] is not None for f in report["faults"]), report["faults"]
    assert report["trajectories_delivered"] == report["trajectories_finished"] > 0
    assert report["published_after_faults"] > 0, report["publish_errors"]  # publishing works again
    latest = report["latest_version"]
    assert all(v == [latest] for v in report["active_versions"].values()), report["active_versions"]
    assert report["replica_restarts"]["cpu-bf16"] >= 1  # the engine kill replaced that replica
    chat = report["chat"]
    assert report["forks"] == 0, report["forked_ids"]  # every reply sent back extended its session
    assert [a["stream"] for a in chat["agents"]] == [False, True], chat
    assert all(a["sessions"] > 0 and a["forks"] == 0 for a in chat["agents"]), chat
    assert chat["sessions_delivered"] == chat["sessions_finished"] > 0, chat
    assert chat["turns"] == sum(a["turns"] for a in chat["agents"]) > 0, chat
    assert set(report["turn_replays"]) == {"found", "raced"}, report["turn_replays"]  # read from the router
    assert proc.returncode == 0, proc.stdout[-3000:]

"""``mixfleet demo`` proves token-in-token-out end to end: its agents chat through each session's
OpenAI API (the official client) on the multi-turn task, and every turn the router stored is
exactly an exchange the engine had.

A real router (with the ``tiny`` base as its chat model and the store's weight routes) and one
bf16 replica (engine + sidecar, :func:`tests.support.fleet.local_fleet`) whose sidecar advertises
a recording proxy (:mod:`tests.support.recorder`) as its URL, so every ``/generate`` the router
sends passes through it. The demo runs against them with ``--router`` (a short SFT, two
updates); then: no episode forked, every episode took one or two turns and some took two, each
trained episode's stored trajectory has as many turns as the episode, its turns extend one
another, and each turn's whole input and its sampled ids are a ``/generate`` exchange the engine
answered; the first turn's input is the trainer's rendering of the problem (what the warm start
trained on).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.chat.conftest import trajectory
from tests.support.fleet import local_fleet
from tests.support.procs import mixfleet_argv
from tests.support.recorder import recording_proxy
from tests.support.router import ALL_SCOPES, router_process, write_preset
from trainer.demo_sft import ChatPrompts

pytestmark = pytest.mark.slow

GROUP = ("cpu-bf16", "bf16")
RUN = "demo-chat"
ARGS = [
    "--updates", "2", "--sft-steps", "3", "--prompts", "2", "--samples", "4", "--agents", "2",
    "--outstanding", "8", "--no-progress",
]  # fmt: skip


def _wait_ready(router, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        groups = httpx.get(router.url + "/v1/groups", headers=router.headers, timeout=5).json()["groups"]
        if groups and all(g.get("ready_replicas", 0) > 0 for g in groups):
            return
        assert time.monotonic() < deadline, groups
        time.sleep(0.2)


def test_demo_chats_token_in_token_out(tmp_path: Path, tiny_dir: Path) -> None:
    key = secrets.token_hex(16)
    preset = write_preset(
        tmp_path / "preset.toml",
        [{"name": GROUP[0], "weight_format": GROUP[1], "min_replicas": 1, "sessions_per_replica": 16}],
    )
    env = {"MIXFLEET_STORE": str(tmp_path / "store"), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    chat_model = ("--chat-model", str(tiny_dir), "--heartbeat-timeout", "5")
    out = tmp_path / "out"
    with (
        recording_proxy("http://127.0.0.1:9") as engine,  # its upstream: the sidecar, once it is up
        router_process(preset, keys={key: ALL_SCOPES}, env=env, extra_args=chat_model) as router,
        local_fleet(
            tmp_path,
            tiny_dir,
            [GROUP],
            run_id=RUN,
            router_url=router.url,
            env={"MIXFLEET_API_KEY": key, "MIXFLEET_URL": router.url},
            group_sidecar_flags={GROUP[0]: ("--advertise-url", engine.url)},
        ) as fleet,
    ):
        engine.upstream = fleet.replica(GROUP[0]).url
        _wait_ready(router)
        argv = mixfleet_argv(
            "demo", "--router", router.url, "--base", str(tiny_dir), "--out", str(out), *ARGS
        )
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}
        done = subprocess.run(
            argv, env={**clean, "MIXFLEET_API_KEY": key}, capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, done.stdout + done.stderr
        record = json.loads((out / "demo.json").read_text())
        trained = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
        stored = {e["session"]: trajectory(router, e["session"]) for e in trained}
        first = trained[0]["session"]
        meta = httpx.get(f"{router.url}/v1/sessions/{first}/trajectory", headers=router.headers).json()
    seen = {
        (tuple(json.loads(req)["input_ids"]), tuple(json.loads(resp)["output_ids"]))
        for req, resp in engine.exchanges("/generate")
    }

    s = record["summary"]
    assert s["updates"] == 2 and s["forks"] == 0 and s["episodes"] == len(trained) > 0
    assert set(s["turns"]) <= {"1", "2"} and s["turns"].get("2", 0) > 0, s["turns"]
    assert "forks: 0" in done.stdout and "turns per episode" in done.stdout
    for u in record["updates"]:
        assert u["forks"] == 0 and sum(u["turns"].values()) == u["trajectories"]
    for e in trained:
        turns = stored[e["session"]]
        assert e["forks"] == 0 and len(turns) == e["turns"] in (1, 2)
        assert all(t["fork"] is None for t in turns)
        for prev, t in zip(turns, turns[1:], strict=False):
            assert t["input_ids"][: t["context"]] == prev["input_ids"] + prev["output_ids"]
        for t in turns:
            assert (tuple(t["input_ids"]), tuple(t["output_ids"])) in seen
    prompt = [{"role": "user", "content": meta["metadata"]["digits"]}]
    assert stored[first][0]["input_ids"] == ChatPrompts(tiny_dir).context(prompt)

"""``mixfleet demo`` end to end on real processes, a few updates on the tiny model (its agents
chat through the router's OpenAI API; token for token: ``test_demo_chat.py``).

* Against a fleet the test starts (``mixfleet up``, preset local: bf16, fp8 and nvfp4 groups; up
  gives the router its base as the chat model) and passes with ``--router``, where another
  publisher takes the next version while the demo warms up (the demo publishes the router's next
  version, not the one after the latest it read at start): demo.json holds the
  SFT phase (its loss decreases) and one entry per update with rewards in [0, 1], its episodes'
  turns and no fork, and every metric per group; every published version was
  observed active in every group, and the router's weights status afterwards shows each
  replica serving the last one; the cost report of the router's ledger was written.
* With no ``--router`` the command starts and stops its own fleet: the store's pointer of every
  format names the last version, and no process of the fleet is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.procs import free_port, mixfleet_argv, process, wait_http

pytestmark = pytest.mark.slow

UPDATES = 3
SHORT = [
    "--updates", str(UPDATES), "--sft-steps", "8", "--prompts", "4", "--samples", "4", "--agents", "4",
    "--no-progress",
]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}


def _check_record(record: dict, groups: set[str]) -> None:
    assert record["config"]["method"] == "sc-mis-topp"
    assert {g["group"] for g in record["groups"]} == groups
    sft = record["sft"]
    assert len(sft["loss"]) == 8 and sft["loss"][-1] < sft["loss"][0]
    first = record["first_version"]
    ups = record["updates"]
    assert [u["update"] for u in ups] == list(range(1, UPDATES + 1))
    assert [u["version"] for u in ups] == list(range(first + 1, first + 1 + UPDATES))
    for u in ups:
        assert 0.0 <= u["mean_reward"] <= 1.0 and 0.0 <= u["exact"] <= 1.0
        assert u["forks"] == 0 and sum(u["turns"].values()) == u["trajectories"]
        assert set(u["turns"]) <= {"1", "2"} and 1 <= u["turns_mean"] <= 2
        assert u["trajectories"] > 0 and u["tokens"] >= u["trajectories"]
        assert u["version_age"]["max"] >= 0 and u["version_age"]["mean"] >= 0
        assert set(u["k3_kl"]) <= groups and u["k3_kl"]
        for key in ("k3_kl", "abs_logprob_diff_mean", "extreme_ratio_share", "tokens_by_group"):
            assert set(u[key]) == set(u["k3_kl"])
        assert all(v >= 0 for v in u["k3_kl"].values())
        assert all(0 <= v <= 1 for v in u["extreme_ratio_share"].values())
        assert sum(u["tokens_by_group"].values()) == u["tokens"]
        assert u["wall_s"] > 0 and u["take_wait_s"] >= 0 and u["empty_takes"] >= 0
        assert u["grad_norm"] >= 0 and u["support_mean"] >= 1 and 0 <= u["singleton_share"] <= 1
        assert 0 <= u["clipped_share"] <= 1
    # every batch's trainer log-probs were uploaded and counted by the router, token for token
    uploads = record["mismatch_uploads"]
    assert [up["tokens"] + up["skipped"] for up in uploads] == [u["tokens"] for u in ups]
    for up in uploads:
        assert up["groups"] and {g["group"] for g in up["groups"]} <= groups
    # the warm start and every update were published and served by every group
    acts = record["activations"]
    assert [a["version"] for a in acts] == list(range(first, first + 1 + UPDATES))
    for a in acts:
        assert set(a["activated_s"]) == groups
        assert all(s >= a["published_s"] >= 0 for s in a["activated_s"].values())


def test_demo_against_a_running_fleet(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "fleet"
    up = mixfleet_argv("up", "--port", str(port), "--data-dir", str(data), "--model-preset", "tiny")
    with process(up, log=tmp_path / "up.log", env=_env()):
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", timeout=120)
        key = (data / "api_key").read_text().strip()
        headers = {"Authorization": f"Bearer {key}"}
        groups: set[str] = set()
        for _ in range(600):
            body = httpx.get(url + "/v1/groups", headers=headers, timeout=5).json()
            groups = {g["name"] for g in body["groups"] if g.get("ready_replicas", 0) > 0}
            if len(groups) == 3:
                break
            time.sleep(0.2)
        assert groups == {"cpu-bf16", "cpu-fp8", "cpu-nvfp4"}
        out = tmp_path / "out"
        argv = mixfleet_argv("demo", "--router", url, "--base", str(data / "base"), "--out", str(out), *SHORT)
        env = {**_env(), "MIXFLEET_API_KEY": key}
        with subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as demo:
            seen = []
            for line in demo.stdout:  # the demo read the latest version; its SFT runs now
                seen.append(line)
                if "latest v" in line:
                    break
            latest = int(seen[-1].rsplit("latest v", 1)[1])
            other = httpx.post(
                url + "/v1/weights", json={"checkpoint": str(data / "base")}, headers=headers, timeout=30
            )
            assert other.status_code == 202 and other.json()["version"] == latest + 1, other.text
            stdout, stderr = demo.communicate(timeout=300)
        done = subprocess.CompletedProcess(argv, demo.returncode, "".join(seen) + stdout, stderr)
        assert done.returncode == 0, done.stdout + done.stderr
        record = json.loads((out / "demo.json").read_text())
        _check_record(record, groups)
        assert record["first_version"] == latest + 2  # after the other publisher's
        assert (out / "demo.png").stat().st_size > 0
        report = json.loads((out / "report" / "report.json").read_text())
        assert isinstance(report, dict) and report
        last = record["updates"][-1]["version"]
        status = httpx.get(url + "/v1/weights", headers=headers, timeout=5).json()
        assert status["latest_version"] == last
        for g in status["groups"]:
            assert g["replicas"] and all(r["active_version"] == last for r in g["replicas"]), g
        metrics = httpx.get(url + "/metrics", headers=headers, timeout=5).text
        counted = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("mixfleet_mismatch_tokens_total{")
        )
        assert counted == sum(up["tokens"] for up in record["mismatch_uploads"]) > 0
    assert "updates in" in done.stdout and "forks: 0" in done.stdout


def test_demo_starts_and_stops_its_own_fleet(tmp_path: Path) -> None:
    """Also on-policy (``--max-version-age 0``) with room for one batch only: the sessions an
    update makes stale are held back by the router, and the agents get their room back while the
    trainer's take waits, so no take waits out its time (60 s) empty."""
    out = tmp_path / "out"
    argv = mixfleet_argv("demo", "--out", str(out), *SHORT, "--max-version-age", "0", "--outstanding", "16")
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "demo.json").read_text())
    _check_record(record, {"cpu-bf16", "cpu-fp8", "cpu-nvfp4"})
    assert all(u["version_age"]["max"] == 0 for u in record["updates"])
    assert sum(u["held_back"] > 0 for u in record["updates"]) >= 1  # what makes the room matter
    assert [u["empty_takes"] for u in record["updates"]] == [0] * UPDATES
    last = record["updates"][-1]["version"]
    for fmt in ("bf16", "fp8", "nvfp4"):
        assert (out / "fleet" / "store" / "local" / fmt / "CURRENT").read_text().strip() == str(last)
    assert "stopping the fleet" in done.stdout
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out / "fleet") not in ps


def test_demo_refuses_bad_arguments(tmp_path: Path) -> None:
    cases = [
        (["--router", "http://127.0.0.1:9"], "--router needs a key"),
        (["--method", "nope"], "method must be one of"),
        (["--min-len", "5", "--max-len", "3"], "min_len <= max_len"),
        (["--turns", "0"], "max_turns must be >= 1"),
        # these ran the warm start and publish first, then died in a traceback (AdamW's check)
        (["--lr", "-1"], "lr must be a positive, finite number, got -1.0"),
        (["--sft-lr", "nan"], "sft_lr must be a positive, finite number, got nan"),
        (["--max-version-age", "-1"], "max_version_age must be >= 0"),
        (["--time-limit", "nan"], "time_limit_s must be > 0, got nan"),
    ]
    for args, message in cases:
        done = subprocess.run(
            mixfleet_argv("demo", "--out", str(tmp_path / "o"), *args),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr

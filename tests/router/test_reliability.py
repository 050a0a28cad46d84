"""Reliability with real processes: three local engine groups (bf16, fp8, nvfp4 checkpoints made
by the converter), a real router, a real redis-server.

* 256 concurrent sessions x 5 turns: every trajectory complete, token counts exact.
* Engines killed mid-run (one of two bf16 replicas, then the only fp8 one): every session
  finishes, nothing lost or recorded twice; the moves are recorded.
* redis-server restarted (AOF on, same port and dir) mid-run: no finished trajectory lost; the
  router reconnects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.router.agents import check_exact, run_agents, take_all
from tests.support.engines import engine_argv
from tests.support.models import make_model_dir
from tests.support.procs import free_port, kill_group, process, redis_process, wait_http
from tests.support.router import router_process, write_preset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
MAX_NEW = 4
# A loaded engine may answer health polls late; a dead one refuses connections at once, which
# takes it out of rotation without waiting for this.
ROUTER_ARGS = ("--heartbeat-timeout", "60")
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "top_p": 0.95}


@pytest.fixture(scope="module")
def model_dirs(model_root) -> dict[str, Path]:
    return {fmt: make_model_dir(model_root, "tiny", fmt) for fmt in ("bf16", "fp8", "nvfp4")}


@contextlib.contextmanager
def engines(dirs: list[tuple[str, Path]], log_dir: Path) -> Iterator[dict[str, tuple[str, subprocess.Popen]]]:
    """Start one engine per (name, model dir) at once; yield name -> (url, process)."""
    with contextlib.ExitStack() as stack:
        out = {}
        for name, d in dirs:
            port = free_port()
            proc = stack.enter_context(process(engine_argv(d, port), log=log_dir / f"{name}.log"))
            out[name] = (f"http://127.0.0.1:{port}", proc)
        for name, (url, proc) in out.items():
            try:
                wait_http(f"{url}/health", timeout=180, proc=proc)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(
                    f"{name}: {exc}\n{(log_dir / f'{name}.log').read_text()[-3000:]}"
                ) from None
        yield out


def _preset(path: Path, urls: dict[str, list[str]]) -> Path:
    return write_preset(
        path,
        [
            {
                "name": "cpu-bf16",
                "weight_format": "bf16",
                "sessions_per_replica": 8,
                "replicas": urls["bf16"],
            },
            {"name": "cpu-fp8", "weight_format": "fp8", "sessions_per_replica": 8, "replicas": urls["fp8"]},
            {
                "name": "cpu-nvfp4",
                "weight_format": "nvfp4",
                "sessions_per_replica": 8,
                "replicas": urls["nvfp4"],
            },
        ],
    )


def _wait_ready(url: str, headers: dict[str, str], replicas: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        groups = httpx.get(f"{url}/v1/groups", headers=headers).json()["groups"]
        if sum(g["ready_replicas"] for g in groups) == replicas:
            return
        time.sleep(0.2)
    raise AssertionError(f"router never saw {replicas} replicas in rotation")


def _run_with(url: str, headers: dict[str, str], sessions: int, turns: int, at: list[tuple[float, object]]):
    """Run the agents; call each ``fn`` of ``at`` once progress passes its fraction of all turns."""
    progress = [0]
    total = sessions * turns
    done = threading.Event()
    fired: list[float] = []

    def watcher() -> None:
        pending = sorted(at, key=lambda x: x[0])
        while pending and not done.is_set():
            if progress[0] >= pending[0][0] * total:
                fired.append(progress[0] / total)
                pending.pop(0)[1]()
            time.sleep(0.02)

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    try:
        logs = asyncio.run(run_agents(url, headers, sessions, turns, SAMPLING, progress, timeout=300))
    finally:
        done.set()
        thread.join(timeout=30)
    assert len(fired) == len(at), f"faults fired at {fired}, wanted {len(at)}"
    return logs


def test_256_sessions_x_5_turns_over_three_groups(model_dirs, tmp_path) -> None:
    with engines([(f, model_dirs[f]) for f in ("bf16", "fp8", "nvfp4")], tmp_path) as eng:
        preset = _preset(tmp_path / "p.toml", {f: [eng[f][0]] for f in ("bf16", "fp8", "nvfp4")})
        with router_process(preset, extra_args=ROUTER_ARGS) as router:
            _wait_ready(router.url, router.headers, 3)
            logs = _run_with(router.url, router.headers, 256, 5, [])
            trajectories = take_all(router.url, router.headers, 256)
            tokens = check_exact(logs, trajectories, 5, MAX_NEW)
            groups = httpx.get(f"{router.url}/v1/groups", headers=router.headers).json()["groups"]
            assert sum(g["tokens_total"] for g in groups) == tokens
            assert sum(g["sessions_total"] for g in groups) == 256
            spread = Counter(log.group for log in logs)
            assert set(spread) == {"cpu-bf16", "cpu-fp8", "cpu-nvfp4"}  # equal capacity: all used
            assert max(spread.values()) - min(spread.values()) <= 3
            moved = [t for log in logs for t in log.turns if t["group"] != log.group]
            errors = [(r["replica_id"], r["error"]) for g in groups for r in g["replicas"]]
            detail = [
                (
                    log.session_id,
                    log.group,
                    log.retries,
                    t["session_id"],
                    t["turn"],
                    t["group"],
                    t["moved_from"],
                    t["timings"],
                )
                for log in logs
                for t in log.turns
                if t["group"] != log.group
            ]
            assert not moved, f"{len(moved)} turns left their group without a fault: {detail[:5]}; {errors}"


def test_engines_killed_mid_run_lose_and_duplicate_nothing(model_dirs, tmp_path) -> None:
    dirs = [
        ("bf16-a", model_dirs["bf16"]),
        ("bf16-b", model_dirs["bf16"]),
        ("fp8", model_dirs["fp8"]),
        ("nvfp4", model_dirs["nvfp4"]),
    ]
    with engines(dirs, tmp_path) as eng:
        urls = {
            "bf16": [eng["bf16-a"][0], eng["bf16-b"][0]],
            "fp8": [eng["fp8"][0]],
            "nvfp4": [eng["nvfp4"][0]],
        }
        with router_process(_preset(tmp_path / "p.toml", urls), extra_args=ROUTER_ARGS) as router:
            _wait_ready(router.url, router.headers, 4)
            logs = _run_with(
                router.url,
                router.headers,
                64,
                5,
                [
                    (0.2, lambda: kill_group(eng["bf16-b"][1])),  # same group has another replica
                    (0.45, lambda: kill_group(eng["fp8"][1])),  # the group's only replica: sessions move
                ],
            )
            trajectories = take_all(router.url, router.headers, 64)
            tokens = check_exact(logs, trajectories, 5, MAX_NEW)
            groups = httpx.get(f"{router.url}/v1/groups", headers=router.headers).json()["groups"]
            assert sum(g["tokens_total"] for g in groups) == tokens
            turns = [t for log in logs for t in log.turns]
            moved = [t for t in turns if t["moved_from"] == "cpu-fp8"]
            assert moved and all(t["group"] in ("cpu-bf16", "cpu-nvfp4") for t in moved)
            assert all(t["replica"] != "cpu-fp8/0" for t in moved)
            late_bf16 = {t["replica"] for t in turns if t["group"] == "cpu-bf16"}
            assert "cpu-bf16/0" in late_bf16
            # a moved session stays in its new group afterwards
            for log in logs:
                seen = [t["group"] for t in log.turns]
                if "cpu-fp8" in seen and seen[-1] != "cpu-fp8":
                    first_out = next(i for i, g in enumerate(seen) if g != "cpu-fp8")
                    assert len(set(seen[first_out:])) == 1
            metrics = httpx.get(f"{router.url}/metrics").text
            moves = [  # every pair's series exists from the start (at 0): the moves must have counted
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith('mixfleet_router_session_moves_total{from_group="cpu-fp8"')
            ]
            assert len(moves) == 2 and sum(moves) >= 1, moves


def test_redis_restart_mid_run_loses_no_finished_trajectory(model_dirs, tmp_path) -> None:
    data = tmp_path / "redis"
    data.mkdir()
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    finished_before: list[str] = []
    with contextlib.ExitStack() as stack:
        current = {"ctx": contextlib.ExitStack()}
        stack.callback(lambda: current["ctx"].close())

        def start_redis() -> subprocess.Popen:
            server = redis_process(port, data, appendonly=True, log=data / "redis.log")
            return current["ctx"].enter_context(server)

        first = start_redis()

        def restart() -> None:
            r = redis.Redis(port=port)
            deadline = time.monotonic() + 120
            while not r.xlen("mf:ready") and time.monotonic() < deadline:
                time.sleep(0.05)  # restart only once some sessions have finished (agents keep going)
            finished_before.extend(m[1][b"sid"].decode() for m in r.xrange("mf:ready"))
            r.close()
            first.send_signal(signal.SIGTERM)  # a clean stop: the AOF is flushed
            first.wait(timeout=20)
            current["ctx"].close()
            time.sleep(1.0)  # the router sees a refused connection meanwhile
            current["ctx"] = contextlib.ExitStack()
            start_redis()

        eng = stack.enter_context(engines([(f, model_dirs[f]) for f in ("bf16", "fp8", "nvfp4")], tmp_path))
        preset = _preset(tmp_path / "p.toml", {f: [eng[f][0]] for f in ("bf16", "fp8", "nvfp4")})
        router = stack.enter_context(router_process(preset, state=url, extra_args=ROUTER_ARGS))
        _wait_ready(router.url, router.headers, 3)
        logs = _run_with(router.url, router.headers, 48, 5, [(0.5, restart)])
        assert finished_before, "the restart should come after some sessions finished"
        trajectories = take_all(router.url, router.headers, 48)
        check_exact(logs, trajectories, 5, MAX_NEW)
        assert set(finished_before) <= {t["session_id"] for t in trajectories}
        assert httpx.get(f"{router.url}/healthz").json()["state"] is True

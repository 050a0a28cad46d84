"""``mixfleet router --workers 2 --state redis://...``: a scrape of ``/metrics`` answers for both
workers, whichever one serves it (prometheus-client's multiprocess collection,
:mod:`router.metrics`). Every request goes out on a connection of its own so both workers serve
traffic (each answer names its process in ``X-Mixfleet-Router``). Every group's series exist at 0
before any traffic; after sessions, turns and acknowledged batches spread over both workers, every
scrape shows the totals; after one worker is SIGKILLed (uvicorn's supervisor starts another) no
counter goes backwards, the dead worker's ``mixfleet_router_workers`` share is gone, and later
traffic adds to the totals; the workers' metric directory is removed when the router stops. Every
scrape shows each live worker's process metrics (resident memory, fds, CPU, start time) and the
supervisor's, one series per process labelled ``pid``, and no dead worker's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from mixfleet.router import METRICS_DIR_PREFIX, remove_stale_metric_dirs
from router.metrics import MULTIPROC_ENV
from tests.support.metrics import Samples, assert_groups_at_zero, samples_of
from tests.support.procs import redis_server
from tests.support.router import RouterHandle, router_process, write_preset

pytestmark = pytest.mark.timeout(600)

KEY = "k" * 32
GROUPS = ("cpu-a", "cpu-b")
SP = {"max_new_tokens": 3, "seed": 1}


def call(router: RouterHandle, method: str, path: str, **kw) -> tuple[httpx.Response, int]:
    """One request on a connection of its own; the response and the pid of the worker that served it."""
    r = httpx.request(method, router.url + path, headers=router.headers, timeout=120, **kw)
    return r, int(r.headers["x-mixfleet-router"].rsplit("/", 1)[1])


def scrape(router: RouterHandle) -> tuple[Samples, int]:
    """Every ``mixfleet_*`` sample of one scrape, keyed by (name, sorted labels); the worker's pid."""
    r, pid = call(router, "GET", "/metrics")
    assert r.status_code == 200, r.text
    return samples_of(r.text), pid


def process_by_pid(router: RouterHandle) -> dict[int, dict[str, float]]:
    """One scrape's ``process_*`` samples: worker pid -> name -> value, each worker's values sane."""
    r, _ = call(router, "GET", "/metrics")
    assert r.status_code == 200, r.text
    out: dict[int, dict[str, float]] = {}
    for (name, labels), value in samples_of(r.text, "process_").items():
        assert [k for k, _ in labels] == ["pid"], (name, labels)
        out.setdefault(int(labels[0][1]), {})[name] = value
    for pid, got in out.items():
        assert got["process_resident_memory_bytes"] > 10 * 2**20, (pid, got)
        assert 0 < got["process_open_fds"] <= got["process_max_fds"], (pid, got)
        assert got["process_cpu_seconds_total"] > 0, (pid, got)
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


COUNTED = (
    "mixfleet_router_turns_total",
    "mixfleet_router_tokens_total",
    "mixfleet_router_sessions_created_total",
    "mixfleet_router_turn_seconds_count",
    "mixfleet_router_engine_seconds_count",
    "mixfleet_router_updates_total",
    "mixfleet_router_leases_total",
    "mixfleet_router_trajectories_acked_total",
)


def totals(samples: Samples) -> dict[str, float]:
    return {name: total(samples, name) for name in COUNTED}


def scrapes(router: RouterHandle, at_least: int = 8, pids: int = 2) -> list[tuple[Samples, int]]:
    """At least ``at_least`` scrapes, and until ``pids`` distinct workers answered (at most 200)."""
    out: list[tuple[Samples, int]] = []
    for _ in range(200):
        out.append(scrape(router))
        if len(out) >= at_least and len({p for _, p in out}) >= pids:
            return out
    raise AssertionError(f"only workers {sorted({p for _, p in out})} answered /metrics")


def serve(router: RouterHandle, sessions: int, workers: int = 1) -> dict[str, object]:
    """``sessions`` sessions of two turns, and more (at most 64) until ``workers`` workers served
    one of their requests (which worker accepts a new connection is the kernel's choice: a busy
    machine may hand one worker many in a row), finished, then every trajectory taken in batches
    of 2 and acknowledged; what was done, and by which workers."""
    served_by: Counter[int] = Counter()
    turns = tokens = created = 0
    while created < sessions or (len(served_by) < workers and created < sessions + 64):
        created += 1
        r, pid = call(router, "POST", "/v1/sessions", json={})
        assert r.status_code == 200, r.text
        served_by[pid] += 1
        sid = r.json()["session_id"]
        for i in range(2):
            t, pid = call(
                router,
                "POST",
                f"/v1/sessions/{sid}/turns",
                json={"input_ids": [1, 2, 3 + i], "sampling_params": SP},
            )
            assert t.status_code == 200, t.text
            served_by[pid] += 1
            turns += 1
            tokens += len(t.json()["output_ids"])
        f, _ = call(router, "POST", f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
        assert f.status_code == 200, f.text
    acked = updates = 0
    while acked < created:
        b, pid = call(router, "POST", "/v1/batches/take", json={"size": 2})
        assert b.status_code == 200 and b.json()["trajectories"], b.text
        a, _ = call(router, "POST", f"/v1/batches/{b.json()['lease_id']}/ack")
        assert a.status_code == 200, a.text
        acked += a.json()["acked"]
        updates += 1
    return {
        "served_by": served_by,
        "sessions": created,
        "turns": turns,
        "tokens": tokens,
        "updates": updates,
        "acked": acked,
    }


def expect(done: list[dict[str, object]]) -> dict[str, float]:
    """The totals every scrape must show after ``done`` (``serve``'s results)."""
    turns = sum(int(d["turns"]) for d in done)
    updates = sum(int(d["updates"]) for d in done)
    return {
        "mixfleet_router_turns_total": turns,
        "mixfleet_router_tokens_total": sum(int(d["tokens"]) for d in done),
        "mixfleet_router_sessions_created_total": sum(int(d["sessions"]) for d in done),
        "mixfleet_router_turn_seconds_count": turns,
        "mixfleet_router_engine_seconds_count": turns,
        "mixfleet_router_updates_total": updates,
        "mixfleet_router_leases_total": updates,
        "mixfleet_router_trajectories_acked_total": sum(int(d["acked"]) for d in done),
    }


@pytest.fixture
def workers(engine_url, tmp_path):
    preset = write_preset(
        tmp_path / "p.toml",
        [
            {"name": "cpu-a", "replicas": [engine_url], "sessions_per_replica": 8},
            {
                "name": "cpu-b",
                "replicas": [engine_url.replace("127.0.0.1", "localhost")],
                "sessions_per_replica": 8,
            },
        ],
    )
    with (
        redis_server() as url,
        router_process(
            preset,
            state=url,
            keys={KEY: ["rollout", "trainer", "admin"]},
            log=tmp_path / "router.log",
            extra_args=("--workers", "2", "--log-level", "info"),  # the log shows each stage of a stop
        ) as router,
    ):
        yield router


def test_every_scrape_answers_for_all_workers_and_survives_a_killed_worker(workers: RouterHandle) -> None:
    router = workers
    deadline = time.monotonic() + 120
    while total(scrape(router)[0], "mixfleet_router_workers") != 2:  # the second may start later
        assert time.monotonic() < deadline, "the second worker never started"
        time.sleep(0.2)
    first = scrapes(router)
    pids = {p for _, p in first}
    for samples, _ in first:
        assert_groups_at_zero(samples, GROUPS)  # every group's series, at 0, before any traffic
        assert totals(samples) == dict.fromkeys(COUNTED, 0)
        assert total(samples, "mixfleet_router_workers") == 2
        assert total(samples, "mixfleet_router_version_lag_bound") == 2  # no --max-version-lag: the default
        assert not [k for k in samples if "pid" in dict(k[1])], "a per-process series leaked"
    for _ in range(8):  # whichever worker answers: both workers' and the supervisor's process series
        assert set(process_by_pid(router)) == pids | {router.proc.pid}
    (env,) = {Path(f"/proc/{p}/environ").read_bytes() for p in pids}
    (metrics_dir,) = [
        v.split(b"=", 1)[1].decode() for v in env.split(b"\0") if v.startswith(MULTIPROC_ENV.encode() + b"=")
    ]
    assert Path(metrics_dir).is_dir()

    done = [serve(router, sessions=8, workers=2)]
    assert len(done[0]["served_by"]) == 2, done[0]["served_by"]  # both workers served
    want = expect(done)
    for samples, _ in scrapes(router):
        assert totals(samples) == want

    # SIGKILL one worker: what it counted stays, whichever worker answers, and uvicorn starts another
    victim = next(iter(pids))
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 180
    seen: set[int] = set()
    while True:
        samples, pid = scrape(router)
        assert pid != victim
        assert totals(samples) == want, "a counter went backwards"
        assert total(samples, "mixfleet_router_workers") in (1, 2)
        seen.add(pid)
        if pid not in pids and total(samples, "mixfleet_router_workers") == 2:
            break  # the replacement serves, and the killed worker's share is gone
        assert time.monotonic() < deadline, f"no replacement worker answered; saw {seen}"
        time.sleep(0.2)

    done.append(serve(router, sessions=4))
    want = expect(done)
    live = {p for _, p in scrapes(router)}
    assert victim not in live and len(live) == 2
    for samples, _ in scrapes(router):
        assert totals(samples) == want
        assert total(samples, "mixfleet_router_workers") == 2
        assert set(process_by_pid(router)) == live | {router.proc.pid}  # the killed worker's are gone

    # a graceful stop (SIGTERM to the supervisor) removes the workers' metric files
    router.proc.send_signal(signal.SIGTERM)
    try:
        router.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:  # name the stage each process stopped at (uvicorn logs them)
        tail = router.log.read_text(errors="replace").splitlines()[-40:]
        pytest.fail("the router did not stop within 120 s of SIGTERM; its log ends:\n" + "\n".join(tail))
    assert not Path(metrics_dir).exists()


def test_a_killed_routers_metric_directory_is_removed_by_the_next_router(tmp_path: Path) -> None:
    """Metric directories are named after their router's pid: one whose router is gone is removed
    before a new router makes its own; a running router's stays."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"{METRICS_DIR_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{METRICS_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{METRICS_DIR_PREFIX}x-ghi"  # not a router's: left alone
    for d in (stale, live, other):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"\0" * 8)
    assert remove_stale_metric_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.is_dir() and other.is_dir()

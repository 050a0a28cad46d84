"""``mixfleet router --workers 2`` on one real redis-server serves one fleet from two processes on
one port as one router: every request goes out on a new connection (so both workers get traffic,
each answer names its process in ``X-Mixfleet-Router``), and whichever worker answers, sessions
created on one take turns on the other, sidecar heartbeats (with a ``replica`` key) land anywhere
and ``/v1/groups`` agrees, the routing window is one window, batches are handed out once, a publish
job started on one is visible on the other, and a second publish while one runs is refused
wherever it lands; after every write of one run, every read (session, trajectory, queue, groups
with their mismatch, ledger) answers the same on both workers, and what the run wrote."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.process import open_files_wanted
from core.tcp import port_is_free
from core.wire import LOGPROBS_MEDIA_TYPE as LOGPROBS
from core.wire import RECORDS_MEDIA_TYPE as RECORDS
from tests.support.procs import mixfleet_argv, open_files_limit, redis_server, soft_open_files
from tests.support.router import RouterHandle, router_process, write_preset
from trainer.batch import decode_batch
from trainer.upload import encode_trainer_logprobs

ADMIN = "a" * 32
REPLICA = "r" * 32
SP = {"max_new_tokens": 3, "seed": 1}
ALL_FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]


def call(
    router: RouterHandle, method: str, path: str, key: str = ADMIN, headers_extra: dict | None = None, **kw
) -> tuple[httpx.Response, str]:
    """One request on a connection of its own; the response and the pid of the worker that served it."""
    headers = {"Authorization": f"Bearer {key}", **(headers_extra or {})}
    r = httpx.request(method, router.url + path, headers=headers, timeout=120, **kw)
    return r, r.headers["x-mixfleet-router"].rsplit("/", 1)[1]


@pytest.fixture(scope="module")
def workers(engine_url, tmp_path_factory):
    """Two workers over groups ``cpu-a`` (the engine, static) and ``cpu-b`` (heartbeats only), and
    a group without replicas per other format, with the weight routes on a local store; yields the
    router once both workers answer."""
    d = tmp_path_factory.mktemp("workers")
    preset = write_preset(
        d / "p.toml",
        [
            {"name": "cpu-a", "replicas": [engine_url], "sessions_per_replica": 8},
            {"name": "cpu-b", "sessions_per_replica": 8},
            # no replicas: the fleet serves every format, so a publish of ALL_FORMATS is allowed
            *({"name": f"cpu-{f}", "weight_format": f} for f in ALL_FORMATS[1:]),
        ],
    )
    keys = {ADMIN: ["rollout", "trainer", "admin"], REPLICA: ["replica"]}
    env = {"MIXFLEET_STORE": str(d / "store"), "MIXFLEET_RUN": "run", "MIXFLEET_PUBLISH_WORKERS": "0"}
    with (
        redis_server() as url,
        router_process(
            preset,
            state=url,
            keys=keys,
            env=env,
            extra_args=("--workers", "2", "--heartbeat-timeout", "300"),
        ) as router,
    ):
        both_workers_answer(router)
        yield router


def both_workers_answer(router: RouterHandle, timeout: float = 60) -> None:
    """Wait until two worker processes have answered ``/healthz`` (fresh connections), at most
    ``timeout`` seconds."""
    pids: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(pids) < 2:
        assert time.monotonic() < deadline, f"only workers {pids} answered"
        r, pid = call(router, "GET", "/healthz")
        if r.status_code == 200:
            pids.add(pid)


def _groups(router: RouterHandle) -> tuple[dict, str]:
    r, pid = call(router, "GET", "/v1/groups")
    assert r.status_code == 200, r.text
    return r.json(), pid


def _view(snapshot: dict) -> dict:
    """What every router must agree on: per group its replicas in rotation, sessions, window."""
    return {
        "latest_version": snapshot["latest_version"],
        "groups": [
            {
                "name": g["name"],
                "ready_replicas": g["ready_replicas"],
                "in_rotation": sorted(r["replica_id"] for r in g["replicas"] if r["in_rotation"]),
                "sessions_total": g["sessions_total"],
                "window_sessions": g["window_sessions"],
                "window_session_share": g["window_session_share"],
            }
            for g in snapshot["groups"]
            if g["name"] in ("cpu-a", "cpu-b")  # the groups with replicas
        ],
    }


def _agreed(router: RouterHandle, at_least: int = 12) -> dict:
    """``/v1/groups`` asked at least ``at_least`` times and until both workers answered (at most
    200): every answer the same view."""
    views: dict[str, dict] = {}
    for i in range(200):
        snap, pid = _groups(router)
        views.setdefault(pid, _view(snap))
        assert _view(snap) == views[pid] == next(iter(views.values())), (pid, views)
        if len(views) == 2 and i + 1 >= at_least:
            break
    assert len(views) == 2, f"only workers {set(views)} answered /v1/groups"
    return next(iter(views.values()))


def test_memory_state_with_several_workers_is_refused_in_one_line(tmp_path) -> None:
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    argv = mixfleet_argv("router", "--preset", str(preset), "--workers", "2", "--insecure-no-auth")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workers 2 needs --state redis://" in lines[0], r.stderr
    assert "memory state cannot be shared" in lines[0]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def worker_pids(router: RouterHandle, n: int) -> set[int]:
    """The pids of ``router``'s ``n`` workers, each seen answering ``/healthz`` (within 60 s)."""
    pids: set[int] = set()
    deadline = time.monotonic() + 60
    while len(pids) < n:
        assert time.monotonic() < deadline, f"only workers {pids} answered"
        r, pid = call(router, "GET", "/healthz", key=router.key)
        if r.status_code == 200:
            pids.add(int(pid))
    return pids


def test_workers_stop_when_their_supervisor_is_killed(tmp_path) -> None:
    """A SIGKILLed ``mixfleet router --workers 2`` (the OOM killer, ``kill -9``) takes its workers
    with it: none keeps serving the port, which the next router can bind."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    with redis_server() as url, router_process(preset, state=url, extra_args=("--workers", "2")) as router:
        pids = worker_pids(router, 2)
        router.proc.kill()
        router.proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while (alive := {p for p in pids if running(p)}) or not port_is_free("127.0.0.1", router.port):
            assert time.monotonic() < deadline, f"workers {alive} outlived their supervisor"
            time.sleep(0.2)


def test_a_stalled_worker_is_not_killed_for_answering_late(tmp_path) -> None:
    """A worker that does not answer uvicorn's health ping for 8 s (stopped: a host starved of CPU,
    a long stall) is still the same process, serving, once it runs again: the supervisor does not
    SIGKILL it, and every turn it serves, after uvicorn's default 5 s."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    with redis_server() as url, router_process(preset, state=url, extra_args=("--workers", "2")) as router:
        pids = worker_pids(router, 2)
        victim = min(pids)
        os.kill(victim, signal.SIGSTOP)
        try:
            time.sleep(8)
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone: the supervisor killed it
                os.kill(victim, signal.SIGCONT)
        served: set[int] = set()
        deadline = time.monotonic() + 30
        while victim not in served:
            assert running(victim), "the supervisor killed the stalled worker"
            assert time.monotonic() < deadline, f"worker {victim} never served again; saw {served}"
            r, pid = call(router, "GET", "/healthz", key=router.key)
            served.add(int(pid))


def test_two_workers_serve_one_fleet_consistently(workers: RouterHandle, engine_url: str) -> None:
    router = workers
    # a sidecar's heartbeats, with its replica-only key, land on either worker
    hb = {
        "replica_id": "side-b",
        "group": "cpu-b",
        "url": engine_url.replace("127.0.0.1", "localhost"),
        "ready": True,
        "active_version": 0,
    }
    beats = Counter()
    while len(beats) < 2 and sum(beats.values()) < 100:
        r, pid = call(router, "POST", "/v1/replicas/heartbeat", key=REPLICA, json=hb)
        assert r.status_code == 200, r.text
        beats[pid] += 1
    assert len(beats) == 2, beats
    assert call(router, "POST", "/v1/sessions", key=REPLICA, json={})[0].status_code == 403
    assert call(router, "GET", "/v1/weights", key=REPLICA)[0].status_code == 403
    view = _agreed(router)
    assert [(g["name"], g["ready_replicas"]) for g in view["groups"]] == [("cpu-a", 1), ("cpu-b", 1)]
    assert view["groups"][1]["in_rotation"] == ["side-b"]

    # sessions placed by the policy, each taking turns on whichever worker answers
    served: list[dict[str, object]] = []
    for _ in range(12):
        r, created_by = call(router, "POST", "/v1/sessions", json={})
        assert r.status_code == 200, r.text
        sid, turns_by, outputs = r.json()["session_id"], [], []
        for i in range(3):
            body = {"input_ids": [1, 2, 3 + i], "sampling_params": SP, "turn": i}
            t, pid = call(router, "POST", f"/v1/sessions/{sid}/turns", json=body)
            assert t.status_code == 200 and t.json()["turn"] == i, t.text
            turns_by.append(pid)
            outputs.append(t.json()["output_ids"])
        f, finished_by = call(router, "POST", f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
        assert f.status_code == 200, f.text
        served.append({"sid": sid, "created": created_by, "turns": turns_by, "outputs": outputs})
    assert any(p != s["created"] for s in served for p in s["turns"]), "no session took a turn elsewhere"
    assert len({p for s in served for p in (s["created"], *s["turns"])}) == 2

    # one window: every worker reports all 12 assignments, split by capacity (equal groups)
    view = _agreed(router)
    assert {g["name"]: g["window_sessions"] for g in view["groups"]} == {"cpu-a": 6, "cpu-b": 6}
    assert {g["name"]: g["sessions_total"] for g in view["groups"]} == {"cpu-a": 6, "cpu-b": 6}
    assert [g["window_session_share"] for g in view["groups"]] == [0.5, 0.5]

    # batches: every finished trajectory handed out once, whichever worker takes or acknowledges
    want = {s["sid"]: s["outputs"] for s in served}
    taken: dict[str, list] = {}
    while len(taken) < len(want):
        b, pid = call(router, "POST", "/v1/batches/take", json={"size": 5})
        assert b.status_code == 200, b.text
        batch = b.json()
        assert batch["trajectories"], f"only {len(taken)} of {len(want)} handed out"
        for t in batch["trajectories"]:
            assert t["session_id"] not in taken, f"{t['session_id']} handed out twice"
            taken[t["session_id"]] = [turn["output_ids"] for turn in t["turns"]]
        a, pid = call(router, "POST", f"/v1/batches/{batch['lease_id']}/ack")
        assert a.status_code == 200 and a.json()["acked"] == len(batch["trajectories"]), a.text
    assert taken == want
    empty = Counter()
    while len(empty) < 2 and sum(empty.values()) < 100:  # nothing is left for either worker
        b, pid = call(router, "POST", "/v1/batches/take", json={"size": 20})
        assert b.status_code == 200 and b.json()["trajectories"] == [], b.text
        empty[pid] += 1
    assert len(empty) == 2, empty


def _wait_done(router: RouterHandle, job_id: str) -> dict:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        r, _ = call(router, "GET", f"/v1/weights/jobs/{job_id}")
        assert r.status_code == 200, r.text
        if r.json()["state"] != "running":
            return r.json()
        time.sleep(0.2)
    raise AssertionError(f"weight job {job_id} still running")


def _publish_probed_by_second_publishes(
    router: RouterHandle, body: dict, refused: Counter, running_by: Counter
) -> tuple[str, dict]:
    """Start a publish of ``body``; while it runs, read it and ask for a second publish, each on a
    new connection, counting per worker the reads that saw it running (``running_by``) and the
    second publishes refused because it runs (``refused``). A second publish that started had to
    start after the first ended; it is waited for. Returns the first's job id and its end."""
    first, _ = call(router, "POST", "/v1/weights", json=body)
    assert first.status_code == 202, first.text
    job_id = first.json()["job_id"]
    later = []
    while True:
        r, pid = call(router, "GET", f"/v1/weights/jobs/{job_id}")
        assert r.status_code == 200 and r.json()["job_id"] == job_id, r.text
        if r.json()["state"] != "running":
            break
        running_by[pid] += 1
        second, pid = call(router, "POST", "/v1/weights", json={**body, "formats": ["bf16"]})
        if second.status_code == 409:
            assert "already running" in second.json()["detail"], second.text
            assert job_id in second.json()["detail"]
            refused[pid] += 1
        else:  # only once the first had ended
            assert second.status_code == 202, second.text
            later.append(second.json())
    done = r.json()
    assert done["state"] == "done" and done["error"] is None, done
    for job in later:
        assert job["started_at"] >= done["finished_at"], (job, done)
        _wait_done(router, job["job_id"])
    return job_id, done


def test_one_publish_at_a_time_across_workers_and_every_worker_sees_its_job(
    workers: RouterHandle, tiny_bf16
) -> None:
    router = workers
    body = {"checkpoint": str(tiny_bf16), "formats": ALL_FORMATS}
    refused, running_by = Counter(), Counter()
    for _ in range(6):  # a loaded machine may give one worker every connection of a short job: again
        job_id, done = _publish_probed_by_second_publishes(router, body, refused, running_by)
        if len(refused) == 2 and len(running_by) == 2:
            break
    assert len(refused) == 2, f"a second publish was refused only by {dict(refused)}"
    views = {}
    while len(views) < 2:  # the finished job reads the same on both workers
        r, pid = call(router, "GET", f"/v1/weights/jobs/{job_id}")
        views[pid] = r.json()
    assert list(views.values())[0] == list(views.values())[1] == done
    assert len(running_by) == 2, f"the running job was read only on {dict(running_by)}"

    # the lock is free again: a new publish starts wherever it lands and both see its version
    again, _ = call(router, "POST", "/v1/weights", json={**body, "formats": ["bf16"]})
    assert again.status_code == 202, again.text
    final = _wait_done(router, again.json()["job_id"])
    assert final["state"] == "done", final
    assert _agreed(router)["latest_version"] == final["version"] == final["result"]["version"]
    listed = {}
    while len(listed) < 2:
        r, pid = call(router, "GET", "/v1/weights")
        assert r.status_code == 200, r.text
        listed[pid] = [(j["job_id"], j["state"]) for j in r.json()["jobs"]]
    a, b = listed.values()
    assert a == b and (job_id, "done") in a and (again.json()["job_id"], "done") in a, listed


def test_a_replica_deregistered_on_one_worker_leaves_both(workers: RouterHandle, engine_url: str) -> None:
    router = workers
    hb = {"replica_id": "side-gone", "group": "cpu-b", "url": engine_url, "ready": True, "active_version": 0}
    assert call(router, "POST", "/v1/replicas/heartbeat", key=REPLICA, json=hb)[0].status_code == 200
    assert "side-gone" in _agreed(router)["groups"][1]["in_rotation"]
    r, _ = call(router, "DELETE", "/v1/replicas/side-gone")
    assert r.status_code == 200 and r.json()["removed"] is True, r.text
    assert "side-gone" not in _agreed(router)["groups"][1]["in_rotation"]
    assert call(router, "DELETE", "/v1/replicas/side-gone")[0].status_code == 404


def test_replica_keys_file_format_names_the_scope(tmp_path) -> None:
    """A key file may carry the ``replica`` scope (and nothing else)."""
    from router.auth import load_keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({REPLICA: ["replica"]}))
    assert load_keys(path) == {REPLICA: frozenset({"replica"})}


@pytest.mark.slow
def test_a_job_whose_worker_dies_reads_failed_once_its_lock_lapses(workers: RouterHandle, tiny_bf16) -> None:
    """SIGKILL of the worker running a publish: the other worker reads the job running while its
    lock lasts, then failed (naming why), and publishing is open again."""
    import os
    import signal

    from router.publishing import LOCK_TTL_S, ORPHANED

    router = workers
    body = {"checkpoint": str(tiny_bf16), "formats": ALL_FORMATS}
    started, pid = call(router, "POST", "/v1/weights", json=body)
    assert started.status_code == 202, started.text
    job_id = started.json()["job_id"]
    os.kill(int(pid), signal.SIGKILL)
    killed_at = time.monotonic()
    deadline = killed_at + LOCK_TTL_S + 30
    again = None
    while True:
        r, by = call(router, "GET", f"/v1/weights/jobs/{job_id}")
        assert r.status_code == 200 and by != pid, r.text
        if r.json()["state"] != "running":
            break
        assert time.monotonic() < deadline, "the dead worker's job never stopped reading running"
        refused, _ = call(router, "POST", "/v1/weights", json={**body, "formats": ["bf16"]})
        if refused.status_code == 202:  # the lock lapsed since the read above: the job reads failed now
            again = refused
            r, _ = call(router, "GET", f"/v1/weights/jobs/{job_id}")
            break
        assert refused.status_code == 409, refused.text
        time.sleep(0.5)
    assert r.json()["state"] == "failed" and r.json()["error"] == ORPHANED, r.json()
    assert time.monotonic() - killed_at >= LOCK_TTL_S - 10  # it held until its lock lapsed
    if again is None:
        again, _ = call(router, "POST", "/v1/weights", json={**body, "formats": ["bf16"]})
    assert again.status_code == 202, again.text
    assert _wait_done(router, again.json()["job_id"])["state"] == "done"
    both_workers_answer(router)  # the killed worker's replacement serves again (the module's fixture)


def read_everywhere(router: RouterHandle, path: str, view=lambda body: body, at_least: int = 4) -> Any:
    """GET ``path`` on fresh connections until both workers answered and at least ``at_least``
    times (at most 200): every answer's ``view`` the same; returns it."""
    seen: dict[str, Any] = {}
    for i in range(200):
        r, pid = call(router, "GET", path)
        assert r.status_code == 200, (path, r.text)
        got = view(r.json())
        seen.setdefault(pid, got)
        assert got == next(iter(seen.values())), (path, pid, got, seen)
        if len(seen) == 2 and i + 1 >= at_least:
            return got
    raise AssertionError(f"only workers {set(seen)} answered {path}")


def _fleet_view(router: RouterHandle) -> dict[str, Any]:
    """What the run changes and every worker must report alike: per group sessions, tokens and
    the mismatch (totals and per version), the ledger's tokens and updates, the queue."""

    def groups(body: dict) -> dict:
        return {
            g["name"]: {
                "sessions": g["sessions_total"],
                "active": g["active_sessions"],
                "tokens": g["tokens_total"],
                "mismatch": {k: g["mismatch"][k] for k in ("tokens", "k3_kl", "versions", "earlier")},
            }
            for g in body["groups"]
        }

    def ledger(body: dict) -> dict:
        return {
            "tokens": {g["name"]: g["tokens"] for g in body["groups"]},
            "sessions": {g["name"]: g["sessions"] for g in body["groups"]},
            "updates": [(u["seq"], u["trajectories"], u["tokens"]) for u in body["updates"]],
        }

    return {
        "groups": read_everywhere(router, "/v1/groups", groups),
        "ledger": read_everywhere(router, "/v1/ledger", ledger),
        "queue": read_everywhere(router, "/v1/batches/stats"),
    }


def _one_session(router: RouterHandle, n: int, writers: Counter) -> tuple[str, list, int]:
    """Create, two turns, finish, each on any worker (counted in ``writers``), every state read
    back on both; returns the session id, its outputs and its tokens."""
    r, pid = call(router, "POST", "/v1/sessions", json={"group": "cpu-a", "metadata": {"n": n}})
    assert r.status_code == 200, r.text
    sid, outputs, tokens = r.json()["session_id"], [], 0
    writers[pid] += 1
    for i in range(2):
        body = {"input_ids": [4, 5, n + i], "sampling_params": SP, "turn": i}
        t, pid = call(router, "POST", f"/v1/sessions/{sid}/turns", json=body)
        assert t.status_code == 200, t.text
        writers[pid] += 1
        outputs.append(t.json()["output_ids"])
        tokens += len(t.json()["output_ids"])
        state = read_everywhere(router, f"/v1/sessions/{sid}")
        want = ("open", i + 1, tokens, {"n": n})
        assert (state["status"], state["turns"], state["tokens"], state["metadata"]) == want, state
    f, pid = call(router, "POST", f"/v1/sessions/{sid}/finish", json={"reward": n / 2})
    assert f.status_code == 200, f.text
    writers[pid] += 1
    state = read_everywhere(router, f"/v1/sessions/{sid}")
    assert (state["status"], state["reward"]) == ("finished", n / 2), state
    trajectory = read_everywhere(router, f"/v1/sessions/{sid}/trajectory")
    assert [t["output_ids"] for t in trajectory["turns"]] == outputs, trajectory
    return sid, outputs, tokens


def test_every_read_answers_what_the_run_wrote_whichever_worker_serves_it(workers: RouterHandle) -> None:
    """One run's requests each on a fresh connection (so either worker serves each): after every
    write, each read on both workers answers exactly what the run wrote: the session's state and
    trajectory, the queue, the groups' counts and mismatch, the ledger's tokens and updates."""
    router = workers
    base = _fleet_view(router)
    writers: Counter = Counter()
    written: dict[str, dict] = {}
    for n in range(6):
        sid, outputs, tokens = _one_session(router, n, writers)
        written[sid] = {"outputs": outputs, "tokens": tokens}
    run_tokens = sum(w["tokens"] for w in written.values())
    now = _fleet_view(router)
    a, a0 = now["groups"]["cpu-a"], base["groups"]["cpu-a"]
    assert (a["sessions"], a["active"], a["tokens"]) == (
        a0["sessions"] + 6,
        a0["active"],
        a0["tokens"] + run_tokens,
    )
    assert now["ledger"]["tokens"]["cpu-a"] == base["ledger"]["tokens"]["cpu-a"] + run_tokens
    assert now["queue"]["ready"] == base["queue"]["ready"] + 6

    b, pid = call(router, "POST", "/v1/batches/take", json={"size": 6}, headers_extra={"Accept": RECORDS})
    assert b.status_code == 200, b.text
    batch = decode_batch(b.content)
    assert {t["session_id"] for t in batch.trajectories} == set(written)
    queue = read_everywhere(router, "/v1/batches/stats")
    assert (queue["ready"], queue["pending"], queue["leases"]) == (
        base["queue"]["ready"],
        base["queue"]["pending"] + 6,
        base["queue"]["leases"] + 1,
    )
    up, pid = call(
        router,
        "POST",
        f"/v1/batches/{batch.lease_id}/trainer_logprobs",
        content=encode_trainer_logprobs(batch.logprobs),
        headers_extra={"Content-Type": LOGPROBS},
    )
    assert up.status_code == 200 and up.json()["tokens"] == run_tokens, up.text
    again, _ = call(
        router,
        "POST",
        f"/v1/batches/{batch.lease_id}/trainer_logprobs",
        content=encode_trainer_logprobs(batch.logprobs - 0.5),
        headers_extra={"Content-Type": LOGPROBS},
    )
    assert again.status_code == 409, again.text  # once per lease, whichever worker it reaches
    ack, pid = call(router, "POST", f"/v1/batches/{batch.lease_id}/ack")
    assert ack.status_code == 200 and ack.json()["acked"] == 6, ack.text

    after = _fleet_view(router)
    assert after["queue"] == base["queue"]
    a = after["groups"]["cpu-a"]
    assert a["mismatch"]["tokens"] == a0["mismatch"]["tokens"] + run_tokens and a["mismatch"]["k3_kl"] == 0.0
    updates = after["ledger"]["updates"]
    assert updates[:-1] == base["ledger"]["updates"] and updates[-1][1:] == (6, run_tokens), updates
    for sid in written:
        assert read_everywhere(router, f"/v1/sessions/{sid}")["status"] == "consumed"
    assert len(writers) == 2, f"every write went to one worker: {dict(writers)}"


def test_every_worker_raises_its_soft_open_file_limit(tmp_path) -> None:
    """Started under a soft open-file limit of 256, each of ``--workers 2`` runs with it raised
    (:func:`core.process.raise_open_file_limit`, ``/proc/PID/limits``)."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    with (
        redis_server() as url,
        router_process(
            preset, state=url, extra_args=("--workers", "2"), preexec_fn=soft_open_files(256)
        ) as router,
    ):
        limits = {pid: open_files_limit(pid)[0] for pid in worker_pids(router, 2)}
    assert set(limits.values()) == {open_files_wanted(resource.getrlimit(resource.RLIMIT_NOFILE)[1])}, limits

"""Weight sync on a real local fleet: a router and, per group (bf16, fp8, nvfp4), one ``tiny``
engine process behind its sidecar, all real processes over HTTP, on one LocalStore.

The tests run in order on one fleet; each starts from "every replica serves the latest version"
and leaves the fleet there. Covered: the replica front (blocked control routes, 409 version
constraints), CLI publish/status through the router, a turn across an activation (two spans,
tokens tagged), in-flight requests during activation, fixed-prefix scoring (``/v1/score``),
``mixfleet weights verify``, and the faults: a corrupted shard, an engine refusing a wrong
architecture (routed around past ``max_version_lag``), a sidecar killed mid-stage and restarted.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mixfleet.init_model import PRESETS
from replica.sidecar import parse_prometheus
from tests.support.fleet import LOCAL_GROUPS, LocalFleet, local_fleet
from tests.support.procs import REPO, interruptible, mixfleet_argv
from tests.support.router import ALL_SCOPES, RouterHandle, router_process, write_preset
from weight_sync.convert import convert_checkpoint
from weight_sync.types import VersionRef

RUN = "run"
MAX_LAG = 1
HELLO = [72, 101, 108, 108, 111]  # greedy decoding of tiny from here runs >1500 tokens without EOS
N = 300


@dataclass
class Live:
    router: RouterHandle
    fleet: LocalFleet
    env: dict[str, str]

    @property
    def h(self) -> dict[str, str]:
        return self.router.headers

    def get(self, path: str) -> dict:
        r = httpx.get(self.router.url + path, headers=self.h, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, path: str, body: dict, status: int = 200) -> dict:
        r = httpx.post(self.router.url + path, headers=self.h, json=body, timeout=120)
        assert r.status_code == status, r.text
        return r.json()

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            mixfleet_argv("weights", *args),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
        )

    def wait_job(self, job: dict, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while job["state"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
            job = self.get(f"/v1/weights/jobs/{job['job_id']}")
        assert job["state"] == "done", job
        return job

    def publish(self, ckpt: Path, version: int, formats: list[str] | None = None) -> dict:
        body = {"checkpoint": str(ckpt), "version": version, "formats": formats}
        return self.wait_job(self.post("/v1/weights", body, status=202))

    def group(self, name: str) -> dict:
        return next(g for g in self.get("/v1/groups")["groups"] if g["name"] == name)

    def wait_router(self, pred, what: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            snap = self.get("/v1/groups")
            if pred(snap):
                return snap
            assert time.monotonic() < deadline, f"router never showed {what}: {json.dumps(snap)[:2000]}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_base):
    work = tmp_path_factory.mktemp("wsl-fleet")
    key = secrets.token_hex(16)
    preset = write_preset(
        work / "preset.toml",
        [
            {"name": g, "weight_format": f, "sessions_per_replica": 8, "min_replicas": 1}
            for g, f in LOCAL_GROUPS
        ],
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MIXFLEET_STORE", str(work / "store"))  # the router's weight routes use this store
        mp.setenv("MIXFLEET_RUN", RUN)
        mp.setenv("MIXFLEET_PUBLISH_WORKERS", "0")  # tiny model: convert in the router process
        with router_process(
            preset,
            keys={key: ALL_SCOPES},
            log=work / "router.log",
            extra_args=("--max-version-lag", str(MAX_LAG), "--heartbeat-timeout", "5"),
        ) as router:
            env = {"MIXFLEET_API_KEY": key, "MIXFLEET_URL": router.url}
            # Every sidecar activates by SGLang's protocol (replica.activation): retract, update with
            # a cache flush, continue.
            with local_fleet(work, tiny_base, run_id=RUN, router_url=router.url, env=env) as fleet:
                live = Live(router, fleet, env)
                live.wait_router(
                    lambda s: all(g["ready_replicas"] == 1 and g["active_version"] == 1 for g in s["groups"]),
                    "every group ready at version 1",
                )
                yield live


def _precommit(fleet: LocalFleet, version: int, ckpt: Path, formats: list[str] | None = None) -> None:
    """Convert and commit ``version`` for ``formats`` without moving any pointer."""
    for f in formats or fleet.formats:
        staged = fleet.store.staging_dir(VersionRef(RUN, f, version))
        convert_checkpoint(ckpt, staged, f, workers=1)
        fleet.store.commit(VersionRef(RUN, f, version), staged)


def _corrupt(fleet: LocalFleet, version: int, fmt: str) -> Path:
    """Flip one byte in the middle of ``fmt``'s committed shard of ``version``; its path."""
    shard = fleet.store.version_dir(VersionRef(RUN, fmt, version)) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def _advance(live: Live, version: int, formats: list[str] | None = None) -> None:
    for f in formats or live.fleet.formats:
        live.fleet.store.advance(VersionRef(RUN, f, version))
    status = live.get("/v1/weights")  # the router adopts the store's latest version
    assert status["max_version_lag"] == MAX_LAG  # what mixfleet validate states as allowed staleness


def _engine_metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)


def _engine_version(url: str) -> int:
    return int(httpx.get(url + "/model_info", timeout=10).json()["weight_version"])


def _start_turn_and_pause(live: Live, engine_url: str) -> tuple[str, threading.Thread | None, dict]:
    """Start a greedy turn of ``N`` tokens in a new cpu-bf16 session and, once the engine has
    generated 20 of them, pause the engine in place, holding the turn mid-generation (the
    sidecar's retract then takes it out of the running batch, the update swaps the weights while
    the engine is paused, and the turn is recomputed and resumes on the new version). The thread
    is None (the engine running again, the session deleted) when the turn finished before the
    pause landed: the engine's generated-token counter, which a paused engine leaves still, then
    already counts all ``N`` tokens."""
    sid = live.post("/v1/sessions", {"group": "cpu-bf16"})["session_id"]
    before = _engine_metrics(engine_url).get("sglang:generation_tokens_total", 0.0)
    result: dict = {}

    def turn() -> None:
        result["turn"] = live.post(
            f"/v1/sessions/{sid}/turns",
            {"input_ids": HELLO, "sampling_params": {"temperature": 0.0, "max_new_tokens": N}},
        )

    t = threading.Thread(target=turn)
    t.start()
    deadline = time.monotonic() + 60
    while _engine_metrics(engine_url).get("sglang:generation_tokens_total", 0.0) < before + 20:
        assert time.monotonic() < deadline and t.is_alive(), "the turn never got going"
        time.sleep(0.05)
    httpx.post(engine_url + "/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
    if _engine_metrics(engine_url).get("sglang:generation_tokens_total", 0.0) < before + N:
        return sid, t, result
    httpx.post(engine_url + "/continue_generation", json={}, timeout=10).raise_for_status()
    t.join(timeout=60)
    httpx.delete(live.router.url + f"/v1/sessions/{sid}", headers=live.h, timeout=10).raise_for_status()
    return sid, None, result


def _spans_ok(spans: list[dict], n: int) -> None:
    assert spans[0]["start"] == 0 and spans[-1]["end"] == n, spans
    for a, b in zip(spans, spans[1:], strict=False):
        assert a["end"] == b["start"] and a["version"] < b["version"], spans


# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_replica_front_blocks_control_routes_and_enforces_versions(live: Live) -> None:
    v = live.fleet.latest()
    for r in live.fleet.replicas:
        for path in (
            "/update_weights_from_disk",
            "/pause_generation",
            "/continue_generation",
            "/flush_cache",
            "/abort_request",
            "/release_memory_occupation",
        ):
            resp = httpx.post(r.url + path, json={"model_path": "/tmp"}, timeout=10)
            assert resp.status_code == 403, (path, resp.text)
            assert "control route" in resp.json()["error"]["message"]
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        ahead = httpx.post(r.url + "/generate", json={**body, "min_version": v + 1}, timeout=30)
        assert ahead.status_code == 409
        info = ahead.json()
        assert info["retryable"] is True and info["target_version"] == v + 1 and info["applied_version"] == v
        ahead_h = httpx.post(
            r.url + "/generate", json=body, headers={"X-Mixfleet-Min-Version": str(v + 1)}, timeout=30
        )
        assert ahead_h.status_code == 409 and ahead_h.json()["constraint"] == "min_version"
        wrong = httpx.post(r.url + "/generate", json={**body, "exact_version": v - 1}, timeout=30)
        assert wrong.status_code == 409 and wrong.json()["constraint"] == "exact_version"
        ok = httpx.post(r.url + "/generate", json={**body, "exact_version": v, "min_version": v}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["meta_info"]["weight_version"] == str(v)
        for path in ("/model_info", "/server_info", "/health"):
            assert httpx.get(r.url + path, timeout=10).status_code == 200
        metrics = httpx.get(r.url + "/metrics", timeout=10).text
        assert "mixfleet_replica_active_version" in metrics and "sglang:" not in metrics
        assert "sglang:num_running_reqs" in httpx.get(r.url + "/engine/metrics", timeout=10).text
        assert parse_prometheus(metrics)["mixfleet_replica_active_version"] == v


@pytest.mark.timeout(240)
def test_cli_publish_status_through_router(live: Live, tiny_seed2: Path) -> None:
    v = live.fleet.next_version()
    out = live.cli("publish", "--version", str(v), "--per-format", str(tiny_seed2))
    assert out.returncode == 0, out.stderr + live.fleet.logs()
    n = len(live.fleet.replicas)
    assert f"every live replica ({n}) serves version {v}\n" in out.stdout, out.stdout
    for r in live.fleet.replicas:
        assert _engine_version(r.engine_url) == v
    st = live.cli("status", "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["latest_version"] == v
    for g in status["groups"]:
        assert g["desired_version"] == v and g["lag"] == 0, g
        (rep,) = g["replicas"]
        assert rep["active_version"] == v and rep["last_activation"]["version"] == v
        assert rep["last_activation_at"] > 0 and rep["error"] is None
        assert status["formats"][g["format"]]["manifest"]["version"] == v
    snap = live.wait_router(lambda s: all(g["active_version"] == v for g in s["groups"]), f"v{v} everywhere")
    assert snap["latest_version"] == v and all(g["version_lag"] == 0 for g in snap["groups"])
    # The router refuses a publish it cannot do, naming the problem.
    r = httpx.post(
        live.router.url + "/v1/weights", headers=live.h, json={"checkpoint": "/no/such/dir", "version": v + 1}
    )
    assert r.status_code == 400 and "does not exist" in r.json()["detail"]
    r = httpx.post(live.router.url + "/v1/weights", json={"checkpoint": str(tiny_seed2)})
    assert r.status_code == 401
    r = httpx.post(
        live.router.url + "/v1/weights", headers=live.h, json={"checkpoint": str(tiny_seed2), "version": 1}
    )
    assert r.status_code == 409 and "never move backwards" in r.json()["detail"]
    r = httpx.post(
        live.router.url + "/v1/weights", headers=live.h, json={"checkpoint": "x", "formats": ["int3"]}
    )
    assert r.status_code == 422 and "formats" in r.json()["detail"]
    assert httpx.get(live.router.url + "/v1/weights/jobs/nope", headers=live.h).status_code == 404


def _interruptible_cli(live: Live, *args: str) -> subprocess.Popen:
    """``mixfleet *args`` against the live router, its output piped (text, unbuffered), started so
    that a SIGINT interrupts it (:func:`tests.support.procs.interruptible`)."""
    return subprocess.Popen(
        mixfleet_argv(*args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **live.env, "PYTHONUNBUFFERED": "1"},
        preexec_fn=interruptible,
    )


@pytest.mark.timeout(240)
def test_cli_publish_interrupted_says_what_the_router_goes_on_with(live: Live, tiny_seed2: Path) -> None:
    """Ctrl-C while `mixfleet weights publish` waits (the router stopped meanwhile, so the wait
    cannot end by itself): exit 130 and one line naming the version the router goes on with and
    how to follow it (it exited without a word before, the publish going on unseen); the version
    is then published all the same."""
    import signal

    v = live.fleet.next_version()
    proc = _interruptible_cli(live, "weights", "publish", "--version", str(v), str(tiny_seed2))
    stopped = False
    try:
        assert proc.stderr.readline().startswith("  converted "), "no conversion event"  # it waits
        live.router.proc.send_signal(signal.SIGSTOP)
        stopped = True
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if stopped:
            live.router.proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("mixfleet weights: interrupted: "), stderr
    assert f"(version {v})" in last or f"version {v} is published" in last, last
    assert "`mixfleet weights status` shows what each group serves" in last, last
    live.fleet.wait_active(v)


@pytest.mark.timeout(240)
def test_cli_publish_of_some_formats_waits_for_their_groups_only(live: Live, tiny_seed2: Path) -> None:
    """``publish --formats bf16`` moves the bf16 pointer only: the CLI waits for the bf16 group
    and says the others were not published for (it waited for them until --timeout before)."""
    v = live.fleet.next_version()
    out = live.cli("publish", "--version", str(v), "--formats", "bf16", "--timeout", "60", str(tiny_seed2))
    assert out.returncode == 0, out.stderr + live.fleet.logs()
    others = sorted(r.group for r in live.fleet.replicas if r.group != "cpu-bf16")
    want = f"every live replica (1) serves version {v}; not published for (their format is not in this "
    assert f"{want}version): {', '.join(others)}\n" in out.stdout, out.stdout
    # the same version for the other formats completes it: every group serves it
    out = live.cli("publish", "--version", str(v), str(tiny_seed2))
    assert out.returncode == 0, out.stderr + live.fleet.logs()
    assert f"every live replica ({len(live.fleet.replicas)}) serves version {v}\n" in out.stdout, out.stdout


@pytest.mark.timeout(240)
def test_turn_across_an_activation_has_two_spans(live: Live, tiny_base: Path) -> None:
    fleet = live.fleet
    v1 = fleet.next_version()
    _precommit(fleet, v1, tiny_base)
    _advance(live, v1)
    fleet.wait_active(v1)
    v2 = v1 + 1
    _precommit(fleet, v2, tiny_base)  # same weights: the greedy continuation stays EOS-free
    live.wait_router(lambda s: all(g["active_version"] == v1 for g in s["groups"]), f"v{v1}")
    bf16 = fleet.replica("cpu-bf16")
    for _attempt in range(5):
        sid, t, result = _start_turn_and_pause(live, bf16.engine_url)
        if t is not None:
            break
    else:
        pytest.fail("five turns in a row finished before the engine could be paused")
    try:
        _advance(live, v2)
        fleet.wait_active(v2, replicas=[bf16])
    finally:
        httpx.post(bf16.engine_url + "/continue_generation", json={}, timeout=10).raise_for_status()
    t.join(timeout=180)
    turn_out = result["turn"]
    n = len(turn_out["output_ids"])
    assert n == N, turn_out["finish_reason"]
    spans = turn_out["weight_versions"]
    assert [s["version"] for s in spans] == [v1, v2], spans
    _spans_ok(spans, n)
    cut = spans[0]["end"]
    assert 0 < cut < n
    assert [rec["weight_version"] for rec in turn_out["records"]] == [v1] * cut + [v2] * (n - cut)
    # The stored trajectory says the same, and the trainer's batch reports the version age.
    traj = live.get(f"/v1/sessions/{sid}/trajectory")
    assert traj["turns"][0]["weight_versions"] == spans
    live.post(f"/v1/sessions/{sid}/finish", {"reward": 1.0})
    batch = live.post("/v1/batches/take", {"size": 64, "wait_s": 5})
    mine = [tr for tr in batch["trajectories"] if tr["session_id"] == sid]
    assert mine, batch
    latest = live.get("/v1/groups")["latest_version"]
    assert mine[0]["version_age"]["min"] == latest - v2 and mine[0]["version_age"]["max"] == latest - v1
    live.post(f"/v1/batches/{batch['lease_id']}/ack", {})
    fleet.wait_active(v2)


@pytest.mark.timeout(240)
def test_inflight_requests_complete_during_activation(live: Live, tiny_seed2: Path) -> None:
    fleet = live.fleet
    v = fleet.next_version()
    _precommit(fleet, v, tiny_seed2)
    per_replica, new_tokens = 6, 500  # long enough that an activation lands mid-request
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}

    def one(r) -> tuple[str, httpx.Response]:
        return r.group, httpx.post(r.url + "/generate", json=body, timeout=300)

    with ThreadPoolExecutor(max_workers=len(fleet.replicas) * per_replica) as pool:
        futures = [pool.submit(one, r) for r in fleet.replicas for _ in range(per_replica)]
        # Each replica's requests have started (seen running at least once: on a loaded machine one
        # replica can finish its six before the slowest starts, so never all at one moment).
        deadline, started = time.monotonic() + 120, set()
        while len(started) < len(fleet.replicas):
            for r in fleet.replicas:
                m = _engine_metrics(r.engine_url)
                if m.get("sglang:generation_tokens_total", 0) > 0 and m.get("sglang:num_running_reqs", 0):
                    started.add(r.group)
            assert time.monotonic() < deadline, f"requests never started on every replica: {started}"
            time.sleep(0.05)
        # Heartbeats carry the engines' load to the router.
        live.wait_router(
            lambda snap: any(rep["running"] >= 1 for g in snap["groups"] for rep in g["replicas"]),
            "a replica reporting running requests",
            timeout=10,
        )
        _advance(live, v)
        answers = [f.result() for f in futures]
    crossed: dict[str, int] = {}
    for group, resp in answers:
        assert resp.status_code == 200, (group, resp.text)
        meta = resp.json()["meta_info"]
        assert meta["completion_tokens"] == new_tokens and meta["finish_reason"]["type"] == "length"
        _spans_ok(meta["weight_versions"], new_tokens)
        crossed[group] = crossed.get(group, 0) + (len(meta["weight_versions"]) > 1)
    fleet.wait_active(v)
    # Every replica ran the one protocol: retract -> update (flush) -> continue.
    for r in fleet.replicas:
        act = fleet.status(r)["last_activation"]
        assert act["version"] == v, act
        assert act["pause_s"] > 0 and act["update_s"] > 0, (r.group, act)
    # The swap happened mid-request somewhere: how far each group's requests got before its own
    # sidecar activated is a race (a group whose requests all finished first proves nothing).
    assert sum(crossed.values()) >= 1, crossed


def _greedy(url: str, ids: list[int], n: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
        "return_logprob": True,
    }
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _turn_loop(live: Live, group: str, n: int, stop: threading.Event, out: list, errors: list) -> None:
    """Long greedy turns of one session of ``group``, one after another, until ``stop``."""
    try:
        sid = live.post("/v1/sessions", {"group": group})["session_id"]
        while not stop.is_set():
            params = {"temperature": 0.0, "max_new_tokens": n}
            out.append(
                (
                    group,
                    live.post(f"/v1/sessions/{sid}/turns", {"input_ids": HELLO, "sampling_params": params}),
                )
            )
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


def _check_turn_exact(turn: dict, old: int, new: int, ref_old: dict, new_url: str, lps: bool) -> bool:
    """Every token of ``turn`` is what its span's version computes: the old version's greedy
    continuation of HELLO before the cut, the new version's continuation of the prefix after it;
    with ``lps``, the raw log-probs too (the engines of the quantized groups are not
    batch-invariant: the same token scores up to ~0.05 apart alone and in a busy batch, so their
    log-probs are not compared). Returns whether the turn crossed the activation."""
    out, spans, n = turn["output_ids"], turn["weight_versions"], len(turn["output_ids"])
    _spans_ok(spans, n)
    assert [s["version"] for s in spans] in ([old], [new], [old, new]), spans
    k = spans[0]["end"] if spans[0]["version"] == old else 0
    assert [rec["weight_version"] for rec in turn["records"]] == [old] * k + [new] * (n - k)
    raw = [rec["raw_logprob"] for rec in turn["records"]]
    assert out[:k] == ref_old["output_ids"][:k], spans
    if lps:
        assert raw[:k] == pytest.approx(_logprobs(ref_old)[:k], abs=1e-3)
    if k < n:
        tail = _greedy(new_url, HELLO + out[:k], n - k)  # prefill of the prefix, then decode
        assert out[k:] == tail["output_ids"][: n - k], spans  # a turn may end early at EOS
        if lps:
            assert raw[k:] == pytest.approx(_logprobs(tail)[: n - k], abs=1e-3)
    return 0 < k < n


def _logprobs(answer: dict) -> list[float]:
    return [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


@pytest.mark.timeout(480)
def test_publish_under_sustained_load_activates_everywhere_with_exact_spans(
    live: Live, tiny_base: Path, tiny_seed2: Path
) -> None:
    """SGLang's activation under continuous long turns on every group: the publish activates on
    every replica, every turn completes, and each turn that crossed the activation has exact
    spans (every token is what the version its span names computes)."""
    fleet = live.fleet
    old = fleet.next_version()
    _precommit(fleet, old, tiny_base)
    _advance(live, old)
    fleet.wait_active(old)
    crossed: dict[str, int] = {}
    # Whether the pause lands mid-turn on a replica is a matter of timing: publish again (up to eight
    # times, alternating checkpoints) until every group has had a turn cross an activation. A publish
    # from tiny_seed2 is the weaker chance: its greedy turns from HELLO end at EOS after 19-27
    # tokens, so a pause more often falls between two of them (on a loaded machine one group missed
    # it in five publishes).
    for ckpt in (tiny_seed2, tiny_base) * 4:
        for group, n in _publish_under_load(live, old, old + 1, ckpt).items():
            crossed[group] = crossed.get(group, 0) + n
        old += 1
        if all(crossed.get(r.group) for r in fleet.replicas):
            break
    assert all(crossed.get(r.group) for r in fleet.replicas), crossed


def _publish_under_load(live: Live, old: int, new: int, ckpt: Path) -> dict[str, int]:
    """Publish ``new`` (``ckpt``) while every group serves continuous long greedy turns at ``old``;
    check every turn (complete, exact spans) and the activation; how many turns crossed, per group."""
    fleet = live.fleet
    lengths = (120, 157, 191)  # loops of one group out of step: one is mid-turn whenever the pause lands
    _precommit(fleet, new, ckpt)
    refs = {r.group: _greedy(r.engine_url, HELLO, max(lengths)) for r in fleet.replicas}
    stop, turns, errors = threading.Event(), [], []
    threads = [
        threading.Thread(target=_turn_loop, args=(live, r.group, n, stop, turns, errors))
        for r in fleet.replicas
        for n in lengths
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while {g for g, _ in turns} != {r.group for r in fleet.replicas}:  # every group busy
            assert not errors and time.monotonic() < deadline, (errors, len(turns))
            time.sleep(0.05)
        _advance(live, new)
        fleet.wait_active(new, timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=240)
    assert not errors, errors
    crossed: dict[str, int] = {}
    for group, turn in turns:
        finish = turn["finish_reason"]
        assert (finish["type"] if isinstance(finish, dict) else finish) in ("length", "stop"), finish
        url = fleet.replica(group).engine_url
        try:
            exact = _check_turn_exact(turn, old, new, refs[group], url, lps=group == "cpu-bf16")
            crossed[group] = crossed.get(group, 0) + exact
        except AssertionError as exc:
            raise AssertionError(f"{group}: {exc}") from None
    for r in fleet.replicas:
        act = fleet.status(r)["last_activation"]
        assert act["version"] == new and act["pause_s"] > 0, act
    return crossed


@pytest.mark.timeout(120)
def test_score_answers_every_replica_with_its_version_and_refuses_bad_input(live: Live) -> None:
    v = live.fleet.latest()
    seqs = [HELLO, HELLO + [32, 119]]
    results = live.post("/v1/score", {"input_ids": seqs, "logprob_start_len": 2})["results"]
    assert sorted(r["group"] for r in results) == sorted(g for g, _ in LOCAL_GROUPS), results
    formats = dict(LOCAL_GROUPS)
    for r in results:
        assert r["format"] == formats[r["group"]] and r["weight_version"] == v, r
        assert [len(lp) for lp in r["logprobs"]] == [len(s) - 2 for s in seqs], r
        assert all(x is not None and x <= 0 for lp in r["logprobs"] for x in lp), r
        # the shared prefix scores alike in both sequences
        assert r["logprobs"][1][: len(HELLO) - 2] == pytest.approx(r["logprobs"][0], abs=1e-4), r
    one = LOCAL_GROUPS[0][0]
    only = live.post("/v1/score", {"input_ids": [HELLO], "groups": [one]})["results"]
    assert [r["group"] for r in only] == [one], only

    def refused(body: dict, status: int, needle: str) -> None:
        r = httpx.post(live.router.url + "/v1/score", headers=live.h, json=body, timeout=60)
        assert r.status_code == status and needle in r.json()["detail"], r.text

    refused({"input_ids": [HELLO], "groups": ["nope"]}, 400, "nope")
    refused({"input_ids": [HELLO], "logprob_start_len": len(HELLO)}, 400, "input_ids[0]")
    refused({"input_ids": [HELLO, [1, -3]]}, 422, "input_ids: Value error, [1][1] = -3 is not a token id")
    refused({"input_ids": [HELLO, [1, True]]}, 422, "[1][1] = true is not a token id")
    refused({"input_ids": [[1, 10**9]]}, 400, "replica")  # the engines refuse an id past the vocabulary
    r = httpx.post(live.router.url + "/v1/score", json={"input_ids": [HELLO]}, timeout=30)
    assert r.status_code == 401, r.text


@pytest.mark.timeout(300)
def test_verify_proves_every_group_activated(live: Live) -> None:
    before = live.fleet.latest()
    out = live.cli("verify", "--json")
    assert out.returncode == 0, out.stdout + out.stderr + live.fleet.logs()
    report = json.loads(out.stdout)
    assert report["ok"] and not report["failures"], report
    assert report["perturbed"] == before + 1 and report["rolled_back"] == before + 2
    assert sorted(report["groups"]) == sorted(g for g, _ in LOCAL_GROUPS)
    for row in report["groups"].values():
        assert row["rise_expected"] > 0.5  # the swap moves the chosen token's log-prob a lot
        assert abs(row["rise_observed"] - row["rise_expected"]) <= row["tolerance"]
    live.fleet.wait_active(before + 2)


@pytest.mark.timeout(300)
def test_verify_fails_a_group_it_could_not_check(live: Live) -> None:
    """A group whose only replica is down (sidecar killed, past the heartbeat timeout) is not
    scored, so verify cannot say it activated: it fails naming it (it said OK before)."""
    fleet = live.fleet
    r = fleet.replica("cpu-fp8")
    fleet.kill_sidecar(r)
    try:
        live.wait_router(
            lambda s: all(g["ready_replicas"] == 0 for g in s["groups"] if g["name"] == "cpu-fp8"), "fp8 down"
        )
        out = live.cli("verify", "--json", "--timeout", "120")
        assert out.returncode == 1, out.stdout + out.stderr + fleet.logs()
        report = json.loads(out.stdout)
        assert report["failures"] == ["cpu-fp8: not verified: no live replica answered the baseline scores"]
        assert sorted(report["groups"]) == ["cpu-bf16", "cpu-nvfp4"], report
    finally:
        fleet.start_sidecar(r)
    fleet.wait_active(fleet.latest())


def _content(live: Live, fmt: str = "bf16") -> dict:
    """The files (digests) of the version ``fmt``'s pointer names: what its replicas load."""
    from weight_sync.manifest import Manifest
    from weight_sync.types import FormatRef

    store, run = live.fleet.store, live.fleet.run_id
    ref = VersionRef(run, fmt, store.read_pointer(FormatRef(run, fmt)))
    return Manifest.read(Path(store.version_dir(ref))).files


@pytest.mark.timeout(300)
def test_verify_interrupted_after_its_perturbation_rolls_it_back(live: Live) -> None:
    """Ctrl-C during `mixfleet weights verify` once its perturbation is accepted: it publishes the
    rollback before it exits (130), saying so; before, the fleet was left serving the
    perturbation (two rows of lm_head swapped) without a word."""
    import signal

    before, content = live.fleet.latest(), _content(live)
    proc = _interruptible_cli(live, "weights", "verify")
    try:
        for line in proc.stdout:
            if line.startswith("baseline at"):  # printed as the perturbation is sent
                break
        deadline = time.monotonic() + 120
        while live.fleet.latest() == before:  # Ctrl-C once the perturbation is published
            assert time.monotonic() < deadline and proc.poll() is None, "the perturbation was never published"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert live.fleet.latest() == before + 2 and _content(live) == content, stderr
    assert "Traceback" not in stderr, stderr
    # "stopped after publishing v{before + 1}, ...: rolling back" comes first unless the Ctrl-C
    # came after verify had sent its own rollback
    assert f"verify: rolled back as v{before + 2} (v{before}'s content)" in stderr, stderr
    live.fleet.wait_active(before + 2)


@pytest.mark.timeout(240)
def test_corrupt_shard_keeps_old_version_and_a_republish_recovers(live: Live, tiny_base: Path) -> None:
    fleet = live.fleet
    old = fleet.latest()
    v = old + 1
    _precommit(fleet, v, tiny_base)
    shard = _corrupt(fleet, v, "fp8")
    _advance(live, v)
    fleet.wait_active(v, replicas=[fleet.replica("cpu-bf16"), fleet.replica("cpu-nvfp4")])
    fp8 = fleet.replica("cpu-fp8")
    deadline = time.monotonic() + 30
    while True:
        st = fleet.status(fp8)
        if st["failures"] >= 2:  # failed, backed off, retried, failed again
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
    assert st["active_version"] == old and st["ready"]
    assert "checksum" in st["error"] and str(shard) in st["error"], st["error"]
    assert _engine_version(fp8.engine_url) == old
    ok = httpx.post(
        fp8.url + "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["meta_info"]["weight_version"] == str(old)
    live.wait_router(
        lambda s: (
            "checksum"
            in (next(g for g in s["groups"] if g["name"] == "cpu-fp8")["replicas"][0]["error"] or "")
        ),
        "the fp8 replica's error",
    )
    # A republish (a new number, same weights) recovers.
    live.publish(tiny_base, v + 1)
    fleet.wait_active(v + 1)
    assert fleet.status(fp8)["error"] is None


@pytest.mark.timeout(300)
def test_a_replica_that_cannot_activate_is_routed_around_past_max_lag(
    live: Live, tiny_base: Path, tiny_other_arch: Path
) -> None:
    """A checkpoint the engines could not load into the served model is refused by the publish
    job, nothing moves; a version one replica cannot stage (a corrupt shard) keeps it serving the
    old one, in rotation while within the allowed lag and routed around past it."""
    fleet = live.fleet
    old = fleet.latest()
    job = live.post("/v1/weights", {"checkpoint": str(tiny_other_arch), "version": old + 1}, status=202)
    deadline = time.monotonic() + 60
    while job["state"] == "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
        job = live.get(f"/v1/weights/jobs/{job['job_id']}")
    assert job["state"] == "failed" and "does not fit run" in job["error"], job
    assert f"tensor 'model.layers.{PRESETS['tiny'].num_hidden_layers - 1}." in job["error"], job
    assert live.get("/v1/groups")["latest_version"] == old and fleet.latest() == old
    fp8 = fleet.replica("cpu-fp8")
    for step in (1, 2):
        v = old + step
        _precommit(fleet, v, tiny_base)
        _corrupt(fleet, v, "fp8")
        _advance(live, v)
        fleet.wait_active(v, replicas=[fleet.replica("cpu-bf16"), fleet.replica("cpu-nvfp4")])
        deadline = time.monotonic() + 30
        while fleet.status(fp8)["error_version"] != v:
            assert time.monotonic() < deadline, fleet.status(fp8)
            time.sleep(0.1)
        st = fleet.status(fp8)
        assert st["active_version"] == old and "checksum" in st["error"], st
        assert _engine_version(fp8.engine_url) == old
        snap = live.wait_router(lambda s, v=v: s["latest_version"] == v, f"latest {v}")
        g = next(x for x in snap["groups"] if x["name"] == "cpu-fp8")
        rotation = g["replicas"][0]["in_rotation"]
        assert rotation == (step <= MAX_LAG), g  # lag 1: still serving; lag 2: routed around
    assert live.group("cpu-fp8")["ready_replicas"] == 0
    sessions = [live.post("/v1/sessions", {}) for _ in range(9)]
    assert all(s["group"] != "cpu-fp8" for s in sessions), sessions
    for s in sessions:
        httpx.delete(live.router.url + f"/v1/sessions/{s['session_id']}", headers=live.h, timeout=10)
    # A good version for every format brings the replica back into rotation.
    v = old + 3
    live.publish(tiny_base, v)
    fleet.wait_active(v)
    live.wait_router(
        lambda s: all(g["ready_replicas"] == 1 and g["version_lag"] == 0 for g in s["groups"]),
        "every group back in rotation",
    )


@pytest.mark.timeout(240)
def test_pending_versions_coalesce_into_the_newest(live: Live, tiny_base: Path, tiny_seed2: Path) -> None:
    """While a replica stages v, versions v+1 and v+2 are published: it abandons v, skips
    v+1, and activates only v+2."""
    fleet = live.fleet
    r = fleet.replica("cpu-bf16")
    old = fleet.latest()
    fleet.kill_sidecar(r)
    fleet.start_sidecar(r, "--stage-rate-mb", "1")  # ~3.5 s to stage the tiny bf16 model
    fleet.wait_active(old, replicas=[r])
    _precommit(fleet, old + 1, tiny_seed2, ["bf16"])
    _precommit(fleet, old + 2, tiny_base, ["bf16"])
    _precommit(fleet, old + 3, tiny_seed2)
    _advance(live, old + 1, ["bf16"])
    deadline = time.monotonic() + 30
    while (fleet.status(r).get("staging") or {}).get("version") != old + 1:
        assert time.monotonic() < deadline, fleet.status(r)
        time.sleep(0.02)
    _advance(live, old + 2, ["bf16"])
    _advance(live, old + 3)
    fleet.wait_active(old + 3)
    assert [a["version"] for a in fleet.status(r)["activations"]] == [old + 3]
    fleet.kill_sidecar(r)
    fleet.start_sidecar(r)
    fleet.wait_active(old + 3, replicas=[r])


@pytest.mark.timeout(240)
def test_sidecar_killed_mid_stage_converges_after_restart(live: Live, tiny_seed2: Path) -> None:
    """A version is published while the replica's sidecar is down; the restarted sidecar joins
    at the pointer's version (not ready until then), is killed mid-stage, and the next restart
    converges."""
    fleet = live.fleet
    r = fleet.replica("cpu-nvfp4")
    old = fleet.latest()
    v = old + 1
    fleet.kill_sidecar(r)
    _precommit(fleet, v, tiny_seed2)
    _advance(live, v)
    fleet.start_sidecar(r, "--stage-rate-mb", "0.15")  # slow staging, so the kill lands mid-copy
    deadline = time.monotonic() + 60
    while not ((fleet.status(r).get("staging") or {}).get("bytes_done") or 0) > 0:
        assert time.monotonic() < deadline, fleet.status(r)
        time.sleep(0.05)
    health = httpx.get(r.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["active_version"] == old, health.text
    gen = httpx.post(r.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    assert gen.status_code == 503 and gen.json()["retryable"] is True
    fleet.kill_sidecar(r)
    assert list(r.staging_dir.glob("*.partial")), list(r.staging_dir.iterdir())
    assert _engine_version(r.engine_url) == old  # the engine kept serving the old version
    fleet.start_sidecar(r)
    fleet.wait_active(v, replicas=[r])
    assert _engine_version(r.engine_url) == v
    assert httpx.get(r.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30  # the old copy is removed just after the activation
    while sorted(p.name for p in r.staging_dir.iterdir()) != [f"v{v:06d}"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.name for p in r.staging_dir.iterdir()) == [f"v{v:06d}"]
    fleet.wait_active(v)

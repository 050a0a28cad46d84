"""``mixfleet up`` end to end: a fresh data dir becomes a serving fleet whose banner commands work
when pasted, a published version reaches every group, Ctrl-C stops every process it started; a
killed engine is restarted while sessions fail over without losing a token; SIGTERM during
start-up stops everything; and when ``up`` itself is killed, its processes exit too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from core.process import open_files_wanted
from core.tcp import port_is_free
from tests.support.procs import (
    descendants,
    free_port,
    kill_group,
    mixfleet_argv,
    open_files_limit,
    soft_open_files,
    worker_ports,
)
from tests.support.router import write_preset


def _wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if m := re.search(pattern, text, re.M):
            return m
        if proc.poll() is not None:
            raise AssertionError(f"mixfleet up exited with {proc.returncode}:\n{text}")
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout}s:\n{text}")


def _alive(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def _clean_env() -> dict[str, str]:
    """This environment without MIXFLEET_* and without the venv on PATH (as after the README's
    install, which does not activate it)."""
    venv_bin = os.path.dirname(os.path.abspath(sys.executable))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    return env


@contextmanager
def _up(
    tmp_path: Path, *extra: str, preexec_fn: Callable[[], None] | None = None
) -> Iterator[tuple[subprocess.Popen, Path, int]]:
    """``mixfleet up`` (tiny base policy) on a free port, its data dir ``tmp_path/data``; yields
    (process, its output file ``tmp_path/up.log``, port)."""
    port, out = free_port(), tmp_path / "up.log"
    argv = mixfleet_argv(
        "up", "--model-preset", "tiny", "--port", str(port), "--data-dir", str(tmp_path / "data")
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [*argv, *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_clean_env(),
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    try:
        yield proc, out, port
    finally:
        kill_group(proc)


def _started(out: Path) -> dict[str, int]:
    """Each process ``up`` reported starting: name -> pid (the latest start of each name)."""
    text = out.read_text(errors="replace")
    return {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) .*?\(pid (\d+),", text)}


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reaped by whoever adopts it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.1)


def _pasteable(banner: str) -> list[str]:
    """The shell lines the banner offers between "Try" and "OpenAPI"."""
    block = banner.split("Try (in another shell):\n", 1)[1].split("\nOpenAPI:", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_up_serves_publishes_and_stops_cleanly(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with _up(tmp_path) as (proc, out, port):
        _wait_for_line(out, r"^mixfleet is up: (http://\S+)", proc, timeout=300)
        key = _wait_for_line(out, r"^  (mf-\S+)$", proc, timeout=5).group(1)
        assert (data / "api_key").read_text().strip() == key
        banner = _wait_for_line(out, r"^Ctrl-C stops everything\.$", proc, timeout=5).string
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(url + "/v1/groups").status_code == 401

        # The banner's commands, pasted into a shell elsewhere (no MIXFLEET_*, no venv on PATH).
        set_key, curl, publish = _pasteable(banner)
        shell = tmp_path / "elsewhere"
        shell.mkdir()

        def paste(*lines: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                ["bash", "-c", "set -e\n" + "\n".join(lines)],
                cwd=shell,
                env=_clean_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )

        got = paste(set_key, curl)
        assert got.returncode == 0, got.stderr
        groups = json.loads(got.stdout)["groups"]
        assert {g["name"]: g["active_version"] for g in groups} == {
            "cpu-bf16": 0, "cpu-fp8": 0, "cpu-nvfp4": 0,
        }  # fmt: skip
        sid = httpx.post(url + "/v1/sessions", json={}, headers=auth).json()["session_id"]
        turn = httpx.post(
            url + f"/v1/sessions/{sid}/turns",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "top_p": 0.9}},
            headers=auth,
            timeout=60,
        ).json()
        n = len(turn["output_ids"])  # 5, or fewer when the sampled text ended (EOS)
        assert n == len(turn["records"]) and 1 <= n <= 5, turn
        assert n == 5 or turn["finish_reason"]["type"] == "stop", turn["finish_reason"]
        assert all(r["weight_version"] == 0 for r in turn["records"])
        vocab = json.loads((data / "base" / "config.json").read_text())["vocab_size"]
        refused = httpx.post(  # the router's own refusal, before any engine (SGLang checks none)
            url + f"/v1/sessions/{sid}/turns", json={"input_ids": [1, vocab]}, headers=auth, timeout=60
        )
        assert refused.status_code == 422 and refused.json() == {
            "detail": f"input_ids[1] = {vocab} is outside the vocabulary (size {vocab})"
        }, refused.text

        # The README's promise: with `up` running, the banner's publish just works, and pasted
        # again it takes the next version (no --version to collide on).
        assert "--version" not in publish
        for expected in (1, 2):
            pub = paste(set_key, publish + " --json")
            assert pub.returncode == 0, pub.stderr
            assert json.loads(pub.stdout)["result"]["version"] == expected
            groups = httpx.get(url + "/v1/groups", headers=auth).json()["groups"]
            assert all(g["active_version"] == expected for g in groups)
        replica_ports = [int(r["url"].rsplit(":", 1)[1]) for g in groups for r in g["replicas"]]

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in out.read_text()
        assert not _alive(port) and not any(_alive(p) for p in replica_ports)


HARNESS = Path(__file__).parent.parent / "docs" / "chat.md"


@pytest.mark.slow
def test_up_serves_the_chat_apis_to_the_openai_client(tmp_path: Path) -> None:
    """docs/chat.md's agent harness, pasted into a shell in the directory ``up`` runs in: a two-turn
    conversation through the official ``openai`` client (the base URL from ``POST /v1/sessions``,
    the key from ``.mixfleet/api_key``), the second turn extending the first token for token."""
    text = HARNESS.read_text()
    snippet = text.split("<!-- harness-snippet -->\n```python\n", 1)[1].split("```", 1)[0]
    with _up(tmp_path, "--data-dir", str(tmp_path / ".mixfleet")) as (proc, out, port):
        _wait_for_line(out, r"^Ctrl-C stops everything\.$", proc, timeout=300)
        env = {**_clean_env(), "MIXFLEET_ROUTER_URL": f"http://127.0.0.1:{port}"}
        argv = [sys.executable, "-c", snippet]
        run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        kinds = [line.split(" ", 1)[0] for line in lines]
        assert kinds == ["session:", "turn:", "turn:", "recorded:", "recorded:"], lines
        key = (tmp_path / ".mixfleet" / "api_key").read_text().strip()
        auth = {"Authorization": f"Bearer {key}"}
        url = f"http://127.0.0.1:{port}/v1/sessions/{lines[0].split()[1]}/trajectory"
        first, second = httpx.get(url, headers=auth).json()["turns"]
        assert 1 <= len(first["output_ids"]) <= 16 and len(first["records"]) == len(first["output_ids"])
        # append-only: the second turn extends the first (no fork), after its input and its sampled ids
        assert first["context"] == 0 and first["fork"] is None and second["fork"] is None
        assert second["context"] == len(first["append_ids"]) + len(first["output_ids"])


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            mixfleet_argv("up", "--port", str(port), "--data-dir", str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 2
    assert f"port {port}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.timeout(300)
def test_a_second_up_of_the_same_data_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    """`mixfleet up` run again on the same --data-dir (another port): one line naming the running
    one, exit 2, before it writes anything; without the refusal it started a second fleet on the
    same base, store, staging directories, key file and logs. The first keeps serving, and once
    it is stopped the data dir is free again."""
    with _up(tmp_path) as (first, out, _port):
        _wait_for_line(out, r"started router \(pid", first, timeout=240)
        second_port = free_port()
        second = subprocess.Popen(
            mixfleet_argv(
                "up",
                "--model-preset",
                "tiny",
                "--port",
                str(second_port),
                "--data-dir",
                str(tmp_path / "data"),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_clean_env(),
            start_new_session=True,
        )
        try:
            stdout, stderr = second.communicate(timeout=60)
        finally:
            kill_group(second)
        assert second.returncode == 2, stdout + stderr
        assert stdout == "" and "Traceback" not in stderr
        (line,) = stderr.strip().splitlines()
        assert f"is in use by another mixfleet up (pid {first.pid}, router http://127.0.0.1:{_port})" in line
        assert first.poll() is None
        assert port_is_free("127.0.0.1", second_port)
    import socket

    with socket.socket() as held:  # the lock went with the first (SIGKILLed): now the port stops it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run(
            mixfleet_argv("up", "--port", str(port), "--data-dir", str(tmp_path / "data")),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 2 and f"port {port} " in r.stderr, r.stderr


def test_up_refuses_a_bad_state_or_data_dir_in_one_line_before_preparing_anything(tmp_path: Path) -> None:
    """`--state foo` wrote the base policy and version 0, started the router and only then said
    "router exited with 2; see <log>"; a --data-dir that is a file was a Python traceback. Both are
    one line naming the flag now, exit 2, nothing written."""
    (tmp_path / "file").write_text("not a directory\n")
    cases = [
        (["--state", "foo", "--data-dir", str(tmp_path / "d")], "--state must be 'memory' or a redis:// URL"),
        (["--data-dir", str(tmp_path / "file")], f"--data-dir {tmp_path / 'file'}: File exists"),
        (
            ["--replica-ports", "20100-20104", "--data-dir", str(tmp_path / "e")],
            "--replica-ports 20100-20104 holds 5 ports; its 3 local replicas need 6",
        ),
    ]
    for args, message in cases:
        r = subprocess.run(
            mixfleet_argv("up", "--model-preset", "tiny", "--port", str(free_port()), *args),
            capture_output=True,
            text=True,
            env=_clean_env(),
            timeout=120,
        )
        assert r.returncode == 2, r.stdout + r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert message in line and r.stdout == "", r.stdout + r.stderr
    assert not (tmp_path / "d").exists()


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid``'s process listens on (``/proc/PID/net/tcp`` lists its network
    namespace's sockets; those whose inodes are among its open files are its own)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
def test_two_fleets_of_other_data_dirs_and_ports_run_side_by_side(tmp_path: Path) -> None:
    """Two ``up`` at once, each under a soft open-file limit of 256: both serve, every engine and
    sidecar on a port of its own ``--replica-ports`` (the banner names the range and the sidecars),
    and ``up`` and every process it started run with the raised limit."""
    preset = write_preset(tmp_path / "one.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    block = worker_ports()
    ranges = (
        range(block.stop - 20, block.stop - 10),
        range(block.stop - 10, block.stop),
    )  # free_port: its start
    with contextlib.ExitStack() as stack:
        fleets = [
            stack.enter_context(
                _up(tmp_path / name, "--preset", str(preset), "--replica-ports", f"{r.start}-{r.stop - 1}",
                    preexec_fn=soft_open_files(256))
            )
            for name, r in zip("ab", ranges, strict=True)
        ]  # fmt: skip
        raised = open_files_wanted(open_files_limit(os.getpid())[1])
        for (proc, out, port), ports in zip(fleets, ranges, strict=True):
            banner = _wait_for_line(out, r"^Ctrl-C stops everything\.$", proc, timeout=300).string
            assert f"--replica-ports {ports.start}-{ports.stop - 1}" in banner
            key = (tmp_path / out.parent.name / "data" / "api_key").read_text().strip()
            groups = httpx.get(
                f"http://127.0.0.1:{port}/v1/groups", headers={"Authorization": f"Bearer {key}"}
            ).json()["groups"]
            (sidecar_url,) = [r["url"] for g in groups for r in g["replicas"]]
            assert f"local engine, sidecar {sidecar_url}" in banner
            started = _started(out)
            engine, sidecar = started["engine-cpu-bf16-0"], started["sidecar-cpu-bf16-0"]
            assert _listening_ports(sidecar) == {int(sidecar_url.rsplit(":", 1)[1])}
            replica_ports = _listening_ports(engine) | _listening_ports(sidecar)
            assert len(replica_ports) == 2 and replica_ports <= set(ports), (replica_ports, ports)
            for pid in (proc.pid, *descendants(proc.pid)):
                assert open_files_limit(pid)[0] == raised, (pid, Path(f"/proc/{pid}/cmdline").read_bytes())


def test_free_ports_are_never_handed_out_twice() -> None:
    # The kernel hands out a port it just returned again soon enough (birthday odds over ~28k
    # ephemeral ports are ~99% for 500 draws); two engines would then be told to share it.
    from core.tcp import free_port as fleet_free_port

    ports = [fleet_free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_free_ports_of_a_range_skip_listening_ones_and_run_out_with_a_clear_error() -> None:
    import socket

    from core.tcp import free_port as fleet_free_port
    from core.tcp import release_port

    # The top of this process's block of test ports: free_port() hands out a block from its start
    # (the kernel's choice, port 0, could be one the test above had from free_port()), and no
    # other test process or port 0 takes a port of this block once it is closed.
    with socket.socket() as held:
        for taken in reversed(worker_ports()):
            try:
                held.bind(("127.0.0.1", taken))
                break
            except OSError:
                continue
        else:
            pytest.fail(f"no port of {worker_ports()} could be bound")
        held.listen()
        block = range(taken, taken + 1)
        with pytest.raises(OSError, match=f"in {taken}-{taken}"):
            fleet_free_port("127.0.0.1", block)
    assert fleet_free_port("127.0.0.1", block) == taken  # closed now
    with pytest.raises(OSError, match="handed out already"):
        fleet_free_port("127.0.0.1", block)
    release_port("127.0.0.1", taken)  # its process exited: the next engine may take it
    assert fleet_free_port("127.0.0.1", block) == taken


@pytest.mark.timeout(120)
def test_up_refuses_an_engine_port_answered_by_another_process(tmp_path: Path) -> None:
    from launcher.children import Child, ChildFailed, Probe
    from tests.support.engines import engine_argv
    from tests.support.models import make_model_dir
    from tests.support.procs import process, wait_http

    model = make_model_dir(tmp_path, "tiny", "bf16")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with process(engine_argv(model, port), log=tmp_path / "engine.log") as engine, Probe() as probe:
        wait_http(url + "/health", timeout=120, proc=engine)
        probe.check_own_engine(url, Child("engine-a", tmp_path / "engine.log", engine))
        refused = pytest.raises(ChildFailed, match=f"served by process {engine.pid}, not by this engine")
        with process(["sleep", "60"]) as other, refused:  # as if this one had failed to bind the port
            probe.check_own_engine(url, Child("engine-b", tmp_path / "b.log", other))


def _agent(
    url: str,
    auth: dict[str, str],
    n: int,
    turns_each: int,
    served: dict[str, list[dict]],
    errors: list[str],
    first_bf16: threading.Event,
) -> None:
    """Session ``n``: ``turns_each`` turns (a 503 retried for up to 120 s: no group could serve,
    nothing was recorded), each turn kept in ``served``, then finished; a failed turn goes to
    ``errors`` and ends the session; ``first_bf16`` is set once cpu-bf16 served a turn."""
    with httpx.Client(base_url=url, headers=auth, timeout=120) as http:
        sid = http.post("/v1/sessions", json={"metadata": {"n": n}}).json()["session_id"]
        served[sid] = []
        context = [1, 2 + n, 3]
        for t in range(turns_each):
            body = {
                "input_ids": context,
                "sampling_params": {"max_new_tokens": 12, "top_p": 0.9},
                "turn": t,
            }
            deadline = time.monotonic() + 120
            while (r := http.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 503:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)  # no group could serve right now: the turn was not recorded
            if r.status_code != 200:
                errors.append(f"session {n} turn {t}: {r.status_code} {r.text}")
                return
            turn = r.json()
            served[sid].append(turn)
            if turn["group"] == "cpu-bf16":
                first_bf16.set()
            context = [*context, *turn["output_ids"], 4]
        assert http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200


def _take_all(url: str, auth: dict[str, str], sessions: int) -> dict[str, dict]:
    """Take and acknowledge batches until ``sessions`` trajectories came (or 60 s passed), by session
    id; no trajectory comes twice."""
    taken: dict[str, dict] = {}
    deadline = time.monotonic() + 60
    while len(taken) < sessions and time.monotonic() < deadline:
        batch = httpx.post(
            url + "/v1/batches/take", json={"size": sessions, "wait_s": 2}, headers=auth
        ).json()
        for traj in batch["trajectories"]:
            assert traj["session_id"] not in taken
            taken[traj["session_id"]] = traj
        if batch["lease_id"] is not None:
            ack = httpx.post(url + f"/v1/batches/{batch['lease_id']}/ack", headers=auth).json()
            assert ack["acked"] == len(batch["trajectories"])
    return taken


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_engine_is_restarted_while_sessions_fail_over_and_a_killed_up_takes_its_children(
    tmp_path: Path,
) -> None:
    sessions, turns_each = 6, 5
    with _up(tmp_path) as (proc, out, port):
        _wait_for_line(out, r"^Ctrl-C stops everything\.$", proc, timeout=300)
        key = (tmp_path / "data" / "api_key").read_text().strip()
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
        served: dict[str, list[dict]] = {}
        errors: list[str] = []
        first_bf16 = threading.Event()

        agents = [
            threading.Thread(target=_agent, args=(url, auth, n, turns_each, served, errors, first_bf16))
            for n in range(sessions)
        ]
        for a in agents:
            a.start()
        assert first_bf16.wait(120), "no turn was served by cpu-bf16"
        os.kill(_started(out)["engine-cpu-bf16-0"], signal.SIGKILL)
        for a in agents:
            a.join(timeout=300)
        assert not errors, errors
        assert proc.poll() is None, "mixfleet up stopped"

        # Every token once: each turn's records match its output ids, turn indices are contiguous.
        assert len(served) == sessions and all(len(ts) == turns_each for ts in served.values())
        for ts in served.values():
            assert [t["turn"] for t in ts] == list(range(turns_each))
            for t in ts:
                assert [rec["token_id"] for rec in t["records"]] == t["output_ids"] and t["output_ids"]
        assert any(t["moved_from"] == "cpu-bf16" for ts in served.values() for t in ts), "no failover seen"

        # Every trajectory reaches the trainer, exactly as the agents saw it.
        taken = _take_all(url, auth, sessions)
        assert set(taken) == set(served)
        for sid, traj in taken.items():
            assert [(t["turn"], t["output_ids"]) for t in traj["turns"]] == [
                (t["turn"], t["output_ids"]) for t in served[sid]
            ]

        # The group is back in rotation, and its new sidecar counts the restart.
        _wait_for_line(out, r"replica cpu-bf16-0 is serving again \(restarts: 1\)", proc, timeout=180)

        def bf16_ready() -> bool:
            groups = httpx.get(url + "/v1/groups", headers=auth).json()["groups"]
            return next(g for g in groups if g["name"] == "cpu-bf16")["ready_replicas"] >= 1

        _wait_until(bf16_ready, 60, "cpu-bf16 not back in rotation")
        groups = httpx.get(url + "/v1/groups", headers=auth).json()["groups"]
        replica_urls = [r["url"] for g in groups for r in g["replicas"]]
        bf16_url = next(r["url"] for g in groups if g["name"] == "cpu-bf16" for r in g["replicas"])
        metrics = httpx.get(bf16_url + "/metrics").text
        assert 'mixfleet_replica_restarts_total{group="cpu-bf16",replica="cpu-bf16-0"} 1.0' in metrics

        # SIGKILL of `mixfleet up` itself: its processes exit and free their ports.
        children = set(descendants(proc.pid))
        assert set(_started(out).values()) <= children
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        _wait_until(lambda: all(_gone(p) for p in children), 10, f"children of up still running: {children}")
        ports = [port, *(int(u.rsplit(":", 1)[1]) for u in replica_urls)]
        assert all(port_is_free("127.0.0.1", p) for p in ports), ports


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("moment", "line"),
    [("converting", r"converting the base policy to bf16"), ("engines", r"started engine-cpu-nvfp4-0 ")],
)
def test_sigterm_during_start_up_stops_everything(tmp_path: Path, moment: str, line: str) -> None:
    with _up(tmp_path) as (proc, out, _port):
        _wait_for_line(out, line, proc, timeout=240)
        below = set(descendants(proc.pid))  # conversion workers, or the router and engines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # "within a few seconds": work in progress is killed
        text = out.read_text()
        assert "mixfleet is up" not in text and "stopped" in text, text
        started = _started(out)
        if moment == "engines":
            assert {"router", "engine-cpu-bf16-0", "engine-cpu-fp8-0", "engine-cpu-nvfp4-0"} <= set(started)
        assert below and set(started.values()) <= below
        _wait_until(lambda: all(_gone(p) for p in below), 5, f"processes of up still running: {below}")


def test_up_passes_keep_store_versions_and_the_base_vocabulary_to_its_router(tmp_path: Path) -> None:
    """``mixfleet up --keep-store-versions N`` starts its router with the same flag (it prunes
    there, at every weight job), and with the base's vocabulary size; a negative N is one line and
    exit 2 before anything starts."""
    from types import SimpleNamespace

    from launcher.embedded import UpSettings, _start_router

    spawned = []

    class Launcher:
        def spawn(self, name, argv, log, env):
            spawned.append(argv)
            return SimpleNamespace(pid=1, log=log)

    class Probe:
        def wait_http(self, url, child, deadline):
            return None

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text('{"vocab_size": 300}')
    plan = SimpleNamespace(data=tmp_path, keys={}, admin_key=None, logs=tmp_path)
    for keep, flags in ((0, []), (3, ["--keep-store-versions", "3"])):
        spawned.clear()
        settings = UpSettings(preset="local", keep_store_versions=keep)
        _start_router(Launcher(), Probe(), settings, "http://127.0.0.1:1", plan)
        argv = spawned[0]
        got = argv[argv.index("--keep-store-versions") :][:2] if "--keep-store-versions" in argv else []
        assert got == flags, argv
        assert argv[argv.index("--vocab-size") + 1] == "300", argv  # the base's (its config.json)
    r = subprocess.run(
        mixfleet_argv("up", "--keep-store-versions", "-1", "--data-dir", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr == (
        "mixfleet up: error: --keep-store-versions must be >= 0 (0: never prune), got -1\n"
    ), r.stderr

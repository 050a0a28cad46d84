"""The processes :mod:`launcher.children` starts, as ``ps`` and ``/proc`` see them: a launcher
started under a low soft open-file limit raises its own before it starts a process, and the
process (here one that is not ``mixfleet``, as SGLang is not) runs with the raised limit; the
guard a started ``mixfleet`` process forks into its group is named ``mixfleet-guard``."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

from core.process import open_files_wanted
from launcher.children import spawn, stop
from tests.support.procs import (
    REPO,
    free_port,
    open_files_limit,
    process,
    soft_open_files,
    wait_for_text,
    wait_started,
)

LOW = 256

LAUNCHER = """
import sys, time
from pathlib import Path
from launcher.children import spawn
child = spawn("sleeper", ["60"], Path(sys.argv[1]), program=("sleep",))
print(f"started {child.pid}", flush=True)
time.sleep(60)
"""


def test_a_launcher_under_a_low_soft_limit_raises_its_own_and_its_childrens(tmp_path: Path) -> None:
    raised = open_files_wanted(resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    assert raised > LOW, "the hard open-file limit here is too low for this test"
    out = tmp_path / "launcher.out"
    argv = [sys.executable, "-c", LAUNCHER, str(tmp_path / "sleeper.log")]
    with process(argv, log=out, cwd=REPO, preexec_fn=soft_open_files(LOW)) as launcher:
        child_pid = int(wait_for_text(out, "started ").split("started ", 1)[1].split()[0])
        assert open_files_limit(launcher.pid)[0] == raised
        assert open_files_limit(child_pid)[0] == raised


def _group_children(pid: int) -> dict[int, str]:
    """The children of ``pid`` in its process group: pid -> name (``/proc/PID/comm``)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and int(fields[2]) == pid:
                found[int(entry.name)] = (entry / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):  # exited while listed
            continue
    return found


def test_the_guard_of_a_started_process_is_named(tmp_path: Path) -> None:
    port = free_port()
    argv = [
        "sidecar", "--engine", f"http://127.0.0.1:{free_port()}", "--group", "cpu-a", "--format", "bf16",
        "--store", str(tmp_path), "--run", "run", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    child = spawn("sidecar", argv, tmp_path / "sidecar.log")
    try:
        wait_started("sidecar", f"http://127.0.0.1:{port}", "/v1/status", child.proc, child.log, 60)
        deadline = time.monotonic() + 10
        while not (names := _group_children(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(names.values()) == ["mixfleet-guard"], names
    finally:
        stop([child])

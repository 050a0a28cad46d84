"""Real processes for tests: free loopback ports, child processes that are always reaped,
and a private redis-server.

Every process started here is killed (its whole process group) when the context exits,
so a failing test never leaves an engine or a redis-server behind.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from core import tcp
from launcher import children

REPO = Path(__file__).resolve().parents[2]


#: The ports tests hand to the servers they start: below the kernel's ephemeral range (32768-60999 by
#: default), split into one block per pytest-xdist worker (:func:`worker_ports`). No two workers, and
#: no process's port 0 or outgoing connection, can take a port a test handed to a server that is
#: still starting (a server that failed to bind would leave its test talking to another's server).
#: Suites run side by side on one machine take disjoint ranges: ``MIXFLEET_TEST_PORTS=20000-26000``.
TEST_PORTS = range(10_000, 32_000)


def port_range() -> range:
    """:data:`TEST_PORTS`, or the ``MIXFLEET_TEST_PORTS`` range ("FIRST-LAST", inclusive) when set."""
    spec = os.environ.get("MIXFLEET_TEST_PORTS")
    if not spec:
        return TEST_PORTS
    first, _, last = spec.partition("-")
    return range(int(first), int(last) + 1)


def worker_ports() -> range:
    """This test process's block of :func:`port_range`: worker ``gwN`` of ``PYTEST_XDIST_WORKER_COUNT``
    takes the N-th of that many equal blocks; one process (no workers) takes them all."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    ports = port_range()
    size = len(ports) // count
    if size < 150:
        raise RuntimeError(f"{count} workers leave {size} test ports each (at least 150 wanted); use fewer")
    return range(ports.start + index * size, ports.start + (index + 1) * size)


def free_port() -> int:
    """A TCP port on 127.0.0.1 of this process's block (:func:`worker_ports`) that was free a
    moment ago, never handed out twice by this process (two engines started back to back could
    otherwise be given the same one)."""
    return tcp.free_port("127.0.0.1", worker_ports())


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # exited while listed
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Block until ``GET url`` answers 200, the process dies, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s (last: {last!r})")


def wait_started(name: str, url: str, health: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """:func:`wait_http` on ``url + health`` for a process started with ``log``; a failed start
    raises RuntimeError naming ``name`` and ``url`` and carrying the tail of the log."""
    try:
        wait_http(url + health, timeout=timeout, proc=proc)
    except (RuntimeError, TimeoutError) as exc:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        raise RuntimeError(f"{name} on {url} did not start: {exc}\n--- {name} log ---\n{tail}") from None


def mixfleet_argv(*args: str) -> list[str]:
    """argv that runs the ``mixfleet`` CLI from this checkout with the current interpreter."""
    return [*children.mixfleet_command(), *args]


@contextlib.contextmanager
def process(
    argv: list[str],
    *,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[subprocess.Popen]:
    """Start ``argv`` in its own process group (``preexec_fn`` runs in the child before it
    executes ``argv``, e.g. :func:`soft_open_files`); kill the group on exit."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        argv,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=cwd or REPO,
        env=full_env,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    try:
        yield proc
    finally:
        kill_group(proc)
        if log:
            out.close()


def soft_open_files(soft: int, hard: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` that starts the child with a soft open-file limit of ``soft`` (and a hard
    one of ``hard``; default: unchanged), as on a host whose default soft limit is low."""

    def lower() -> None:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (soft, hard or resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    return lower


def wait_for_text(path: Path, text: str, timeout: float = 30.0) -> str:
    """The text of the file at ``path`` once it contains ``text``; AssertionError with its tail
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = path.read_text(errors="replace")
        if text in body:
            return body
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}:\n{path.read_text(errors='replace')[-3000:]}")


def interruptible() -> None:
    """A ``preexec_fn`` for a child a test interrupts with SIGINT (Ctrl-C): SIGINT back to its
    default. Python turns SIGINT into KeyboardInterrupt only when it is not ignored at start, and a
    non-interactive shell starts its background jobs with SIGINT ignored (POSIX), which children
    inherit: a test suite run as one (a CI runner's ``bash .ci/run &``) would send a signal the
    child ignores."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def open_files_limit(pid: int) -> tuple[int, int]:
    """The soft and hard open-file limits of process ``pid`` (``/proc/PID/limits``)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise RuntimeError(f"no open-file limit in /proc/{pid}/limits")


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process's whole group and reap it; a no-op if it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def redis_process(
    port: int, data_dir: Path, *, appendonly: bool = False, log: Path | None = None
) -> Iterator[subprocess.Popen]:
    """redis-server on loopback ``port`` keeping its files in ``data_dir``; yields the process once
    it answers ``PING`` (after loading its append-only file, when it has one). With ``appendonly``
    it fsyncs the file before answering each write (``--appendfsync always``): a write it accepted
    survives a restart, even on a loaded machine."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--dir", str(data_dir)]  # fmt: skip
    if appendonly:  # every accepted write is on disk before its reply: a restart loses none of them
        argv += ["--appendfsync", "always"]
    with process(argv, log=log) as proc:
        import redis

        client = redis.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)
        client.close()
        yield proc


@contextlib.contextmanager
def redis_server(
    *, appendonly: bool = False, port: int | None = None, data_dir: Path | None = None
) -> Iterator[str]:
    """A private redis-server on a free loopback port; yields its ``redis://`` URL."""
    port = port or free_port()
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="redis-")))
        stack.enter_context(redis_process(port, data_dir, appendonly=appendonly))
        yield f"redis://127.0.0.1:{port}/0"

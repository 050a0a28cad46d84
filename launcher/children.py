"""Start and supervise the fleet's own processes on this machine: the router, and per replica an
engine behind its sidecar (what ``mixfleet up`` runs, and the test fleet).

Every process is a ``mixfleet`` subcommand run by this interpreter (:func:`mixfleet_command`), in
its own session (a terminal's Ctrl-C reaches only the supervisor, which stops the rest), with
stdout and stderr appended to its log file. On Linux each one is sent SIGKILL when the thread
that started it ends, and the processes it starts in turn (a router's conversion workers) are
killed with it (:func:`guard_group`), so a supervisor that is killed itself (SIGKILL, the OOM
killer) leaves no process behind; elsewhere its children outlive it.

A :class:`Replica` is an engine on a fresh loopback port at every start, behind a sidecar on a
fixed port (the URL the router knows it by): free ports of the launcher's ``ports`` range when it
has one, else free ports the kernel chooses; either way two launchers on one machine never share
one (a port in use is skipped). A :class:`Supervisor` brings replicas up and keeps
them serving: while ``strict`` (start-up), a process that exits or is not ready in time raises
:class:`ChildFailed`; afterwards an engine that exits is started again on the store's current
version together with a new sidecar, a sidecar that exits is started again alone, each after a
backoff that doubles per consecutive failure. A replica that has been ready is asked every
``check_interval_s`` whether its processes answer -- the engine's ``/health`` and the sidecar's
``/v1/status`` (its own state: it asks the engine nothing), each 200 within the probe's timeout
-- and one that has not answered for ``unresponsive_s`` (hung, stopped) is killed (SIGKILL to its
process group) and restarted the same way: an engine with a new sidecar, a sidecar alone. A
weight activation never looks like that: the local engine answers ``/health`` from its event
loop while it is paused and loads the new weights on a thread (``engine/server/routes_info.py``,
``engine/server/routes_weights.py``), and the sidecar's status route answers while it activates.
Every restart is reported through ``on_event`` and counted in the replica's ``restarts``, which
each new sidecar exports as ``mixfleet_replica_restarts_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import UserError
from core.process import raise_open_file_limit
from core.tcp import free_port, release_port
from weight_sync.types import VersionRef

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
GUARD_NAME = b"mixfleet-guard"
"""The guard's process name (``/proc/PID/comm``, what ``ps -e``, ``top`` and ``pgrep`` show; at most
15 bytes): the rest of its command line is its parent's, whose fork it is."""
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
GUARD_ENV = "MIXFLEET_GUARD_GROUP"
_guard_fds: list[int] = []


class ChildFailed(UserError):
    """A started process exited or did not become ready; carries the child."""

    def __init__(self, child: Child, what: str) -> None:
        super().__init__(f"{child.name} {what}; see {child.log}")
        self.child = child
        self.what = what


def mixfleet_command() -> list[str]:
    """The argv prefix that runs the ``mixfleet`` command with this interpreter."""
    return [sys.executable, "-m", "mixfleet"]


def guard_group() -> None:
    """Make this process's group die with it, when :func:`spawn` started it (``GUARD_ENV`` set,
    removed here so its own children do not inherit it) and it leads its own process group.

    Call first thing, before any thread, socket or child exists: it forks a sentinel into the
    group that ignores SIGINT and SIGTERM and blocks on a pipe whose only writer is this process;
    once this process has exited, however it ended, the sentinel SIGKILLs the whole group (every
    process started from here that did not leave it) and so itself. The sentinel is named
    :data:`GUARD_NAME` (Linux). Processes started with
    ``exec`` do not hold the pipe (its end is close-on-exec); a plain ``fork`` child would keep
    the sentinel waiting until it exits too.
    """
    if os.environ.pop(GUARD_ENV, None) != "1" or not hasattr(os, "fork") or os.getpgrp() != os.getpid():
        return
    r, w = os.pipe()
    if os.fork() == 0:
        try:
            os.close(w)
            if _LIBC is not None:
                _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(GUARD_NAME), 0, 0, 0)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while os.read(r, 1):
                pass
            os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(r)
    _guard_fds.append(w)


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have this process sent ``sig`` when the thread of ``parent_pid`` that started it ends (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing is asked); exit at once (status 1) when its parent is
    already another process (``parent_pid`` died before the request)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _die_with(parent_pid: int) -> Callable[[], None]:
    return lambda: die_with_parent(parent_pid)


@dataclass
class Child:
    """One started process: its name, log file and handle."""

    name: str
    log: Path
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        """None while it runs, else its exit status (negative: killed by that signal)."""
        return self.proc.poll()


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    env: dict[str, str] | None = None,
    *,
    program: Sequence[str] | None = None,
) -> Child:
    """Start ``mixfleet *argv`` (see the module docstring), or ``program *argv`` when given (an
    engine that is not a ``mixfleet`` command: SGLang); ``env`` is added to this process's.

    This process raises its soft open-file limit first
    (:func:`core.process.raise_open_file_limit`), so it and every process it starts, whatever
    program that runs, run with the raised limit."""
    raise_open_file_limit()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*(mixfleet_command() if program is None else program), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), GUARD_ENV: "1"},
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()),
        )
    return Child(name, log, proc)


def _signal_group(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


def kill(child: Child) -> None:
    """SIGKILL the child's process group and reap it."""
    _signal_group(child, signal.SIGKILL)
    child.proc.wait()


def stop(children: Iterable[Child], grace_s: float = 3.0) -> None:
    """Stop every child at once: SIGTERM to each process group, SIGKILL to every group after
    ``grace_s`` (also the group's other processes when its leader has exited). After: every
    child is reaped."""
    children = list(children)
    for child in children:
        if child.returncode() is None:
            _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        kill(child)


class Probe:
    """Blocking HTTP checks on the fleet's processes, over one private event loop and aiohttp
    pool. Close it (or use it as a context manager) when done."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        from clients.engine import make_http_client

        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()

        async def open_pool() -> Any:
            return make_http_client(connect_timeout_s=timeout_s, timeout_s=timeout_s, max_connections=32)

        self._http = self._loop.run_until_complete(open_pool())

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(self._http.close())
        self._loop.close()

    def healthy(self, url: str) -> bool:
        """Whether ``GET url/health`` (an engine's or a sidecar's) answers 200."""
        from clients.engine import SGLangClient

        return self._loop.run_until_complete(SGLangClient(self._http, url).health(self.timeout_s))

    def engine_pid(self, url: str) -> int | None:
        """The ``pid`` the engine at ``url`` names in its ``/server_info``."""
        from clients.engine import SGLangClient

        info = self._loop.run_until_complete(SGLangClient(self._http, url).server_info(self.timeout_s))
        pid = info.get("pid")
        return pid if isinstance(pid, int) else None

    def get_json(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """``GET url``: (status, decoded JSON or None); (0, None) when nothing answered."""
        return self._loop.run_until_complete(self._get(url, headers))

    def answering(self, urls: Sequence[str]) -> list[bool]:
        """Whether each ``GET url`` answers 200 within the timeout, all asked at once (the call
        takes at most one timeout however many do not answer)."""

        async def ask() -> list[tuple[int, Any]]:
            return await asyncio.gather(*(self._get(url) for url in urls))

        return [status == 200 for status, _body in self._loop.run_until_complete(ask())]

    async def _get(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        import aiohttp

        from core.jsonio import loads

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._http.get(url, headers=headers or {}, timeout=timeout) as r:
                body = await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return 0, None
        try:
            return r.status, loads(body) if body else None
        except ValueError:
            return r.status, None

    def check_own_engine(self, url: str, child: Child) -> None:
        """The engine answering at ``url`` must be ``child`` itself, not another process that holds
        the port (``child`` would then have failed to bind it and its group would be served by
        someone else's engine); raises :class:`ChildFailed` otherwise."""
        from clients.engine import EngineError

        try:
            pid = self.engine_pid(url)
        except EngineError as exc:
            raise ChildFailed(child, f"answers no /server_info at {url}: {exc}") from None
        if pid != child.pid:
            raise ChildFailed(child, f"is not what serves {url}: {url} is served by process {pid}, "
                              f"not by this engine (pid {child.pid})")  # fmt: skip

    def wait_http(
        self, url: str, child: Child, deadline: float, headers: dict[str, str] | None = None
    ) -> None:
        """Block until ``GET url`` answers 200; raises :class:`ChildFailed` if ``child`` exits
        first or ``deadline`` (monotonic) passes."""
        while True:
            code = child.returncode()
            if code is not None:
                raise ChildFailed(child, f"exited with {code}")
            if self.get_json(url, headers)[0] == 200:
                return
            if time.monotonic() > deadline:
                raise ChildFailed(child, f"did not answer {url} in time")
            time.sleep(0.2)


def engine_argv(
    model: Path,
    port: int,
    version: int,
    *,
    threads: int = 1,
    kv_cache_dtype: str = "auto",
    flags: Sequence[str] = (),
) -> list[str]:
    """The ``mixfleet engine`` arguments of a local CPU engine serving ``model`` as ``version`` on
    ``127.0.0.1:port`` (``flags`` last)."""
    argv = [
        "engine", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--weight-version", str(version), "--threads", str(threads),
    ]  # fmt: skip
    if kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    return [*argv, *flags]


@dataclass(frozen=True)
class ReplicaSpec:
    """What to run for one replica: its identity and format, and extra flags of its processes."""

    replica_id: str
    group: str
    weight_format: str
    kv_cache_dtype: str = "auto"
    engine_flags: tuple[str, ...] = ()
    sidecar_flags: tuple[str, ...] = ()


@dataclass
class Replica:
    """One replica's processes and where they are: the engine (``engine``, on ``engine_port``,
    fresh at every start) behind the sidecar (``sidecar``, on ``sidecar_port`` at ``host``)."""

    spec: ReplicaSpec
    host: str
    sidecar_port: int
    staging_dir: Path
    engine_log: Path
    sidecar_log: Path
    engine_port: int | None = None
    engine: Child | None = None
    sidecar: Child | None = None
    restarts: int = 0
    state: str = "stopped"  # stopped | engine (starting) | sidecar (starting) | running | backoff
    state_until: float = 0.0  # engine/sidecar: readiness deadline; backoff: when to start again
    failures: int = 0  # consecutive failures, for the backoff
    engine_answered: float = 0.0  # running: when the engine last answered its health check
    sidecar_answered: float = 0.0  # running: when the sidecar last answered its status check

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def group(self) -> str:
        return self.spec.group

    @property
    def weight_format(self) -> str:
        return self.spec.weight_format

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def url(self) -> str:
        """The sidecar's URL, the replica's address for the router."""
        return f"http://{self.host}:{self.sidecar_port}"


class Launcher:
    """Starts the router, engines and sidecars of run ``run_id`` on store ``store_root`` and
    stops them all: every child it started is in ``children``; :meth:`stop_all` (also on leaving
    the ``with`` block) stops those still running. Engines and sidecars listen on free ports of
    ``ports`` (None: free ports the kernel chooses); a range with none left free is a UserError."""

    def __init__(
        self,
        store_root: Path,
        run_id: str,
        *,
        host: str = "127.0.0.1",
        router_url: str | None = None,
        sidecar_env: dict[str, str] | None = None,
        engine_threads: int = 1,
        ports: range | None = None,
    ) -> None:
        self.store_root = Path(store_root)
        self.run_id = run_id
        self.host = host
        self.router_url = router_url
        self.sidecar_env = dict(sidecar_env or {})
        self.engine_threads = engine_threads
        self.ports = ports
        self.children: list[Child] = []

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self, grace_s: float = 3.0) -> None:
        stop(self.children, grace_s)
        self.children.clear()

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        *,
        program: Sequence[str] | None = None,
    ) -> Child:
        child = spawn(name, argv, log, env, program=program)
        self.children = [c for c in self.children if c.returncode() is None]
        self.children.append(child)
        return child

    def replica(
        self, spec: ReplicaSpec, *, staging_dir: Path, engine_log: Path, sidecar_log: Path
    ) -> Replica:
        """A replica of this launcher (nothing started yet) with a free sidecar port."""
        port = self._free_port(self.host)
        return Replica(spec, self.host, port, Path(staging_dir), engine_log, sidecar_log)

    def _free_port(self, host: str) -> int:
        try:
            return free_port(host, self.ports)
        except OSError as exc:
            raise UserError(f"no port for a replica's process: {exc}") from None

    def start_engine(self, replica: Replica, version: int) -> Child:
        """Start the replica's engine on ``version`` in the store (:func:`weight_sync.stage.loadable_dir`:
        a delta's whole content staged in the replica's staging directory), on a fresh port."""
        from weight_sync.stage import loadable_dir
        from weight_sync.store.local import LocalStore

        ref = VersionRef(self.run_id, replica.weight_format, version)
        model = loadable_dir(LocalStore(self.store_root), ref, replica.staging_dir)
        if replica.engine_port is not None:  # its engine has exited: the port may serve the next
            release_port("127.0.0.1", replica.engine_port)
        replica.engine_port = self._free_port("127.0.0.1")
        argv = engine_argv(
            model,
            replica.engine_port,
            version,
            threads=self.engine_threads,
            kv_cache_dtype=replica.spec.kv_cache_dtype,
            flags=replica.spec.engine_flags,
        )
        replica.engine = self.spawn(f"engine-{replica.replica_id}", argv, replica.engine_log)
        return replica.engine

    def start_sidecar(self, replica: Replica, *extra: str) -> Child:
        """Start the replica's sidecar in front of its engine; ``extra`` flags go last."""
        argv = [
            "sidecar", "--engine", replica.engine_url, "--group", replica.group,
            "--format", replica.weight_format, "--store", str(self.store_root), "--run", self.run_id,
            "--host", replica.host, "--port", str(replica.sidecar_port),
            "--replica-id", replica.replica_id, "--staging-dir", str(replica.staging_dir),
            "--restarts", str(replica.restarts),
        ]  # fmt: skip
        if self.router_url:
            argv += ["--router", self.router_url]
        argv += [*replica.spec.sidecar_flags, *extra]
        replica.sidecar = self.spawn(
            f"sidecar-{replica.replica_id}", argv, replica.sidecar_log, self.sidecar_env
        )
        return replica.sidecar


class Supervisor:
    """Brings ``replicas`` up and keeps them serving (see the module docstring).

    ``version_of(format)`` is the version a (re)started engine loads; ``ready_timeout_s`` bounds
    each start; a running replica's processes are checked every ``check_interval_s`` and
    restarted once one has not answered for ``unresponsive_s``. Call :meth:`tick` often (it blocks
    at most for one probe timeout); :meth:`wait_running` ticks until every replica is running.
    """

    def __init__(
        self,
        launcher: Launcher,
        replicas: Sequence[Replica],
        version_of: Callable[[str], int],
        probe: Probe,
        *,
        ready_timeout_s: float = 600.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        stable_s: float = 60.0,
        unresponsive_s: float = 60.0,
        check_interval_s: float = 2.0,
        on_event: Callable[[str], None] = lambda _line: None,
    ) -> None:
        self.launcher = launcher
        self.replicas = list(replicas)
        self.version_of = version_of
        self.probe = probe
        self.ready_timeout_s = ready_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stable_s = stable_s
        self.unresponsive_s = unresponsive_s
        self.check_interval_s = check_interval_s
        self.on_event = on_event
        self.strict = True
        self._next_check = 0.0

    def start(self) -> None:
        """Start every replica's engine (their sidecars follow as the engines get ready)."""
        for r in self.replicas:
            self._start_engine(r)

    def running(self) -> bool:
        return all(r.state == "running" for r in self.replicas)

    def wait_running(self, deadline: float, check: Callable[[], None] = lambda: None) -> None:
        """Tick until every replica runs; ``check()`` runs between ticks (it may raise)."""
        while not self.running():
            check()
            self.tick()
            if time.monotonic() > deadline:
                late = ", ".join(f"{r.replica_id} ({r.state})" for r in self.replicas if r.state != "running")
                raise UserError(f"replicas not ready in time: {late}")
            time.sleep(0.2)

    def tick(self) -> None:
        if time.monotonic() >= self._next_check:
            self._check_running()
            self._next_check = time.monotonic() + self.check_interval_s
        now = time.monotonic()
        for r in self.replicas:
            self._advance(r, now)

    def _check_running(self) -> None:
        """Ask every running replica's engine (``/health``) and sidecar (its status route) at
        once; note when each answered."""
        from clients.sidecar import STATUS_PATH

        running = [r for r in self.replicas if r.state == "running"]
        if not running:
            return
        answers = self.probe.answering(
            [u for r in running for u in (r.engine_url + "/health", r.url + STATUS_PATH)]
        )
        now = time.monotonic()
        for r, engine_ok, sidecar_ok in zip(running, answers[::2], answers[1::2], strict=True):
            if engine_ok:
                r.engine_answered = now
            if sidecar_ok:
                r.sidecar_answered = now

    def _start_engine(self, r: Replica) -> None:
        version = self.version_of(r.weight_format)
        child = self.launcher.start_engine(r, version)
        self.on_event(f"started {child.name} on v{version} (pid {child.pid}, log {child.log})")
        r.state, r.state_until = "engine", time.monotonic() + self.ready_timeout_s

    def _start_sidecar(self, r: Replica) -> None:
        child = self.launcher.start_sidecar(r)
        self.on_event(f"started {child.name} (pid {child.pid}, log {child.log})")
        r.state, r.state_until = "sidecar", time.monotonic() + self.ready_timeout_s

    def _advance(self, r: Replica, now: float) -> None:
        engine_code = r.engine.returncode() if r.engine is not None else None
        sidecar_code = r.sidecar.returncode() if r.sidecar is not None else None
        if r.state == "engine":
            assert r.engine is not None
            if engine_code is not None:
                self._failed(r, r.engine, f"exited with {engine_code}", keep_engine=False)
            elif self.probe.healthy(r.engine_url):
                try:
                    self.probe.check_own_engine(r.engine_url, r.engine)
                except ChildFailed as exc:
                    self._failed(r, r.engine, exc.what, keep_engine=False)
                    return
                self._start_sidecar(r)
            elif now > r.state_until:
                self._failed(r, r.engine, "was not ready in time", keep_engine=False)
        elif r.state in ("sidecar", "running"):
            assert r.engine is not None and r.sidecar is not None
            if engine_code is not None:
                self._failed(r, r.engine, f"exited with {engine_code}", keep_engine=False)
            elif sidecar_code is not None:
                self._failed(r, r.sidecar, f"exited with {sidecar_code}", keep_engine=True)
            elif r.state == "sidecar":
                if self.probe.healthy(r.url):
                    r.state = "running"
                    r.engine_answered = r.sidecar_answered = now
                    if r.restarts:
                        self.on_event(f"replica {r.replica_id} is serving again (restarts: {r.restarts})")
                elif now > r.state_until:
                    self._failed(r, r.sidecar, "was not ready in time", keep_engine=True)
            else:
                self._check_unresponsive(r, now)
        elif r.state == "backoff" and now >= r.state_until:
            if r.engine is not None and r.engine.returncode() is None:
                self._start_sidecar(r)
            else:
                self._start_engine(r)

    def _check_unresponsive(self, r: Replica, now: float) -> None:
        """Restart the running replica's engine (with a new sidecar) or its sidecar alone when it
        has not answered its check for ``unresponsive_s``."""
        assert r.engine is not None and r.sidecar is not None
        for child, answered, keep_engine in (
            (r.engine, r.engine_answered, False),
            (r.sidecar, r.sidecar_answered, True),
        ):
            silent = now - answered
            if silent >= self.unresponsive_s:
                what = f"did not answer for {silent:.0f} s (unresponsive); killed"
                self._failed(r, child, what, keep_engine=keep_engine)
                return

    def _failed(self, r: Replica, child: Child, what: str, *, keep_engine: bool) -> None:
        if self.strict:
            raise ChildFailed(child, what)
        if r.sidecar is not None and r.sidecar.returncode() is None:
            kill(r.sidecar)
        if not keep_engine and r.engine is not None:
            kill(r.engine)
        lived = time.monotonic() - child.started_at
        r.failures = 1 if lived >= self.stable_s else r.failures + 1
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (r.failures - 1))
        r.restarts += 1
        r.state, r.state_until = "backoff", time.monotonic() + delay
        again = "its sidecar" if keep_engine else "its engine and sidecar"
        self.on_event(
            f"{child.name} {what}; see {child.log}; starting {again} again in {delay:.0f} s "
            f"(restart {r.restarts} of replica {r.replica_id})"
        )

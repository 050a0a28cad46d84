"""The replica entrypoint: one replica of a sampler group, its engine behind its sidecar.

Plain Python, the same on a Modal GPU server (SGLang) and on one machine (``mixfleet replica``
with the local CPU engine). :func:`run_replica`, in order:

1. **stage**: reads the store's pointer for the group's format (on a Modal Volume the read
   reloads the volume first, with no file of it open) and copies that version to ``stage_dir`` on
   the replica's own disk, verifying every file (:func:`weight_sync.stage.stage_version`, copy
   mode). The engine is pointed at that local copy, never at the store: SGLang keeps its
   safetensors mapped, which would block every later reload of the volume.
2. **engine**: starts ``engine_argv(model_path, weight_version)`` -- a full command line that
   serves on ``127.0.0.1:engine_port``, private to the machine, with
   :data:`core.sglang_release.ENGINE_ENV` in its environment -- and waits until it answers
   ``/health`` (the one engine client, through :class:`launcher.children.Probe`).
3. **sidecar**: starts ``mixfleet sidecar`` on ``host:public_port`` in front of the engine, on the
   same store and staging directory, heartbeating to ``router_url`` with ``replica_key``
   (``MIXFLEET_API_KEY``, scope ``replica``) and advertising ``public_url``.
4. **ready**: once the sidecar's ``/health`` answers 200 (its engine serves the pointer's
   version), calls ``on_ready`` with a :class:`ReadyReplica` and logs one line.
5. **serve**: the sidecar reconciles from then on (pointer watch, stage, activate, heartbeat).
   :func:`run_replica` returns once ``stop`` is set, after stopping both processes (SIGTERM,
   SIGKILL after ``grace_s``); it raises :class:`launcher.children.ChildFailed` when either process
   exits or is not ready within ``ready_timeout_s`` (the other is stopped; a platform that
   restarts containers replaces the replica), and ``UserError`` when nothing is published yet.

Processes are started and stopped with :mod:`launcher.children` (what ``mixfleet up`` uses); they die
with the thread that called :func:`run_replica`. Their output goes to ``log_dir`` (one file each)
or, without one, to this process's standard output.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from clients.sidecar import STATUS_PATH
from core.errors import UserError
from core.sglang_release import ENGINE_ENV
from fleet.specs import GroupSpec
from launcher.children import Child, ChildFailed, Launcher, Probe, Replica, ReplicaSpec
from weight_sync.stage import StagedVersion, stage_version
from weight_sync.store import StoreLocation
from weight_sync.types import FormatRef

log = logging.getLogger("mixfleet.replica")

EngineArgv = Callable[[str, str | None], Sequence[str]]
"""``(model_path, weight_version) -> argv``: the full command line of an engine serving
``model_path`` as ``weight_version`` on the replica's private engine port."""

_POLL_S = 0.2


@dataclass(frozen=True)
class ReadyReplica:
    """A replica that serves: its id, the URL the router knows it by, its engine, the version
    it served when it became ready (newer than the staged one when a publish came in between),
    and where it staged the version it started on."""

    replica_id: str
    url: str
    engine_url: str
    version: int
    staged_path: Path
    engine_pid: int
    sidecar_pid: int


def sidecar_store_flags(store: StoreLocation) -> list[str]:
    """The ``mixfleet sidecar`` flags (besides ``--store``) that open ``store`` in the sidecar."""
    flags: list[str] = []
    if store.volume is not None:
        flags += ["--volume", store.volume]
        if store.scratch is not None:
            flags += ["--volume-scratch", str(store.scratch)]
    return flags


def run_replica(
    *,
    group: GroupSpec,
    run_id: str,
    store: StoreLocation,
    stage_dir: str | Path,
    engine_argv: EngineArgv,
    engine_port: int,
    public_port: int,
    host: str = "0.0.0.0",
    router_url: str | None = None,
    replica_key: str | None = None,
    public_url: str | None = None,
    replica_id: str | None = None,
    log_dir: str | Path | None = None,
    stop: threading.Event | None = None,
    on_ready: Callable[[ReadyReplica], None] = lambda _r: None,
    ready_timeout_s: float = 1800.0,
    grace_s: float = 10.0,
    sidecar_flags: Sequence[str] = (),
) -> None:
    """Run one replica of ``group`` until ``stop`` is set (see the module docstring)."""
    stop = stop if stop is not None else threading.Event()
    stage_dir = Path(stage_dir)
    replica_id = replica_id or f"{group.name}-{socket.gethostname()}-{public_port}"
    version, staged = _stage_current(store, FormatRef(run_id, group.weight_format), stage_dir, replica_id)
    flags = (
        *sidecar_store_flags(store),
        *(("--advertise-url", public_url) if public_url else ()),
        *sidecar_flags,
    )
    logs = Path(log_dir) if log_dir is not None else None
    replica = Replica(
        spec=ReplicaSpec(
            replica_id=replica_id,
            group=group.name,
            weight_format=group.weight_format,
            kv_cache_dtype=group.kv_cache_dtype,
            sidecar_flags=flags,
        ),
        host=host,
        sidecar_port=public_port,
        staging_dir=stage_dir,
        engine_log=logs / f"engine-{replica_id}.log" if logs else Path("/dev/stdout"),
        sidecar_log=logs / f"sidecar-{replica_id}.log" if logs else Path("/dev/stdout"),
        engine_port=engine_port,
    )
    sidecar_env = {"MIXFLEET_API_KEY": replica_key} if replica_key else None
    launcher = Launcher(store.root, run_id, host=host, router_url=router_url, sidecar_env=sidecar_env)
    local_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    sidecar_url = f"http://{local_host}:{public_port}"
    deadline = time.monotonic() + ready_timeout_s
    with launcher, Probe() as probe:
        argv = list(engine_argv(str(staged.path), str(version)))
        sidecar = _start_processes(launcher, probe, replica, argv, sidecar_url, deadline, stop)
        if sidecar is None:
            return
        _, status = probe.get_json(sidecar_url + STATUS_PATH)
        active = status.get("active_version") if isinstance(status, dict) else None
        ready = ReadyReplica(
            replica_id=replica_id,
            url=public_url or sidecar_url,
            engine_url=replica.engine_url,
            version=active if isinstance(active, int) else version,
            staged_path=staged.path,
            engine_pid=replica.engine.pid,
            sidecar_pid=sidecar.pid,
        )
        log.info("replica %s ready at version %d: %s", replica_id, ready.version, ready.url)
        on_ready(ready)
        while not stop.wait(_POLL_S):
            for child in (replica.engine, sidecar):
                code = child.returncode()
                if code is not None:
                    raise ChildFailed(child, f"exited with {code}")
        launcher.stop_all(grace_s)


def _stage_current(
    store: StoreLocation, stream: FormatRef, stage_dir: Path, replica_id: str
) -> tuple[int, StagedVersion]:
    """Step 1: the pointer's version of ``stream``, staged (copied and verified) into ``stage_dir``;
    ``UserError`` when nothing is published."""
    opened = store.open()
    version = opened.read_pointer(stream)
    if version is None:
        raise UserError(
            f"nothing is published for {stream} in the store at {store.root}: publish a version first"
        )
    staged = stage_version(opened, stream.at(version), stage_dir, mode="copy")
    log.info("replica %s staged version %d at %s (%d bytes)", replica_id, version, staged.path, staged.bytes)
    return version, staged


def _start_processes(
    launcher: Launcher,
    probe: Probe,
    replica: Replica,
    argv: list[str],
    sidecar_url: str,
    deadline: float,
    stop: threading.Event,
) -> Child | None:
    """Steps 2 and 3: the engine (``argv``) until it answers ``/health``, then the sidecar until
    its ``/health`` is 200; the sidecar's child, or None when ``stop`` was set first."""
    rid = replica.spec.replica_id
    replica.engine = launcher.spawn(f"engine-{rid}", argv, replica.engine_log, dict(ENGINE_ENV), program=())
    log.info("replica %s started its engine (pid %d): %s", rid, replica.engine.pid, " ".join(argv))
    if not _wait(lambda: probe.healthy(replica.engine_url), replica.engine, deadline, stop):
        return None
    sidecar = launcher.start_sidecar(replica)
    log.info("replica %s started its sidecar (pid %d) on %s", rid, sidecar.pid, sidecar_url)
    if not _wait(lambda: probe.healthy(sidecar_url), sidecar, deadline, stop, others=(replica.engine,)):
        return None
    return sidecar


def _wait(
    ok: Callable[[], bool], child: Child, deadline: float, stop: threading.Event, others: Sequence[Child] = ()
) -> bool:
    """Poll ``ok()`` until True (True) or ``stop`` is set (False); raises ``ChildFailed`` when
    ``child`` or one of ``others`` exits, or ``deadline`` (monotonic) passes first."""
    while not stop.is_set():
        for c in (child, *others):
            code = c.returncode()
            if code is not None:
                raise ChildFailed(c, f"exited with {code}")
        if ok():
            return True
        if time.monotonic() > deadline:
            raise ChildFailed(child, "was not ready in time")
        stop.wait(_POLL_S)
    return False

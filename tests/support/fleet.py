"""A real local fleet for tests: a version store, and per group one engine process plus its sidecar.

``local_fleet(work, base_ckpt, groups)`` publishes ``base_ckpt`` as ``initial_version`` of the
run into a fresh :class:`LocalStore` (every group's format, once), starts one engine per group
on that version's directory (``--weight-version`` stamped), then one sidecar per engine, and
waits until every sidecar reports ready. Everything is killed on exit. This is the same
sequence ``mixfleet up`` runs per group.

Engines run with one torch thread (tests share two cores).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleet.up import Child, check_own_engine
from tests.support.engines import engine_argv
from tests.support.procs import free_port, kill_group, mixfleet_argv, process, wait_http
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef, VersionRef

LOCAL_GROUPS: tuple[tuple[str, str], ...] = (("cpu-bf16", "bf16"), ("cpu-fp8", "fp8"), ("cpu-nvfp4", "nvfp4"))


@dataclass
class Replica:
    group: str
    fmt: str
    replica_id: str
    engine_url: str
    sidecar_port: int
    staging_dir: Path
    sidecar_log: Path
    engine_log: Path
    sidecar_proc: subprocess.Popen | None = None
    extra_flags: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"


@dataclass
class LocalFleet:
    work: Path
    store: LocalStore
    run_id: str
    replicas: list[Replica]
    router_url: str | None
    env: dict[str, str] = field(default_factory=dict)
    _stack: contextlib.ExitStack | None = None

    @property
    def formats(self) -> list[str]:
        return list(dict.fromkeys(r.fmt for r in self.replicas))

    def replica(self, group: str) -> Replica:
        return next(r for r in self.replicas if r.group == group)

    def status(self, replica: Replica) -> dict[str, Any]:
        return httpx.get(replica.url + "/v1/status", timeout=10).json()

    def publish(self, version: int, ckpt: Path, **kw: Any):
        kw.setdefault("workers", 0)
        return publish_checkpoint(self.store, self.run_id, version, ckpt, self.formats, **kw)

    def latest(self) -> int:
        return max(self.store.read_pointer(FormatRef(self.run_id, f)) or 0 for f in self.formats)

    def wait_active(
        self, version: int, timeout: float = 60.0, replicas: Sequence[Replica] | None = None
    ) -> None:
        """Block until every (given) sidecar reports ``version`` active."""
        deadline = time.monotonic() + timeout
        pending = list(replicas or self.replicas)
        last: dict[str, Any] = {}
        while pending:
            for r in list(pending):
                try:
                    st = self.status(r)
                except httpx.HTTPError as exc:
                    last[r.group] = repr(exc)
                    continue
                last[r.group] = {
                    k: st.get(k) for k in ("active_version", "desired_version", "error", "staging")
                }
                if st["active_version"] == version:
                    pending.remove(r)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not active at {version} within {timeout}s: {last}\n{self.logs(pending)}")
            if pending:
                time.sleep(0.1)

    def logs(self, replicas: Sequence[Replica] | None = None, tail: int = 3000) -> str:
        out = []
        for r in replicas or self.replicas:
            for log in (r.sidecar_log, r.engine_log):
                if log.exists():
                    out.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def sidecar_argv(self, r: Replica, *extra: str) -> list[str]:
        argv = [
            "sidecar",
            "--engine",
            r.engine_url,
            "--group",
            r.group,
            "--format",
            r.fmt,
            "--store",
            str(self.store.root),
            "--run",
            self.run_id,
            "--port",
            str(r.sidecar_port),
            "--replica-id",
            r.replica_id,
            "--staging-dir",
            str(r.staging_dir),
            "--poll-s",
            "0.2",
            "--heartbeat-s",
            "0.5",
            "--backoff-max-s",
            "2",
            "--log-level",
            "info",
        ]
        if self.router_url:
            argv += ["--router", self.router_url]
        return mixfleet_argv(*argv, *r.extra_flags, *extra)

    def start_sidecar(self, r: Replica, *extra: str, wait: bool = True) -> None:
        assert self._stack is not None
        r.sidecar_proc = self._stack.enter_context(
            process(self.sidecar_argv(r, *extra), log=r.sidecar_log, env=self.env)
        )
        if wait:
            wait_http(r.url + "/v1/status", timeout=60, proc=r.sidecar_proc)

    def kill_sidecar(self, r: Replica) -> None:
        if r.sidecar_proc is not None:
            kill_group(r.sidecar_proc)
            r.sidecar_proc = None

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            while True:
                try:
                    if httpx.get(r.url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{r.group} sidecar not ready within {timeout}s\n{self.logs([r])}")
                time.sleep(0.1)


@contextlib.contextmanager
def local_fleet(
    work: Path,
    base_ckpt: Path,
    groups: Sequence[tuple[str, str]] = LOCAL_GROUPS,
    *,
    run_id: str = "run",
    initial_version: int = 1,
    router_url: str | None = None,
    env: dict[str, str] | None = None,
    sidecar_flags: Sequence[str] = (),
    group_sidecar_flags: dict[str, Sequence[str]] | None = None,
) -> Iterator[LocalFleet]:
    """Publish ``base_ckpt`` as ``initial_version``, start engines and sidecars, yield the fleet.

    ``sidecar_flags`` go to every sidecar, ``group_sidecar_flags[group]`` to that group's after them.
    """
    work = Path(work)
    store = LocalStore(work / "store")
    formats = list(dict.fromkeys(f for _, f in groups))
    publish_checkpoint(store, run_id, initial_version, base_ckpt, formats, workers=0)
    with contextlib.ExitStack() as stack:
        replicas: list[Replica] = []
        procs = []
        for group, fmt in groups:
            port = free_port()
            log = work / f"engine-{group}.log"
            model = store.version_dir(VersionRef(run_id, fmt, initial_version))
            kv = "fp8_e4m3" if fmt == "fp8" else None
            proc = stack.enter_context(
                process(
                    engine_argv(model, port, weight_version=initial_version, kv_cache_dtype=kv),
                    log=log,
                )
            )
            procs.append(proc)
            replicas.append(
                Replica(
                    group=group,
                    fmt=fmt,
                    replica_id=f"{group}-0",
                    engine_url=f"http://127.0.0.1:{port}",
                    sidecar_port=free_port(),
                    staging_dir=work / f"staging-{group}",
                    sidecar_log=work / f"sidecar-{group}.log",
                    engine_log=log,
                    extra_flags=(*sidecar_flags, *(group_sidecar_flags or {}).get(group, ())),
                )
            )
        fleet = LocalFleet(work, store, run_id, replicas, router_url, dict(env or {}), stack)
        for r, proc in zip(replicas, procs, strict=True):
            try:
                wait_http(r.engine_url + "/health", timeout=180, proc=proc)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"engine {r.group} did not start: {exc}\n{fleet.logs([r])}") from None
            check_own_engine(r.engine_url, Child(f"engine {r.group}", r.engine_log, proc))
        for r in replicas:
            fleet.start_sidecar(r, wait=False)
        for r in replicas:
            wait_http(r.url + "/v1/status", timeout=60, proc=r.sidecar_proc)
        fleet.wait_ready()
        yield fleet

"""A real local fleet for tests: a version store, and per group one engine process plus its sidecar.

``local_fleet(work, base_ckpt, groups)`` publishes ``base_ckpt`` as ``initial_version`` of the
run into a fresh :class:`LocalStore` (every group's format, once), then brings up one replica per
group with :mod:`launcher.children` (what ``mixfleet up`` runs): an engine on that version behind a
sidecar, and waits until every sidecar reports ready. Nothing restarts what a test kills; every
process is killed on exit.

Engines run with one torch thread (tests share two cores).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from launcher.children import Launcher, Probe, Replica, ReplicaSpec, Supervisor, kill
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

LOCAL_GROUPS: tuple[tuple[str, str], ...] = (("cpu-bf16", "bf16"), ("cpu-fp8", "fp8"), ("cpu-nvfp4", "nvfp4"))
SIDECAR_FLAGS = ("--poll-s", "0.2", "--heartbeat-s", "0.5", "--backoff-max-s", "2", "--log-level", "info")


@dataclass
class LocalFleet:
    work: Path
    store: LocalStore
    run_id: str
    replicas: list[Replica]
    router_url: str | None
    launcher: Launcher
    probe: Probe
    env: dict[str, str] = field(default_factory=dict)

    @property
    def formats(self) -> list[str]:
        return list(dict.fromkeys(r.weight_format for r in self.replicas))

    def replica(self, group: str) -> Replica:
        return next(r for r in self.replicas if r.group == group)

    def status(self, replica: Replica) -> dict[str, Any]:
        return httpx.get(replica.url + "/v1/status", timeout=10).json()

    def publish(self, version: int, ckpt: Path, **kw: Any):
        kw.setdefault("workers", 0)
        return publish_checkpoint(self.store, self.run_id, version, ckpt, self.formats, **kw)

    def latest(self) -> int:
        return max(self.store.read_pointer(FormatRef(self.run_id, f)) or 0 for f in self.formats)

    def next_version(self) -> int:
        """A version no format has committed yet: one above every committed and current one (a
        failed test may have committed a version it never made current)."""
        committed = (max(self.store.versions(FormatRef(self.run_id, f)), default=0) for f in self.formats)
        return max(self.latest(), *committed) + 1

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

    def start_sidecar(self, r: Replica, *extra: str, wait: bool = True) -> None:
        """Start ``r``'s sidecar again (``extra`` flags after the fleet's); with ``wait``, until
        it answers ``/v1/status``."""
        self.launcher.start_sidecar(r, *extra)
        if wait:
            assert r.sidecar is not None
            self.probe.wait_http(r.url + "/v1/status", r.sidecar, time.monotonic() + 60)

    def kill_sidecar(self, r: Replica) -> None:
        if r.sidecar is not None:
            kill(r.sidecar)
            r.sidecar = None

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            while not self.probe.healthy(r.url):
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
    engine_flags: Sequence[str] = (),
) -> Iterator[LocalFleet]:
    """Publish ``base_ckpt`` as ``initial_version``, start engines and sidecars, yield the fleet.

    ``sidecar_flags`` go to every sidecar, ``group_sidecar_flags[group]`` to that group's after them;
    ``engine_flags`` to every engine.
    """
    work = Path(work)
    store = LocalStore(work / "store")
    formats = list(dict.fromkeys(f for _, f in groups))
    publish_checkpoint(store, run_id, initial_version, base_ckpt, formats, workers=0)
    launcher = Launcher(store.root, run_id, router_url=router_url, sidecar_env=env, engine_threads=1)
    with launcher, Probe() as probe:
        replicas = [
            launcher.replica(
                ReplicaSpec(
                    replica_id=f"{group}-0",
                    group=group,
                    weight_format=fmt,
                    kv_cache_dtype="fp8_e4m3" if fmt == "fp8" else "auto",
                    engine_flags=tuple(engine_flags),
                    sidecar_flags=(
                        *SIDECAR_FLAGS,
                        *sidecar_flags,
                        *(group_sidecar_flags or {}).get(group, ()),
                    ),
                ),
                staging_dir=work / f"staging-{group}",
                engine_log=work / f"engine-{group}.log",
                sidecar_log=work / f"sidecar-{group}.log",
            )
            for group, fmt in groups
        ]
        fleet = LocalFleet(work, store, run_id, replicas, router_url, launcher, probe, dict(env or {}))

        def version_of(fmt: str) -> int:
            return store.read_pointer(FormatRef(run_id, fmt)) or 0

        supervisor = Supervisor(launcher, replicas, version_of, probe, ready_timeout_s=180)
        supervisor.start()
        try:
            supervisor.wait_running(time.monotonic() + 300)
        except Exception as exc:
            raise RuntimeError(f"the fleet did not start: {exc}\n{fleet.logs()}") from None
        yield fleet

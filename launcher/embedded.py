"""The embedded fleet of ``mixfleet up``: base policy, one engine + sidecar per group, and the router,
on this machine (:func:`serve`; the command, :mod:`mixfleet.up`, only parses its flags into
:class:`UpSettings`). The flags named below are the command's, the settings' fields by another name.

Before: nothing (a fresh machine is fine). What :func:`serve` does, in order:

0. ``<data-dir>/up.lock``: held for as long as this ``up`` runs (:func:`hold_data_dir`); another
   ``up`` of the same data dir is refused in one line naming this one's pid and router URL.

1. ``<data-dir>/base``: the BF16 base policy; created by ``init-model`` (``--model-preset``,
   default ``small``) when it holds no ``config.json`` (written aside and moved into place, so
   an interrupted first run leaves no half-written base).
2. ``<data-dir>/store``: a local version store for run ``--run``, bootstrapped by
   :func:`weight_sync.publish.bootstrap` (the base policy becomes version 0, converted once per
   format; later ``up`` runs start from each format's pointer).
3. The router (``mixfleet router``) on ``--host:--port`` with the store's weight routes and the
   base policy as its chat model (``--chat-model``: the per-session chat APIs render with its
   tokenizer and chat template) and its vocabulary size (``--vocab-size``: an input id beyond the
   base's vocabulary is refused before it reaches an engine), then
   for every group that lists no static ``replicas``, ``max(min_replicas, 1)`` replicas, each a
   ``mixfleet engine`` on the pointer's version behind a ``mixfleet sidecar`` that heartbeats
   to the router and activates new versions (started by :mod:`launcher.children`), each on a
   free port of ``--replica-ports`` when given, else on a free port the kernel chooses (so
   fleets of different ``--data-dir`` and ``--port`` run side by side). Groups with
   static replicas are routed to as listed (their engines run elsewhere). The sidecars stage in
   place (the store is on local disk) and activate as on SGLang (:mod:`replica.activation`:
   retract, update with a cache flush, continue; the engine loads the new version while paused).
4. API keys: ``MIXFLEET_API_KEYS`` if set; otherwise one key with every scope, kept in
   ``<data-dir>/api_key`` (mode 0600, reused on the next ``up``), which ``mixfleet weights``
   reads when ``MIXFLEET_API_KEY`` is unset. The sidecars heartbeat with a key of scope
   ``replica`` only: one of ``MIXFLEET_API_KEYS`` that has it, else a fresh one for this run
   (the router admits it beside the others); they never hold the admin key.

After (:func:`run_until_stopped`): prints the URL, the key and commands to paste, and serves until
Ctrl-C or SIGTERM. It
supervises its processes: an engine or sidecar that exits, or that has served and then stops
answering for ``--unresponsive-timeout`` (hung: killed first), is started again (with backoff;
logged; counted in the sidecar's ``mixfleet_replica_restarts_total``), and while a group has no
replica its sessions fail over to the others. Ctrl-C or SIGTERM, at any moment including start-up, stops
every process it started within a few seconds and exits 0. If the router exits, it stops the
others and exits 1, naming the router's log (``<data-dir>/logs/``); so does a process that fails
during start-up. Should ``up`` itself be killed, its processes exit too (Linux).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from core.process import raise_open_file_limit
from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG
from core.tcp import port_is_free
from fleet.specs import FleetSpec, GroupSpec
from launcher.children import Child, Launcher, Probe, Replica, ReplicaSpec, Supervisor, mixfleet_command
from weight_sync.store.base import VersionStore
from weight_sync.types import FormatRef

ALL_SCOPES = ("rollout", "trainer", "admin")


@dataclass(frozen=True)
class UpSettings:
    """What ``mixfleet up`` runs (its flags): the preset, the router's address and state, where the
    base policy, store and logs live, the run id, the base policy's size on a first run, torch
    threads per engine, the router's version-lag bound, the readiness timeout, the longest
    restart backoff, how long a serving engine or sidecar may go without answering before it
    is restarted (seconds; :class:`launcher.children.Supervisor`), and the ports its engines and
    sidecars take free ones of (None: the kernel's choice)."""

    preset: str = "local"
    host: str = "127.0.0.1"
    port: int = 8300
    state: str = "memory"
    data_dir: Path = Path(".mixfleet")
    run: str = "local"
    model_preset: str = "small"
    engine_threads: int = 1
    max_version_lag: int | None = None
    keep_store_versions: int = 0
    ready_timeout_s: float = 600.0
    restart_backoff_max_s: float = 30.0
    unresponsive_s: float = 60.0
    replica_ports: range | None = None


@dataclass(frozen=True)
class _Plan:
    """What :func:`serve` prepared before starting any process."""

    fleet: FleetSpec
    data: Path
    local_groups: tuple[GroupSpec, ...]
    keys: dict[str, list[str]]
    admin_key: str | None
    generated: bool
    replica_key: str
    store: VersionStore
    versions: dict[str, int]

    @property
    def logs(self) -> Path:
        return self.data / "logs"


def run_until_stopped(settings: UpSettings) -> int:
    """:func:`serve` until Ctrl-C or SIGTERM (then 0, after stopping everything) or a failure (1)."""
    with stop_on_signals():
        try:
            return serve(settings)
        except KeyboardInterrupt:
            print("stopped", flush=True)
            return 0


def serve(settings: UpSettings) -> int:
    """Prepare, start the router, then the replicas; print the banner once every local group has a
    ready replica and supervise until interrupted (KeyboardInterrupt) or a failure (returns 1,
    everything stopped). Its soft open-file limit is raised first
    (:func:`core.process.raise_open_file_limit`), so every process it starts inherits it."""
    raise_open_file_limit()
    router_url = f"http://{settings.host}:{settings.port}"
    with hold_data_dir(Path(settings.data_dir).expanduser().resolve(), router_url):
        return _serve(settings, router_url)


def _serve(settings: UpSettings, router_url: str) -> int:
    plan = _prepare(settings)
    launcher = Launcher(
        plan.data / "store",
        settings.run,
        host=settings.host,
        router_url=router_url,
        sidecar_env={"MIXFLEET_API_KEY": plan.replica_key},
        engine_threads=settings.engine_threads,
        ports=settings.replica_ports,
    )
    with launcher, Probe() as probe:
        try:
            router = _start_router(launcher, probe, settings, router_url, plan)
            deadline = time.monotonic() + settings.ready_timeout_s
            supervisor = _start_replicas(launcher, probe, settings, plan, router, deadline)
            if plan.admin_key:
                groups = {g.name for g in plan.local_groups}
                _wait_registered(probe, router_url, router, plan.admin_key, groups, deadline)
            supervisor.strict = False
            _print_banner(router_url, plan, supervisor.replicas, settings.replica_ports)
            while True:
                _check_router(router)
                supervisor.tick()
                time.sleep(0.2)
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
            raise
        except UserError as exc:
            print(f"mixfleet up: {exc}; stopping", file=sys.stderr, flush=True)
            return 1


def _prepare(settings: UpSettings) -> _Plan:
    """Steps 1, 2 and 4 of the module docstring: refuse what cannot run here, then the keys, the
    base policy and the store's version 0."""
    from fleet.specs import load_preset
    from weight_sync.publish import bootstrap
    from weight_sync.store.local import LocalStore

    fleet = load_preset(settings.preset)
    if not port_is_free(settings.host, settings.port):
        raise UserError(f"port {settings.port} on {settings.host} is in use (pick another with --port)")
    data = Path(settings.data_dir).expanduser().resolve()
    (data / "logs").mkdir(parents=True, exist_ok=True)
    local_groups = tuple(g for g in fleet.groups if not g.replicas)
    for g in local_groups:
        if not g.is_local:
            raise UserError(
                f"group {g.name!r} runs on {g.accelerator}, lists no replicas, and cannot run on this "
                "machine: give it `replicas = [...]` or deploy it with deploy/modal_app.py"
            )
    _check_replica_ports(settings.replica_ports, local_groups)
    keys, admin_key, generated = api_keys(data)
    keys, sidecar_key = replica_key(keys)
    ensure_base(data / "base", settings.model_preset)
    store = LocalStore(data / "store")
    formats = list(dict.fromkeys(g.weight_format for g in local_groups))

    def progress(kind: str, info: dict) -> None:
        if kind == "convert_start":
            print(f"converting the base policy to {info['format']} ...", flush=True)

    versions = bootstrap(store, settings.run, data / "base", formats, on_event=progress)
    return _Plan(fleet, data, local_groups, keys, admin_key, generated, sidecar_key, store, versions)


def _start_replicas(
    launcher: Launcher,
    probe: Probe,
    settings: UpSettings,
    plan: _Plan,
    router: Child,
    deadline: float,
) -> Supervisor:
    """Step 3's replicas, started and supervised; returns once every one runs (by ``deadline``)."""

    def version_of(fmt: str) -> int:
        return plan.store.read_pointer(FormatRef(settings.run, fmt)) or 0

    replicas = [
        launcher.replica(
            _replica_spec(g, i),
            staging_dir=plan.data / "staging" / f"{g.name}-{i}",
            engine_log=plan.logs / f"engine-{g.name}-{i}.log",
            sidecar_log=plan.logs / f"sidecar-{g.name}-{i}.log",
        )
        for g in plan.local_groups
        for i in range(max(g.min_replicas, 1))
    ]
    supervisor = Supervisor(
        launcher,
        replicas,
        version_of,
        probe,
        ready_timeout_s=settings.ready_timeout_s,
        backoff_max_s=settings.restart_backoff_max_s,
        unresponsive_s=settings.unresponsive_s,
        on_event=_say,
    )
    supervisor.start()
    supervisor.wait_running(deadline, check=lambda: _check_router(router))
    return supervisor


def _start_router(
    launcher: Launcher, probe: Probe, settings: UpSettings, router_url: str, plan: _Plan
) -> Child:
    """The router (``mixfleet router``) with the store's weight routes, the base policy as its
    chat model and its vocabulary size (input ids beyond it refused), once it answers ``/healthz``."""
    argv = ["router", "--preset", str(settings.preset), "--host", settings.host, "--port", str(settings.port)]
    argv += ["--state", settings.state, *_chat_flags(plan.data / "base")]
    argv += ["--vocab-size", str(json.loads((plan.data / "base" / "config.json").read_text())["vocab_size"])]
    if settings.max_version_lag is not None:
        argv += ["--max-version-lag", str(settings.max_version_lag)]
    if settings.keep_store_versions:
        argv += ["--keep-store-versions", str(settings.keep_store_versions)]
    env = {
        "MIXFLEET_API_KEYS": json.dumps(plan.keys),
        "MIXFLEET_API_KEY": plan.admin_key or "",
        "MIXFLEET_STORE": str(plan.data / "store"),
        "MIXFLEET_RUN": settings.run,
    }
    router = launcher.spawn("router", argv, plan.logs / "router.log", env)
    _say(f"started router (pid {router.pid}, log {router.log})")
    probe.wait_http(router_url + "/healthz", router, time.monotonic() + settings.ready_timeout_s)
    return router


def _chat_flags(base: Path) -> list[str]:
    """``--chat-model base`` when the base policy has a chat template (every ``init-model`` preset
    writes one); else none, said once (a base written by an older ``init-model``: the chat APIs
    answer 503 until it is recreated)."""
    try:
        template = json.loads((base / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if template:
        return ["--chat-model", str(base)]
    _say(f"the base policy in {base} has no chat template: the chat APIs answer 503 (remove it to recreate)")
    return []


def api_keys(data: Path) -> tuple[dict[str, list[str]], str | None, bool]:
    """(keys for the router, an admin key for the sidecars and the user, whether it was generated)."""
    raw = os.environ.get("MIXFLEET_API_KEYS", "").strip()
    if raw:
        try:
            keys = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UserError(f"MIXFLEET_API_KEYS is not valid JSON: {exc.msg}") from None
        if not isinstance(keys, dict) or not all(isinstance(v, list) for v in keys.values()):
            raise UserError('MIXFLEET_API_KEYS must be a JSON object {"<token>": ["rollout", ...]}')
        admin = next((k for k, scopes in keys.items() if "admin" in scopes), None)
        return keys, os.environ.get("MIXFLEET_API_KEY") or admin, False
    key_file = data / "api_key"
    if key_file.is_file() and key_file.read_text().strip():
        token = key_file.read_text().strip()
    else:
        token = "mf-" + secrets.token_urlsafe(32)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return {token: list(ALL_SCOPES)}, token, True


def replica_key(keys: dict[str, list[str]]) -> tuple[dict[str, list[str]], str]:
    """(the router's keys, the sidecars' key): a key of ``keys`` with the ``replica`` scope, else
    a fresh one of that scope alone, added to the router's keys."""
    mine = next((k for k, scopes in keys.items() if "replica" in scopes), None)
    if mine is not None:
        return keys, mine
    token = "mf-replica-" + secrets.token_urlsafe(32)
    return {**keys, token: ["replica"]}, token


@contextlib.contextmanager
def hold_data_dir(data: Path, router_url: str) -> Iterator[None]:
    """Inside: this process is the one ``mixfleet up`` of ``data`` (an exclusive ``flock`` of
    ``<data>/up.lock``, which names its pid and router URL; not inherited by the processes it
    starts, released when it exits however it exits). Another ``up`` of the same data dir is a
    UserError naming that one, before it writes anything: two would share the base policy (each
    replacing the other's half-written one), the store, the staging directories, the logs and
    the key file."""
    import fcntl

    try:
        data.mkdir(parents=True, exist_ok=True)
        fd = os.open(data / "up.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:  # a file, a directory it may not write
        raise UserError(f"--data-dir {data}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            raise UserError(
                f"{data} is in use by another mixfleet up ({holder}): stop it, or give this one "
                "another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, router {router_url}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def ensure_base(base: Path, model_preset: str) -> None:
    """The base policy in ``base``: written as ``mixfleet init-model`` writes it
    (:func:`weight_sync.base_model.write_model`, preset ``model_preset``) when it holds no
    ``config.json``, written aside and moved into place."""
    if (base / "config.json").is_file():
        return
    from weight_sync.base_model import write_model

    print(f"creating the {model_preset} base policy in {base} ...", flush=True)
    partial = base.with_name(base.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_model(partial, model_preset)
    shutil.rmtree(base, ignore_errors=True)
    os.replace(partial, base)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside: the first SIGINT or SIGTERM raises KeyboardInterrupt wherever the main thread is
    (later ones are ignored, so stopping is not interrupted); the old handlers come back after."""

    def stop(_signum: int, _frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _say(line: str) -> None:
    print(f"mixfleet up: {line}", flush=True)


def _replica_spec(g: GroupSpec, i: int) -> ReplicaSpec:
    """One local replica of ``g``. Its engine can always return routed experts (the capability
    costs nothing until a request asks), so ``mixfleet validate`` compares routes on this fleet;
    the router records them only for groups and sessions with ``record_routes``
    (:attr:`fleet.specs.GroupSpec.returns_routes` counts on this)."""
    return ReplicaSpec(
        replica_id=f"{g.name}-{i}",
        group=g.name,
        weight_format=g.weight_format,
        kv_cache_dtype="fp8_e4m3" if g.kv_cache_dtype == "fp8_e4m3" else "auto",
        engine_flags=("--served-model-name", "mixfleet-base", ENABLE_RETURN_ROUTED_EXPERTS_FLAG),
        sidecar_flags=("--stage-mode", "inplace"),
    )


def _check_replica_ports(ports: range | None, local_groups: tuple[GroupSpec, ...]) -> None:
    """``--replica-ports`` must hold a port for every local replica's engine and sidecar."""
    wanted = 2 * sum(max(g.min_replicas, 1) for g in local_groups)
    if ports is not None and len(ports) < wanted:
        raise UserError(
            f"--replica-ports {ports.start}-{ports.stop - 1} holds {len(ports)} ports; its "
            f"{wanted // 2} local replicas need {wanted} (an engine and a sidecar each)"
        )


def _check_router(router: Child) -> None:
    code = router.returncode()
    if code is not None:
        raise UserError(f"the router exited with {code}; see {router.log}")


def _wait_registered(
    probe: Probe, router_url: str, router: Child, key: str, groups: set[str], deadline: float
) -> None:
    """Block until the router has every group in ``groups`` with a ready replica in rotation."""
    while True:
        _check_router(router)
        status, body = probe.get_json(router_url + "/v1/groups", {"Authorization": f"Bearer {key}"})
        if status == 200 and isinstance(body, dict):
            ready = {g.get("name") for g in body.get("groups", []) if g.get("ready_replicas", 0) > 0}
            if groups <= ready:
                return
        if time.monotonic() > deadline:
            raise UserError(f"the router did not see every group ready in time; see {router.log}")
        time.sleep(0.2)


def mixfleet_executable() -> str:
    """How to run ``mixfleet`` from a shell with this installation: the console script beside
    this interpreter (a venv's ``bin/mixfleet``) when there is one, else ``python -m mixfleet``."""
    script = Path(os.path.abspath(sys.executable)).parent / "mixfleet"
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return shlex.join(mixfleet_command())


def _print_banner(router_url: str, plan: _Plan, replicas: list[Replica], replica_ports: range | None) -> None:
    fleet, local_groups, versions = plan.fleet, plan.local_groups, plan.versions
    admin_key, generated, data = plan.admin_key, plan.generated, plan.data
    lines = [
        "",
        f"mixfleet is up: {router_url}  (preset {fleet.name}, {len(fleet.groups)} groups)",
    ]
    for g in fleet.groups:
        mine = [r.url for r in replicas if r.group == g.name]
        where = f"local engine, sidecar {', '.join(mine)}" if g in local_groups else ", ".join(g.replicas)
        version = versions.get(g.weight_format, "?") if g in local_groups else "-"
        lines.append(f"  {g.name:<18} {g.weight_format:<6} v{version}  {where}")
    if local_groups and replica_ports is not None:
        span = f"{replica_ports.start}-{replica_ports.stop - 1}"
        lines.append(f"engine and sidecar ports: free ones of --replica-ports {span}")
    elif local_groups:
        lines.append("engine and sidecar ports: free ones the system chose (--replica-ports: a range)")
    key_file = data / "api_key"
    if generated:
        lines.append(f"API key (every scope, saved in {key_file}):")
        lines.append(f"  {admin_key}")
        set_key = f"KEY=$(cat {shlex.quote(str(key_file))})"
    else:
        lines.append("API keys: from MIXFLEET_API_KEYS")
        set_key = 'KEY="$MIXFLEET_API_KEY"' if os.environ.get("MIXFLEET_API_KEY") else None
    lines.append("Try (in another shell):")
    if set_key is None:
        lines.append("  # set KEY to an admin token of MIXFLEET_API_KEYS, then:")
    else:
        lines.append(f"  {set_key}")
    lines += [
        f'  curl -s -H "Authorization: Bearer $KEY" {router_url}/v1/groups',
        f'  MIXFLEET_API_KEY="$KEY" {mixfleet_executable()} weights publish --router {router_url} '
        f"{shlex.quote(str(data / 'base'))}",
        f"OpenAPI: {router_url}/docs   metrics: {router_url}/metrics   logs: {data / 'logs'}",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)

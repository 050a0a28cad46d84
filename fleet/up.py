"""Run the embedded default fleet: base policy, one engine + sidecar per group, and the router.

``mixfleet up [--preset local] [--port 8300] [--state memory|redis://...] [--data-dir .mixfleet]``

Before: nothing (a fresh machine is fine). What it does, in order:

1. ``<data-dir>/base``: the BF16 base policy; created by ``init-model`` (``--model-preset``,
   default ``small``) when it holds no ``config.json``.
2. ``<data-dir>/store``: a local version store for run ``--run``, bootstrapped by
   :func:`weight_sync.publish.bootstrap` (the base policy becomes version 0, converted once per
   format; later ``up`` runs start from each format's pointer).
3. The router (``mixfleet router``) on ``--host:--port`` with the store's weight routes, then
   for every group that lists no static ``replicas``, ``max(min_replicas, 1)`` replicas, each a
   ``mixfleet engine`` on the pointer's version behind a ``mixfleet sidecar`` that heartbeats
   to the router and activates new versions. Groups with static replicas are routed to as
   listed (their engines run elsewhere). The sidecars stage in place (the store is on local
   disk) and activate by the sidecar's default, ``auto``: the local engine says it loads a new
   version while serving and swaps between two decode steps, so it is never paused. (SGLang's
   pause protocol would put the engine's whole load inside the pause: 7-14% of publish -> every
   replica active for the ``small`` models in ``benchmarks/weight_sync.py``'s
   ``sglang-protocol`` configuration.)
4. API keys: ``MIXFLEET_API_KEYS`` if set; otherwise one key with every scope, kept in
   ``<data-dir>/api_key`` (mode 0600, reused on the next ``up``), which ``mixfleet weights``
   reads when ``MIXFLEET_API_KEY`` is unset.

After: prints the URL and the key, and serves until Ctrl-C (or SIGTERM), then stops every
process it started and exits 0. If one of its processes dies, it stops the others and exits
1, naming the process and its log (``<data-dir>/logs/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fleet.specs import GroupSpec
from fleet.tcp import free_port, port_is_free
from weight_sync.errors import UserError
from weight_sync.types import VersionRef

ALL_SCOPES = ("rollout", "trainer", "admin")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="local", help="fleet preset name or TOML file (default local)")
    parser.add_argument("--host", default="127.0.0.1", help="router address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8300, help="router port (default 8300)")
    parser.add_argument("--state", default="memory", help="router state: memory (default) or redis://...")
    parser.add_argument("--data-dir", default=".mixfleet", help="base model, store, logs (default .mixfleet)")
    parser.add_argument("--run", default="local", help="run id of the published versions (default local)")
    parser.add_argument(
        "--model-preset", default="small", choices=("tiny", "small"), help="base policy size on first run"
    )
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="torch threads per engine process (default 1)"
    )
    parser.add_argument(
        "--max-version-lag", type=int, default=None, help="keep new turns off replicas lagging more than this"
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")


@dataclass
class Child:
    """One process ``up`` started: its name, log file and handle."""

    name: str
    log: Path
    proc: subprocess.Popen


def _api_keys(data: Path) -> tuple[dict[str, list[str]], str | None, bool]:
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


def _ensure_base(base: Path, model_preset: str) -> None:
    if (base / "config.json").is_file():
        return
    from fleet.engine.init_model import write_model

    print(f"creating the {model_preset} base policy in {base} ...", flush=True)
    write_model(base, model_preset)


def _wait_http(url: str, child: Child, deadline: float, headers: dict[str, str] | None = None) -> None:
    import httpx

    while True:
        if child.proc.poll() is not None:
            raise UserError(f"{child.name} exited with {child.proc.returncode}; see {child.log}")
        try:
            if httpx.get(url, timeout=2.0, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise UserError(f"{child.name} not ready at {url} in time; see {child.log}")
        time.sleep(0.2)


def check_own_engine(url: str, child: Child) -> None:
    """The engine answering at ``url`` must be ``child`` itself, not another process that holds
    the port (``child`` would then have failed to bind it and its group would be served by
    someone else's engine)."""
    import httpx

    pid = httpx.get(url + "/server_info", timeout=10.0).json().get("pid")
    if pid != child.proc.pid:
        raise UserError(
            f"{child.name}: {url} is served by process {pid}, not by this engine "
            f"(pid {child.proc.pid}); see {child.log}"
        )


def _wait_registered(router_url: str, router: Child, key: str, groups: set[str], deadline: float) -> None:
    """Block until the router has every group in ``groups`` with a ready replica in rotation."""
    import httpx

    while True:
        if router.proc.poll() is not None:
            raise UserError(f"router exited with {router.proc.returncode}; see {router.log}")
        try:
            body = httpx.get(
                router_url + "/v1/groups", headers={"Authorization": f"Bearer {key}"}, timeout=2.0
            ).json()
            ready = {g["name"] for g in body["groups"] if g["ready_replicas"] > 0}
            if groups <= ready:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise UserError(f"the router did not see every group ready in time; see {router.log}")
        time.sleep(0.2)


@contextlib.contextmanager
def _children() -> Iterator[list[Child]]:
    """A list to append started processes to; on exit every one is stopped (TERM, then KILL)."""
    children: list[Child] = []
    try:
        yield children
    finally:
        for child in reversed(children):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in reversed(children):
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()


def _start(children: list[Child], name: str, argv: list[str], logs: Path, env: dict[str, str]) -> Child:
    log = logs / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mixfleet", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,
        )
    child = Child(name, log, proc)
    children.append(child)
    return child


def run(args: argparse.Namespace) -> int:
    from fleet.specs import load_preset
    from weight_sync.publish import bootstrap
    from weight_sync.store.local import LocalStore

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.engine_threads < 1:
        raise UserError("--engine-threads must be >= 1")
    fleet = load_preset(args.preset)
    if not port_is_free(args.host, args.port):
        raise UserError(f"port {args.port} on {args.host} is in use (pick another with --port)")
    data = Path(args.data_dir).expanduser().resolve()
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base, store_root = data / "base", data / "store"
    local_groups = [g for g in fleet.groups if not g.replicas]
    for g in local_groups:
        if not g.is_local:
            raise UserError(
                f"group {g.name!r} runs on {g.accelerator}, lists no replicas, and cannot run on this "
                "machine: give it `replicas = [...]` or deploy it with deploy/modal_app.py"
            )

    keys, admin_key, generated = _api_keys(data)
    _ensure_base(base, args.model_preset)
    store = LocalStore(store_root)
    formats = list(dict.fromkeys(g.weight_format for g in local_groups))

    def progress(kind: str, info: dict) -> None:
        if kind == "convert_start":
            print(f"converting the base policy to {info['format']} ...", flush=True)

    versions = bootstrap(store, args.run, base, formats, on_event=progress)

    router_url = f"http://{args.host}:{args.port}"
    common_env = {"MIXFLEET_API_KEYS": json.dumps(keys), "MIXFLEET_API_KEY": admin_key or ""}
    stop = {"signal": None}

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with _children() as children:
        router_argv = ["router", "--preset", str(args.preset), "--host", args.host, "--port", str(args.port)]
        router_argv += ["--state", args.state]
        if args.max_version_lag is not None:
            router_argv += ["--max-version-lag", str(args.max_version_lag)]
        router_env = {**common_env, "MIXFLEET_STORE": str(store_root), "MIXFLEET_RUN": args.run}
        router = _start(children, "router", router_argv, logs, router_env)
        deadline = time.monotonic() + args.ready_timeout
        _wait_http(router_url + "/healthz", router, deadline)

        engines: list[tuple[str, GroupSpec, Child, int]] = []
        for g in local_groups:
            fmt, version = g.weight_format, versions[g.weight_format]
            for i in range(max(g.min_replicas, 1)):
                name = f"{g.name}-{i}"
                port = free_port("127.0.0.1")
                engine_argv = [
                    "engine", "--model", str(store.version_dir(VersionRef(args.run, fmt, version))),
                    "--host", "127.0.0.1", "--port", str(port),
                    "--weight-version", str(version), "--threads", str(args.engine_threads),
                    "--served-model-name", "mixfleet-base",
                ]  # fmt: skip
                if g.kv_cache_dtype == "fp8_e4m3":
                    engine_argv += ["--kv-cache-dtype", "fp8_e4m3"]
                engines.append((name, g, _start(children, f"engine-{name}", engine_argv, logs, {}), port))
        sidecars: list[tuple[Child, str]] = []
        for name, g, engine, port in engines:
            _wait_http(f"http://127.0.0.1:{port}/health", engine, deadline)
            check_own_engine(f"http://127.0.0.1:{port}", engine)
            sidecar_port = free_port(args.host)
            sidecar_argv = [
                "sidecar", "--engine", f"http://127.0.0.1:{port}", "--group", g.name,
                "--format", g.weight_format, "--store", str(store_root), "--run", args.run,
                "--host", args.host, "--port", str(sidecar_port), "--router", router_url,
                "--replica-id", name, "--staging-dir", str(data / "staging" / name),
                "--stage-mode", "inplace",
            ]  # fmt: skip
            sidecar = _start(children, f"sidecar-{name}", sidecar_argv, logs, common_env)
            sidecars.append((sidecar, f"http://{args.host}:{sidecar_port}/health"))
        for sidecar, health in sidecars:
            _wait_http(health, sidecar, deadline)
        if admin_key:
            _wait_registered(router_url, router, admin_key, {g.name for g in local_groups}, deadline)

        _print_banner(router_url, fleet, local_groups, versions, admin_key, generated, data)
        while stop["signal"] is None:
            for child in children:
                if child.proc.poll() is not None:
                    print(
                        f"mixfleet up: {child.name} exited with {child.proc.returncode}; "
                        f"see {child.log}; stopping",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.5)
        print("\nstopping ...", flush=True)
    print("stopped", flush=True)
    return 0


def _print_banner(router_url, fleet, local_groups, versions, admin_key, generated, data: Path) -> None:
    lines = [
        "",
        f"mixfleet is up: {router_url}  (preset {fleet.name}, {len(fleet.groups)} groups)",
    ]
    for g in fleet.groups:
        where = "local engine" if g in local_groups else ", ".join(g.replicas)
        version = versions.get(g.weight_format, "?") if g in local_groups else "-"
        lines.append(f"  {g.name:<18} {g.weight_format:<6} v{version}  {where}")
    if generated:
        lines.append(f"API key (every scope, saved in {data / 'api_key'}):")
        lines.append(f"  {admin_key}")
    else:
        lines.append("API keys: from MIXFLEET_API_KEYS")
    lines += [
        "Try:",
        f"  curl -H 'Authorization: Bearer $KEY' {router_url}/v1/groups",
        f"  mixfleet weights publish --version 1 {data / 'base'}",
        f"OpenAPI: {router_url}/docs   metrics: {router_url}/metrics   logs: {data / 'logs'}",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)

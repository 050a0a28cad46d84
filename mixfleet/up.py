"""Run the embedded default fleet on this machine (base policy, one engine + sidecar per group,
and the router) until Ctrl-C or SIGTERM.

``mixfleet up [--preset local] [--port 8300] [--state memory|redis://...] [--data-dir .mixfleet]
[--replica-ports FIRST-LAST]``.
A flag it cannot use (a ``--state`` of another form, a ``--data-dir`` that is a file) is one line
before anything is written.
What it starts and in which order, and what it guarantees,
is :mod:`launcher.embedded`; this module is the command: its flags, checked, become
:class:`launcher.embedded.UpSettings`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core.errors import UserError
from launcher.embedded import UpSettings, run_until_stopped
from mixfleet.argtypes import port_range, seconds
from mixfleet.router import check_state_form


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="local", help="fleet preset name or TOML file (default local)")
    parser.add_argument("--host", default="127.0.0.1", help="router address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8300, help="router port (default 8300)")
    parser.add_argument("--state", default="memory", help="router state: memory (default) or redis://...")
    parser.add_argument(
        "--replica-ports",
        type=port_range,
        default=None,
        metavar="FIRST-LAST",
        help="the engines and sidecars listen on free ports of this range (default: free ports the "
        "system chooses; either way fleets of different --data-dir and --port run side by side)",
    )
    parser.add_argument("--data-dir", default=".mixfleet", help="base model, store, logs (default .mixfleet)")
    parser.add_argument("--run", default="local", help="run id of the published versions (default local)")
    parser.add_argument(
        "--model-preset",
        default="small",
        choices=("tiny", "small"),
        help="base policy size on first run (default small)",
    )
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="torch threads per engine process (default 1)"
    )
    parser.add_argument(
        "--max-version-lag", type=int, default=None, help="keep new turns off replicas lagging more than this"
    )
    parser.add_argument(
        "--keep-store-versions",
        type=int,
        default=0,
        metavar="N",
        help="the router's --keep-store-versions: at the start of every weight job, delete the "
        "store's versions beyond the run's newest N, keeping what replicas serve and every delta's "
        "bases (0: never; default 0)",
    )
    parser.add_argument("--ready-timeout", type=seconds, default=600.0, help="seconds to wait for readiness")
    parser.add_argument(
        "--restart-backoff-max",
        type=float,
        default=30.0,
        help="longest wait before restarting a replica that keeps exiting (seconds, default 30)",
    )
    parser.add_argument(
        "--unresponsive-timeout",
        type=seconds,
        default=60.0,
        help="seconds a serving engine or sidecar may go without answering its health check before "
        "it is killed and restarted (default 60)",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    check_state_form(args.state)  # the router's own check, before the base policy is written
    if args.engine_threads < 1:
        raise UserError("--engine-threads must be >= 1")
    if args.keep_store_versions < 0:
        raise UserError(
            f"--keep-store-versions must be >= 0 (0: never prune), got {args.keep_store_versions}"
        )
    if args.restart_backoff_max < 1:
        raise UserError("--restart-backoff-max must be >= 1")
    settings = UpSettings(
        preset=args.preset,
        host=args.host,
        port=args.port,
        state=args.state,
        data_dir=Path(args.data_dir),
        run=args.run,
        model_preset=args.model_preset,
        engine_threads=args.engine_threads,
        max_version_lag=args.max_version_lag,
        keep_store_versions=args.keep_store_versions,
        ready_timeout_s=args.ready_timeout,
        restart_backoff_max_s=args.restart_backoff_max,
        unresponsive_s=args.unresponsive_timeout,
        replica_ports=args.replica_ports,
    )
    return run_until_stopped(settings)

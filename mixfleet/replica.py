"""Run one replica of a sampler group: stage the current version, start its engine and sidecar.

``mixfleet replica --preset P --group G --store ROOT [--volume NAME] --run R --port P
--stage-dir DIR [--router URL] [--engine-command CMD]``. Without ``--engine-command`` the engine
is the local CPU engine (``mixfleet engine``, able to return routed experts, as ``mixfleet up``'s
are) on the staged copy; with it, ``CMD`` is split like a
shell line and ``{model}``, ``{port}`` and ``{version}`` in it are replaced (an SGLang server
outside Modal, say). The router key for heartbeats comes from ``MIXFLEET_API_KEY``. Stops on
SIGTERM or Ctrl-C. See :mod:`replica.entrypoint` for the contract.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import threading
from pathlib import Path

from core.errors import UserError
from core.fs import make_dir
from mixfleet.argtypes import seconds, tcp_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="the fleet preset (built-in name or TOML file)")
    parser.add_argument("--group", required=True, help="the preset's group this replica serves")
    parser.add_argument("--store", required=True, help="the version store's root (with --volume: its mount)")
    parser.add_argument("--volume", default=None, help="the Modal Volume mounted at --store (on Modal)")
    parser.add_argument(
        "--volume-scratch", default=None, help="with --volume: the container's own directory for the store"
    )
    parser.add_argument("--run", dest="run_id", required=True, help="the run whose versions to serve")
    parser.add_argument("--port", type=int, required=True, help="the public port (the sidecar's)")
    parser.add_argument("--host", default="127.0.0.1", help="address the sidecar binds (default 127.0.0.1)")
    parser.add_argument(
        "--engine-port", type=tcp_port, default=None, help="the engine's private port (default: free)"
    )
    parser.add_argument("--stage-dir", required=True, help="local directory the versions are staged into")
    parser.add_argument("--router", default=None, help="router URL to report to")
    parser.add_argument("--replica-id", default=None, help="replica id (default <group>-<host>-<port>)")
    parser.add_argument("--advertise-url", default=None, help="URL the router should use for this replica")
    parser.add_argument(
        "--engine-command",
        default=None,
        help="the engine's command line, with {model}, {port} and {version} (default: the local CPU engine)",
    )
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="local engine: torch threads (default 1)"
    )
    parser.add_argument("--log-dir", default=None, help="one log file per process here (default: stdout)")
    parser.add_argument(
        "--ready-timeout", type=seconds, default=1800.0, help="seconds to wait for the engine and sidecar"
    )
    parser.add_argument(
        "--sidecar-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra flag for the sidecar (repeat; e.g. --sidecar-flag=--poll-s --sidecar-flag=0.2)",
    )


def run(args: argparse.Namespace) -> int:
    from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG
    from core.tcp import free_port
    from fleet.specs import load_preset
    from launcher.children import engine_argv, mixfleet_command
    from replica.entrypoint import run_replica
    from weight_sync.store import StoreLocation

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.router and not args.router.startswith(("http://", "https://")):
        raise UserError(f"--router must be an http(s) URL, got {args.router!r}")
    if args.engine_threads < 1:
        raise UserError(f"--engine-threads must be >= 1, got {args.engine_threads}")
    fleet = load_preset(args.preset)
    try:
        group = fleet.group(args.group)
    except KeyError:
        known = ", ".join(g.name for g in fleet.groups)
        raise UserError(f"preset {fleet.name!r} has no group {args.group!r} (groups: {known})") from None
    root = Path(args.store).expanduser()
    if not root.is_dir():
        raise UserError(f"store root {root} does not exist")
    port = args.engine_port or free_port("127.0.0.1")

    stage_dir = make_dir(Path(args.stage_dir).expanduser(), "--stage-dir")
    if args.engine_command:
        template = shlex.split(args.engine_command)
        if not template or shutil.which(template[0]) is None:
            program = template[0] if template else ""
            raise UserError(f"--engine-command: no program {program!r} to run (not found, or not executable)")
        try:
            [part.format(model="m", port="1", version="0") for part in template]
        except (KeyError, IndexError, ValueError) as exc:
            raise UserError(
                f"--engine-command: cannot fill in {exc} (it may name {{model}}, {{port}} and {{version}})"
            ) from None

        def argv(model: str, version: str | None) -> list[str]:
            return [part.format(model=model, port=port, version=version or "") for part in template]

    else:

        def argv(model: str, version: str | None) -> list[str]:
            local = engine_argv(
                Path(model),
                port,
                int(version or 0),
                threads=args.engine_threads,
                kv_cache_dtype=group.kv_cache_dtype,
                flags=(ENABLE_RETURN_ROUTED_EXPERTS_FLAG,),  # as mixfleet up's: GroupSpec.returns_routes
            )
            return [*mixfleet_command(), *local]

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    scratch = Path(args.volume_scratch).expanduser() if args.volume_scratch else None
    run_replica(
        group=group,
        run_id=args.run_id,
        store=StoreLocation(root, volume=args.volume, scratch=scratch),
        stage_dir=stage_dir,
        engine_argv=argv,
        engine_port=port,
        public_port=args.port,
        host=args.host,
        router_url=args.router.rstrip("/") if args.router else None,
        replica_key=os.environ.get("MIXFLEET_API_KEY") or None,
        public_url=args.advertise_url,
        replica_id=args.replica_id,
        log_dir=Path(args.log_dir).expanduser() if args.log_dir else None,
        stop=stop,
        ready_timeout_s=args.ready_timeout,
        sidecar_flags=tuple(args.sidecar_flag),
    )
    return 0

"""Run a replica's sidecar: proxy its engine, activate published weight versions, heartbeat.

``mixfleet sidecar --engine URL --group G --format F --store ROOT [--volume NAME] --run R --port P
[--router URL] [--replica-id ID]``. The router key for heartbeats comes from
``MIXFLEET_API_KEY``: a key of the router's ``replica`` scope, which admits heartbeats and nothing
else (``mixfleet up`` makes one for its sidecars). See :mod:`replica.sidecar` for the contract.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import tempfile
from pathlib import Path

from core.errors import UserError
from core.formats import FORMATS
from mixfleet.argtypes import log_level, seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", required=True, help="the engine's base URL (http://127.0.0.1:PORT)")
    parser.add_argument("--group", required=True, help="the sampler group this replica belongs to")
    parser.add_argument(
        "--format",
        dest="weight_format",
        required=True,
        choices=FORMATS,
        help="the weight format the group serves",
    )
    parser.add_argument(
        "--store", required=True, help="the version store's root directory (with --volume: its mount path)"
    )
    parser.add_argument(
        "--volume", default=None, help="the Modal Volume mounted at --store that holds the store (on Modal)"
    )
    parser.add_argument(
        "--volume-scratch",
        default=None,
        help="with --volume: the container's own directory for the store's lock (default: a temp dir)",
    )
    parser.add_argument("--run", dest="run_id", required=True, help="the run whose versions to serve")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--router", default=None, help="router URL to send heartbeats to")
    parser.add_argument("--replica-id", default=None, help="replica id (default <group>-<host>-<port>)")
    parser.add_argument(
        "--advertise-url",
        default=None,
        help="URL the router should use for this replica (default http://HOST:PORT)",
    )
    parser.add_argument(
        "--staging-dir",
        default=None,
        help="local directory for staged versions (default: a per-replica temp dir)",
    )
    parser.add_argument(
        "--stage-mode",
        choices=("copy", "inplace"),
        default="copy",
        help="copy versions next to the engine (default) or verify and load them in place",
    )
    parser.add_argument(
        "--stage-rate-mb",
        type=float,
        default=None,
        help="cap staging reads at this many MB/s (default: unlimited)",
    )
    parser.add_argument(
        "--poll-s", type=float, default=0.5, help="pointer poll interval, <= 1 s (default 0.5)"
    )
    parser.add_argument("--heartbeat-s", type=seconds, default=1.0, help="heartbeat interval (default 1)")
    parser.add_argument(
        "--backoff-max-s", type=seconds, default=30.0, help="longest retry backoff (default 30)"
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="times a supervisor restarted this replica before (exported as mixfleet_replica_restarts_total)",
    )
    parser.add_argument(
        "--log-level", type=log_level, default="info", help="uvicorn/log level (default info)"
    )


def run(args: argparse.Namespace) -> int:
    import logging

    import prometheus_client
    import uvicorn

    from core.process import raise_open_file_limit
    from replica.sidecar import ReconcileSettings, SidecarConfig, create_app
    from weight_sync.store import open_store

    if not args.engine.startswith(("http://", "https://")):
        raise UserError(f"--engine must be an http(s) URL, got {args.engine!r}")
    if args.router and not args.router.startswith(("http://", "https://")):
        raise UserError(f"--router must be an http(s) URL, got {args.router!r}")
    if not 0 < args.poll_s <= 1.0:
        raise UserError(f"--poll-s must be in (0, 1], got {args.poll_s}")
    if args.stage_rate_mb is not None and not 0 < args.stage_rate_mb < math.inf:
        raise UserError(f"--stage-rate-mb must be > 0 and finite, got {args.stage_rate_mb}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.restarts < 0:
        raise UserError(f"--restarts must be >= 0, got {args.restarts}")
    root = Path(args.store).expanduser()
    if not root.is_dir():
        raise UserError(f"store root {root} does not exist")
    host_name = args.host if args.host not in ("0.0.0.0", "::") else socket.gethostname()
    replica_id = args.replica_id or f"{args.group}-{host_name}-{args.port}"
    advertise = (
        args.advertise_url
        or f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    ).rstrip("/")
    staging = (
        Path(args.staging_dir).expanduser()
        if args.staging_dir
        else (Path(tempfile.gettempdir()) / f"mixfleet-staging-{replica_id}")
    )
    settings = ReconcileSettings(
        group=args.group,
        weight_format=args.weight_format,
        run_id=args.run_id,
        replica_id=replica_id,
        advertise_url=advertise,
        staging_dir=staging,
        stage_mode=args.stage_mode,
        stage_rate_bytes_per_s=args.stage_rate_mb * 1e6 if args.stage_rate_mb else None,
        poll_s=args.poll_s,
        heartbeat_s=args.heartbeat_s,
        backoff_max_s=args.backoff_max_s,
        restarts=args.restarts,
    )
    config = SidecarConfig(
        engine_url=args.engine.rstrip("/"),
        reconcile=settings,
        router_url=args.router.rstrip("/") if args.router else None,
        api_key=os.environ.get("MIXFLEET_API_KEY") or None,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise_open_file_limit()
    prometheus_client.disable_created_metrics()  # counters export their _total only
    scratch = Path(args.volume_scratch).expanduser() if args.volume_scratch else None
    app = create_app(config, open_store(root, volume=args.volume, scratch=scratch))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0

"""Write the cost report (report.html, report.md, report.json) from a router's ledger or a ledger file.

``mixfleet report --out DIR`` reads ``GET /v1/ledger`` and ``GET /v1/groups`` (each group's
mismatch) from the router named by ``--router`` or ``MIXFLEET_URL`` with the key in
``MIXFLEET_API_KEY`` (else ``.mixfleet/api_key``; scope ``trainer`` or ``admin``);
``--ledger FILE`` (and optionally ``--groups FILE``) reads the same JSON from files instead. DIR
receives ``report.html`` (self-contained), ``report.md`` with its PNG plots, ``report.json`` and
the ledger it was built from (``ledger.json``, readable again with ``--ledger``). The what-if
baseline is a group of ``--baseline-preset`` serving the same tokens at
``--baseline-tokens-per-s`` per replica; without that flag it is a group of the ledger itself at
its measured throughput (``--baseline-group``, else its first BF16 group that served tokens;
:func:`router.report.measured_baseline`), and the report says which it used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from core.errors import UserError
from mixfleet.argtypes import seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write the report into")
    parser.add_argument(
        "--router", default=None, help="router URL (default $MIXFLEET_URL or http://127.0.0.1:8300)"
    )
    parser.add_argument("--ledger", default=None, metavar="FILE", help="read the ledger JSON from FILE")
    parser.add_argument(
        "--groups", default=None, metavar="FILE", help="with --ledger: the /v1/groups JSON (mismatch)"
    )
    parser.add_argument(
        "--baseline-preset", default="homogeneous", help="preset of the what-if fleet (default homogeneous)"
    )
    parser.add_argument(
        "--baseline-group",
        default=None,
        help="group of that preset (default: its first group); without --baseline-tokens-per-s, the "
        "ledger's group whose measured throughput is the baseline (default: its first BF16 group "
        "with tokens)",
    )
    parser.add_argument(
        "--baseline-tokens-per-s",
        type=float,
        default=None,
        metavar="N",
        help="the baseline's stated generated tokens/s per replica (default: measured in the ledger)",
    )
    parser.add_argument("--timeout", type=seconds, default=60.0, help="seconds per router call")


def _read_json(path: str, what: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} file not found: {p}")
    try:
        return json.loads(p.read_text())
    except ValueError as exc:
        raise UserError(f"{p}: not JSON: {exc}") from None


async def _fetch(url: str, key: str | None, timeout: float) -> tuple[Any, Any]:
    from clients.router import RouterClient, open_session

    async with open_session() as http:
        client = RouterClient(http, url, key, timeout)
        return await client.call("GET", "/v1/ledger"), await client.call("GET", "/v1/groups")


def baseline(preset: str, group: str | None, tokens_per_s: float | None):
    """The what-if :class:`router.report.Baseline`, or None without a stated throughput."""
    from fleet.specs import load_preset
    from router.report import Baseline

    if tokens_per_s is None:
        return None
    if not tokens_per_s > 0:
        raise UserError(f"--baseline-tokens-per-s must be > 0, got {tokens_per_s:g}")
    fleet = load_preset(preset)
    try:
        spec = fleet.groups[0] if group is None else fleet.group(group)
    except KeyError:
        known = ", ".join(g.name for g in fleet.groups)
        raise UserError(
            f"--baseline-group: preset {fleet.name!r} has no group {group!r} (known: {known})"
        ) from None
    return Baseline(
        preset=fleet.name,
        group=spec.name,
        accelerator=spec.accelerator,
        weight_format=spec.weight_format,
        kv_cache_dtype=spec.kv_cache_dtype,
        gpus_per_replica=spec.gpus_per_replica,
        price_per_gpu_hour=spec.price_per_gpu_hour,
        price_date=spec.price_date.isoformat() if spec.price_date else None,
        price_source=spec.price_source,
        tokens_per_s_per_replica=tokens_per_s,
    )


def run(args: argparse.Namespace) -> int:
    from router.report import build
    from router.report_render import write

    base = baseline(args.baseline_preset, args.baseline_group, args.baseline_tokens_per_s)
    if args.ledger is not None and args.router is not None:
        raise UserError("--ledger and --router exclude each other (read the ledger from one place)")
    if args.ledger is not None:
        ledger = _read_json(args.ledger, "ledger")
        groups = _read_json(args.groups, "groups") if args.groups else None
        source = str(args.ledger)
    else:
        if args.groups:
            raise UserError("--groups needs --ledger (with a router, /v1/groups is read from it)")
        from clients.router import api_key, router_url

        source = router_url(args.router)
        ledger, groups = asyncio.run(_fetch(source, api_key(), args.timeout))
    if not isinstance(ledger, dict) or (groups is not None and not isinstance(groups, dict)):
        raise UserError("the ledger and groups JSON must be objects (GET /v1/ledger, GET /v1/groups)")
    try:
        measure = args.baseline_group if base is None else None
        report = build(ledger, groups, base, source=source, measure_group=measure)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"cannot build the report from {source}: {exc}") from None
    try:
        paths = write(report, args.out)
        (Path(args.out) / "ledger.json").write_text(json.dumps(ledger, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write the report into {args.out}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a field of another type than its own
        raise UserError(f"cannot render the report from {source}: {type(exc).__name__}: {exc}") from None
    for kind in ("html", "md", "json"):
        print(paths[kind])
    return 0

"""Scale the deployed groups to demand (mixfleet scale [--preset P] [--router URL] [--dry-run] [--app NAME]).

Reads the demand from the router's ``GET /v1/groups`` (active sessions, the requests replicas report
queued, capacities, token and session counts of the whole run and of the routing window), computes
every group's min / max / buffer containers by :mod:`fleet.autoscale`'s rule within the preset's
bounds, prints one line per group and, unless ``--dry-run``, applies them with Modal's
``Server.autoscaler.update`` (needs a Modal token; a redeploy resets the overrides). The router URL
and key come from ``--router`` / ``MIXFLEET_URL`` (else ``mixfleet up``'s) and ``MIXFLEET_API_KEY``.
A router that serves none of the preset's groups (another fleet's, e.g. ``mixfleet up``'s against
the default ``mixed``) is refused with one line naming both
(:func:`fleet.autoscale.demand_from_groups`).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="mixed", help="mixed (default), homogeneous, or a TOML file")
    parser.add_argument(
        "--router", default=None, help="router URL (default $MIXFLEET_URL or http://127.0.0.1:8300)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the settings; apply nothing")
    parser.add_argument("--app", default=None, help="the deployed Modal app (default: the deploy's name)")
    parser.add_argument("--env", default=None, help="Modal environment (default: the profile's)")


async def _groups(url: str, key: str | None) -> Any:
    from clients.router import RouterClient, open_session

    http = open_session()
    try:
        return await RouterClient(http, url, key, timeout=30.0).call("GET", "/v1/groups")
    finally:
        await http.close()


def describe(settings: list[Any], demand: Any) -> list[str]:
    """One line per group: its demand and the settings for it."""
    from fleet.autoscale import length_trend

    lines = [f"length trend {length_trend(demand.tokens_per_session):.3f} (tokens/session: "
             + ", ".join(f"{x:.1f}" for x in demand.tokens_per_session) + ")"]  # fmt: skip
    for s in settings:
        d = demand.groups.get(s.group)
        active, queued, share = (d.active_sessions, d.queued_sessions, d.target_share) if d else (0, 0, 0.0)
        lines.append(
            f"{s.group}: active {active}, queued {queued}, share {share:.3f} -> min {s.min_containers}, "
            f"max {s.max_containers}, buffer {s.buffer_containers}, scaledown {s.scaledown_window}s, "
            f"target concurrency {s.target_concurrency}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from clients.router import api_key, router_url
    from core.errors import UserError
    from deploy import autoscaler
    from deploy.plan import APP_NAME, PresetRejected, load_plan
    from fleet.autoscale import DemandError, GroupBounds, demand_from_groups, scale_settings

    try:
        plan = load_plan(args.preset)
    except PresetRejected as exc:
        raise UserError(next(p.text() for p in exc.problems if p.level == "error")) from None
    bounds = [GroupBounds.of(s.group) for s in plan.servers]
    snapshot = asyncio.run(_groups(router_url(args.router), api_key()))
    try:
        demand = demand_from_groups(snapshot, bounds)
        settings = scale_settings(bounds, demand)
    except DemandError as exc:
        raise UserError(f"the router's /v1/groups answer: {exc}") from None
    for line in describe(settings, demand):
        print(line)
    if args.dry_run:
        return 0
    import modal.exception

    try:
        autoscaler.apply(settings, plan, app_name=args.app or APP_NAME, environment_name=args.env)
    except autoscaler.ClientMismatch as exc:
        raise UserError(str(exc)) from None
    except (modal.exception.Error, OSError) as exc:  # no token, app not deployed, a value refused
        raise UserError(f"modal: {type(exc).__name__}: {exc}") from None
    print(f"applied to {len(settings)} server(s) of app {args.app or APP_NAME}")
    return 0

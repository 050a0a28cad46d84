"""The cost ledger's route: ``GET /v1/ledger`` (scope ``trainer`` or ``admin``), the ledger as
JSON (:class:`LedgerView`), which ``mixfleet report`` reads.

Every group of the preset is listed in preset order (zeros until something is booked), then any
group the ledger holds that the preset no longer names (its spec fields null); the versions in
the same group order, each group's unreported one (null) first, then ascending. Updates carry
their cost by :func:`router.ledger.update_costs`. The state keeps per group the latest
``--keep-versions`` versions and the latest ``--keep-updates`` updates (:mod:`router.ledger`,
Bounds): ``earlier_versions`` and ``earlier_updates`` hold what was rolled up, so every total
still adds up.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from fleet.specs import FleetSpec
from router.auth import require
from router.errors import AUTH, error_responses
from router.json_route import JsonRoute
from router.ledger import EarlierUpdates as EarlierUpdatesRecord
from router.ledger import LedgerSnapshot, LedgerTotals, update_costs

router = APIRouter(tags=["trainer"], responses=error_responses(*AUTH), route_class=JsonRoute)


class GroupLedger(BaseModel):
    name: str
    accelerator: str | None
    weight_format: str | None
    kv_cache_dtype: str | None
    gpus_per_replica: int | None
    price_per_gpu_hour: float | None
    price_date: str | None
    price_source: str | None
    price_verified: bool
    replica_seconds: float
    gpu_seconds: float
    cost_dollars: float
    tokens: int
    sessions: int


class VersionLedger(BaseModel):
    group: str
    version: int | None
    replica_seconds: float
    gpu_seconds: float
    cost_dollars: float
    tokens: int


class UpdateLedger(BaseModel):
    seq: int
    at: float
    trajectories: int
    tokens: int
    cost_dollars: float
    cost_by_group: dict[str, float]


class EarlierVersions(BaseModel):
    """A group's versions rolled up: every version below its lowest one in ``versions``."""

    group: str
    replica_seconds: float
    gpu_seconds: float
    cost_dollars: float
    tokens: int


class EarlierUpdates(BaseModel):
    """The updates rolled up (``seq`` 1 .. ``through_seq``), their cost summed."""

    updates: int
    through_seq: int
    trajectories: int
    tokens: int
    cost_dollars: float
    cost_by_group: dict[str, float]


class LedgerView(BaseModel):
    """The ledger at ``generated_at`` (wall clock): ``span_s`` is how long one observation of a
    replica books (:mod:`router.ledger`)."""

    generated_at: float
    fleet: str
    span_s: float
    groups: list[GroupLedger]
    versions: list[VersionLedger]
    updates: list[UpdateLedger]
    earlier_versions: list[EarlierVersions]
    earlier_updates: EarlierUpdates


def ledger_view(snap: LedgerSnapshot, fleet: FleetSpec, span_s: float, now: float) -> dict[str, Any]:
    """The JSON of :class:`LedgerView` for ``snap`` and the preset ``fleet``."""
    names = [g.name for g in fleet.groups] + sorted(set(snap.groups) - {g.name for g in fleet.groups})
    groups = []
    for name in names:
        t = snap.groups.get(name, LedgerTotals())
        spec = next((g for g in fleet.groups if g.name == name), None)
        groups.append(
            {
                "name": name,
                "accelerator": spec and spec.accelerator,
                "weight_format": spec and spec.weight_format,
                "kv_cache_dtype": spec and spec.kv_cache_dtype,
                "gpus_per_replica": spec and spec.gpus_per_replica,
                "price_per_gpu_hour": spec and spec.price_per_gpu_hour,
                "price_date": spec.price_date.isoformat() if spec and spec.price_date else None,
                "price_source": spec and spec.price_source,
                "price_verified": bool(spec and spec.price_verified),
                "replica_seconds": t.replica_seconds,
                "gpu_seconds": t.gpu_seconds,
                "cost_dollars": t.cost_dollars,
                "tokens": t.tokens,
                "sessions": t.sessions,
            }
        )
    order = {n: i for i, n in enumerate(names)}
    versions = [
        {"group": g, "version": v, **_money(t)}
        for (g, v), t in sorted(
            snap.versions.items(),
            key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][0], -1 if kv[0][1] is None else kv[0][1]),
        )
    ]
    updates = [
        {
            "seq": u.seq,
            "at": u.at,
            "trajectories": u.trajectories,
            "tokens": u.tokens,
            "cost_dollars": u.cost_dollars,
            "cost_by_group": dict(u.cost_by_group),
        }
        for u in update_costs(snap.updates, snap.earlier_updates.cumulative_cost)
    ]
    earlier = sorted(snap.earlier.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))
    return {
        "generated_at": now,
        "fleet": fleet.name,
        "span_s": span_s,
        "groups": groups,
        "versions": versions,
        "updates": updates,
        "earlier_versions": [{"group": g, **_money(t)} for g, t in earlier],
        "earlier_updates": _earlier_updates(snap.earlier_updates),
    }


def _money(t: LedgerTotals) -> dict[str, Any]:
    return {
        "replica_seconds": t.replica_seconds,
        "gpu_seconds": t.gpu_seconds,
        "cost_dollars": t.cost_dollars,
        "tokens": t.tokens,
    }


def _earlier_updates(e: EarlierUpdatesRecord) -> dict[str, Any]:
    """:class:`EarlierUpdates`' JSON: the rolled-up updates cost what was booked until the last."""
    return {
        "updates": e.updates,
        "through_seq": e.through_seq,
        "trajectories": e.trajectories,
        "tokens": e.tokens,
        "cost_dollars": sum(e.cumulative_cost.values()),
        "cost_by_group": dict(e.cumulative_cost),
    }


@router.get(
    "/v1/ledger",
    response_model=LedgerView,
    dependencies=[Depends(require("trainer", "admin"))],
    summary="The cost ledger: per group, per version and per update (what `mixfleet report` reads)",
)
async def ledger(request: Request) -> dict[str, Any]:
    ctx = request.app.state.ctx
    return ledger_view(await ctx.store.ledger(), ctx.fleet, ctx.config.heartbeat_timeout_s, time.time())

"""Routing policy: pure functions from a snapshot of group loads (and replica views) to a choice.

Capacity of a group = sum over its ready replicas of ``sessions_per_replica``, times a
throughput factor once decode throughput is measured (a group that decodes more tokens/s per
session slot than the fleet's average gets proportionally more sessions; clamped to [1/4, 4]).

* ``capacity``: the healthy group with the smallest ``(active_sessions + 1) / capacity``;
  ties go to the lower cost per token, then to the name.
* ``round_robin``: healthy groups in turn.
* ``cost``: the cheapest healthy group (cost per token) that still has room
  (``active_sessions + 1 <= capacity``); when none has room, falls back to ``capacity``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Per-session decode rate assumed before a group reports throughput (tokens/s); only used to
# compare prices of groups that have not measured yet.
NOMINAL_TPS_PER_SESSION = 20.0
FACTOR_BOUNDS = (0.25, 4.0)


@dataclass(frozen=True)
class GroupLoad:
    name: str
    capacity: float
    active_sessions: int
    cost_per_token: float


@dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    group: str
    url: str
    active_version: int | None
    load: int


def throughput_factors(slots: dict[str, int], tps: dict[str, float | None]) -> dict[str, float]:
    """Per-group capacity correction from measured tokens/s per nominal session slot.

    Groups without a measurement (or without slots) get 1.0; the measured ones are scaled so
    their mean is 1.0, then clamped to ``FACTOR_BOUNDS``.
    """
    rates = {g: tps[g] / slots[g] for g in slots if slots[g] > 0 and (tps.get(g) or 0) > 0}
    out = {g: 1.0 for g in slots}
    if len(rates) < 2:
        return out
    mean = sum(rates.values()) / len(rates)
    lo, hi = FACTOR_BOUNDS
    for g, rate in rates.items():
        out[g] = min(hi, max(lo, rate / mean))
    return out


def cost_per_token(
    price_per_replica_hour: float, tokens_per_s_per_replica: float | None, sessions_per_replica: int
) -> float:
    """USD per generated token; uses the nominal rate when throughput is not measured yet."""
    tps = tokens_per_s_per_replica or sessions_per_replica * NOMINAL_TPS_PER_SESSION
    return price_per_replica_hour / 3600.0 / tps


def choose_group(policy: str, loads: Sequence[GroupLoad], turn: int = 0) -> str | None:
    """The group a new session goes to, or None when no group has capacity."""
    healthy = [g for g in loads if g.capacity > 0]
    if not healthy:
        return None
    if policy == "round_robin":
        ordered = sorted(healthy, key=lambda g: g.name)
        return ordered[turn % len(ordered)].name
    if policy == "cost":
        room = [g for g in healthy if g.active_sessions + 1 <= g.capacity]
        if room:
            return min(room, key=lambda g: (g.cost_per_token, g.active_sessions / g.capacity, g.name)).name
    elif policy != "capacity":
        raise ValueError(f"unknown policy {policy!r}")
    return min(healthy, key=lambda g: ((g.active_sessions + 1) / g.capacity, g.cost_per_token, g.name)).name


def choose_replica(
    candidates: Iterable[ReplicaView], affinity: str | None, exclude: set[str] | frozenset[str] = frozenset()
) -> ReplicaView | None:
    """The session's affinity replica when it is a candidate, else the least-loaded one."""
    usable = [r for r in candidates if r.replica_id not in exclude]
    if not usable:
        return None
    for r in usable:
        if r.replica_id == affinity:
            return r
    return min(usable, key=lambda r: (r.load, r.replica_id))

"""Autoscaling policy: from a fleet's demand to each sampler group's autoscaler settings. Pure: no
I/O, no clock, no Modal (the adapter that applies the settings is ``deploy.autoscaler``).

The rule (the contract), for each group g with the preset's bounds ``lo = min_replicas``,
``hi = max_replicas``, ``b = buffer_replicas`` and ``spr = sessions_per_replica``:

* fleet demand ``D = sum over groups of (active_g + queued_g)`` sessions;
* length trend ``L`` (:func:`length_trend`): tokens per session of the latest window over the
  mean of the earlier windows, clamped to ``[1/2, 2]``; 1 with fewer than two positive windows.
  Longer trajectories hold their session slots longer, so at a steady session rate the sessions
  open at once grow in proportion (Little's law);
* the group's demand ``d = L * max(active_g + queued_g, share_g * D)``: the sessions it holds, or
  its target share of the fleet's (the capacity policy's shares, :func:`capacity_shares`),
  whichever is more;
* replicas needed ``n = ceil(d / spr)`` (with a tolerance of 1e-9 against rounding);
* ``min_containers = clamp(n, lo, hi)``; ``max_containers = hi``;
* ``buffer_containers = min(b + ceil((L - 1) * n) if L > 1 else b, hi - min_containers)``: the
  preset's buffer plus the replicas one more window of the same growth would need;
* ``scaledown_window`` and ``target_concurrency`` stay the preset's (``scaledown_window_s``,
  ``sessions_per_replica``), so an update re-asserts what the deploy set.

What holds after :func:`scale_settings`: ``lo <= min_containers <= max_containers == hi``,
``0 <= buffer_containers <= hi - min_containers``; ``min_containers`` and ``min_containers +
buffer_containers`` never decrease when any group's active or queued sessions, the group's share
or the length trend grow; no demand gives ``min_containers == lo``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.specs import GroupSpec

TREND_BOUNDS = (0.5, 2.0)
_EPS = 1e-9


class DemandError(ValueError):
    """Demand the policy cannot use (``field`` names what is wrong)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GroupBounds:
    """What the preset allows a group: ``0 <= min_replicas <= max_replicas``, ``max_replicas >= 1``,
    ``0 <= buffer_replicas``, ``sessions_per_replica >= 1``, ``2 <= scaledown_window_s <= 3600``."""

    name: str
    sessions_per_replica: int
    min_replicas: int
    max_replicas: int
    buffer_replicas: int = 0
    scaledown_window_s: int = 300

    def __post_init__(self) -> None:
        if self.sessions_per_replica < 1:
            raise DemandError(
                f"{self.name}.sessions_per_replica", f"must be >= 1, got {self.sessions_per_replica}"
            )
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise DemandError(
                f"{self.name}.min_replicas",
                f"need 0 <= min ({self.min_replicas}) <= max ({self.max_replicas}) and max >= 1",
            )
        if self.buffer_replicas < 0:
            raise DemandError(f"{self.name}.buffer_replicas", f"must be >= 0, got {self.buffer_replicas}")
        if not 2 <= self.scaledown_window_s <= 3600:
            raise DemandError(
                f"{self.name}.scaledown_window_s", f"must be in 2..3600, got {self.scaledown_window_s}"
            )

    @classmethod
    def of(cls, group: GroupSpec) -> GroupBounds:
        """The bounds a preset's group sets."""
        return cls(
            name=group.name,
            sessions_per_replica=group.sessions_per_replica,
            min_replicas=group.min_replicas,
            max_replicas=group.max_replicas,
            buffer_replicas=group.buffer_replicas,
            scaledown_window_s=group.scaledown_window_s,
        )


@dataclass(frozen=True)
class GroupDemand:
    """One group's demand: sessions open on it, sessions waiting for it beyond those, and its
    target share of the fleet's sessions (in [0, 1])."""

    active_sessions: int = 0
    queued_sessions: int = 0
    target_share: float = 0.0


@dataclass(frozen=True)
class Demand:
    """The fleet's demand: per group, and the tokens per session of recent windows, oldest first."""

    groups: Mapping[str, GroupDemand] = field(default_factory=dict)
    tokens_per_session: Sequence[float] = ()


@dataclass(frozen=True)
class ScaleSettings:
    """One group's autoscaler settings (Modal's names; containers = replicas)."""

    group: str
    min_containers: int
    max_containers: int
    buffer_containers: int
    scaledown_window: int
    target_concurrency: int

    def update_kwargs(self) -> dict[str, int]:
        """The keyword arguments of Modal's ``Server.autoscaler.update`` for these settings."""
        return {
            "min_containers": self.min_containers,
            "max_containers": self.max_containers,
            "buffer_containers": self.buffer_containers,
            "scaledown_window": self.scaledown_window,
            "target_concurrency": self.target_concurrency,
        }


def length_trend(tokens_per_session: Sequence[float]) -> float:
    """``L`` of the module's rule: the latest window's tokens per session over the mean of the
    earlier ones, clamped to :data:`TREND_BOUNDS`; 1.0 unless the latest and at least one earlier
    window are positive and finite. Non-finite or non-positive earlier windows are left out."""
    values = [float(x) for x in tokens_per_session]
    if len(values) < 2 or not (math.isfinite(values[-1]) and values[-1] > 0):
        return 1.0
    earlier = [x for x in values[:-1] if math.isfinite(x) and x > 0]
    if not earlier:
        return 1.0
    low, high = TREND_BOUNDS
    return min(high, max(low, values[-1] / (sum(earlier) / len(earlier))))


def capacity_shares(capacities: Mapping[str, float], bounds: Iterable[GroupBounds]) -> dict[str, float]:
    """Target shares by the capacity policy's rule (a group's capacity over the fleet's,
    ``router.policy``), where a group with no capacity now (no ready replica) counts as one
    replica's sessions, so a group scaled to zero is owed a share and can be scaled up. Shares
    sum to 1 (empty for no groups). DemandError for a negative or non-finite capacity."""
    counted: dict[str, float] = {}
    for b in bounds:
        c = float(capacities.get(b.name, 0.0))
        if not math.isfinite(c) or c < 0:
            raise DemandError(f"{b.name}.capacity", f"must be a finite number >= 0, got {c}")
        counted[b.name] = c if c > 0 else float(b.sessions_per_replica)
    total = sum(counted.values())
    return {name: c / total for name, c in counted.items()} if total else {}


def _check(bounds: Sequence[GroupBounds], demand: Demand) -> None:
    names = [b.name for b in bounds]
    if len(set(names)) != len(names):
        raise DemandError("groups", f"names repeat: {names}")
    unknown = sorted(set(demand.groups) - set(names))
    if unknown:
        raise DemandError("demand", f"unknown group(s) {', '.join(unknown)} (known: {', '.join(names)})")
    total_share = 0.0
    for name, d in demand.groups.items():
        for what, value in (("active_sessions", d.active_sessions), ("queued_sessions", d.queued_sessions)):
            if value < 0:
                raise DemandError(f"{name}.{what}", f"must be >= 0, got {value}")
        if not (math.isfinite(d.target_share) and 0.0 <= d.target_share <= 1.0):
            raise DemandError(f"{name}.target_share", f"must be in [0, 1], got {d.target_share}")
        total_share += d.target_share
    if total_share > 1.0 + 1e-6:
        raise DemandError("target_share", f"shares sum to {total_share:.6g} > 1")


def scale_settings(bounds: Sequence[GroupBounds], demand: Demand) -> list[ScaleSettings]:
    """Every group's settings by the module's rule, in the order of ``bounds`` (a group missing
    from ``demand`` has none). Raises :class:`DemandError` for demand that names an unknown group,
    a negative count, a share outside [0, 1] or shares summing beyond 1."""
    _check(bounds, demand)
    trend = length_trend(demand.tokens_per_session)
    none = GroupDemand()
    fleet = sum(d.active_sessions + d.queued_sessions for d in demand.groups.values())
    out = []
    for b in bounds:
        d = demand.groups.get(b.name, none)
        wanted = trend * max(d.active_sessions + d.queued_sessions, d.target_share * fleet)
        needed = max(0, math.ceil(wanted / b.sessions_per_replica - _EPS))
        low = min(max(needed, b.min_replicas), b.max_replicas)
        growth = math.ceil((trend - 1.0) * needed - _EPS) if trend > 1.0 else 0
        buffer = min(b.buffer_replicas + max(0, growth), b.max_replicas - low)
        out.append(
            ScaleSettings(
                group=b.name,
                min_containers=low,
                max_containers=b.max_replicas,
                buffer_containers=buffer,
                scaledown_window=b.scaledown_window_s,
                target_concurrency=b.sessions_per_replica,
            )
        )
    return out


def demand_from_groups(snapshot: Mapping[str, Any], bounds: Sequence[GroupBounds]) -> Demand:
    """The demand a router's ``GET /v1/groups`` answer shows: per group ``active_sessions``, as
    queued the requests its replicas report waiting (each a session not being served now), the
    target share by :func:`capacity_shares` of the groups' ``capacity``; the length trend from two
    windows: tokens per session over the router's whole count (``tokens_total / sessions_total``)
    and over its routing window (``window_tokens / window_sessions``). Groups the answer lacks
    have no demand. DemandError naming the field when the answer is not that shape, and naming
    both sets of groups when the answer lists groups and none of them is in ``bounds`` (a router
    of another fleet: its demand is none of these groups', and scaling them by it would set every
    one to its bounds' minimum)."""
    groups = snapshot.get("groups") if isinstance(snapshot, Mapping) else None
    if not isinstance(groups, list):
        raise DemandError("groups", "the router's answer has no groups list")
    known = {b.name for b in bounds}
    rows: dict[str, Mapping[str, Any]] = {}
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping) or not isinstance(g.get("name"), str):
            raise DemandError(f"groups[{i}]", "is not a group object with a name")
        if g["name"] in known:
            rows[g["name"]] = g
    if groups and not rows:
        theirs = ", ".join(sorted(g["name"] for g in groups))
        raise DemandError(
            "groups",
            f"the router serves {theirs}, none of the preset's groups ({', '.join(sorted(known))}): "
            "name the preset it was deployed with (--preset) or its URL (--router)",
        )

    def number(g: Mapping[str, Any], key: str) -> float:
        value = g.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise DemandError(f"{g['name']}.{key}", f"is not a number: {value!r}")
        return float(value)

    shares = capacity_shares({name: number(g, "capacity") for name, g in rows.items()}, bounds)
    per_group = {}
    for name, g in rows.items():
        queued = 0
        for r in g.get("replicas") or []:
            if isinstance(r, Mapping):
                queued += max(0, int(number({"name": name, **r}, "queued")))
        per_group[name] = GroupDemand(
            active_sessions=int(number(g, "active_sessions")),
            queued_sessions=queued,
            target_share=shares.get(name, 0.0),
        )
    sums = {key: sum(number(g, key) for g in rows.values()) for key in _WINDOW_KEYS}
    windows = [
        sums["tokens_total"] / sums["sessions_total"] if sums["sessions_total"] else 0.0,
        sums["window_tokens"] / sums["window_sessions"] if sums["window_sessions"] else 0.0,
    ]
    return Demand(groups=per_group, tokens_per_session=tuple(windows))


_WINDOW_KEYS = ("tokens_total", "sessions_total", "window_tokens", "window_sessions")

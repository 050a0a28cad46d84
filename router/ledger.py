"""The cost ledger's booking rules and records (pure: no I/O, no clock; times are wall-clock
seconds handed in by the caller).

**Replica time.** Every observation of a replica that is up at wall time ``t`` covers
``[t, t + span_s)``: a sidecar heartbeat, ready or still starting (the container runs and is
billed either way), and a static replica's health poll that answers ready. ``span_s`` is the
router's heartbeat timeout (a replica seen within it counts as alive). A replica's booked time
is the union of what its observations cover, in the order they arrive: it counts from its first
observation to its last plus at most ``span_s``; a silence longer than ``span_s`` is not booked;
an observation inside booked time adds only what it extends (so a replica observed by several
routers is booked once). :func:`charge` is that rule for one observation, given the replica's
booked-until mark.

**Money.** An observation's ``replica_seconds`` are booked to the replica's group and to its
active weight version at that moment (``None``: not reported), with
``gpu_seconds = replica_seconds x gpus_per_replica`` and
``cost_dollars = gpu_seconds x price_per_gpu_hour / 3600`` at the group's price when booked.

**Tokens and sessions.** Every recorded turn books its tokens to its group and to the weight
versions that generated them; every created session counts once for its group.

**Updates.** Each acknowledgement that acknowledges at least one trajectory closes an update
(``seq`` 1, 2, ...): the trajectories the trainer took and acknowledged for it, their tokens, and
the ledger's cumulative cost per group at that moment. :func:`update_costs`: update ``n`` cost
what every group booked between acknowledgement ``n - 1`` (or the ledger's start) and ``n`` —
the fleet's spend while that update was produced, tokens that went into no update included — so
the updates' costs add up to everything booked until the last acknowledgement. The router counts
each such acknowledgement in ``mixfleet_router_updates_total`` (:mod:`router.routes_trainer`,
``AckResult.update`` set), the denominator of the cost dashboard's dollars per update.

**Bounds** (:mod:`router.state.retention`). Per group the ledger keeps the ``keep_versions``
highest versions; older ones are rolled into the group's ``earlier`` totals. The latest
``keep_updates`` update records are kept; older ones are rolled into one
:class:`EarlierUpdates`, whose cumulative cost is what the first kept update's cost is measured
from. Group totals never lose anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Charge:
    """What one observation books; ``booked_until`` is the replica's mark afterwards."""

    replica_seconds: float
    gpu_seconds: float
    cost_dollars: float
    booked_until: float


@dataclass(frozen=True)
class LedgerTotals:
    """One group's (or one version's) totals."""

    replica_seconds: float = 0.0
    gpu_seconds: float = 0.0
    cost_dollars: float = 0.0
    tokens: int = 0
    sessions: int = 0


@dataclass(frozen=True)
class UpdateRecord:
    """One acknowledgement that closed an update, as stored: ``cumulative_cost`` is every group's
    booked cost (dollars) when it was acknowledged."""

    seq: int
    at: float
    trajectories: int
    tokens: int
    cumulative_cost: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class UpdateCost:
    """An update's cost by :func:`update_costs`' rule."""

    seq: int
    at: float
    trajectories: int
    tokens: int
    cost_by_group: Mapping[str, float]

    @property
    def cost_dollars(self) -> float:
        return sum(self.cost_by_group.values())


@dataclass(frozen=True)
class EarlierUpdates:
    """The update records rolled up (``seq`` 1 .. ``through_seq``): how many, their trajectories
    and tokens, and the last one's ``at`` and cumulative cost per group."""

    updates: int = 0
    through_seq: int = 0
    at: float = 0.0
    trajectories: int = 0
    tokens: int = 0
    cumulative_cost: Mapping[str, float] = field(default_factory=dict)

    def roll(self, u: UpdateRecord) -> EarlierUpdates:
        """These and ``u`` (the next record in order)."""
        return EarlierUpdates(
            self.updates + 1,
            u.seq,
            u.at,
            self.trajectories + u.trajectories,
            self.tokens + u.tokens,
            dict(u.cumulative_cost),
        )


@dataclass(frozen=True)
class LedgerSnapshot:
    """The whole ledger: per group, per (group, version) (version ``None``: not reported; its
    ``sessions`` stay 0), per group the ``earlier`` versions rolled up (every version below the
    group's lowest kept one), the kept updates in acknowledgement order and the ones rolled up
    before them."""

    groups: Mapping[str, LedgerTotals]
    versions: Mapping[tuple[str, int | None], LedgerTotals]
    updates: Sequence[UpdateRecord]
    earlier: Mapping[str, LedgerTotals] = field(default_factory=dict)
    earlier_updates: EarlierUpdates = field(default_factory=EarlierUpdates)


def charge(
    booked_until: float | None, at: float, span_s: float, gpus_per_replica: int, price_per_gpu_hour: float
) -> Charge:
    """Book an observation at ``at`` of a replica whose time is booked until ``booked_until``
    (None: never observed). Raises ValueError for a negative span, price or GPU count."""
    if span_s < 0 or price_per_gpu_hour < 0 or gpus_per_replica < 1:
        raise ValueError("span_s and price_per_gpu_hour must be >= 0 and gpus_per_replica >= 1")
    end = at + span_s
    start = at if booked_until is None else max(at, booked_until)
    seconds = max(0.0, end - start)
    gpu_seconds = seconds * gpus_per_replica
    until = end if booked_until is None else max(booked_until, end)
    return Charge(seconds, gpu_seconds, gpu_seconds * price_per_gpu_hour / SECONDS_PER_HOUR, until)


def version_tokens(spans: Sequence[Mapping[str, int]]) -> dict[int, int]:
    """Tokens per weight version of one turn from its ``weight_versions`` spans
    (``{"start", "end", "version"}``, end exclusive)."""
    out: dict[int, int] = {}
    for s in spans:
        n = int(s["end"]) - int(s["start"])
        if n > 0:
            out[int(s["version"])] = out.get(int(s["version"]), 0) + n
    return out


def update_costs(
    updates: Sequence[UpdateRecord], before: Mapping[str, float] | None = None
) -> list[UpdateCost]:
    """Each update's cost per group: its cumulative cost minus the previous update's (``before``
    for the first: the cumulative cost of the updates rolled up before it; a group missing from a
    record had booked nothing yet)."""
    out = []
    prev: Mapping[str, float] = before or {}
    for u in updates:
        groups = sorted(set(prev) | set(u.cumulative_cost))
        by_group = {g: u.cumulative_cost.get(g, 0.0) - prev.get(g, 0.0) for g in groups}
        out.append(UpdateCost(u.seq, u.at, u.trajectories, u.tokens, by_group))
        prev = u.cumulative_cost
    return out


def per_million(dollars: float, tokens: int) -> float | None:
    """Dollars per 1,000,000 tokens; None without tokens."""
    return dollars * 1e6 / tokens if tokens > 0 else None

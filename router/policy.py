"""Routing policy: which group a new session goes to, and which replica serves a turn.

Capacity of a group = sum over its ready replicas of ``sessions_per_replica``, times a
throughput factor once decode throughput is measured (a group that decodes more tokens/s per
session slot than the fleet's average gets proportionally more sessions; clamped to [1/4, 4]).

* ``capacity``: sessions are apportioned by capacity share, with a memory: the
  :class:`AssignmentWindow` of the fleet's latest assignments, kept in the state store and shared
  by every router on it. Balinski and Young's quota method over a sliding window: among the
  healthy candidates, a group may take the session while ``kept < share * (n + 1)``, where
  ``share`` is its capacity share among the candidates, ``kept`` its count among the window's
  entries that stay when one more is recorded and ``n`` the candidates' total of those (its upper
  quota); of those, the one with the largest ``capacity / (kept + 1)`` wins (D'Hondt's divisor).
  Ties go to the smaller live fill ``(active_sessions + 1) / capacity``, then the lower cost per
  token, then the name. (The quota keeps a large group from falling behind while small groups
  take their first sessions, which picking the most-owed group, ``share * (n + 1) - kept``, does
  not.)
  Contract: while the candidates and their capacities hold steady, after each assignment every
  group's count in the window is less than one session from its capacity share of the window,
  however many sessions are open (one at a time, all at once, or anything between); so over any
  run each group's share of the sessions assigned tracks its capacity share, to about one session
  per window length. A group that rejoins is owed its share of the window and gets new sessions
  first until it has it. Sessions are
  the unit apportioned: a group's share of generated tokens follows when sessions generate
  comparable token counts on every group; the window measures tokens so that this can be
  checked (``/v1/groups``), it does not steer by them.
* ``round_robin``: healthy groups in turn (the turn is the count of assignments the state store
  has recorded, so routers sharing a store take turns together).
* ``cost``: the cheapest healthy group (cost per token) that still has room
  (``active_sessions + 1 <= capacity``); when none has room, the one with the smallest live
  fill ``(active_sessions + 1) / capacity`` (ties to the cheaper, then the name).

:func:`assign_group` applies the configured policy to a router's live loads and records the
choice in the shared window (:meth:`router.state.base.StateStore.assign`: decided on exactly the
window it appends to, so concurrent assignments by any number of routers each see the ones before
them); this module never imports the router's context (it reads it through :class:`Placement`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.errors import unavailable
from router.state.base import StateStore, WindowEntry

# Per-session decode rate assumed before a group reports throughput (tokens/s); only used to
# compare prices of groups that have not measured yet.
NOMINAL_TPS_PER_SESSION = 20.0
FACTOR_BOUNDS = (0.25, 4.0)
WINDOW_SIZE = 256


@dataclass(frozen=True)
class GroupLoad:
    """One group as the policy sees it: ``capacity`` in sessions (0: not in rotation),
    ``active_sessions`` open now, ``cost_per_token`` in USD, ``tokens_total`` generated so far
    (as the state store counts them)."""

    name: str
    capacity: float
    active_sessions: int
    cost_per_token: float
    tokens_total: int = 0


class AssignmentWindow:
    """The groups of the latest ``size`` session assignments, oldest first, each with the state
    store's per-group token totals at the time it was made: a value, built from the store's
    window (:meth:`of`) or recorded into locally.

    After :meth:`record`, the window holds the last ``min(size, recorded)`` assignments.
    :meth:`sessions` counts them per group; :meth:`kept` counts the ones that stay when one more
    is recorded (all of them until the window is full); :meth:`tokens` is how many tokens each
    group generated since the oldest assignment in the window was made.
    """

    def __init__(self, size: int = WINDOW_SIZE) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1: {size}")
        self.size = size
        self._entries: deque[tuple[str, Mapping[str, int]]] = deque()
        self._counts: dict[str, int] = {}

    @classmethod
    def of(cls, entries: Iterable[WindowEntry], size: int = WINDOW_SIZE) -> AssignmentWindow:
        """The window holding the last ``size`` of ``entries`` (oldest first)."""
        window = cls(size)
        last = deque(entries, maxlen=size)
        window._entries = deque((e.group, e.tokens_total) for e in last)
        window._counts = dict(Counter(e.group for e in last))
        return window

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, group: str, tokens_total: Mapping[str, int] | None = None) -> None:
        """Append an assignment to ``group`` (dropping the oldest when full)."""
        if len(self._entries) == self.size:
            oldest, _ = self._entries.popleft()
            self._counts[oldest] -= 1
        self._entries.append((group, dict(tokens_total or {})))
        self._counts[group] = self._counts.get(group, 0) + 1

    def sessions(self) -> dict[str, int]:
        """Assignments in the window per group (groups without any are absent)."""
        return {g: n for g, n in self._counts.items() if n > 0}

    def kept(self) -> dict[str, int]:
        """Per group, the assignments that stay in the window when one more is recorded."""
        out = self.sessions()
        if len(self._entries) == self.size:
            oldest = self._entries[0][0]
            out[oldest] -= 1
            if out[oldest] == 0:
                del out[oldest]
        return out

    def tokens(self, tokens_total: Mapping[str, int]) -> dict[str, int]:
        """Per group in ``tokens_total`` (the totals now), the tokens generated since the oldest
        assignment in the window (0 each while it is empty; never negative)."""
        if not self._entries:
            return {g: 0 for g in tokens_total}
        base = self._entries[0][1]
        return {g: max(0, int(t) - int(base.get(g, 0))) for g, t in tokens_total.items()}


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


def _fill(g: GroupLoad) -> float:
    return (g.active_sessions + 1) / g.capacity


def choose_group(
    policy: str, loads: Sequence[GroupLoad], turn: int = 0, kept: Mapping[str, int] | None = None
) -> str | None:
    """The group a new session goes to, or None when no group has capacity.

    ``turn`` is the round-robin counter; ``kept`` the window's assignments that stay when this
    one is recorded (:meth:`AssignmentWindow.kept`; none when omitted), read by ``capacity``.
    """
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
        return min(healthy, key=lambda g: (_fill(g), g.cost_per_token, g.name)).name
    if policy != "capacity":
        raise ValueError(f"unknown policy {policy!r}")
    kept = kept or {}
    total_capacity = sum(g.capacity for g in healthy)
    n = sum(kept.get(g.name, 0) for g in healthy)

    def under_quota(g: GroupLoad) -> bool:  # one more keeps it within its quota (rounded: exact ties)
        return kept.get(g.name, 0) < round(g.capacity / total_capacity * (n + 1), 9)

    def priority(g: GroupLoad) -> float:  # D'Hondt's divisor: capacity per session it would hold
        return round(g.capacity / (kept.get(g.name, 0) + 1), 9)

    eligible = [g for g in healthy if under_quota(g)] or healthy
    return min(eligible, key=lambda g: (-priority(g), _fill(g), g.cost_per_token, g.name)).name


class Placement(Protocol):
    """What :func:`assign_group` reads of a router (its ``RouterContext`` is one)."""

    @property
    def policy(self) -> str: ...

    @property
    def store(self) -> StateStore:
        """The state store whose routing window the router shares."""
        ...

    async def current_loads(self) -> list[GroupLoad]:
        """Every group of the fleet, with its live capacity, load and token total."""
        ...


async def assign_group(ctx: Placement, exclude: Collection[str] = frozenset()) -> str:
    """The group a new session (or one that must leave its group) goes to, by ``ctx.policy``,
    among the groups not in ``exclude``. The choice is made on the store's window of the latest
    ``WINDOW_SIZE`` assignments and recorded in it (whatever the policy) in one atomic step
    (:meth:`~router.state.base.StateStore.assign`), so concurrent assignments, through this router
    or any other sharing the store, each see the ones before them. Raises a 503
    :class:`router.errors.ApiError` when no candidate group has a replica in rotation (nothing
    is recorded)."""
    loads = await ctx.current_loads()
    candidates = [g for g in loads if g.name not in exclude]
    tokens = {g.name: g.tokens_total for g in loads}
    policy = ctx.policy

    def decide(entries: Sequence[WindowEntry], seq: int) -> WindowEntry | None:
        kept = AssignmentWindow.of(entries, WINDOW_SIZE).kept()
        name = choose_group(policy, candidates, seq, kept)
        return None if name is None else WindowEntry(name, tokens)

    entry = await ctx.store.assign(decide, WINDOW_SIZE)
    if entry is None:
        raise unavailable("no sampler group has a replica in rotation", retry_after=2.0)
    return entry.group


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

"""The replica registry: which replicas exist, which are in rotation, and how loaded they are.

Two sources feed it: sidecars' heartbeats (``POST /v1/replicas/heartbeat``; shared between
routers through the state store) and the router's own health polls of replicas listed
statically in the preset; a request that succeeds on a ready replica also counts as a sign of
life (a busy engine may answer health polls late). A replica is in rotation when it reported ``ready`` within
``heartbeat_timeout_s``, is not in a failure cooldown (set after a failed request), and, when
``max_version_lag`` is set and versions are known, lags the latest version by at most that.
Times are ``time.monotonic()`` unless named ``wall``.

**Lost replicas.** A replica is :meth:`~Registry.lost` once it has gone ``heartbeat_timeout_s``
without a sign of health: no heartbeat or static poll that said ready, and no request it answered
(its reports say not ready: its engine refuses connections or does not answer ``/health``; or
they stopped). Its sidecar keeps reporting ready while it activates a version
(:meth:`replica.reconciler.Reconciler.engine_health`), so an activation, which pauses the engine,
never makes a replica lost; a busy engine that answers ``/health`` late leaves rotation at once
but is lost only once that has lasted the timeout. Every request sent to a replica runs inside
:meth:`~Registry.attempt`, whose future :meth:`~Registry.signal_lost` completes once the replica
is lost: the dispatcher then abandons the request (:mod:`router.dispatch`).

An entry is a replica id, not a URL: the containers of one Modal server share the server's one
URL, and each heartbeats with its own id (its sidecar's, ``<group>-<MODAL_TASK_ID>`` on Modal),
so the registry holds one entry per container, all with that URL. With :attr:`Registry.pins` set
(a fleet on Modal, :mod:`router.pinning`), a heartbeat replica is in rotation only while its
container is listed (it has an upstream): every request to it is pinned to that container, so the
router's choice of entry is where the request runs. A static replica of the preset is one entry
per listed URL, and a heartbeat from that URL and group updates it: do not list a Modal server's
URL statically.

**Load-aware affinity.** A replica whose reported queue (the engine's waiting requests, from its
heartbeats) has stayed above ``queue_bound`` for ``overload_hold_s`` is :meth:`overloaded`: the
dispatcher then sends its sessions' new turns to the least-loaded other replica of the group
(:mod:`router.dispatch`), so a replica that falls behind sheds load instead of keeping every
session hashed to it (affinity without load collapses prefix-cache hit rates: prime-rl issue
3255). A queue at or below the bound resets the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.specs import FleetSpec
from router.policy import GroupLoad, ReplicaView, cost_per_token, throughput_factors


@dataclass
class Replica:
    replica_id: str
    group: str
    url: str
    static: bool
    ready: bool = False
    active_version: int | None = None
    running: int = 0
    queued: int = 0
    tokens_per_s: float = 0.0
    error: str | None = None
    last_seen: float = -math.inf
    wall_seen: float = 0.0
    failed_until: float = -math.inf
    inflight: int = 0
    queue_high_since: float | None = None  # since when its queue has been above the affinity bound
    healthy_at: float = -math.inf  # the last sign of health: a ready report, or a request it answered

    def shared(self) -> dict[str, Any]:
        """What other routers learn through the state store."""
        return {
            "replica_id": self.replica_id,
            "group": self.group,
            "url": self.url,
            "ready": self.ready,
            "active_version": self.active_version,
            "running": self.running,
            "queued": self.queued,
            "tokens_per_s": self.tokens_per_s,
            "error": self.error,
            "wall_seen": self.wall_seen,
        }


class StaticReplicaTaken(ValueError):
    """A heartbeat named a replica the preset lists (``replica``) with another group or URL: it
    cannot take that entry over."""

    def __init__(self, replica: Replica, group: str, url: str) -> None:
        super().__init__(
            f"replica {replica.replica_id!r} is listed in the preset (group {replica.group!r}, "
            f"{replica.url}); a heartbeat of group {group!r} at {url} cannot take it over: give the "
            "sidecar another --replica-id"
        )
        self.replica = replica


class PinLookup(Protocol):
    def upstream(self, replica: str) -> str | None: ...


class Registry:
    def __init__(
        self,
        fleet: FleetSpec,
        *,
        heartbeat_timeout_s: float,
        max_version_lag: int | None,
        pins: PinLookup | None = None,
        queue_bound: int = 8,
        overload_hold_s: float = 5.0,
    ) -> None:
        self.fleet = fleet
        self.pins = pins
        self.queue_bound = queue_bound
        self.overload_hold_s = overload_hold_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_version_lag = max_version_lag
        self.replicas: dict[str, Replica] = {}
        self._attempts: dict[str, set[asyncio.Future[float]]] = {}  # replica id -> its attempts' futures
        for g in fleet.groups:
            for i, url in enumerate(g.replicas):
                rid = f"{g.name}/{i}"
                self.replicas[rid] = Replica(rid, g.name, url, static=True)

    def group_names(self) -> list[str]:
        return [g.name for g in self.fleet.groups]

    # updates ----------------------------------------------------------------------------
    def heartbeat(self, hb: dict[str, Any], now: float | None = None, wall: float | None = None) -> Replica:
        """Apply a sidecar heartbeat (already validated: group exists). A heartbeat for the URL
        of a statically listed replica of the same group updates that entry; one naming a static
        replica's id with another group or URL is :class:`StaticReplicaTaken` (nothing changed)."""
        now = time.monotonic() if now is None else now
        rid = hb["replica_id"]
        url = hb["url"].rstrip("/")
        r = self.replicas.get(rid)
        if r is not None and r.static and (r.group != hb["group"] or r.url != url):
            raise StaticReplicaTaken(r, hb["group"], url)
        if r is None:
            r = next(
                (x for x in self.replicas.values() if x.static and x.url == url and x.group == hb["group"]),
                None,
            )
        if r is None:
            r = self.replicas[rid] = Replica(rid, hb["group"], url, static=False)
        r.group = hb["group"]
        r.url = url
        r.ready = bool(hb["ready"])
        r.active_version = hb.get("active_version")
        r.running = int(hb.get("running") or 0)
        r.queued = int(hb.get("queued") or 0)
        if r.queued <= self.queue_bound:
            r.queue_high_since = None
        elif r.queue_high_since is None:
            r.queue_high_since = now
        r.tokens_per_s = float(hb.get("tokens_per_s") or 0.0)
        r.error = hb.get("error")
        r.last_seen = now
        if r.ready:
            r.healthy_at = now
        r.wall_seen = time.time() if wall is None else wall
        return r

    def merge_shared(
        self, shared: dict[str, dict[str, Any]], now: float | None = None, *, read_since: float | None = None
    ) -> None:
        """Adopt the replicas of the state store's map ``shared`` (newer ``wall_seen`` wins). With
        ``read_since`` (the wall time the map's read began) the map is the whole registry: a
        heartbeat replica missing from it and last seen before then was removed (by any router)
        and leaves this registry too; static replicas always stay."""
        now = time.monotonic() if now is None else now
        wall_now = time.time()
        if read_since is not None:
            for rid in [r.replica_id for r in self.replicas.values() if not r.static]:
                if rid not in shared and self.replicas[rid].wall_seen < read_since:
                    del self.replicas[rid]
        for rid, data in shared.items():
            mine = self.replicas.get(rid)
            if mine is not None and mine.wall_seen >= float(data.get("wall_seen", 0)):
                continue
            if data.get("group") not in self.group_names():
                continue
            wall = float(data.get("wall_seen", 0))
            with contextlib.suppress(StaticReplicaTaken):  # an entry a router took before: kept out
                self.heartbeat({**data, "replica_id": rid}, now=now - max(0.0, wall_now - wall), wall=wall)

    def poll_result(
        self,
        replica_id: str,
        *,
        ready: bool,
        version: int | None,
        error: str | None,
        now: float | None = None,
    ) -> None:
        r = self.replicas[replica_id]
        now = time.monotonic() if now is None else now
        r.ready = ready
        r.error = error
        if ready:
            r.last_seen = r.healthy_at = now
            r.wall_seen = time.time()
            r.active_version = version

    def touch(self, replica_id: str, now: float | None = None) -> None:
        """A request just succeeded on the replica: it is alive (passive health), so a busy
        engine that answers its health polls slowly does not leave rotation."""
        r = self.replicas.get(replica_id)
        if r is not None and r.ready:
            r.last_seen = max(r.last_seen, time.monotonic() if now is None else now)
            r.healthy_at = max(r.healthy_at, r.last_seen)

    @contextlib.contextmanager
    def attempt(self, replica_id: str) -> Iterator[asyncio.Future[float]]:
        """While a request runs on the replica: counted in its ``inflight``; the future it yields
        gets, once :meth:`signal_lost` finds the replica :meth:`lost`, the seconds it has gone
        without a sign of health. Call inside the event loop."""
        r = self.replicas.get(replica_id)
        if r is not None:
            r.inflight += 1
        lost: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        futures = self._attempts.setdefault(replica_id, set())
        futures.add(lost)
        try:
            yield lost
        finally:
            if r is not None:
                r.inflight -= 1
            futures.discard(lost)
            if not futures:
                del self._attempts[replica_id]

    def signal_lost(self, now: float | None = None) -> list[str]:
        """Complete the futures of the requests running (:meth:`attempt`) on every replica that is
        :meth:`lost` now; the ids of those replicas."""
        now = time.monotonic() if now is None else now
        lost = [rid for rid in self._attempts if self.lost(rid, now)]
        for rid in lost:
            silent = now - self.replicas[rid].healthy_at
            for future in self._attempts[rid]:
                if not future.done():
                    future.set_result(silent)
        return lost

    def mark_failed(self, replica_id: str, cooldown_s: float, error: str, now: float | None = None) -> None:
        r = self.replicas.get(replica_id)
        if r is not None:
            r.failed_until = (time.monotonic() if now is None else now) + cooldown_s
            r.error = error

    def remove(self, replica_id: str) -> bool:
        r = self.replicas.get(replica_id)
        if r is None or r.static:
            return False
        del self.replicas[replica_id]
        return True

    # queries ----------------------------------------------------------------------------
    def routable(self, r: Replica) -> bool:
        """Whether a request can be sent to ``r`` itself: always without pins; with pins, a static
        replica (its own URL) or one whose container is listed."""
        return self.pins is None or r.static or self.pins.upstream(r.replica_id) is not None

    def fresh(self, r: Replica, now: float) -> bool:
        return (
            r.ready
            and now - r.last_seen <= self.heartbeat_timeout_s
            and now >= r.failed_until
            and self.routable(r)
        )

    def lags(self, r: Replica, latest: int | None) -> bool:
        if self.max_version_lag is None or latest is None or r.active_version is None:
            return False
        return latest - r.active_version > self.max_version_lag

    def in_rotation(self, group: str, latest: int | None, now: float | None = None) -> list[Replica]:
        now = time.monotonic() if now is None else now
        return [
            r
            for r in self.replicas.values()
            if r.group == group and self.fresh(r, now) and not self.lags(r, latest)
        ]

    def lost(self, replica_id: str, now: float | None = None) -> bool:
        """Whether the replica has gone more than ``heartbeat_timeout_s`` without a sign of health
        (see the module docstring); False for a replica the registry does not hold."""
        r = self.replicas.get(replica_id)
        now = time.monotonic() if now is None else now
        return r is not None and now - r.healthy_at > self.heartbeat_timeout_s

    def overloaded(self, replica_id: str, now: float | None = None) -> bool:
        """Whether the replica's queue has stayed above ``queue_bound`` for ``overload_hold_s``."""
        r = self.replicas.get(replica_id)
        if r is None or r.queue_high_since is None:
            return False
        return (time.monotonic() if now is None else now) - r.queue_high_since >= self.overload_hold_s

    def serves(
        self, replica_id: str, group: str, latest: int | None, min_version: int | None
    ) -> Replica | None:
        """The replica, if it is one of ``views(group, latest, min_version=...)`` right now."""
        r = self.replicas.get(replica_id)
        if r is None or r.group != group or not self.fresh(r, time.monotonic()) or self.lags(r, latest):
            return None
        if min_version is not None and (r.active_version is None or r.active_version < min_version):
            return None
        return r

    def views(
        self, group: str, latest: int | None, *, min_version: int | None = None, now: float | None = None
    ) -> list[ReplicaView]:
        out = []
        for r in self.in_rotation(group, latest, now):
            if min_version is not None and (r.active_version is None or r.active_version < min_version):
                continue
            out.append(
                ReplicaView(r.replica_id, r.group, r.url, r.active_version, r.inflight + r.running + r.queued)
            )
        return out

    def active_version(self, group: str, latest: int | None = None) -> int | None:
        """The lowest version active on the group's replicas in rotation (None if unknown)."""
        versions = [r.active_version for r in self.in_rotation(group, latest) if r.active_version is not None]
        return min(versions) if versions else None

    def max_active_version(self) -> int | None:
        now = time.monotonic()
        versions = [
            r.active_version
            for r in self.replicas.values()
            if r.active_version is not None and self.fresh(r, now)
        ]
        return max(versions) if versions else None

    def group_loads(
        self,
        active: Mapping[str, int],
        tokens_total: Mapping[str, int] | None = None,
        latest: int | None = None,
        now: float | None = None,
    ) -> list[GroupLoad]:
        """Every group of the fleet, in preset order, as the policy sees it: capacity = replicas
        in rotation x ``sessions_per_replica`` x the group's throughput factor (from the mean
        tokens/s its measured replicas report, :func:`router.policy.throughput_factors`; 0 with
        no replica in rotation), ``active`` sessions (negative counts read as 0), cost per
        token from its price and measured rate, and its token total."""
        now = time.monotonic() if now is None else now
        tokens_total = tokens_total or {}
        slots: dict[str, int] = {}
        tps: dict[str, float | None] = {}
        per_replica_tps: dict[str, float | None] = {}
        for g in self.fleet.groups:
            reps = self.in_rotation(g.name, latest, now)
            slots[g.name] = len(reps) * g.sessions_per_replica
            measured = [r.tokens_per_s for r in reps if r.tokens_per_s > 0]
            tps[g.name] = sum(measured) * len(reps) / len(measured) if measured else None
            per_replica_tps[g.name] = sum(measured) / len(measured) if measured else None
        factors = throughput_factors(slots, tps)
        return [
            GroupLoad(
                g.name,
                slots[g.name] * factors[g.name],
                max(0, int(active.get(g.name, 0))),
                cost_per_token(g.price_per_replica_hour, per_replica_tps[g.name], g.sessions_per_replica),
                int(tokens_total.get(g.name, 0)),
            )
            for g in self.fleet.groups
        ]

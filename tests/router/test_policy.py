"""Routing policy as pure functions, and over the replica registry (heartbeats, timeouts, lag)."""

from __future__ import annotations

import random

import pytest

from fleet.specs import FleetSpec, GroupSpec
from router.policy import (
    GroupLoad,
    ReplicaView,
    choose_group,
    choose_replica,
    cost_per_token,
    throughput_factors,
)
from router.registry import Registry


def _fleet(*groups: tuple[str, int, float]) -> FleetSpec:
    return FleetSpec(
        name="t",
        groups=tuple(
            GroupSpec(name=n, accelerator="cpu", sessions_per_replica=s, max_replicas=8, price_per_gpu_hour=p)
            for n, s, p in groups
        ),
    )


def _hb(rid: str, group: str, **kw) -> dict:
    return {
        "replica_id": rid,
        "group": group,
        "url": f"http://127.0.0.1:1/{rid}",
        "ready": True,
        "active_version": kw.pop("version", 1),
        "running": 0,
        "queued": 0,
        "tokens_per_s": 0.0,
        "error": None,
        **kw,
    }


def _loads(reg: Registry, active: dict[str, int], latest: int | None = None) -> list[GroupLoad]:
    out = []
    for g in reg.fleet.groups:
        n = len(reg.in_rotation(g.name, latest))
        out.append(
            GroupLoad(
                g.name,
                n * g.sessions_per_replica,
                active.get(g.name, 0),
                cost_per_token(g.price_per_replica_hour, None, g.sessions_per_replica),
            )
        )
    return out


def test_capacity_policy_picks_smallest_fill_ratio_and_breaks_ties_by_cost() -> None:
    loads = [GroupLoad("a", 10, 4, 2.0), GroupLoad("b", 20, 9, 1.0), GroupLoad("c", 0, 0, 0.1)]
    assert choose_group("capacity", loads) == "b"  # (9+1)/20 = 0.5 < (4+1)/10
    tie = [GroupLoad("a", 10, 4, 2.0), GroupLoad("b", 20, 9, 1.0 + 1.0)]
    assert choose_group("capacity", tie) == "a"  # equal fill 0.5: lower cost per token wins
    assert choose_group("capacity", [GroupLoad("a", 0, 0, 1.0)]) is None


def test_round_robin_and_cost_policies() -> None:
    loads = [GroupLoad("b", 4, 0, 1.0), GroupLoad("a", 4, 0, 3.0), GroupLoad("z", 0, 0, 0.0)]
    assert [choose_group("round_robin", loads, i) for i in range(4)] == ["a", "b", "a", "b"]
    assert choose_group("cost", loads) == "b"
    full = [GroupLoad("b", 4, 4, 1.0), GroupLoad("a", 4, 1, 3.0)]
    assert choose_group("cost", full) == "a"  # the cheap group is full
    with pytest.raises(ValueError):
        choose_group("fastest", loads)


def test_throughput_factor_shifts_capacity_toward_faster_groups() -> None:
    f = throughput_factors({"fast": 8, "slow": 8, "new": 8}, {"fast": 300.0, "slow": 100.0, "new": None})
    assert f["new"] == 1.0
    assert f["fast"] == pytest.approx(1.5) and f["slow"] == pytest.approx(0.5)
    extreme = throughput_factors({"a": 1, "b": 1}, {"a": 1000.0, "b": 1.0})
    assert extreme["a"] <= 4.0 and extreme["b"] >= 0.25
    assert throughput_factors({"a": 8}, {"a": 50.0}) == {"a": 1.0}  # nothing to compare with


def test_replica_affinity_then_least_loaded() -> None:
    views = [ReplicaView("r1", "g", "u1", 1, 5), ReplicaView("r2", "g", "u2", 1, 1)]
    assert choose_replica(views, "r1").replica_id == "r1"
    assert choose_replica(views, None).replica_id == "r2"
    assert choose_replica(views, "r1", exclude={"r1"}).replica_id == "r2"
    assert choose_replica(views, None, exclude={"r1", "r2"}) is None


def test_registry_rotation_heartbeat_timeout_failure_cooldown_and_lag() -> None:
    reg = Registry(_fleet(("g", 4, 1.0)), heartbeat_timeout_s=5.0, max_version_lag=2)
    reg.heartbeat(_hb("r1", "g", version=10), now=100.0)
    reg.heartbeat(_hb("r2", "g", version=7), now=100.0)
    assert {r.replica_id for r in reg.in_rotation("g", latest=10, now=101.0)} == {"r1"}  # r2 lags 3 > 2
    assert {r.replica_id for r in reg.in_rotation("g", latest=None, now=101.0)} == {"r1", "r2"}
    assert reg.in_rotation("g", latest=10, now=106.0) == []  # heartbeat missed
    reg.heartbeat(_hb("r1", "g", version=10), now=110.0)
    reg.mark_failed("r1", cooldown_s=2.0, error="boom", now=110.0)
    assert reg.in_rotation("g", latest=10, now=111.0) == []
    assert [r.replica_id for r in reg.in_rotation("g", latest=10, now=112.5)] == ["r1"]
    reg.heartbeat(_hb("r1", "g", version=10, ready=False), now=113.0)
    assert reg.in_rotation("g", latest=10, now=113.0) == []
    views = reg.views("g", None, min_version=8, now=100.5)
    assert views == []  # r1 not ready, r2 below the minimum


def test_heartbeat_for_a_static_url_updates_that_replica() -> None:
    fleet = FleetSpec(name="t", groups=(GroupSpec(name="g", accelerator="cpu", replicas=("http://h:1",)),))
    reg = Registry(fleet, heartbeat_timeout_s=5.0, max_version_lag=None)
    reg.heartbeat({**_hb("side-1", "g"), "url": "http://h:1/"}, now=1.0)
    assert list(reg.replicas) == ["g/0"] and reg.replicas["g/0"].ready


@pytest.mark.parametrize("policy", ["capacity"])
def test_session_shares_track_capacity_shares_over_1000_sessions(policy: str) -> None:
    """Three groups of different capacity (replicas x sessions_per_replica = 64, 32, 8), in the
    registry through heartbeats; sessions open and finish at random; every new session is
    placed by the policy over the registry. Shares of placed sessions stay within 5 points of
    capacity shares."""
    fleet = _fleet(("big", 16, 6.25), ("mid", 16, 3.95), ("small", 8, 2.5))
    reg = Registry(fleet, heartbeat_timeout_s=10.0, max_version_lag=None)
    for i in range(4):
        reg.heartbeat(_hb(f"big-{i}", "big"))
    for i in range(2):
        reg.heartbeat(_hb(f"mid-{i}", "mid"))
    reg.heartbeat(_hb("small-0", "small"))
    capacity = {g.name: c for g, c in zip(fleet.groups, (64, 32, 8), strict=True)}
    rng = random.Random(7)
    active: dict[str, list[int]] = {g: [] for g in capacity}
    placed = {g: 0 for g in capacity}
    for s in range(1000):
        loads = _loads(reg, {g: len(v) for g, v in active.items()})
        assert {x.name: x.capacity for x in loads} == capacity
        group = choose_group(policy, loads, s)
        placed[group] += 1
        active[group].append(s)
        # sessions end at random: the longer-running fleet keeps ~80 sessions open
        while sum(len(v) for v in active.values()) > rng.randint(40, 90):
            everyone = [(g, i) for g, v in active.items() for i in range(len(v))]
            g, i = everyone[rng.randrange(len(everyone))]  # any open session, uniformly
            active[g].pop(i)
    total_cap = sum(capacity.values())
    for g in capacity:
        share, want = placed[g] / 1000, capacity[g] / total_cap
        assert abs(share - want) <= 0.05, (g, share, want, placed)


def test_a_served_request_keeps_a_ready_replica_fresh() -> None:
    reg = Registry(_fleet(("g", 4, 1.0)), heartbeat_timeout_s=5.0, max_version_lag=None)
    reg.heartbeat(_hb("r1", "g"), now=100.0)
    reg.touch("r1", now=104.0)
    assert [r.replica_id for r in reg.in_rotation("g", None, now=108.0)] == ["r1"]
    reg.heartbeat(_hb("r1", "g", ready=False), now=108.0)
    reg.touch("r1", now=109.0)  # a not-ready replica is not revived by traffic
    assert reg.in_rotation("g", None, now=109.0) == []

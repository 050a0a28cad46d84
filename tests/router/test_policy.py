"""Routing policy as pure functions, and over the replica registry (heartbeats, timeouts, lag)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from fastapi.testclient import TestClient

from fleet.specs import FleetSpec, GroupSpec, load_preset
from router.app import create_app
from router.config import RouterConfig
from router.errors import ApiError
from router.policy import (
    WINDOW_SIZE,
    AssignmentWindow,
    GroupLoad,
    ReplicaView,
    assign_group,
    choose_group,
    choose_replica,
    cost_per_token,
    throughput_factors,
)
from router.registry import Registry, StaticReplicaTaken
from router.state.memory import MemoryStore


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


class _Router:
    """What a router gives :func:`assign_group` (a :class:`router.policy.Placement`): a real
    registry's loads, a real (memory) state store holding the window, and the active sessions and
    token totals the state store would count."""

    def __init__(self, registry: Registry, policy: str = "capacity", *, stale_loads: bool = False) -> None:
        self.registry = registry
        self.policy = policy
        self.store = MemoryStore()
        self.active: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.stale_loads = stale_loads

    @property
    def window(self) -> AssignmentWindow:
        """The store's window now (read outside the tests' event loops)."""
        return AssignmentWindow.of(asyncio.run(self.store.window(WINDOW_SIZE)))

    async def current_loads(self) -> list[GroupLoad]:
        loads = self.registry.group_loads(self.active, self.tokens)
        if self.stale_loads:  # every concurrent caller reads the loads before any is placed
            await asyncio.sleep(0)
        return loads


def _registry(replicas: dict[str, int], sessions_per_replica: int = 8, tps: float = 0.0) -> Registry:
    """Groups named by ``replicas`` (all alike but for their replica counts), every replica in
    rotation through a heartbeat reporting ``tps`` tokens/s."""
    reg = Registry(
        _fleet(*((g, sessions_per_replica, 1.0) for g in replicas)),
        heartbeat_timeout_s=1e9,
        max_version_lag=None,
    )
    for g, n in replicas.items():
        for i in range(n):
            reg.heartbeat(_hb(f"{g}-{i}", g, tokens_per_s=tps))
    return reg


def _capacity_shares(reg: Registry) -> dict[str, float]:
    loads = reg.group_loads({})
    total = sum(x.capacity for x in loads)
    return {x.name: x.capacity / total for x in loads}


async def _sequential(router: _Router, n: int, rng: random.Random) -> Counter[str]:
    """``n`` sessions one after another: each is placed, generates 50-150 tokens and finishes
    before the next opens."""
    placed: Counter[str] = Counter()
    for _ in range(n):
        g = await assign_group(router)
        placed[g] += 1
        router.active[g] += 1
        router.tokens[g] += rng.randint(50, 150)
        router.active[g] -= 1
    return placed


def _assert_shares(placed: Counter[str], want: dict[str, float], points: float = 0.05) -> None:
    total = sum(placed.values())
    for g, share in want.items():
        assert abs(placed[g] / total - share) <= points, (g, placed[g] / total, share, placed)


def test_capacity_policy_owes_by_capacity_share_then_breaks_ties_by_fill_then_cost() -> None:
    loads = [GroupLoad("a", 10, 4, 2.0), GroupLoad("b", 20, 9, 1.0), GroupLoad("c", 0, 0, 0.1)]
    assert choose_group("capacity", loads) == "b"  # empty window: b is owed 2/3, a 1/3
    tie = [GroupLoad("a", 10, 4, 2.0), GroupLoad("b", 20, 9, 1.0 + 1.0)]
    assert choose_group("capacity", tie) == "b"  # the window, not the fill, decides first
    assert choose_group("capacity", tie, kept={"a": 0, "b": 1}) == "a"  # owed 2/3 vs 1/3
    assert choose_group("capacity", [GroupLoad("a", 0, 0, 1.0)]) is None
    equal = [GroupLoad("a", 10, 4, 1.0), GroupLoad("b", 10, 1, 2.0)]
    assert choose_group("capacity", equal) == "b"  # equally owed: smaller fill (1+1)/10
    assert choose_group("capacity", equal, kept={"b": 1}) == "a"
    same_fill = [GroupLoad("a", 10, 4, 2.0), GroupLoad("b", 10, 4, 1.0)]
    assert choose_group("capacity", same_fill) == "b"  # equal owed and fill: lower cost per token
    # the window counts only the candidates: a group out of rotation owes nothing
    assert choose_group("capacity", [GroupLoad("a", 10, 0, 1.0)], kept={"a": 5, "b": 9}) == "a"


def test_assignment_window_keeps_the_latest_assignments_and_their_tokens() -> None:
    w = AssignmentWindow(size=3)
    assert (w.sessions(), w.kept(), w.tokens({"a": 7})) == ({}, {}, {"a": 0})
    w.record("a", {"a": 10, "b": 0})
    w.record("b", {"a": 30, "b": 0})
    assert w.sessions() == w.kept() == {"a": 1, "b": 1}  # not full: nothing leaves
    w.record("b", {"a": 30, "b": 5})
    assert w.sessions() == {"a": 1, "b": 2} and w.kept() == {"b": 2}  # "a" is the next to leave
    assert w.tokens({"a": 40, "b": 25}) == {"a": 30, "b": 25}  # since the oldest entry (a=10, b=0)
    w.record("a", {"a": 50, "b": 25})
    assert w.sessions() == {"a": 1, "b": 2} and len(w) == 3
    assert w.tokens({"a": 60, "b": 25}) == {"a": 30, "b": 25}  # since (a=30, b=0)
    with pytest.raises(ValueError):
        AssignmentWindow(size=0)


def test_the_window_holds_every_group_within_one_session_of_its_capacity_share() -> None:
    """The policy's contract, over random fleets: after every assignment each group's count in
    the window differs from its capacity share of the window by less than one session."""
    rng = random.Random(11)
    fleets = [[GroupLoad(n, c, 0, 1.0) for n, c in (("g0", 1.0), ("g1", 7.0), ("g2", 100.0), ("g3", 100.0))]]
    for _ in range(60):  # capacities up to 512x apart (the most-owed rule fell 1.02 behind at 1/7/100/100)
        fleets.append([GroupLoad(f"g{i}", 2 ** rng.uniform(-1, 8), 0, 1.0) for i in range(rng.randint(2, 6))])
    for loads in fleets:
        total = sum(x.capacity for x in loads)
        w = AssignmentWindow(size=rng.choice([7, 32, 100, 1000]))
        for _ in range(400):
            w.record(choose_group("capacity", loads, kept=w.kept()) or "")
            counts = w.sessions()
            for x in loads:
                assert abs(counts.get(x.name, 0) - len(w) * x.capacity / total) < 1.0, (x, counts)


def test_round_robin_and_cost_policies() -> None:
    loads = [GroupLoad("b", 4, 0, 1.0), GroupLoad("a", 4, 0, 3.0), GroupLoad("z", 0, 0, 0.0)]
    assert [choose_group("round_robin", loads, i) for i in range(4)] == ["a", "b", "a", "b"]
    assert choose_group("cost", loads) == "b"
    full = [GroupLoad("b", 4, 4, 1.0), GroupLoad("a", 4, 1, 3.0)]
    assert choose_group("cost", full) == "a"  # the cheap group is full
    all_full = [GroupLoad("b", 4, 6, 1.0), GroupLoad("a", 4, 5, 3.0)]
    assert choose_group("cost", all_full) == "a"  # none has room: the smaller fill (5+1)/4
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


def test_a_replica_is_lost_after_the_heartbeat_timeout_without_a_sign_of_health() -> None:
    """Lost: no ready heartbeat or poll, and no answered request, for the heartbeat timeout. A
    not-ready report leaves rotation at once but is lost only once that has lasted the timeout;
    the futures of the requests running on a lost replica get its silence, others stay open."""
    reg = Registry(_fleet(("g", 4, 1.0)), heartbeat_timeout_s=5.0, max_version_lag=None)
    reg.heartbeat(_hb("r1", "g"), now=100.0)
    reg.heartbeat(_hb("r2", "g"), now=100.0)
    reg.heartbeat(_hb("r1", "g", ready=False), now=102.0)
    assert [r.replica_id for r in reg.in_rotation("g", None, now=102.0)] == ["r2"]
    assert not reg.lost("r1", now=105.0) and reg.lost("r1", now=105.5)
    reg.heartbeat(_hb("r2", "g"), now=104.0)
    reg.touch("r2", now=108.0)  # a request it answered is a sign of health
    assert not reg.lost("r2", now=112.9) and reg.lost("r2", now=113.1)
    assert not reg.lost("unknown", now=1e9)

    async def attempts() -> None:
        with reg.attempt("r1") as on_r1, reg.attempt("r2") as on_r2:
            assert (reg.replicas["r1"].inflight, reg.replicas["r2"].inflight) == (1, 1)
            assert reg.signal_lost(now=104.0) == [] and not on_r1.done()
            assert reg.signal_lost(now=110.0) == ["r1"]
            assert on_r1.result() == pytest.approx(10.0) and not on_r2.done()
        assert (reg.replicas["r1"].inflight, reg.replicas["r2"].inflight) == (0, 0)
        assert reg.signal_lost(now=1e9) == []  # nothing runs: nothing to signal

    asyncio.run(attempts())


def test_heartbeat_for_a_static_url_updates_that_replica() -> None:
    fleet = FleetSpec(name="t", groups=(GroupSpec(name="g", accelerator="cpu", replicas=("http://h:1",)),))
    reg = Registry(fleet, heartbeat_timeout_s=5.0, max_version_lag=None)
    reg.heartbeat({**_hb("side-1", "g"), "url": "http://h:1/"}, now=1.0)
    assert list(reg.replicas) == ["g/0"] and reg.replicas["g/0"].ready
    reg.heartbeat({**_hb("g/0", "g"), "url": "http://h:1"}, now=2.0)  # its own id, group and URL
    with pytest.raises(StaticReplicaTaken, match="'g/0' is listed in the preset"):
        reg.heartbeat({**_hb("g/0", "g"), "url": "http://other:2"}, now=3.0)
    assert reg.replicas["g/0"].url == "http://h:1" and reg.replicas["g/0"].last_seen == 2.0


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
    window = AssignmentWindow()
    for s in range(1000):
        loads = _loads(reg, {g: len(v) for g, v in active.items()})
        assert {x.name: x.capacity for x in loads} == capacity
        group = choose_group(policy, loads, s, window.kept())
        window.record(group)
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


def test_300_sessions_in_sequence_share_a_1_2_3_fleet_by_capacity() -> None:
    reg = _registry({"one": 1, "two": 2, "three": 3})
    want = _capacity_shares(reg)
    assert want == pytest.approx({"one": 1 / 6, "two": 2 / 6, "three": 3 / 6})
    router = _Router(reg)
    placed = asyncio.run(_sequential(router, 300, random.Random(3)))
    _assert_shares(placed, want)
    # the window saw all of it: its session and token shares track capacity too (sessions of
    # every group generate comparable token counts here)
    sessions = router.window.sessions()
    tokens = router.window.tokens(router.tokens)
    for g, share in want.items():
        assert abs(sessions[g] / sum(sessions.values()) - share) <= 0.05
        assert abs(tokens[g] / sum(tokens.values()) - share) <= 0.05, (g, tokens)


@pytest.mark.parametrize("stale_loads", [False, True])
def test_1000_concurrent_sessions_share_a_1_2_3_fleet_by_capacity(stale_loads: bool) -> None:
    """1,000 sessions placed while every earlier one is still open (none finish); with
    ``stale_loads`` every placement reads the loads before any session is counted active, as
    concurrent requests to one router do."""
    reg = _registry({"one": 1, "two": 2, "three": 3})
    router = _Router(reg, stale_loads=stale_loads)

    async def open_session() -> str:
        g = await assign_group(router)
        router.active[g] += 1
        return g

    async def main() -> list[str]:
        return await asyncio.gather(*(open_session() for _ in range(1000)))

    placed = Counter(asyncio.run(main()))
    assert sum(placed.values()) == 1000 and sum(router.active.values()) == 1000
    _assert_shares(placed, _capacity_shares(reg))


def test_halving_a_groups_measured_throughput_lowers_its_share_accordingly() -> None:
    """Replicas report tokens/s in proportion to their session slots (20 tokens/s each); then
    the replicas of ``two`` report half that. Its capacity share, and so its share of the next
    300 sessions, falls from 2/6 to (2 x 1/2) / (1 + 2 x 1/2 + 3) = 1/5."""
    reg = _registry({"one": 1, "two": 2, "three": 3}, tps=8 * 20.0)
    router = _Router(reg)
    rng = random.Random(5)
    before = asyncio.run(_sequential(router, 300, rng))
    _assert_shares(before, {"one": 1 / 6, "two": 2 / 6, "three": 3 / 6})
    for i in range(2):
        reg.heartbeat(_hb(f"two-{i}", "two", tokens_per_s=8 * 10.0))
    want = {"one": 1 / 5, "two": 1 / 5, "three": 3 / 5}
    assert _capacity_shares(reg) == pytest.approx(want)
    after = asyncio.run(_sequential(router, 300, rng))
    _assert_shares(after, want)
    assert after["two"] / 300 < before["two"] / 300 - 0.1


def test_sessions_in_sequence_on_the_local_preset_use_every_group() -> None:
    """The local preset (three equal CPU groups at the same price), one replica each, 30
    sessions one after another: ten to each group, not all to one."""
    fleet = load_preset("local")
    reg = Registry(fleet, heartbeat_timeout_s=1e9, max_version_lag=None)
    for g in fleet.groups:
        reg.heartbeat(_hb(f"{g.name}-0", g.name))
    placed = asyncio.run(_sequential(_Router(reg), 30, random.Random(1)))
    assert placed == {g.name: 10 for g in fleet.groups}


def test_a_move_excludes_the_groups_already_tried_and_is_recorded() -> None:
    reg = _registry({"one": 1, "two": 2, "three": 3})
    router = _Router(reg)
    assert asyncio.run(assign_group(router, exclude={"three", "two"})) == "one"
    assert router.window.sessions() == {"one": 1}
    with pytest.raises(ApiError) as exc:
        asyncio.run(assign_group(router, exclude={"one", "two", "three"}))
    assert exc.value.status == 503 and "no sampler group" in exc.value.message
    assert router.window.sessions() == {"one": 1}


def test_the_router_api_places_sessions_in_sequence_on_every_local_group_and_shows_the_window() -> None:
    """Through the real app: one heartbeat replica per local group; 30 sessions opened and
    deleted one after another go ten to each group, and ``/v1/groups`` shows the window's
    shares beside the capacity shares."""
    fleet = load_preset("local")
    key = "k" * 32
    config = RouterConfig(fleet=fleet, api_keys={key: frozenset({"rollout", "admin"})}, poll_interval_s=60.0)
    with TestClient(create_app(config), headers={"Authorization": f"Bearer {key}"}) as client:
        for g in fleet.groups:
            hb = {"replica_id": f"{g.name}-0", "group": g.name, "url": "http://127.0.0.1:9", "ready": True}
            assert client.post("/v1/replicas/heartbeat", json=hb).json()["in_rotation"] is True
        placed: Counter[str] = Counter()
        for _ in range(30):
            r = client.post("/v1/sessions", json={})
            assert r.status_code == 200, r.text
            placed[r.json()["group"]] += 1
            assert client.delete(f"/v1/sessions/{r.json()['session_id']}").status_code == 200
        assert placed == {g.name: 10 for g in fleet.groups}
        groups = client.get("/v1/groups").json()["groups"]
    for g in groups:
        assert (g["active_sessions"], g["window_sessions"], g["window_tokens"]) == (0, 10, 0)
        assert g["window_session_share"] == pytest.approx(1 / 3) == g["capacity_share"]
        assert g["window_token_share"] == 0.0  # no turn generated a token

"""The autoscaling policy (fleet.autoscale): tables of demand -> settings computed by hand from the
rule in the module docstring, bounds and monotonicity over random demand, the length trend, the
capacity shares, and reading demand from a /v1/groups answer of the router's own schema."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.autoscale import (
    Demand,
    DemandError,
    GroupBounds,
    GroupDemand,
    ScaleSettings,
    capacity_shares,
    demand_from_groups,
    length_trend,
    scale_settings,
)
from fleet.specs import load_preset
from router.schemas import GroupsResponse

A = GroupBounds(
    "a", sessions_per_replica=4, min_replicas=1, max_replicas=10, buffer_replicas=1, scaledown_window_s=120
)
B = GroupBounds(
    "b", sessions_per_replica=8, min_replicas=0, max_replicas=3, buffer_replicas=0, scaledown_window_s=600
)


def table(demand: Demand) -> dict[str, tuple[int, int, int]]:
    return {
        s.group: (s.min_containers, s.max_containers, s.buffer_containers)
        for s in scale_settings([A, B], demand)
    }


@pytest.mark.parametrize(
    ("groups", "trend", "want"),
    [
        # no demand: the preset's minimum and buffer
        ({}, (), {"a": (1, 10, 1), "b": (0, 3, 0)}),
        # a: 9 sessions on 4 per replica -> 3; b: its half share of D = 9 is 4.5 sessions -> 1
        (
            {"a": GroupDemand(9, 0, 0.5), "b": GroupDemand(0, 0, 0.5)},
            (),
            {"a": (3, 10, 1), "b": (1, 3, 0)},
        ),
        # queued sessions count: a holds 5 + 3 = 8 -> 2; b's share 0.25 of D = 8 -> 2 sessions -> 1
        (
            {"a": GroupDemand(5, 3, 0.75), "b": GroupDemand(0, 0, 0.25)},
            (),
            {"a": (2, 10, 1), "b": (1, 3, 0)},
        ),
        # trend: 300 tokens/session after a mean of 150 -> L = 2; D = 24. a wants 2 * max(8, 0.5 * 24)
        # = 24 -> 6 replicas, buffer 1 + ceil((2 - 1) * 6) = 7 capped at 10 - 6 = 4; b wants
        # 2 * max(16, 12) = 32 -> 4, clamped to 3 (no room for a buffer)
        (
            {"a": GroupDemand(8, 0, 0.5), "b": GroupDemand(16, 0, 0.5)},
            (100.0, 200.0, 300.0),
            {"a": (6, 10, 4), "b": (3, 3, 0)},
        ),
        # growth buffer below the cap: L = 1.5, a alone wants 1.5 * 8 = 12 -> 3, buffer 1 + ceil(1.5) = 3
        ({"a": GroupDemand(8, 0, 1.0)}, (100.0, 150.0), {"a": (3, 10, 3), "b": (0, 3, 0)}),
        # shrinking lengths: L = 1/2 (clamped from 50 / 400): a wants 0.5 * 40 = 20 -> 5, no growth buffer
        ({"a": GroupDemand(40, 0, 1.0)}, (400.0, 50.0), {"a": (5, 10, 1), "b": (0, 3, 0)}),
        # beyond every bound: min = max, the buffer has no room
        ({"a": GroupDemand(1000, 50, 1.0)}, (), {"a": (10, 10, 0), "b": (0, 3, 0)}),
    ],
)
def test_demand_to_settings_table(groups, trend, want) -> None:
    assert table(Demand(groups, trend)) == want


def test_settings_keep_the_preset_window_and_concurrency() -> None:
    a, b = scale_settings([A, B], Demand())
    assert (a.scaledown_window, a.target_concurrency, b.scaledown_window, b.target_concurrency) == (
        120,
        4,
        600,
        8,
    )
    assert a.update_kwargs() == {
        "min_containers": 1,
        "max_containers": 10,
        "buffer_containers": 1,
        "scaledown_window": 120,
        "target_concurrency": 4,
    }


def test_length_trend() -> None:
    assert length_trend(()) == 1.0 and length_trend((300.0,)) == 1.0
    assert length_trend((100.0, 150.0)) == 1.5
    assert length_trend((100.0, 200.0, 225.0)) == 1.5  # over the mean of the earlier windows
    assert length_trend((10.0, 1000.0)) == 2.0 and length_trend((1000.0, 10.0)) == 0.5  # clamped
    assert length_trend((0.0, 100.0)) == 1.0  # no earlier positive window
    assert length_trend((100.0, 0.0)) == 1.0 and length_trend((math.nan, 100.0)) == 1.0
    assert length_trend((math.inf, 50.0, 100.0)) == 2.0  # a non-finite earlier window is left out


def test_capacity_shares_count_an_empty_group_as_one_replica() -> None:
    shares = capacity_shares({"a": 12.0}, [A, B])
    assert shares == {"a": 12 / 20, "b": 8 / 20}
    assert capacity_shares({}, [A, B]) == {"a": 4 / 12, "b": 8 / 12}
    with pytest.raises(DemandError, match="a.capacity"):
        capacity_shares({"a": -1.0}, [A, B])


@pytest.mark.parametrize(
    ("demand", "message"),
    [
        (Demand({"c": GroupDemand(1)}), "unknown group"),
        (Demand({"a": GroupDemand(-1)}), "a.active_sessions"),
        (Demand({"a": GroupDemand(0, -2)}), "a.queued_sessions"),
        (Demand({"a": GroupDemand(0, 0, 1.5)}), "a.target_share"),
        (Demand({"a": GroupDemand(0, 0, 0.7), "b": GroupDemand(0, 0, 0.7)}), "shares sum to 1.4"),
    ],
)
def test_bad_demand_is_refused_naming_the_field(demand: Demand, message: str) -> None:
    with pytest.raises(DemandError, match=message):
        scale_settings([A, B], demand)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(DemandError, match="min"):
        GroupBounds("x", 4, 3, 2)
    with pytest.raises(DemandError, match="scaledown_window_s"):
        GroupBounds("x", 4, 0, 2, scaledown_window_s=1)


def test_bounds_of_every_preset_group() -> None:
    fleet = load_preset("mixed")
    for g in fleet.groups:
        b = GroupBounds.of(g)
        assert (b.min_replicas, b.max_replicas, b.buffer_replicas) == (
            g.min_replicas,
            g.max_replicas,
            g.buffer_replicas,
        )
        assert (b.sessions_per_replica, b.scaledown_window_s) == (
            g.sessions_per_replica,
            g.scaledown_window_s,
        )


counts = st.integers(0, 500)
shares = st.floats(0.0, 0.5)
windows = st.lists(st.floats(1.0, 5000.0), max_size=5)
bounds = st.builds(
    lambda spr, lo, extra, buf: GroupBounds("g", spr, lo, max(1, lo + extra), buf),
    st.integers(1, 16),
    st.integers(0, 5),
    st.integers(0, 20),
    st.integers(0, 4),
)


def _one(b: GroupBounds, d: GroupDemand, other: int, trend) -> ScaleSettings:
    other_b = GroupBounds("o", 4, 0, 5)
    return scale_settings([b, other_b], Demand({"g": d, "o": GroupDemand(other, 0, 0.5)}, trend))[0]


@settings(max_examples=300, deadline=None)
@given(bounds, counts, counts, shares, counts, windows)
def test_bounds_hold_for_any_demand(b, active, queued, share, other, trend) -> None:
    s = _one(b, GroupDemand(active, queued, share), other, trend)
    assert b.min_replicas <= s.min_containers <= s.max_containers == b.max_replicas
    assert 0 <= s.buffer_containers <= b.max_replicas - s.min_containers


@settings(max_examples=300, deadline=None)
@given(
    bounds,
    counts,
    counts,
    shares,
    counts,
    windows,
    st.integers(1, 50),
    st.sampled_from(["active", "queued", "share", "other", "trend"]),
)
def test_more_demand_never_scales_down(b, active, queued, share, other, trend, more, what) -> None:
    before = _one(b, GroupDemand(active, queued, share), other, trend)
    if what == "active":
        active += more
    elif what == "queued":
        queued += more
    elif what == "share":
        share = min(0.5, share + more / 100)
    elif what == "other":
        other += more
    else:  # a longer latest window
        trend = (
            [*trend, (trend[-1] if trend else 1.0)]
            if len(trend) < 2
            else [*trend[:-1], trend[-1] * (1 + more / 10)]
        )
    after = _one(b, GroupDemand(active, queued, share), other, trend)
    assert after.min_containers >= before.min_containers
    assert after.min_containers + after.buffer_containers >= before.min_containers + before.buffer_containers


def _snapshot() -> dict:
    """A /v1/groups answer (validated by the router's own response model below)."""

    def group(name, capacity, active, sessions, tokens, w_sessions, w_tokens, queued):
        return {
            "name": name, "accelerator": "H100", "weight_format": "fp8", "kv_cache_dtype": "fp8_e4m3",
            "sessions_per_replica": 4, "capacity": capacity, "ready_replicas": int(capacity // 4),
            "active_sessions": active, "sessions_total": sessions, "tokens_total": tokens,
            "session_share": 0.0, "token_share": 0.0, "capacity_share": 0.0, "window_sessions": w_sessions,
            "window_tokens": w_tokens, "window_session_share": 0.0, "window_token_share": 0.0,
            "active_version": 3, "version_lag": 0, "cost_per_token": 0.0,
            "replicas": [
                {"replica_id": f"{name}-{i}", "url": "http://x", "static": False, "ready": True,
                 "in_rotation": True, "active_version": 3, "running": 4, "queued": q, "inflight": 0,
                 "tokens_per_s": 1.0, "last_seen_s": 0.5, "error": None}
                for i, q in enumerate(queued)
            ],
        }  # fmt: skip

    return {
        "latest_version": 3,
        "policy": "capacity",
        "groups": [group("a", 8.0, 7, 20, 2000, 10, 1500, [2, 1]), group("b", 0.0, 0, 0, 0, 0, 0, [])],
    }


def test_demand_from_a_groups_answer() -> None:
    snap = _snapshot()
    GroupsResponse.model_validate(snap)  # the router's shape
    d = demand_from_groups(snap, [A, B])
    # a: capacity 8; b: none, counted as one replica of 8 sessions -> shares 1/2 and 1/2
    assert d.groups["a"] == GroupDemand(7, 3, 0.5) and d.groups["b"] == GroupDemand(0, 0, 0.5)
    # windows: 2000 tokens / 20 sessions overall, 1500 / 10 in the routing window -> L = 1.5
    assert d.tokens_per_session == (100.0, 150.0) and length_trend(d.tokens_per_session) == 1.5
    # a wants 1.5 * 10 = 15 sessions -> 4 replicas, buffer 1 + ceil(0.5 * 4) = 3;
    # b wants 1.5 * 0.5 * 10 = 7.5 -> 1 replica, buffer ceil(0.5 * 1) = 1
    assert table(d) == {"a": (4, 10, 3), "b": (1, 3, 1)}


def test_a_groups_answer_of_another_shape_is_refused() -> None:
    with pytest.raises(DemandError, match="no groups list"):
        demand_from_groups({"detail": "x"}, [A, B])
    snap = _snapshot()
    snap["groups"][0]["active_sessions"] = "7"
    with pytest.raises(DemandError, match="a.active_sessions"):
        demand_from_groups(snap, [A, B])


def test_a_groups_answer_of_another_fleet_is_refused_naming_both() -> None:
    """A router whose groups are none of the preset's (the wrong --router or --preset) gives no
    demand for any of them; the settings would be every group's minimum. Refused, naming both."""
    snap = _snapshot()
    for g, name in zip(snap["groups"], ("cpu-bf16", "cpu-fp8"), strict=True):
        g["name"] = name
    with pytest.raises(DemandError, match=r"serves cpu-bf16, cpu-fp8, none of the preset's groups \(a, b\)"):
        demand_from_groups(snap, [A, B])
    assert demand_from_groups({"groups": []}, [A, B]).groups == {}  # a router with no groups yet

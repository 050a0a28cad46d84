"""Router metrics as the tests read them: one exposition's samples keyed by name and sorted labels
(:func:`samples_of`), and what every known group's request-path series are before any traffic
(:func:`assert_groups_at_zero`)."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import FAILOVER_REASONS

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# The group-labelled request-path series a router exposes for every group it knows, at 0 from the
# start (besides the failovers of every reason and the session moves between groups).
GROUP_SERIES = (
    "mixfleet_router_turns_total",
    "mixfleet_router_tokens_total",
    "mixfleet_router_sessions_created_total",
    "mixfleet_router_sessions_expired_total",
    "mixfleet_router_generate_requests_total",
    "mixfleet_router_turn_seconds_count",
    "mixfleet_router_engine_seconds_count",
)


def samples_of(text: str, prefix: str = "mixfleet_") -> Samples:
    """Every sample of the exposition ``text`` whose name starts with ``prefix``, keyed by (name,
    sorted labels); a key exposed twice fails the test."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                key = (s.name, tuple(sorted(s.labels.items())))
                assert key not in out, f"{key} exposed twice"
                out[key] = s.value
    return out


def turn_replays(router_url: str) -> tuple[float, float]:
    """``mixfleet_router_turn_replays_total`` of a scrape of the router at ``router_url``:
    (found, raced)."""
    name = "mixfleet_router_turn_replays_total"
    samples = samples_of(httpx.get(f"{router_url}/metrics", timeout=30).text, name)
    return samples[(name, (("outcome", "found"),))], samples[(name, (("outcome", "raced"),))]


def assert_groups_at_zero(samples: Samples, groups: Sequence[str]) -> None:
    """Each of ``groups`` has every :data:`GROUP_SERIES` series and a failover series per reason, at
    0; session moves exist, at 0, between every ordered pair of ``groups`` and no other pair."""
    for g in groups:
        for name in GROUP_SERIES:
            assert samples[(name, (("group", g),))] == 0, (name, g)
        for reason in FAILOVER_REASONS:
            assert samples[("mixfleet_router_failovers_total", (("group", g), ("reason", reason)))] == 0
    moves = {ls: v for (n, ls), v in samples.items() if n == "mixfleet_router_session_moves_total"}
    assert moves == {(("from_group", a), ("to_group", b)): 0 for a in groups for b in groups if a != b}

"""The state's bounds as rules (:mod:`router.state.retention`): which versions roll, the values
refused, the flags that set them, and a report that reads the same before and after the ledger
was compacted."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from core.errors import UserError
from fleet.specs import FleetSpec
from mixfleet.router import BOUNDS, add_arguments, build_config
from router import report
from router.config import RouterConfig
from router.routes_ledger import ledger_view
from router.state.base import TurnRecord
from router.state.memory import MemoryStore
from router.state.retention import Retention, versions_to_roll

pytestmark = pytest.mark.anyio

FLEET = FleetSpec.model_validate(
    {
        "name": "f",
        "groups": [{"name": "g", "accelerator": "cpu", "price_per_gpu_hour": 3.6, "gpus_per_replica": 2}],
    }
)


def test_all_but_the_highest_versions_roll_and_an_unreported_one_never() -> None:
    assert versions_to_roll([5, 1, None, 3, 9, 3], 2) == [1, 3]
    assert versions_to_roll([2, 1], 2) == [] and versions_to_roll([None], 1) == []
    assert versions_to_roll(range(10), 1) == list(range(9))


@pytest.mark.parametrize(
    "bad",
    [
        {"retention_s": 0},
        {"lease_timeout_s": -1},
        {"replica_forget_s": 0},
        {"keep_versions": 0},
        {"keep_updates": 0},
    ],
)
def test_a_bound_out_of_range_is_refused_naming_it(bad: dict) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match=f"^{name} must be"):
        Retention(**bad)


def test_a_lease_is_known_for_its_timeout_plus_the_retention() -> None:
    assert Retention(retention_s=60, lease_timeout_s=5).lease_record_s() == 65


@pytest.mark.parametrize("flag", list(BOUNDS))
def test_each_bound_flag_sets_its_field_and_refuses_zero_naming_itself(flag: str, monkeypatch) -> None:
    monkeypatch.setenv("MIXFLEET_API_KEYS", json.dumps({"k" * 20: ["admin"]}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    field = BOUNDS[flag][0]
    config = build_config(parser.parse_args(["--preset", "local", flag, "7"]))
    assert getattr(config, field) == 7
    with pytest.raises(UserError, match=flag):
        build_config(parser.parse_args(["--preset", "local", flag, "0"]))


def test_the_flags_defaults_are_the_configs_and_the_rules() -> None:
    config = RouterConfig(fleet=FLEET, auth_disabled=True)
    assert {BOUNDS[f][0]: BOUNDS[f][2] for f in BOUNDS} == {
        BOUNDS[f][0]: getattr(config, BOUNDS[f][0]) for f in BOUNDS
    }
    assert config.retention() == Retention()


async def test_the_report_reads_the_same_once_updates_and_versions_are_rolled_up() -> None:
    """Six updates over six versions; with the ledger compacted to one update and one version per
    group, the report's totals (updates, their mean cost, cost, tokens) are what they were."""
    store = MemoryStore(Retention(keep_updates=1, keep_versions=1))
    for i in range(6):
        await store.book_replica(
            "r",
            group="g",
            version=i,
            at=100.0 + 30 * i,
            span_s=10.0,
            gpus_per_replica=2,
            price_per_gpu_hour=3.6,
        )
        await store.create_session(f"s{i}", "g", {}, now=1.0)
        await store.append_turn(
            f"s{i}",
            TurnRecord(
                "t",
                b"x",
                group="g",
                replica="r",
                tokens=i + 1,
                min_version=i,
                max_version=i,
                version_tokens={i: i + 1},
            ),
        )
        await store.finish_session(f"s{i}", "f", 1.0, {})
        lease = await store.take(5, trainer_version=i, max_version_age=None, lease_timeout_s=60)
        await store.ack(lease.lease_id)
    before = report.build(ledger_view(await store.ledger(), FLEET, 10.0, time.time()))
    compacted = await store.compact()
    assert (compacted.updates, compacted.versions) == (5, 5)
    view = ledger_view(await store.ledger(), FLEET, 10.0, time.time())
    assert [u["seq"] for u in view["updates"]] == [6] and view["earlier_updates"]["updates"] == 5
    assert view["earlier_versions"] == [
        {
            "group": "g",
            "replica_seconds": 50.0,
            "gpu_seconds": 100.0,
            "cost_dollars": pytest.approx(0.1),
            "tokens": 15,
        }
    ]
    after = report.build(view)
    assert after["totals"]["updates"] == before["totals"]["updates"] == 6
    assert after["totals"]["cost_per_update_mean"] == pytest.approx(before["totals"]["cost_per_update_mean"])
    assert after["totals"]["cost_per_update_mean"] == pytest.approx(0.12 / 6)
    assert {k: after["totals"][k] for k in ("cost_dollars", "tokens")} == {
        k: before["totals"][k] for k in ("cost_dollars", "tokens")
    }
    assert after["updates"] == before["updates"][-1:]

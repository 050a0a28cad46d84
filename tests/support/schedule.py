"""How the suite is spread over pytest-xdist workers (``pytest -n auto --dist loadgroup``),
through xdist's public means only: the ``xdist_group`` marker and the order
of the collected tests (:func:`arrange`, called from ``tests/conftest.py``).

A unit of work (one ``xdist_group``) runs whole on one worker, its tests in file order:

* a test module, by default, so the engines, routers and fleets its module-scoped fixtures start
  are started once;
* each test alone, for the modules of :data:`SPREAD`: their tests start their own processes and
  take minutes each (a module-scoped fixture there would be set up once per worker that runs one
  of its tests: correct, only slower);
* every test already marked ``@pytest.mark.xdist_group(name)`` with the same name, wherever it is.

Units are collected longest first (:data:`COST`), and xdist hands them out in collection order
(``--no-loadscope-reorder``, pyproject's ``addopts``: by default xdist re-sorts the units by how
many tests each holds), so no long unit is left to end the run alone. A run whose tests xdist did
not group stops at once (:func:`ungrouped`). A unit missing from :data:`COST` counts as short; the
table only orders, it decides nothing else.
"""

from __future__ import annotations

import pytest

# Seconds of wall time of each long unit with four workers on the 2-core CI machine (a module, or
# a test of a SPREAD module; ``--durations`` gives them). Approximate: only their order matters.
COST = {
    "tests/validate/test_ladder_live.py": 600,
    "tests/trainer/test_demo.py::test_demo_against_a_running_fleet": 300,
    "tests/router/test_workers.py": 300,
    "tests/router/test_reliability.py": 250,
    "tests/deploy/test_gpu_check.py::test_check_passes_on_the_local_engine_for_every_format": 240,
    "tests/weight_sync_live/test_fleet.py": 230,
    "tests/deploy/test_deploy_cli.py": 220,
    "tests/weight_sync/test_convert_cli.py": 210,
    "tests/test_soak.py": 160,
    "tests/engine/test_control.py": 150,
    "tests/router/test_fuzz.py": 130,
    "tests/trainer/test_demo.py::test_demo_starts_and_stops_its_own_fleet": 110,
    "tests/test_up.py::test_up_serves_the_chat_apis_to_the_openai_client": 110,
    "tests/test_up.py::test_up_serves_publishes_and_stops_cleanly": 100,
    "tests/router/test_api.py": 100,
    "tests/router/test_weights_routes.py": 90,
    "tests/weight_sync_live/test_delta.py::test_cli_publishes_a_delta_into_a_store": 80,
    "tests/router/test_bounded_state.py": 80,
    "tests/test_up.py::test_a_killed_engine_is_restarted_while_sessions_fail_over"
    "_and_a_killed_up_takes_its_children": 80,
    "tests/chat/test_chat_retries.py": 75,
    "tests/clients/test_engine_client.py": 75,
    "tests/deploy/test_modal_routing.py": 70,
    "tests/router/test_records.py": 70,
    "tests/deploy/test_images.py::test_warm_fills_numbas_cache_so_the_next_start_compiles_nothing": 70,
    "tests/router/test_report.py": 65,
    "tests/chat/test_chat_streaming.py": 60,
    "tests/engine_model/test_precision.py": 60,
    "tests/router/test_workers_metrics.py": 60,
}
# Modules whose tests are units of their own.
SPREAD = frozenset(
    {
        "tests/trainer/test_demo.py",
        "tests/test_up.py",
        "tests/deploy/test_gpu_check.py",
        "tests/deploy/test_images.py",
        "tests/weight_sync_live/test_delta.py",
        "tests/weight_sync_live/test_publish.py",
        "tests/weight_sync/test_store_volume.py",
        "tests/replica/test_entrypoint.py",
        "tests/deploy/test_converters.py",
    }
)


def unit_of(item: pytest.Item) -> str:
    """The unit of a collected test: its ``xdist_group`` name, itself in a :data:`SPREAD` module,
    else its module."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    module = item.nodeid.split("::", 1)[0]
    return item.nodeid if module in SPREAD else module


def cost_of(unit: str) -> float:
    """:data:`COST` of a unit (a parametrized test counts as its function); 0 when not listed."""
    return COST.get(unit, COST.get(unit.split("[", 1)[0], 0.0))


def arrange(items: list[pytest.Item]) -> None:
    """Mark every test with its unit's ``xdist_group`` and order ``items`` (in place) unit by unit,
    longest unit first, each unit's tests in their collected order."""
    first: dict[str, int] = {}
    units = []
    for i, item in enumerate(items):
        unit = unit_of(item)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(unit))
        first.setdefault(unit, i)
        units.append(unit)
    order = sorted(range(len(items)), key=lambda i: (-cost_of(units[i]), first[units[i]], i))
    items[:] = [items[i] for i in order]


def ungrouped(ids: list[str]) -> str | None:
    """Why the test ids a worker collected show that ``--dist loadgroup`` does not group them, or
    None: xdist groups by the ``@<group>`` suffix it writes into each marked test's id, and every
    test here is marked (:func:`arrange`), so an id without one means this pytest ignores that
    rewrite (the test extra's pytest bound in ``pyproject.toml`` says which do): every test would
    be a unit of its own and each module's fleets would start once per worker."""
    plain = [i for i in ids if "@" not in i]
    if not plain:
        return None
    return (
        f"pytest-xdist's --dist loadgroup does not group with pytest {pytest.__version__} "
        f"({plain[0]} has no @<group> suffix; pytest-dev/pytest-xdist#1386): install the test "
        "extra's pytest (pip install -e '.[test]')"
    )

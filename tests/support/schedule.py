"""How the suite is spread over pytest-xdist workers (``-n`` in pyproject's pytest ``addopts``).

A unit of work runs whole on one worker, its tests in file order:

* a test module, by default, so the engines, routers and fleets its module-scoped fixtures start
  are started once;
* each test alone, for the modules of :data:`SPREAD`: their tests start their own processes (no
  module-scoped fixture; ``tests/conftest.py`` checks it at collection) and take minutes each;
* every test marked ``@pytest.mark.xdist_group(name)`` with the same name, wherever it is.

Units start longest first (:data:`COST`), so that no long unit is left to end the run alone; a
worker still running a long unit is given short units to queue behind it (a worker holds the next
test before it runs the current one), and the next long unit goes to a worker whose long one has
finished. A unit missing from :data:`COST` counts as short; the table only orders, it decides
nothing else.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

# Seconds of wall time of each long unit with four workers on the 2-core CI machine (a module, or
# a test of a SPREAD module; ``--durations`` gives them). Approximate: only their order matters.
COST = {
    "tests/validate/test_ladder_live.py": 600,
    "tests/trainer/test_demo.py::test_demo_against_a_running_fleet": 300,
    "tests/router/test_workers.py": 300,
    "tests/trainer/test_demo.py::test_demo_starts_and_stops_its_own_fleet": 230,
    "tests/router/test_reliability.py": 250,
    "tests/deploy/test_gpu_check.py::test_check_passes_on_the_local_engine_for_every_format": 240,
    "tests/weight_sync_live/test_fleet.py": 230,
    "tests/deploy/test_deploy_cli.py": 220,
    "tests/weight_sync/test_convert_cli.py": 210,
    "tests/test_soak.py": 160,
    "tests/engine/test_control.py": 150,
    "tests/router/test_fuzz.py": 130,
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
# A unit at least this long keeps its worker busy: units queued behind it are short ones.
LONG_S = 60


def unit_of(nodeid: str) -> str:
    """The unit a test id belongs to: its ``xdist_group`` (the ``@name`` pytest-xdist appends to
    the id under ``--dist loadgroup``), itself in a :data:`SPREAD` module, else its module."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # a parameter may contain '@'
        return nodeid.rsplit("@", 1)[1]
    module = nodeid.split("::", 1)[0]
    return nodeid if module in SPREAD else module


def cost_of(unit: str) -> float:
    """:data:`COST` of a unit (a parametrized test counts as its function); 0 when not listed."""
    return COST.get(unit, COST.get(unit.split("[", 1)[0], 0.0))


class CostFirstScheduling(LoadGroupScheduling):
    """``--dist loadgroup`` with the units and the order of this module."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        if not self._ordered:  # the first call: the queue holds every unit, in collection order
            units = sorted(self.workqueue.items(), key=lambda kv: -cost_of(kv[0]))  # stable
            self.workqueue.clear()
            self.workqueue.update(units)
            self._ordered = True
        busy = any(
            cost_of(scope) >= LONG_S and not all(done.values())
            for scope, done in self.assigned_work.get(node, {}).items()
        )
        scope, work_unit = self.workqueue.popitem(last=busy)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nid) for nid, done in work_unit.items() if not done])

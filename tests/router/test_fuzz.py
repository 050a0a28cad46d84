"""Schemathesis drives every operation of the router's OpenAPI schema (a bounded number of
generated requests each) against a real router process in front of a real engine: no request
gets a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.support.router import router_process, write_preset

pytestmark = pytest.mark.timeout(240)
EXAMPLES = 12


@pytest.fixture(scope="module")
def fuzz_router(engine_url, tmp_path_factory):
    """Like the API tests' router, plus a (local, empty) weight store so the weight routes that
    the CLI mounts are configured too."""
    d = tmp_path_factory.mktemp("fuzz")
    preset = write_preset(d / "preset.toml", [{"name": "cpu-a", "replicas": [engine_url]}, {"name": "cpu-b"}])
    with router_process(
        preset, env={"MIXFLEET_STORE": str(d / "store")}, extra_args=("--max-body-bytes", "65536")
    ) as handle:
        yield handle


def test_no_operation_answers_5xx(fuzz_router) -> None:
    router = fuzz_router
    schema = schemathesis.openapi.from_url(router.url + "/openapi.json")
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        op = result.ok()
        operations += 1

        @given(case=op.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case) -> None:
            if case.path == "/v1/batches/take" and isinstance(case.body, dict):
                case.body["wait_s"] = 0  # a long poll is valid but would only make the test slow
            response = case.call(headers=router.headers, timeout=60)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} {case.body!r:.300}: "
                    f"{response.status_code} {response.text[:300]}"
                )

        run()
    assert operations >= 12
    assert not failures, "\n".join(failures[:20])

"""Schemathesis drives every operation of the router's OpenAPI document (a bounded number of
generated requests each, valid and invalid) against a real router process in front of a real
engine, with a key of every scope. Every answer must be no 5xx, and conform to the document:
a documented status code, a documented content type, a body matching the documented schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup

from tests.support.router import router_process, write_preset

pytestmark = pytest.mark.timeout(300)
EXAMPLES = 12
CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


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


def test_every_operation_conforms_and_never_answers_5xx(fuzz_router) -> None:
    router = fuzz_router
    schema = schemathesis.openapi.from_url(router.url + "/openapi.json")
    failures: list[str] = []
    operations: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        operations.append(op.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(op, mode, router, failures)
    assert len(operations) >= 17, operations
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:12])


def _fuzz(op, mode: GenerationMode, router, failures: list[str]) -> None:
    """Run ``EXAMPLES`` generated cases of ``op`` (valid or invalid ones, by ``mode``)."""

    @given(case=op.as_strategy(generation_mode=mode))
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
        try:
            case.call_and_validate(headers=router.headers, checks=CHECKS, timeout=60)
        except FailureGroup as exc:
            where = f"{mode.value} {case.method} {case.formatted_path} {case.body!r:.200}"
            failures.append(f"{where}:\n{exc}"[:1500])

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, (
            op.label
        )  # an operation without inputs has no invalid requests

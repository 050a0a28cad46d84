"""The sidecar's version constraint on ``/generate``: a bad bound is a 400 naming the field, an unmet
one a retryable 409 whose body is ``VersionUnavailable.body()``; both are answered before the
engine is asked (the app runs without its lifespan here, so there is no engine at all)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from replica.reconciler import ReconcileSettings
from replica.sidecar import SidecarConfig, create_app
from weight_sync.store.local import LocalStore

BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture()
def client(tmp_path: Path) -> TestClient:
    settings = ReconcileSettings(
        group="g-fp8",
        weight_format="fp8",
        run_id="run",
        replica_id="g-fp8-0",
        advertise_url="http://127.0.0.1:1",
        staging_dir=tmp_path / "staging",
    )
    config = SidecarConfig(engine_url="http://127.0.0.1:1", reconcile=settings)
    return TestClient(create_app(config, LocalStore(tmp_path / "store")))


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        ({**BODY, "min_version": "abc"}, {}, "min_version must be a non-negative integer, got 'abc'"),
        ({**BODY, "min_version": -1}, {}, "min_version must be a non-negative integer, got -1"),
        ({**BODY, "exact_version": 2.0}, {}, "exact_version must be a non-negative integer, got 2.0"),
        ({**BODY, "exact_version": True}, {}, "exact_version must be a non-negative integer, got True"),
        (BODY, {"X-Mixfleet-Exact-Version": "x"}, "exact_version must be a non-negative integer, got 'x'"),
        (BODY, {"X-Min-Version": "1.5"}, "min_version must be a non-negative integer, got '1.5'"),
    ],
)
def test_a_bad_bound_is_a_400_naming_the_field(client: TestClient, body, headers, message) -> None:
    r = client.post("/generate", json=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message}}


def test_an_unmet_bound_is_a_retryable_409(client: TestClient) -> None:
    r = client.post("/generate", json={**BODY, "min_version": 3})
    assert r.status_code == 409 and r.headers["retry-after"] == "1"
    assert r.json() == {
        "code": 409,
        "object": "error",
        "type": "version_unavailable",
        "retryable": True,
        "message": "replica g-fp8-0 serves weight version None, the request needs min_version 3",
        "constraint": "min_version",
        "target_version": 3,
        "applied_version": None,
        "pending_version": None,
        "replica": "g-fp8-0",
        "group": "g-fp8",
    }
    exact = client.post("/generate", json=BODY, headers={"X-Mixfleet-Exact-Version": "0"})
    assert exact.status_code == 409 and exact.json()["constraint"] == "exact_version"
    assert exact.json()["target_version"] == 0
    # The body's field wins over the header: the header's bad value is not looked at.
    both = client.post("/generate", json={**BODY, "min_version": 2}, headers={"X-Mixfleet-Min-Version": "x"})
    assert both.status_code == 409 and both.json()["target_version"] == 2


def test_no_constraint_goes_on_to_the_readiness_check(client: TestClient) -> None:
    r = client.post("/generate", json=BODY)
    assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]

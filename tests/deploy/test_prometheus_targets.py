"""``GET /v1/prometheus/targets`` on a real router process: Prometheus' HTTP service-discovery
format for every replica it knows (preset replicas always, heartbeat replicas while they
heartbeat), keyed; ``test_prometheus_live.py`` has a real Prometheus follow it."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import httpx

from tests.support.router import router_process, write_preset

TIMEOUT = 0.5  # --heartbeat-timeout: a heartbeat replica leaves the targets 6 timeouts after its last one


def _beat(url: str, key: str, replica_id: str, group: str, replica_url: str) -> None:
    body = {"replica_id": replica_id, "group": group, "url": replica_url, "ready": True, "active_version": 1}
    r = httpx.post(
        url + "/v1/replicas/heartbeat", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert r.status_code == 200, r.text


def _target(host: str, group: str, replica: str, component: str, scheme: str, path: str) -> dict:
    """One target group of Prometheus' HTTP service discovery, as the router lists it."""
    labels = {"group": group, "replica": replica, "component": component}
    return {"targets": [host], "labels": {**labels, "__scheme__": scheme, "__metrics_path__": path}}


def test_targets_follow_the_preset_and_the_heartbeats(tmp_path: Path) -> None:
    admin, reader = secrets.token_hex(16), secrets.token_hex(16)
    preset = write_preset(
        tmp_path / "p.toml",
        [
            {"name": "g-static", "weight_format": "bf16", "replicas": ["http://127.0.0.1:9/engine-a/"]},
            {"name": "g-beat", "weight_format": "fp8"},
        ],
    )
    with router_process(
        preset,
        keys={admin: ["admin"], reader: ["rollout"]},
        extra_args=("--heartbeat-timeout", str(TIMEOUT)),
    ) as router:
        url = router.url + "/v1/prometheus/targets"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer " + "x" * 32}, timeout=10).status_code == 401

        _beat(router.url, admin, "beat-0", "g-beat", "https://org--beat.example.run/v/")
        _beat(router.url, admin, "beat-1", "g-beat", "http://10.0.0.7:8080")
        r = httpx.get(url, headers={"Authorization": f"Bearer {reader}"}, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == [
            _target("org--beat.example.run", "g-beat", "beat-0", "sidecar", "https", "/v/metrics"),
            _target("org--beat.example.run", "g-beat", "beat-0", "engine", "https", "/v/engine/metrics"),
            _target("10.0.0.7:8080", "g-beat", "beat-1", "sidecar", "http", "/metrics"),
            _target("10.0.0.7:8080", "g-beat", "beat-1", "engine", "http", "/engine/metrics"),
            _target("127.0.0.1:9", "g-static", "g-static/0", "static", "http", "/engine-a/metrics"),
        ]

        # beat-1 keeps heartbeating, beat-0 stops: after 6 timeouts only beat-1 and the preset's remain
        deadline = time.monotonic() + 30
        while True:
            _beat(router.url, admin, "beat-1", "g-beat", "http://10.0.0.7:8080")
            listed = {
                t["labels"]["replica"] for t in httpx.get(url, headers=router.headers, timeout=10).json()
            }
            if listed == {"beat-1", "g-static/0"}:
                break
            assert listed == {"beat-0", "beat-1", "g-static/0"}, listed
            assert time.monotonic() < deadline, listed
            time.sleep(0.2)

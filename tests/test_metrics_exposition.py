"""The metrics as scraped from real processes: a router, and one replica (a CPU engine behind its
sidecar, heartbeating to the router) that served turns, a taken batch with a trainer log-prob
upload and an acknowledgement. ``promtool check metrics`` (Debian's ``prometheus`` package)
passes on the router's and the sidecar's ``/metrics`` (skipped only when promtool is absent; the
engine's ``sglang:*`` names, colons and all, are relayed apart on ``/engine/metrics``);
every ``mixfleet_*`` family exposed is declared with the type and labels the catalogue states,
and every declared family is exposed; both also show their own process's resident memory, CPU
seconds, open and max fds and start time (prometheus-client's ``ProcessCollector``, as the catalogue
declares them); ``docs/metrics.md`` is what the declarations generate."""

from __future__ import annotations

import ast
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import ProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from core.metric_defs import PROCESS_METRICS, MetricDef
from mixfleet import metrics_doc
from replica.reconciler import REPLICA_METRICS
from router.metrics import FAILOVER_REASONS, ROUTER_METRICS, SNAPSHOT, RouterMetrics
from tests.support.fleet import local_fleet
from tests.support.metrics import Samples, assert_groups_at_zero, samples_of
from tests.support.procs import REPO
from tests.support.router import ALL_SCOPES, router_process, write_preset
from trainer.client import RolloutClient

GROUP = ("cpu-bf16", "bf16")
SP = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.9, "seed": 1}


def test_catalogue_is_generated_from_the_definitions(tmp_path: Path) -> None:
    committed = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert committed == metrics_doc.render(), "docs/metrics.md is stale: python -m mixfleet.metrics_doc"
    for d in (*ROUTER_METRICS, *REPLICA_METRICS, *PROCESS_METRICS):
        assert f"| `{d.name}` | {d.kind} |" in committed, d.name
    cmd = [sys.executable, "-m", "mixfleet.metrics_doc"]
    ok = subprocess.run([*cmd, "--check"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    stale = tmp_path / "metrics.md"
    stale.write_text(committed.replace("Output tokens recorded", "Output tokens"), encoding="utf-8")
    bad = subprocess.run([*cmd, "--check", "--out", str(stale)], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1 and f"{stale} is stale" in bad.stderr
    written = subprocess.run([*cmd, "--out", str(stale)], cwd=REPO, capture_output=True, text=True)
    assert written.returncode == 0 and stale.read_text(encoding="utf-8") == committed


def test_definitions_refuse_names_against_the_conventions() -> None:
    for name, kind, unit in (
        ("mixfleet_x_seconds", "counter", "seconds"),  # a counter without _total
        ("mixfleet_x_total", "gauge", ""),  # a gauge with _total
        ("mixfleet:x_total", "counter", ""),  # a colon
        ("other_x", "gauge", ""),  # not mixfleet_
        ("mixfleet_latency", "histogram", "seconds"),  # the unit not in the name
    ):
        with pytest.raises(ValueError):
            MetricDef(name, kind, (), unit, "help")  # type: ignore[arg-type]


def test_a_multiprocess_mode_belongs_to_a_gauge_updated_in_process() -> None:
    with pytest.raises(ValueError, match="only a gauge"):
        MetricDef("mixfleet_x_total", "counter", (), "", "help", multiprocess_mode="sum")
    with pytest.raises(ValueError, match="no multiprocess_mode"):
        MetricDef("mixfleet_x", "gauge", (), "", "help", multiprocess_mode="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="computed at scrape time"):
        MetricDef("mixfleet_x", "gauge", (), "", "help", multiprocess_mode="max").family()
    assert all(d.multiprocess_mode is None for d in SNAPSHOT)  # computed once, by the worker that answers


def _samples(metrics: RouterMetrics) -> Samples:
    return samples_of(metrics.exposition().decode(), "mixfleet_router_")


def test_every_group_series_exists_at_zero_from_the_start_and_when_a_group_becomes_known() -> None:
    """Before any event: per group, turns, tokens, sessions, expiries, /generate calls, latency
    counts and every failover reason; a move between every ordered pair of groups. A group first
    seen in a scrape's snapshot gets its series from that scrape on."""
    metrics = RouterMetrics(["a", "b"], version_lag_bound=5)
    first = _samples(metrics)
    assert_groups_at_zero(first, ["a", "b"])
    assert first[("mixfleet_router_updates_total", ())] == 0
    assert first[("mixfleet_router_workers", ())] == 1
    assert first[("mixfleet_router_version_lag_bound", ())] == 5
    info = {"accelerator": "cpu", "weight_format": "bf16", "kv_cache_dtype": "auto"}
    metrics.snapshot = {"groups": [{"name": g, **info} for g in ("a", "b", "c")]}
    _samples(metrics)
    assert_groups_at_zero(_samples(metrics), ["a", "b", "c"])


def test_every_failover_reason_the_dispatcher_counts_is_initialised() -> None:
    """The reasons ``router.dispatch._failed`` returns (the first of each returned pair), which
    the dispatcher counts, are :data:`FAILOVER_REASONS`."""
    tree = ast.parse((REPO / "router" / "dispatch.py").read_text(encoding="utf-8"))
    (failed,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_failed"]
    returned = [n.value.elts[0] for n in ast.walk(failed) if isinstance(n, ast.Return) and n.value]
    used = {
        c.value
        for r in returned
        for c in ast.walk(r)
        if isinstance(c, ast.Constant) and isinstance(c.value, str)
    }
    assert used == set(FAILOVER_REASONS), used


def _families(text: str) -> dict[str, tuple[str, set[str]]]:
    """mixfleet_* family -> (type, label names of its samples, ``le`` left out)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("mixfleet_"):
            continue
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = {k for s in fam.samples for k in s.labels if k != "le"}
        out[name] = (fam.type, labels)
    return out


def _check_declared(text: str, defs: tuple[MetricDef, ...]) -> None:
    exposed = _families(text)
    declared = {d.name: d for d in defs}
    assert set(exposed) == set(declared), set(exposed) ^ set(declared)
    for name, (kind, labels) in exposed.items():
        d = declared[name]
        assert kind == d.kind, name
        assert labels <= set(d.labels), (name, labels, d.labels)
    samples = [s.name for f in text_string_to_metric_families(text) for s in f.samples]
    assert not [n for n in samples if n.startswith("mixfleet_") and n.endswith("_created")]


def test_process_declarations_are_what_prometheus_client_exports() -> None:
    exported = {
        s.name: (f.type, f.documentation)
        for f in ProcessCollector(registry=None).collect()
        for s in f.samples
    }
    assert exported == {d.name: (d.kind, d.help) for d in PROCESS_METRICS}


def _check_process(text: str) -> dict[str, float]:
    """The exposition's ``process_*`` samples (one process's: unlabelled), each sane; name -> value."""
    values = samples_of(text, "process_")
    assert {ls for _, ls in values} == {()}, values
    got = {n: v for (n, _), v in values.items()}
    assert set(got) == {d.name for d in PROCESS_METRICS}, got
    assert got["process_resident_memory_bytes"] > 10 * 2**20  # a Python process with FastAPI loaded
    assert 0 < got["process_open_fds"] <= got["process_max_fds"]
    assert got["process_cpu_seconds_total"] > 0
    assert 0 < time.time() - got["process_start_time_seconds"] < 3600
    return got


def _promtool(text: str) -> None:
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


@pytest.mark.timeout(600)
def test_router_and_sidecar_metrics_pass_promtool(tmp_path: Path, tiny_dir: Path) -> None:
    key = secrets.token_hex(16)
    preset = write_preset(
        tmp_path / "preset.toml",
        [{"name": GROUP[0], "weight_format": GROUP[1], "sessions_per_replica": 4, "price_per_gpu_hour": 1.5}],
    )
    with router_process(preset, keys={key: ALL_SCOPES}, log=tmp_path / "router.log") as router:
        env = {"MIXFLEET_API_KEY": key}
        with local_fleet(tmp_path / "fleet", tiny_dir, [GROUP], router_url=router.url, env=env) as fleet:
            h = router.headers
            deadline = time.monotonic() + 60
            while not httpx.get(router.url + "/v1/groups", headers=h).json()["groups"][0]["ready_replicas"]:
                assert time.monotonic() < deadline, fleet.logs()
                time.sleep(0.2)
            with RolloutClient(router.url, key) as c:
                s = c.create_session(GROUP[0])
                c.turn(s.session_id, [1, 2, 3], SP)
                c.turn(s.session_id, [1, 2, 3, 4, 5], SP)
                c.finish(s.session_id, 1.0)
                batch = c.take(4, wait_s=5)
                c.upload_trainer_logprobs(batch.lease_id, batch.logprobs - np.float32(0.5))
                c.ack(batch.lease_id)
            router_text = httpx.get(router.url + "/metrics").text
            sidecar_text = httpx.get(fleet.replicas[0].url + "/metrics").text
            engine_text = httpx.get(fleet.replicas[0].url + "/engine/metrics").text

    assert 'mixfleet_mismatch_tokens_total{group="cpu-bf16"}' in router_text
    assert 'mixfleet_router_turn_seconds_count{group="cpu-bf16"} 2.0' in router_text
    assert 'mixfleet_group_price_dollars_per_gpu_hour{group="cpu-bf16"} 1.5' in router_text
    assert 'mixfleet_replica_ready{group="cpu-bf16",replica="cpu-bf16-0"} 1.0' in sidecar_text
    assert "sglang:" not in sidecar_text and "sglang:num_running_reqs" in engine_text  # relayed apart
    _check_declared(router_text, ROUTER_METRICS)
    _check_declared(sidecar_text, REPLICA_METRICS)
    _check_process(router_text)
    _check_process(sidecar_text)
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    _promtool(router_text)
    _promtool(sidecar_text)

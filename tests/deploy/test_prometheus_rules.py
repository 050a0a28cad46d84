"""deploy/prometheus: ``promtool`` accepts the scrape configuration and the rules, and the rules'
unit tests (synthetic series for every alert, firing and not) pass; the rules query only metrics
the code defines. Skipped only where Debian's ``prometheus`` package (``promtool``) is absent."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.grafana import generate
from launcher.embedded import UpSettings
from tests.support.procs import REPO

PROM = REPO / "deploy" / "prometheus"
RULES = sorted((PROM / "rules").glob("*.yml"))
TESTS = sorted((PROM / "tests").glob("*.test.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool absent (apt-get install prometheus)")


def _promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict]:
    return [r for path in RULES for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


@needs_promtool
def test_promtool_checks_the_config_and_the_rules() -> None:
    out = _promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    for path in RULES:
        assert f"SUCCESS: {len(yaml.safe_load(path.read_text())['groups'][0]['rules'])} rules found" in (
            out.stdout
        ), out.stdout
    out = _promtool("check", "rules", *map(str, RULES))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    assert TESTS
    out = _promtool("test", "rules", *map(str, TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_promtool
def test_unit_tests_fail_when_an_alert_changes(tmp_path: Path) -> None:
    """The unit tests hold the alerts to their thresholds: the lag alert's bound is the routers'
    exported one; one more than that, or the old fixed 2, fails them."""
    for i, bound in enumerate(
        (
            "(max(mixfleet_router_version_lag_bound) + 1)",  # a lagging 3 over a bound of 2 stays quiet
            "vector(2)",  # the configured bound of 3 ignored: a lagging 3 fires
        )
    ):
        out = _mutated(tmp_path / str(i), BOUND, bound)
        assert out.returncode == 1, out.stdout
        assert "alertname: MixfleetVersionLagHigh" in out.stdout + out.stderr


BOUND = "max(mixfleet_router_version_lag_bound)"


def _mutated(work: Path, old: str, new: str) -> subprocess.CompletedProcess:
    """``promtool test rules`` with ``old`` replaced by ``new`` in the alerts file."""
    (work / "rules").mkdir(parents=True)
    (work / "tests").mkdir()
    for path in RULES:
        text = path.read_text()
        if path.name == "mixfleet-alerts.yml":
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        (work / "rules" / path.name).write_text(text)
    for path in TESTS:
        shutil.copy(path, work / "tests" / path.name)
    return _promtool("test", "rules", *(f"tests/{p.name}" for p in TESTS), cwd=work)


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert alerts == {
        "MixfleetRouterDown",
        "MixfleetStateDown",
        "MixfleetStateDataLost",
        "MixfleetGroupDown",
        "MixfleetVersionLagHigh",
        "MixfleetMismatchKLGrowing",
        "MixfleetSessionShareDrift",
        "MixfleetTokenShareDrift",
        "MixfleetReplicaRestarting",
        "MixfleetReplicaActivationFailing",
        "MixfleetOpenFilesNearLimit",
    }
    firing, quiet = set(), set()
    for path in TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert firing == alerts and quiet == alerts
    for path in TESTS:
        assert sorted(yaml.safe_load(path.read_text())["rule_files"]) == sorted(
            f"../rules/{p.name}" for p in RULES
        )


def test_rules_query_only_defined_metrics() -> None:
    defined = generate.defined_metrics()
    used = {m for r in _rules() for m in generate.metric_names(r["expr"])}
    assert used and used <= defined, sorted(used - defined)
    records = {r["record"] for r in _rules() if "record" in r}
    for r in _rules():
        for name in set(re.findall(r"\b(group:mixfleet_[\w:]+)", r["expr"])):
            assert name in records, name


def test_scrape_config_discovers_replicas_from_the_router() -> None:
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["rules/*.yml"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {generate.ROUTER_JOB, generate.REPLICA_JOB}
    replicas = jobs[generate.REPLICA_JOB]
    assert replicas["honor_labels"] is True
    (sd,) = replicas["http_sd_configs"]
    (router,) = jobs[generate.ROUTER_JOB]["static_configs"]
    assert sd["url"] == f"http://{router['targets'][0]}/v1/prometheus/targets"
    assert router["targets"] == [f"127.0.0.1:{UpSettings.port}"]  # `mixfleet up` as it starts
    assert sd["authorization"]["type"] == "Bearer"

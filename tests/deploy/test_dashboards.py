"""deploy/grafana: the committed dashboards are what ``deploy.grafana.generate`` writes, query only
metrics the code defines, and keep the conventions (Grafana 11 schema, the data source as a
variable, no NaN from idle ratios). Every query's data on a real Prometheus is checked in
``test_prometheus_live.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.grafana import generate
from tests.support.procs import REPO

DASH_DIR = REPO / "deploy" / "grafana" / "dashboards"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.grafana.generate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _dashboards() -> dict[str, dict]:
    return {name: json.loads((DASH_DIR / name).read_text()) for name in generate.DASHBOARDS}


def _panels(dash: dict):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def test_committed_dashboards_are_current() -> None:
    out = _run("--check")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == ""
    assert sorted(p.name for p in DASH_DIR.glob("*.json")) == sorted(generate.DASHBOARDS)


def test_check_fails_on_a_stale_missing_or_foreign_file(tmp_path: Path) -> None:
    out = _run("--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(generate.DASHBOARDS)
    assert _run("--check", "--out", str(tmp_path)).returncode == 0

    stale = tmp_path / "mixfleet-cost.json"
    dash = json.loads(stale.read_text())
    dash["panels"][0]["title"] = "edited by hand"
    stale.write_text(json.dumps(dash, indent=2) + "\n")
    (tmp_path / "mixfleet-mismatch.json").unlink()
    (tmp_path / "old.json").write_text("{}\n")
    out = _run("--check", "--out", str(tmp_path))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3, out.stderr
    assert any(f"{stale}: stale" in x for x in lines)
    assert any(f"{tmp_path / 'mixfleet-mismatch.json'}: missing" in x for x in lines)
    assert any(f"{tmp_path / 'old.json'}: not generated" in x for x in lines)
    assert "Traceback" not in out.stderr
    # --check writes nothing
    assert json.loads(stale.read_text())["panels"][0]["title"] == "edited by hand"
    assert not (tmp_path / "mixfleet-mismatch.json").exists()


def test_check_fails_on_a_metric_the_code_does_not_define(tmp_path: Path) -> None:
    defined = generate.defined_metrics()
    assert generate.problems(tmp_path, check=False, defined=defined) == []
    gone = defined - {"mixfleet_router_tokens_total", "sglang:num_queue_reqs"}
    errors = generate.problems(tmp_path, check=True, defined=gone)
    assert errors == [
        "mixfleet-overview.json: queries metrics the code does not define: mixfleet_router_tokens_total",
        "mixfleet-cost.json: queries metrics the code does not define: mixfleet_router_tokens_total",
        "mixfleet-engines.json: queries metrics the code does not define: sglang:num_queue_reqs",
    ]
    dash = generate.overview()
    dash["panels"][0]["targets"][0]["expr"] = 'sum(rate(mixfleet_router_tokenz_total{group=~"$group"}[5m]))'
    assert generate.undefined_metrics(dash, defined) == ["mixfleet_router_tokenz_total"]


def test_defined_metrics_are_read_from_the_registries() -> None:
    from engine.runtime.metrics import EngineMetrics
    from replica.reconciler import REPLICA_METRICS, SidecarMetrics
    from router.metrics import ROUTER_METRICS, RouterMetrics

    defined = generate.defined_metrics()
    for d in (*ROUTER_METRICS, *REPLICA_METRICS):
        if d.kind == "histogram":
            assert {f"{d.name}_bucket", f"{d.name}_count", f"{d.name}_sum"} <= defined, d.name
            assert d.name not in defined
        else:
            assert d.name in defined, d.name
    engine = {m.name for m in EngineMetrics("m").registry.collect()}
    assert "sglang:num_running_reqs" in engine and "sglang:num_running_reqs" in defined
    assert "sglang:generation_tokens_total" in defined and "sglang:generation_tokens" not in defined
    records = generate.recording_rules()
    assert "group:mixfleet_mismatch_k3_kl:rate15m" in records and records <= defined
    for registry in (RouterMetrics().registry, SidecarMetrics("g", "r").registry):  # ProcessCollector's
        assert {"process_resident_memory_bytes", "process_open_fds", "process_max_fds"} <= {
            m.name for m in registry.collect()
        }
    assert {"process_resident_memory_bytes", "process_open_fds", "process_max_fds"} <= defined


def test_metric_names_are_not_read_from_strings() -> None:
    expr = (
        'sum by (group) (label_replace(rate(mixfleet_router_session_moves_total{from_group=~"$group"}[5m]),'
        ' "group", "$1", "from_group", "(.*)")) or max(up{job="mixfleet-replicas"})'
        " + group:mixfleet_x:rate5m"
    )
    assert generate.metric_names(expr) == {"mixfleet_router_session_moves_total", "up"}
    fds = 'max by (instance) (process_open_fds{job="mixfleet-router"}) / (process_max_fds > 0)'
    assert generate.metric_names(fds) == {"process_open_fds", "process_max_fds"}


def test_every_dashboard_takes_its_datasource_from_the_variable() -> None:
    for name, dash in _dashboards().items():
        assert dash["schemaVersion"] >= 39, name
        assert dash["uid"] == name.removesuffix(".json")
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["group"]["datasource"] == generate.DATASOURCE
        text = json.dumps(dash)
        uids = set(re.findall(r'"uid": "([^"]*)"', text))
        assert uids == {"${datasource}", "-- Grafana --", dash["uid"]}, (name, uids)
        ids = []
        for p in _panels(dash):
            ids.append(p["id"])
            pos = p["gridPos"]
            assert pos["x"] + pos["w"] <= 24 and pos["w"] > 0 and pos["h"] > 0
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (name, p["title"])
            assert p["targets"], (name, p["title"])
            for t in p["targets"]:
                assert t["datasource"] == p["datasource"]
        assert len(ids) == len(set(ids)), name


def _closing(expr: str, start: int) -> int:
    depth = 0
    for i in range(start, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced: {expr}")


def test_every_division_drops_zero_denominators_and_quantiles_need_counts() -> None:
    divisions = quantiles = 0
    for name, dash in _dashboards().items():
        for expr in generate.queries(dash):
            for m in re.finditer(r" / (on \([^)]*\) group_left \([^)]*\) )?", expr):
                rest = expr[m.end() :]
                if re.match(r"\d", rest):
                    continue  # a constant (unit conversion)
                assert rest.startswith("("), (name, expr)
                inner = rest[: _closing(rest, 0) + 1]
                assert inner.endswith(" > 0)"), (name, expr)
                divisions += 1
            for m in re.finditer(r"histogram_quantile\(", expr):
                body = expr[m.end() - 1 :]
                body = body[: _closing(body, 0) + 1]
                assert re.search(r"_count(\{[^}]*\})?\[[^]]+\]\)\) > 0\)\)$", body), (name, body)
                quantiles += 1
    assert divisions >= 8 and quantiles >= 10


def test_provisioning_and_compose_point_at_the_generated_dashboards() -> None:
    root = REPO / "deploy" / "grafana"
    ds = yaml.safe_load((root / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and "uid" not in source
    prov = yaml.safe_load((root / "provisioning" / "dashboards" / "mixfleet.yml").read_text())
    (provider,) = prov["providers"]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    grafana, prom = compose["services"]["grafana"], compose["services"]["prometheus"]
    mounts = {src: dst for src, dst, *_ in (v.split(":") for v in grafana["volumes"])}
    assert mounts["./dashboards"] == provider["options"]["path"]
    assert mounts["./provisioning"] == "/etc/grafana/provisioning"
    prom_mounts = {src: dst for src, dst, *_ in (v.split(":") for v in prom["volumes"])}
    assert prom_mounts["../prometheus"] == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert prom["network_mode"] == "host" and "ports" not in prom  # it scrapes 127.0.0.1 addresses
    assert source["url"] == "http://host.docker.internal:9090"
    assert "host.docker.internal:host-gateway" in grafana["extra_hosts"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert home.rsplit("/", 1)[1] in generate.DASHBOARDS


@pytest.mark.parametrize("name", sorted(generate.DASHBOARDS))
def test_dashboard_json_is_the_generators_output(name: str) -> None:
    assert (DASH_DIR / name).read_text() == generate.render(generate.DASHBOARDS[name]())

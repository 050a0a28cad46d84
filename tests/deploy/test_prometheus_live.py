"""Every dashboard query answers data on a real Prometheus scraping a real local fleet.

Debian's ``prometheus`` runs on loopback with ``deploy/prometheus/prometheus.yml`` (its jobs, its
rules) pointed at a real router and scraping every 2 s; the replicas (two groups, one ``tiny``
engine behind its sidecar each) are discovered through the router's
``/v1/prometheus/targets``. The fleet serves multi-turn sessions (placed by the router's
policy), publishes version 2 and serves sessions on it on every group, and a trainer takes a
batch, uploads its log-probs and acknowledges it. Then every query of every dashboard (and every
variable), with the Grafana variables set to each group and its replica, must return at least one
series, all of whose values are finite numbers (the ``(den > 0)`` and counted-quantile guards
hold). The test waits (with a generous bound) for the scrapes that carry each query's series
rather than sleeping a fixed time, so a busy machine makes it slower, not red. Skipped only where
``prometheus`` is absent.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG
from deploy.grafana import generate
from tests.support.fleet import LocalFleet, local_fleet
from tests.support.models import make_model_dir
from tests.support.procs import REPO, free_port, process
from tests.support.router import ALL_SCOPES, RouterHandle, router_process, write_preset
from trainer.client import RolloutClient

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus absent (apt-get install prometheus)"),
]

RUN = "run"
GROUPS = (("cpu-bf16", "bf16"), ("cpu-fp8", "fp8"))
PRICES = {"cpu-bf16": 2.5, "cpu-fp8": 1.25}
# Grafana's variables as the test sets them; the window spans the whole test.
WINDOW = {"$__rate_interval": "5m", "$__range": "10m", "$__interval": "15s"}
HELLO = [72, 101, 108, 108, 111]


@dataclass
class Prometheus:
    url: str
    log: Path

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, r.text)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def wait(self, expr: str, what: str, timeout: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"Prometheus never showed {what} ({expr})\n{tail}")
            time.sleep(0.5)


@contextlib.contextmanager
def prometheus(work: Path, router: RouterHandle) -> Iterator[Prometheus]:
    """Debian's prometheus with the committed config and rules, aimed at ``router``."""
    committed = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    key_file = work / "prometheus_key"
    key_file.write_text(router.key)
    key_file.chmod(0o600)
    address = f"127.0.0.1:{router.port}"
    cfg = dict(committed)
    cfg["global"] = {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"}
    cfg["rule_files"] = [str(REPO / "deploy" / "prometheus" / f) for f in committed["rule_files"]]
    for job in cfg["scrape_configs"]:
        for static in job.get("static_configs", []):
            static["targets"] = [address]
        for sd in job.get("http_sd_configs", []):
            sd["url"] = re.sub(r"^http://[^/]+", f"http://{address}", sd["url"])
            sd["refresh_interval"] = "1s"
            sd["authorization"]["credentials_file"] = str(key_file)
    path = work / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    port = free_port()
    argv = [
        str(PROMETHEUS),
        f"--config.file={path}",
        f"--storage.tsdb.path={work / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    log = work / "prometheus.log"
    with process(argv, log=log) as proc:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        yield Prometheus(url, log)


@dataclass
class Observed:
    prom: Prometheus
    fleet: LocalFleet
    router: RouterHandle
    targets: list[dict]
    client: RolloutClient


def _serve(
    client: RolloutClient, sessions: int, turns: int, groups: tuple[str, ...] | None = None
) -> dict[str, int]:
    """``sessions`` sessions of ``turns`` turns each, finished, placed by the router's policy, or
    in turn on each of ``groups``; the sessions per group."""
    per: dict[str, int] = {}
    for i in range(sessions):
        s = client.create_session(groups[i % len(groups)] if groups else None)
        per[s.group] = per.get(s.group, 0) + 1
        context = list(HELLO)
        for _ in range(turns):
            out = client.turn(s.session_id, context, {"max_new_tokens": 6, "temperature": 1.0})
            context = context + out["output_ids"] + [32, 63]
        client.finish(s.session_id, reward=float(i % 2))
    return per


def _take_upload_ack(client: RolloutClient, prom: Prometheus) -> None:
    """As a trainer: take every trajectory, upload noisy log-probs and drawn route flags, acknowledge;
    then wait until Prometheus has the upload's tokens and route flags."""
    batch = client.take(64)
    assert batch.lease_id is not None and len(batch.trajectories) == 10
    rng = np.random.default_rng(0)
    noise = rng.normal(0.0, 0.3, size=batch.logprobs.shape).astype(np.float32)
    trainer = np.minimum(batch.logprobs + noise, np.float32(0.0))  # log-probs: at most 0
    # a trainer's replay flags (0 same experts, 1 different), drawn: the panels need both
    routes = rng.integers(0, 2, size=batch.logprobs.shape).astype(np.uint8)
    figures = client.upload_trainer_logprobs(batch.lease_id, trainer, routes)
    assert figures["tokens"] == len(batch.logprobs)
    assert {g["group"] for g in figures["groups"]} == {g for g, _ in GROUPS}
    client.ack(batch.lease_id)

    prom.wait(
        f"sum(max by (group) (mixfleet_mismatch_tokens_total)) == {len(batch.logprobs)}",
        "the upload's tokens",
        30,
    )
    prom.wait(
        f"sum(max by (group) (mixfleet_mismatch_route_tokens_total)) == {len(batch.logprobs)}",
        "the upload's route flags",
        30,
    )


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Iterator[Observed]:
    work = tmp_path_factory.mktemp("prom-live")
    base = make_model_dir(work / "models", "tiny", "bf16")
    seed2 = make_model_dir(work / "models", "tiny", "bf16", seed=2)
    key = secrets.token_hex(16)
    preset = write_preset(
        work / "preset.toml",
        [
            {
                "name": g,
                "weight_format": f,
                "sessions_per_replica": 2,
                "min_replicas": 1,
                "price_per_gpu_hour": PRICES[g],
                "record_routes": True,  # the route-mismatch panels need routes recorded and replayed
            }
            for g, f in GROUPS
        ],
    )
    env = {"MIXFLEET_STORE": str(work / "store"), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    with router_process(
        preset,
        keys={key: ALL_SCOPES},
        log=work / "router.log",
        extra_args=("--heartbeat-timeout", "5"),
        env=env,
    ) as router:
        fleet_env = {"MIXFLEET_API_KEY": key, "MIXFLEET_URL": router.url}
        with (
            local_fleet(
                work,
                base,
                GROUPS,
                run_id=RUN,
                router_url=router.url,
                env=fleet_env,
                engine_flags=(ENABLE_RETURN_ROUTED_EXPERTS_FLAG,),
            ) as fleet,
            RolloutClient(router.url, key) as client,
            prometheus(work, router) as prom,
        ):
            h = router.headers
            assert httpx.get(router.url + "/v1/weights", headers=h, timeout=30).status_code == 200
            targets = httpx.get(router.url + "/v1/prometheus/targets", headers=h, timeout=30).json()
            up = prom.wait('count(up{job="mixfleet-replicas"} == 1) == 4', "both replicas up", 60)
            prom.wait('up{job="mixfleet-router"} == 1', "the router up")
            prom.wait("mixfleet_weights_published_version == 1", "version 1 published")
            assert up

            per = _serve(client, sessions=6, turns=2)
            assert set(per) == {g for g, _ in GROUPS}, per  # the capacity policy used both groups

            job = client.publish(str(seed2), version=2)
            client.wait_job(job["job_id"], timeout_s=120)
            fleet.wait_active(2, timeout=120)
            prom.wait("mixfleet_weights_published_version == 2", "version 2 published")
            names = tuple(g for g, _ in GROUPS)
            assert _serve(client, sessions=4, turns=2, groups=names) == dict.fromkeys(names, 2)

            _take_upload_ack(client, prom)
            prom.wait("count(mixfleet_replica_activations_total >= 1) == 2", "both activations", 30)
            prom.wait("sum(mixfleet_router_updates_total) == 1", "the acknowledged update", 60)
            for g in names:  # two scrapes after the last turn of each group: its rates have data
                expr = f'sum(rate(mixfleet_router_tokens_total{{group="{g}"}}[5m])) > 0'
                prom.wait(expr, f"a token rate of {g}", 60)
            yield Observed(prom, fleet, router, targets, client)


def _substitute(expr: str, group: str, replica: str) -> str:
    for var, value in {**WINDOW, "$group": group, "$replica": replica}.items():
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$1", ""), expr
    return expr


def test_the_router_lists_every_replica_as_a_scrape_target(observed: Observed) -> None:
    listed = {(t["labels"]["replica"], t["labels"]["component"]): t for t in observed.targets}
    assert len(listed) == len(observed.targets) == 2 * len(observed.fleet.replicas)
    for r in observed.fleet.replicas:
        for component, path in (("sidecar", "/metrics"), ("engine", "/engine/metrics")):
            t = listed[(r.replica_id, component)]
            assert t["targets"] == [r.url.removeprefix("http://")]
            assert t["labels"] == {
                "group": r.group,
                "replica": r.replica_id,
                "component": component,
                "__scheme__": "http",
                "__metrics_path__": path,
            }
    active = observed.prom.api("targets", state="active")["activeTargets"]
    scraped = {
        (t["labels"]["job"], t["labels"].get("replica"), t["labels"].get("component")): t for t in active
    }
    assert len(scraped) == len(active) == 1 + len(observed.targets)
    for r in observed.fleet.replicas:
        for component, path in (("sidecar", "/metrics"), ("engine", "/engine/metrics")):
            t = scraped[(generate.REPLICA_JOB, r.replica_id, component)]
            assert t["health"] == "up" and t["labels"]["group"] == r.group, t
            assert t["scrapeUrl"] == f"{r.url}{path}"
    assert scraped[(generate.ROUTER_JOB, None, None)]["health"] == "up"
    # the engine's series get the replica's group and id from the target; the sidecar's carry their own
    for r in observed.fleet.replicas:
        sel = f'{{group="{r.group}", replica="{r.replica_id}"}}'
        (running,) = observed.prom.query(f"sglang:num_running_reqs{sel}")
        assert running["metric"]["component"] == "engine"
        (ready,) = observed.prom.query(f"mixfleet_replica_ready{sel}")
        assert ready["value"][1] == "1" and ready["metric"]["component"] == "sidecar"


QUERY_DATA_TIMEOUT_S = 180.0
"""How long every dashboard query may take to show data after the fixture's last event: the
series a query needs appear with the next scrapes, later on a busy machine (a scrape that times
out leaves a gap), so the test waits for them instead of sleeping a fixed time."""
REFRESH_S = 10.0
"""While queries lack data, every group serves a turn this often: a rate over the dashboards'
5 min window is 0 once every sample in it shows the same count (the fixture's turns were that
long ago on a slow machine, or a histogram's first scrape already held all its observations: the
engine exports a histogram from its first observation, engine/runtime/metrics.py), and the
quantile panels drop a series whose rate is 0."""


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    prom = observed.prom
    pending: dict[str, str] = {}  # expression -> where it is used
    for name, build in generate.DASHBOARDS.items():
        dash = build()
        assert json.loads((REPO / "deploy" / "grafana" / "dashboards" / name).read_text()) == dash
        for r in observed.fleet.replicas:
            for panel in dash["panels"]:
                for t in panel.get("targets", []):
                    expr = _substitute(t["expr"], r.group, r.replica_id)
                    pending.setdefault(expr, f"{name} / {panel['title']} [{r.group}]")
    assert len(pending) > 100
    groups = tuple(g for g, _ in GROUPS)
    deadline = time.monotonic() + QUERY_DATA_TIMEOUT_S
    refresh = time.monotonic() + REFRESH_S
    while True:
        if time.monotonic() > refresh:
            _serve(observed.client, sessions=len(groups), turns=1, groups=groups)
            refresh = time.monotonic() + REFRESH_S
        for expr, where in list(pending.items()):
            result = prom.query(expr)
            for sample in result:
                assert math.isfinite(float(sample["value"][1])), (where, expr, sample)
            if result:
                del pending[expr]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    empty = [f"{where}: {expr}" for expr, where in pending.items()]
    assert not empty, f"queries without data after {QUERY_DATA_TIMEOUT_S:g} s:\n" + "\n".join(empty)


def test_every_variable_query_lists_values(observed: Observed) -> None:
    for name, build in generate.DASHBOARDS.items():
        for var in build()["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
            assert m, var["definition"]
            for r in observed.fleet.replicas:
                match = _substitute(m.group(1), r.group, r.replica_id)
                series = observed.prom.api("series", **{"match[]": match})
                values = {s[m.group(2)] for s in series if m.group(2) in s}
                want = r.group if m.group(2) == "group" else r.replica_id
                assert want in values, (name, var["name"], match, values)


def test_figures_agree_with_the_router(observed: Observed) -> None:
    """A few dashboard figures, read back from Prometheus, are the router's own numbers."""
    prom = observed.prom
    groups = httpx.get(observed.router.url + "/v1/groups", headers=observed.router.headers, timeout=30).json()
    for g in groups["groups"]:
        sel = f'{{group="{g["name"]}"}}'
        (price,) = prom.query(f"max by (group) (mixfleet_group_price_dollars_per_gpu_hour{sel})")
        assert float(price["value"][1]) == PRICES[g["name"]]
        (lag,) = prom.query(f"max by (group) (mixfleet_group_version_lag{sel})")
        assert float(lag["value"][1]) == 0
        (active,) = prom.query(f"max by (group) (mixfleet_group_active_version{sel})")
        assert float(active["value"][1]) == 2
        kl = g["mismatch"]["k3_kl"]
        (total,) = prom.query(f"max by (group) (mixfleet_mismatch_k3_total{sel})")
        (tokens,) = prom.query(f"max by (group) (mixfleet_mismatch_tokens_total{sel})")
        assert float(total["value"][1]) / float(tokens["value"][1]) == pytest.approx(kl, rel=1e-9)
    (published,) = prom.query("max(mixfleet_weights_published_version)")
    assert float(published["value"][1]) == 2
    # the recording rules run on the real Prometheus too (evaluated every 2 s: the upload's scrape
    # may be newer than the last evaluation)
    prom.wait("group:mixfleet_mismatch_k3_kl:rate15m", "the k3 KL recording rule's value", 30)
    rules = prom.api("rules")["groups"]
    assert {g["name"] for g in rules} == {"mixfleet-recording", "mixfleet-alerts"}
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules

"""The autoscaler adapter (deploy.autoscaler) against the installed modal client's own signatures
(offline: ``Server.from_name`` is lazy and nothing is called), and ``mixfleet scale --dry-run``
reading demand from a real router process."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import httpx
import modal
import pytest

from deploy import autoscaler
from deploy.plan import APP_NAME, load_plan
from fleet.autoscale import Demand, GroupBounds, GroupDemand, scale_settings
from tests.support.procs import mixfleet_argv
from tests.support.router import router_process, write_preset


def _update_signature() -> inspect.Signature:
    return inspect.signature(modal.Server.from_name(APP_NAME, "any").autoscaler.update)


def test_the_installed_client_takes_every_keyword_the_adapter_passes() -> None:
    plan = load_plan("mixed")
    bounds = [GroupBounds.of(s.group) for s in plan.servers]
    settings = scale_settings(bounds, Demand({b.name: GroupDemand(9, 1, 1 / len(bounds)) for b in bounds}))
    params = _update_signature().parameters
    for s in settings:
        kwargs = s.update_kwargs()
        assert set(kwargs) == set(autoscaler.UPDATE_KEYWORDS)
        for key, value in kwargs.items():
            assert params[key].kind is inspect.Parameter.KEYWORD_ONLY
            assert isinstance(value, int) and not isinstance(value, bool)
        # the client's own rules (modal/_server.py _ServerAutoscalerManager.update), checked after hydration
        assert kwargs["min_containers"] >= 0 and kwargs["buffer_containers"] >= 0
        assert kwargs["max_containers"] > 0 and 2 <= kwargs["scaledown_window"] <= 3600
        assert kwargs["target_concurrency"] > 0
    from_name = inspect.signature(modal.Server.from_name).parameters
    assert list(from_name)[:2] == ["app_name", "name"] and "environment_name" in from_name
    for s in plan.servers:  # every server the deploy names is a lazy reference the adapter accepts
        autoscaler.check_client(autoscaler.server_ref(APP_NAME, s.name))


def test_servers_are_addressed_by_the_names_the_deploy_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXFLEET_PRESET", "mixed")
    monkeypatch.delenv("MIXFLEET_FLEET_JSON", raising=False)
    sys.modules.pop("deploy.modal_app", None)
    try:
        app = importlib.import_module("deploy.modal_app")
        names = autoscaler.server_names(app.PLAN)
        assert sorted(names.values()) == sorted(app.SERVERS) == sorted(app.SERVER_OPTIONS)
        assert all(app.SERVER_OPTIONS[name]["name"] == name for name in names.values())
    finally:
        sys.modules.pop("deploy.modal_app", None)


class _StandIn:
    """A server whose ``autoscaler.update`` has the installed client's signature and records calls
    (Modal itself cannot be reached from a test)."""

    def __init__(self, name: str, signature: inspect.Signature) -> None:
        self.name = name
        self.calls: list[dict] = []
        stand_in = self

        def update(**kwargs):
            signature.bind(None, **kwargs)  # TypeError unless the real client takes this call
            stand_in.calls.append(kwargs)
            return kwargs

        update.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
        self.autoscaler = type("Autoscaler", (), {"update": staticmethod(update)})()


def test_apply_updates_each_server_once_with_its_settings() -> None:
    plan = load_plan("homogeneous")
    bounds = [GroupBounds.of(s.group) for s in plan.servers]
    settings = scale_settings(bounds, Demand({bounds[0].name: GroupDemand(30, 0, 1.0)}))
    made: dict[str, _StandIn] = {}

    def ref(app_name: str, name: str, env: str | None) -> _StandIn:
        assert (app_name, env) == ("my-app", "dev")
        made[name] = _StandIn(name, _update_signature())
        return made[name]

    out = autoscaler.apply(settings, plan, app_name="my-app", environment_name="dev", ref=ref)
    assert out == [s.update_kwargs() for s in settings]
    assert {n: m.calls for n, m in made.items()} == {
        plan.servers[i].name: [s.update_kwargs()] for i, s in enumerate(settings)
    }


def test_a_client_without_the_keywords_is_refused_before_any_update() -> None:
    class Old:
        class autoscaler:  # noqa: N801
            @staticmethod
            def update(*, min_containers=None, max_containers=None):
                raise AssertionError("must not be called")

    with pytest.raises(
        autoscaler.ClientMismatch, match="buffer_containers, scaledown_window, target_concurrency"
    ):
        autoscaler.check_client(Old())
    with pytest.raises(autoscaler.ClientMismatch, match="no Server.autoscaler.update"):
        autoscaler.check_client(object())


def test_scale_dry_run_reads_demand_from_a_real_router(tmp_path: Path) -> None:
    groups = [
        {"name": "h100", "accelerator": "H100", "weight_format": "fp8", "kv_cache_dtype": "fp8_e4m3",
         "sessions_per_replica": 4, "min_replicas": 0, "max_replicas": 5, "buffer_replicas": 1},
        {"name": "b200", "accelerator": "B200", "weight_format": "bf16", "kv_cache_dtype": "fp8_e4m3",
         "sessions_per_replica": 4, "min_replicas": 0, "max_replicas": 5},
    ]  # fmt: skip
    preset = write_preset(tmp_path / "gpu.toml", groups)
    with router_process(preset) as router:
        hb = {"replica_id": "h100-0", "group": "h100", "url": "http://127.0.0.1:9/", "ready": True,
              "active_version": None, "running": 4, "queued": 3}  # fmt: skip
        r = httpx.post(router.url + "/v1/replicas/heartbeat", json=hb, headers=router.headers)
        assert r.status_code == 200, r.text
        for _ in range(6):  # only h100 has capacity: every session goes there
            r = httpx.post(router.url + "/v1/sessions", json={}, headers=router.headers)
            assert r.status_code in (200, 201), r.text
        env = {**os.environ, "MIXFLEET_API_KEY": router.key}
        done = subprocess.run(
            mixfleet_argv("scale", "--preset", str(preset), "--router", router.url, "--dry-run"),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # h100: 6 active + 3 queued = 9 sessions -> ceil(9 / 4) = 3; b200: no capacity, counted as one
    # replica (4 sessions) against h100's 4 -> share 1/2 of D = 9 -> 4.5 sessions -> 2 replicas
    assert lines[1].startswith("h100: active 6, queued 3, share 0.500 -> min 3, max 5, buffer 1,")
    assert lines[2].startswith("b200: active 0, queued 0, share 0.500 -> min 2, max 5, buffer 0,")
    assert "scaledown 300s, target concurrency 4" in lines[1]


def test_scale_refuses_a_router_that_serves_none_of_the_presets_groups(tmp_path: Path) -> None:
    """`mixfleet scale` pointed at a router of another fleet (here: the README's `mixfleet up`
    groups against the default preset, mixed) is one line naming both fleets' groups, exit 2:
    without it every group of the preset was printed, and applied, at its minimum."""
    groups = [{"name": "cpu-bf16", "accelerator": "cpu", "weight_format": "bf16", "sessions_per_replica": 8}]
    with router_process(write_preset(tmp_path / "local.toml", groups)) as router:
        done = subprocess.run(
            mixfleet_argv("scale", "--router", router.url, "--dry-run"),
            capture_output=True,
            text=True,
            env={**os.environ, "MIXFLEET_API_KEY": router.key},
            timeout=120,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert "the router serves cpu-bf16, none of the preset's groups (a100-bf16, b200-nvfp4," in line


def test_scale_refuses_a_local_preset_and_an_unreachable_router(tmp_path: Path) -> None:
    done = subprocess.run(
        mixfleet_argv("scale", "--preset", "local", "--dry-run"), capture_output=True, text=True
    )
    assert done.returncode == 2 and "a Modal server needs a GPU" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = subprocess.run(
        mixfleet_argv("scale", "--preset", "mixed", "--router", "http://127.0.0.1:9", "--dry-run"),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr

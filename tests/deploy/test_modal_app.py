"""deploy/modal_app.py imported offline for every deployable preset, checked from modal's own objects
(the app's registered functions, ``Server.info()`` / ``Function.info()``) against the preset.

``Function.info()`` holds no autoscaler settings, so those are checked in the keyword arguments the
app passed to ``@app.server`` (``SERVER_OPTIONS``), which modal's decorator validated on import.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import modal
import pytest

from deploy import plan as deploy_plan
from fleet.specs import FleetSpec, load_preset
from images import modal_images
from images.accelerators import parse_gpu

PRESETS = ["mixed", "homogeneous"]
ROOT = Path(__file__).resolve().parents[2]


def _import_app(monkeypatch: pytest.MonkeyPatch, preset: str, **env: str) -> ModuleType:
    monkeypatch.setenv("MIXFLEET_PRESET", preset)
    monkeypatch.delenv("MIXFLEET_FLEET_JSON", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    sys.modules.pop("deploy.modal_app", None)
    return importlib.import_module("deploy.modal_app")


def _registered(module: ModuleType) -> dict[str, modal.Function]:
    with warnings.catch_warnings():  # announced for removal in modal 1.7 (pyproject pins < 1.7)
        warnings.simplefilter("ignore")
        return dict(module.app.registered_functions)


def _secret_reprs(info) -> set[str]:
    return set(info.secrets)


@pytest.fixture(params=PRESETS)
def deployed(request, monkeypatch) -> tuple[ModuleType, FleetSpec]:
    module = _import_app(monkeypatch, request.param)
    yield module, load_preset(request.param)
    sys.modules.pop("deploy.modal_app", None)


def test_one_gpu_server_per_group_plus_router_and_publish(deployed) -> None:
    module, fleet = deployed
    names = [g.name for g in fleet.groups]
    assert list(_registered(module)) == [*names, "router", "publish"]
    assert list(module.SERVERS) == names
    assert all(isinstance(s, modal.Server) for s in module.SERVERS.values())


def test_server_info_matches_the_preset(deployed) -> None:
    module, fleet = deployed
    functions = _registered(module)
    for g in fleet.groups:
        info = module.SERVERS[g.name].info()
        assert info.gpus == [(parse_gpu(g.accelerator).kind, g.gpus_per_replica)]
        assert info.port == deploy_plan.PUBLIC_PORT
        assert info.unauthenticated is False  # proxy auth on
        assert info.startup_timeout == deploy_plan.SERVER_STARTUP_TIMEOUT_S
        assert info.exit_grace_period == deploy_plan.SERVER_EXIT_GRACE_S
        assert {p: v.name for p, v in info.volumes.items()} == {
            deploy_plan.VOLUME_MOUNT: deploy_plan.VOLUME_NAME
        }
        secrets = _secret_reprs(info)
        assert f"modal.Secret.from_name('{deploy_plan.REPLICA_SECRET}')" in secrets
        # the router's keys (admin among them) stay off the GPU containers
        assert f"modal.Secret.from_name('{deploy_plan.KEYS_SECRET}')" not in secrets
        concurrency = functions[g.name].info().concurrency_info
        assert concurrency is not None
        assert concurrency.max_inputs == g.sessions_per_replica + deploy_plan.CONTROL_HEADROOM


def test_autoscaling_and_image_passed_to_app_server(deployed) -> None:
    module, fleet = deployed
    for g in fleet.groups:
        options = module.SERVER_OPTIONS[g.name]
        assert options["min_containers"] == g.min_replicas
        assert options["max_containers"] == g.max_replicas
        assert options["buffer_containers"] == g.buffer_replicas
        assert options["scaledown_window"] == g.scaledown_window_s
        assert options["target_concurrency"] == g.sessions_per_replica
        assert options["max_concurrency"] == g.sessions_per_replica + deploy_plan.CONTROL_HEADROOM
        family = "blackwell" if g.accelerator in ("B200", "B300", "RTX-PRO-6000") else "ampere-hopper"
        assert options["image"] is modal_images.sglang_image(family)
        assert options["gpu"] == (
            g.accelerator if g.gpus_per_replica == 1 else f"{g.accelerator}:{g.gpus_per_replica}"
        )


def test_the_names_groups_may_not_take_are_the_apps_functions(deployed) -> None:
    # a group named like one of these would be replaced by it, with only a logged warning
    module, fleet = deployed
    functions = [n for n in _registered(module) if n not in module.SERVERS]
    assert tuple(functions) == deploy_plan.APP_FUNCTIONS


def test_router_is_an_asgi_app_on_several_containers_with_redis(deployed) -> None:
    module, _ = deployed
    info = _registered(module)["router"].info()
    assert info.web_info is not None  # an ASGI endpoint
    assert info.gpus == []
    assert info.concurrency_info.max_inputs == deploy_plan.RouterPlan().max_concurrency
    assert info.concurrency_info.target_inputs == deploy_plan.RouterPlan().target_concurrency
    secrets = _secret_reprs(info)
    assert f"modal.Secret.from_name('{deploy_plan.REDIS_SECRET}')" in secrets
    assert f"modal.Secret.from_name('{deploy_plan.KEYS_SECRET}')" in secrets
    assert f"modal.Secret.from_name('{deploy_plan.PROXY_SECRET}')" in secrets
    assert info.web_info.unauthenticated  # the router's own bearer keys guard it
    assert deploy_plan.RouterPlan().min_containers >= 2


def test_publish_is_a_cpu_function_sized_for_a_35b_checkpoint(deployed) -> None:
    module, _ = deployed
    info = _registered(module)["publish"].info()
    assert info.gpus == []
    assert {p: v.name for p, v in info.volumes.items()} == {deploy_plan.VOLUME_MOUNT: deploy_plan.VOLUME_NAME}
    assert info.cpu >= 16
    # a 35B-parameter BF16 checkpoint is ~70 GB: memory for it and its largest conversions
    assert info.memory_mib >= 128 * 1024
    assert info.ephemeral_disk_mib >= 256 * 1024
    assert info.timeout >= 3600


def test_a_container_rebuilds_the_same_app_from_the_shipped_fleet(monkeypatch) -> None:
    local = _import_app(monkeypatch, "homogeneous")
    shipped = local.ENV["MIXFLEET_FLEET_JSON"]
    # in a container: no preset file to read, only the environment the app shipped
    remote = _import_app(monkeypatch, "/nonexistent/preset.toml", MIXFLEET_FLEET_JSON=shipped)
    assert remote.PLAN.fleet == local.PLAN.fleet
    assert list(_registered(remote)) == list(_registered(local))
    sys.modules.pop("deploy.modal_app", None)


def test_server_class_is_a_module_global_modal_finds_by_name(deployed) -> None:
    module, fleet = deployed
    for g in fleet.groups:
        server = getattr(module, "Server_" + g.name.replace("-", "_"))
        assert server is module.SERVERS[g.name]


def test_a_bad_preset_fails_at_import_naming_the_problem(monkeypatch, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[groups]]\nname = "g"\naccelerator = "H300"\n')
    with pytest.raises(deploy_plan.PresetRejected, match="group g: GPU 'H300' is not a Modal GPU type"):
        _import_app(monkeypatch, str(bad))
    sys.modules.pop("deploy.modal_app", None)


@pytest.mark.parametrize("preset", PRESETS)
def test_modals_cli_loads_the_file_as_modal_deploy_does(preset: str) -> None:
    # ``modal run FILE::FUNCTION --help`` imports the app file by path, like ``modal deploy``,
    # and builds the function's options from its signature; it needs no token.
    env = {**os.environ, "MIXFLEET_PRESET": preset}
    env.pop("MIXFLEET_FLEET_JSON", None)
    argv = [sys.executable, "-m", "modal", "run", "deploy/modal_app.py::publish", "--help"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--checkpoint TEXT" in done.stdout and "--version INTEGER" in done.stdout


def test_replica_entrypoint_takes_the_arguments_the_server_passes(deployed) -> None:
    import inspect
    import threading

    from replica.entrypoint import run_replica

    module, fleet = deployed
    for g in fleet.groups:
        kwargs = module.replica_kwargs(g, threading.Event(), "https://router.example", None)
        inspect.signature(run_replica).bind(**kwargs)  # raises TypeError on a mismatch
        assert kwargs["store"].volume == deploy_plan.VOLUME_NAME
        assert str(kwargs["store"].root) == deploy_plan.VOLUME_MOUNT
        assert (
            kwargs["engine_port"] == deploy_plan.ENGINE_PORT
            and kwargs["public_port"] == deploy_plan.PUBLIC_PORT
        )
        argv = kwargs["engine_argv"]("/root/mixfleet-stage/main/x/v000002", "2")
        assert argv == deploy_plan.sglang_argv(g, "/root/mixfleet-stage/main/x/v000002", "2")
        assert argv[argv.index("--port") + 1] == str(deploy_plan.ENGINE_PORT)
        assert argv[argv.index("--tp-size") + 1] == str(g.gpus_per_replica)

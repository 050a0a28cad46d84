"""Where publications run (weight_sync.converters): the Modal-function adapter's call against the
installed modal client's own objects and signatures and the deployed ``publish`` function's
signature (offline: ``Function.from_name`` is lazy and nothing is called); the whole remote path
run for real with stand-ins of ``modal.Function`` / ``FunctionCall`` bound to those signatures,
the function's own body publishing on a stand-in Volume that enforces Modal's rules; and a real
router app publishing through that converter (its job, events and status)."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import time
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import modal
import pytest
from fastapi.testclient import TestClient

from core.errors import UserError
from fleet.specs import load_preset
from router.app import create_app
from router.config import RouterConfig, WeightsConfig
from router.publishing import PublishService
from router.routes_weights import create_weights_router
from tests.support.router import write_preset
from tests.support.volume import volume_store
from weight_sync.converters import (
    CONVERT_FUNCTION_ENV,
    ConvertRequest,
    LocalConverter,
    ModalFunctionConverter,
    open_converter,
)
from weight_sync.converters.modal_function import call_kwargs, function_ref, parse_function_ref, run_request
from weight_sync.publish import next_version
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef, VersionRef

ADMIN = "tok-admin-0123456789abcdef"


@pytest.fixture()
def deployed(monkeypatch: pytest.MonkeyPatch) -> typing.Iterator[ModuleType]:
    monkeypatch.setenv("MIXFLEET_PRESET", "homogeneous")
    monkeypatch.delenv("MIXFLEET_FLEET_JSON", raising=False)
    sys.modules.pop("deploy.modal_app", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield importlib.import_module("deploy.modal_app")
    sys.modules.pop("deploy.modal_app", None)


def _registered(module: ModuleType) -> dict[str, modal.Function]:
    with warnings.catch_warnings():  # announced for removal in modal 1.7 (pyproject pins < 1.7)
        warnings.simplefilter("ignore")
        return dict(module.app.registered_functions)


def _remote_raw_f(module: ModuleType) -> Any:
    """The deployed function's Python function, where modal's own CLI reads its signature
    (modal 1.6.4, ``modal/cli/run.py`` ``_get_click_command_for_function``:
    ``function._source_info_.raw_f``)."""
    return _registered(module)["publish"]._source_info_.raw_f


def _remote_signature(module: ModuleType) -> inspect.Signature:
    return inspect.signature(_remote_raw_f(module))


@dataclass
class StandInCall:
    """A ``modal.FunctionCall`` that already ran: ``object_id`` and ``get``, bound to the
    installed client's ``FunctionCall.get`` signature."""

    object_id: str
    result: Any

    def get(self, *args: Any, **kwargs: Any) -> Any:
        inspect.signature(modal.FunctionCall.get).bind(self, *args, **kwargs)
        return self.result


@dataclass
class StandInFunction:
    """A deployed ``publish`` function: ``spawn`` binds its arguments to the installed client's
    ``Function.spawn`` and to the deployed function's signature, then runs the function's body
    (``publish_into``) on ``store``, as the function's container would on its Volume."""

    module: ModuleType
    store: Any
    calls: list[dict[str, Any]] = field(default_factory=list)

    def spawn(self, *args: Any, **kwargs: Any) -> StandInCall:
        inspect.signature(modal.Function.spawn).bind(self, *args, **kwargs)
        bound = _remote_signature(self.module).bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append(dict(bound.arguments))
        result = self.module.publish_into(self.store, **bound.arguments)
        json.dumps(result)  # what crosses back from the function is plain data
        return StandInCall(f"fc-standin-{len(self.calls)}", result)


def test_the_installed_client_takes_the_call_the_adapter_makes(deployed: ModuleType) -> None:
    module = deployed
    ref = module.ROUTER_ENV[CONVERT_FUNCTION_ENV]
    assert parse_function_ref(ref) == (module.APP_NAME, "publish") and "publish" in _registered(module)
    converter = open_converter(WeightsConfig.from_env(module.ROUTER_ENV).convert_function)
    assert isinstance(converter, ModalFunctionConverter) and converter.ref == ref
    handle = converter.function()  # lazy: contacts nothing
    assert isinstance(handle, modal.Function) and isinstance(
        function_ref(*parse_function_ref(ref)), modal.Function
    )
    from_name = inspect.signature(modal.Function.from_name).parameters
    assert list(from_name)[:2] == ["app_name", "name"] and "environment_name" in from_name

    spawn = inspect.signature(modal.Function.spawn).parameters
    assert [p.kind for p in spawn.values()][-1] is inspect.Parameter.VAR_KEYWORD
    get = inspect.signature(modal.FunctionCall.get).parameters
    assert get["timeout"].default is None  # call.get() waits for the result
    assert isinstance(inspect.getattr_static(modal.FunctionCall, "object_id"), property)

    request = ConvertRequest("main", 7, "/weights/ckpt/v7", ("bf16", "fp8"), "per_format", 6)
    kwargs = call_kwargs(request)
    remote = _remote_signature(module)
    remote.bind(**kwargs)  # every argument the adapter sends is a parameter of the function
    hints = typing.get_type_hints(_remote_raw_f(module))
    for name, value in kwargs.items():
        assert isinstance(value, typing.get_args(hints[name]) or hints[name]), (name, value)
    assert kwargs["formats"] == "bf16,fp8"
    assert set(remote.parameters) == set(kwargs)  # and it takes nothing the adapter does not send


def test_a_bad_function_name_or_request_is_refused_naming_it(tmp_path: Path) -> None:
    for bad in ("publish", "/publish", "mixfleet/", "a/b/c"):
        with pytest.raises(UserError, match="APP/FUNCTION"):
            ModalFunctionConverter(bad)
    store = LocalStore(tmp_path / "store")
    good = call_kwargs(ConvertRequest("main", 1, str(tmp_path), ("bf16",)))
    with pytest.raises(UserError, match="version is required"):
        run_request(store, {k: v for k, v in good.items() if k != "version"})
    with pytest.raises(UserError, match="version has the wrong type"):
        run_request(store, {**good, "version": "1"})
    with pytest.raises(UserError, match="unknown fields"):
        run_request(store, {**good, "extra": 1})
    with pytest.raises(UserError, match="formats must be format names joined by commas"):
        run_request(store, {**good, "formats": ["bf16"]})


def test_a_publication_runs_in_the_function_on_the_volume(
    deployed: ModuleType, tmp_path: Path, tiny_dir
) -> None:
    module = deployed
    router_store = volume_store(tmp_path / "volume", "router")
    function = StandInFunction(module, volume_store(tmp_path / "volume", "publish-fn"))
    converter = ModalFunctionConverter("mixfleet/publish", lookup=lambda app, name, env: function)
    events: list[tuple[str, dict]] = []
    stream = FormatRef(module.RUN_ID, "bf16")
    assert router_store.read_pointer(stream) is None

    request = ConvertRequest(module.RUN_ID, 3, str(tiny_dir), tuple(module.PLAN.fleet.formats))
    result = converter.publish(router_store, request, lambda kind, info: events.append((kind, info)))

    assert function.calls == [
        {
            "checkpoint": str(tiny_dir),
            "version": 3,
            "formats": "bf16",
            "run_id": module.RUN_ID,
            "mode": "barrier",
            "delta_of": None,
        }
    ]
    assert result["version"] == 3 and [f["format"] for f in result["formats"]] == ["bf16"]
    assert events == [
        ("remote_call", {"function": "mixfleet/publish", "call_id": "fc-standin-1"}),
        ("remote_done", {"function": "mixfleet/publish", "call_id": "fc-standin-1"}),
    ]
    # the router's container sees the committed version without another reload (the adapter's
    # refresh), and its pointer
    assert router_store.versions(stream) == [3]
    assert router_store.read_pointer(stream) == 3
    assert router_store.verify(VersionRef(module.RUN_ID, "bf16", 3)).version == 3


def test_the_router_publishes_through_the_modal_function(
    deployed: ModuleType, tmp_path: Path, tiny_dir
) -> None:
    module = deployed
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    root = tmp_path / "store"
    function = StandInFunction(module, LocalStore(root))  # the function's container, same store
    converter = ModalFunctionConverter("mixfleet/publish", lookup=lambda app, name, env: function)
    config = RouterConfig(fleet=load_preset(preset), api_keys={ADMIN: frozenset({"admin", "rollout"})})
    weights = create_weights_router(
        WeightsConfig(store_root=root, run_id="run-a", pointer_poll_s=0.2), converter=converter
    )
    auth = {"Authorization": f"Bearer {ADMIN}"}
    expected = next_version(LocalStore(root), "run-a", ["bf16"])  # the router's default number
    with TestClient(create_app(config, extra_routers=[weights])) as client:
        r = client.post("/v1/weights", json={"checkpoint": str(tiny_dir)}, headers=auth)
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        deadline = time.monotonic() + 120
        while (job := client.get(f"/v1/weights/jobs/{job_id}", headers=auth).json())["state"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        assert job["state"] == "done", job
        assert job["result"]["version"] == expected and job["version"] == expected
        assert [e["kind"] for e in job["events"]] == ["remote_call", "remote_done"]
        assert function.calls[0]["formats"] == "bf16" and function.calls[0]["run_id"] == "run-a"
        status = client.get("/v1/weights", headers=auth).json()
        assert status["formats"]["bf16"]["pointer"] == expected and status["latest_version"] == expected


def test_the_service_picks_its_converter_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CONVERT_FUNCTION_ENV, raising=False)
    assert isinstance(PublishService(WeightsConfig.from_env()).converter, LocalConverter)
    monkeypatch.setenv(CONVERT_FUNCTION_ENV, "mixfleet/publish")
    converter = PublishService(WeightsConfig.from_env()).converter
    assert isinstance(converter, ModalFunctionConverter) and converter.ref == "mixfleet/publish"
    monkeypatch.setenv(CONVERT_FUNCTION_ENV, "publish")
    with pytest.raises(UserError, match="APP/FUNCTION"):
        WeightsConfig.from_env()

"""router.config.WeightsConfig: the weight routes' configuration, read from the environment only
by the command that builds it (WeightsConfig.from_env); the publish service reads none."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import UserError
from router.config import WeightsConfig
from router.publishing import PublishService, StoreNotConfigured
from weight_sync.converters import LocalConverter, ModalFunctionConverter


def test_from_env_reads_each_variable_and_treats_blank_as_unset() -> None:
    assert WeightsConfig.from_env({}) == WeightsConfig()
    blank = {k: "  " for k in ("MIXFLEET_STORE", "MIXFLEET_RUN", "MIXFLEET_STORE_VOLUME",
                               "MIXFLEET_PUBLISH_WORKERS", "MIXFLEET_CONVERT_FUNCTION")}  # fmt: skip
    assert WeightsConfig.from_env(blank) == WeightsConfig()
    config = WeightsConfig.from_env(
        {
            "MIXFLEET_STORE": "/weights",
            "MIXFLEET_RUN": "main",
            "MIXFLEET_STORE_VOLUME": "mixfleet-weights",
            "MIXFLEET_PUBLISH_WORKERS": "-3",
            "MIXFLEET_CONVERT_FUNCTION": "mixfleet/publish",
        }
    )
    assert config == WeightsConfig(
        store_root=Path("/weights"),
        run_id="main",
        volume="mixfleet-weights",
        workers=0,
        convert_function="mixfleet/publish",
    )


def test_from_env_refuses_malformed_values_in_one_line() -> None:
    with pytest.raises(UserError, match="MIXFLEET_PUBLISH_WORKERS must be an integer, got 'two'"):
        WeightsConfig.from_env({"MIXFLEET_PUBLISH_WORKERS": "two"})
    with pytest.raises(UserError, match="APP/FUNCTION"):
        WeightsConfig.from_env({"MIXFLEET_CONVERT_FUNCTION": "publish"})
    with pytest.raises(ValueError, match="pointer_poll_s"):
        WeightsConfig(pointer_poll_s=0)
    with pytest.raises(ValueError, match="workers"):
        WeightsConfig(workers=-1)


def test_the_service_uses_its_config_not_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MIXFLEET_STORE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MIXFLEET_RUN", "from-env")
    monkeypatch.setenv("MIXFLEET_CONVERT_FUNCTION", "mixfleet/publish")
    unconfigured = PublishService(WeightsConfig())
    assert not unconfigured.configured and unconfigured.run_id == "default"
    assert isinstance(unconfigured.converter, LocalConverter)
    with pytest.raises(StoreNotConfigured):
        unconfigured.store()
    service = PublishService(WeightsConfig(store_root=tmp_path / "store", run_id="r", workers=0))
    assert service.configured and service.run_id == "r"
    assert service.store().root == tmp_path / "store" and not (tmp_path / "elsewhere").exists()
    remote = PublishService(WeightsConfig(convert_function="app/fn")).converter
    assert isinstance(remote, ModalFunctionConverter) and remote.ref == "app/fn"

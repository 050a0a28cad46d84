"""Shared checkpoints for the weight-sync live tests: real ``tiny`` models written once per session."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.support.models import make_model_dir


@pytest.fixture(scope="session")
def wsl_models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wsl-models")


@pytest.fixture(scope="session")
def tiny_base(wsl_models: Path) -> Path:
    """The ``tiny`` base policy (BF16 HF checkpoint)."""
    return make_model_dir(wsl_models, "tiny", "bf16")


@pytest.fixture(scope="session")
def tiny_seed2(wsl_models: Path) -> Path:
    """Same architecture, other weights: a distinct 'trained' version."""
    return make_model_dir(wsl_models, "tiny", "bf16", seed=2)


@pytest.fixture(scope="session")
def tiny_other_arch(wsl_models: Path) -> Path:
    """A BF16 checkpoint of another architecture (one layer fewer than ``tiny``)."""
    from mixfleet.init_model import PRESETS, write_model

    out = wsl_models / "tiny-1layer-bf16"
    if not out.is_dir():
        spec = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=PRESETS["tiny"].num_hidden_layers - 1)
        write_model(out, spec)
    return out


@pytest.fixture(scope="session")
def tiny_2shards(wsl_models: Path) -> Path:
    """The ``tiny`` architecture in two safetensors shards (with an index), as trainers write."""
    from mixfleet.init_model import PRESETS, write_model

    out = wsl_models / "tiny-2shards-bf16"
    if not out.is_dir():
        write_model(out, dataclasses.replace(PRESETS["tiny"], shards=2))
    return out

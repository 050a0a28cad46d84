"""Shared fixtures of the engine model tests: model directories built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.models import make_model_dir

# Two shared cores: one intra-op thread avoids OpenMP oversubscription stalls.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-models")


@pytest.fixture(scope="session")
def tiny_dir(model_root: Path) -> Path:
    return make_model_dir(model_root, "tiny", "bf16")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path):
    from fleet.engine.model import load_model

    return load_model(tiny_dir)

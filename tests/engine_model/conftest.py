"""Shared fixtures of the engine model tests: model directories built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Two shared cores: one intra-op thread avoids OpenMP oversubscription stalls.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path):
    from engine.model.model import load_model

    return load_model(tiny_dir)

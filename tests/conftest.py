"""Fixtures every suite shares: one directory of generated models per test session.

``make_model_dir`` reuses a model it already built under the same root, so the engine, model
and router suites build each (preset, format) once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import make_model_dir


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_dir(model_root: Path) -> Path:
    return make_model_dir(model_root, "tiny", "bf16")

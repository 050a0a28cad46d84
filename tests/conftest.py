"""Fixtures every suite shares (one directory of generated models per test session), and how the
suite runs in parallel (the README's ``-n auto --dist loadgroup``: pytest-xdist workers, twice the
cores, since most tests wait on real processes), scheduled by
:mod:`tests.support.schedule`, after numba's kernels are compiled once (:mod:`tests.support.warm`).
Without ``-n`` everything runs in one process.

``make_model_dir`` reuses a model it already built under the same root, and copies one built under
another root from the session's model cache, so the suite builds each (preset, format, seed) once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import warm
from tests.support.models import CACHE_ENV, make_model_dir
from tests.support.schedule import arrange, ungrouped

_WARM = pytest.StashKey[tuple]()
_MODEL_CACHE = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return 2 * (os.cpu_count() or 1)


def pytest_configure(config: pytest.Config) -> None:
    """The session's model cache (:data:`tests.support.models.CACHE_ENV`; workers share the
    controller's); on the controller of a run on workers: start compiling numba's kernels (the
    workers wait)."""
    if not os.environ.get(CACHE_ENV):
        cache = Path(tempfile.mkdtemp(prefix="mixfleet-test-models-"))
        os.environ[CACHE_ENV] = str(cache)
        config.stash[_MODEL_CACHE] = cache
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if config.getoption("collectonly"):
        return
    workdir = Path(tempfile.mkdtemp(prefix="mixfleet-test-warm-"))
    config.stash[_WARM] = (warm.start(workdir), workdir)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    proc, workdir = config.stash.get(_WARM, (None, None))
    if proc is not None and proc.poll() not in (None, 0):
        log = (workdir / "warm.log").read_text(errors="replace")[-3000:]
        terminalreporter.write_sep("-", f"tests/support/warm.py exited with {proc.returncode}")
        terminalreporter.write_line(log)


def pytest_unconfigure(config: pytest.Config) -> None:
    cache = config.stash.get(_MODEL_CACHE, None)
    if cache is not None:
        os.environ.pop(CACHE_ENV, None)
        shutil.rmtree(cache, ignore_errors=True)
    proc, workdir = config.stash.get(_WARM, (None, None))
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _numba_kernels_compiled() -> Iterator[None]:
    warm.wait()
    yield


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Stop a run whose units xdist did not group (:func:`tests.support.schedule.ungrouped`)."""
    if node.config.getoption("dist", None) == "loadgroup":
        problem = ungrouped(ids)
        if problem:
            pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The units of work and their order on the workers (:func:`tests.support.schedule.arrange`);
    a run in one process keeps the collected order."""
    if hasattr(config, "workerinput") or config.getoption("numprocesses", None):
        arrange(items)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_dir(model_root: Path) -> Path:
    return make_model_dir(model_root, "tiny", "bf16")

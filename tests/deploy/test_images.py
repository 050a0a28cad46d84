"""Images: one per accelerator family from the pinned SGLang tag, the project's dependency list from
pyproject.toml (CUDA torch kept in the GPU images), and numba's cache really warmed by images.warm."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import modal
import pytest

from images import accelerators, modal_images

ROOT = Path(__file__).resolve().parents[2]


def test_one_image_per_family_reused_for_every_server_of_it() -> None:
    hopper, blackwell = modal_images.sglang_image("ampere-hopper"), modal_images.sglang_image("blackwell")
    assert isinstance(hopper, modal.Image) and isinstance(blackwell, modal.Image)
    assert hopper is not blackwell
    assert modal_images.sglang_image("blackwell") is blackwell
    assert isinstance(modal_images.cpu_image(), modal.Image)


def test_requirements_are_pyproject_less_torch_for_gpu_images() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    with_torch = modal_images.requirements(with_torch=True)
    without = modal_images.requirements(with_torch=False)
    assert [d for d in declared if d not in with_torch] == [d for d in declared if d.startswith("modal")]
    assert [d for d in with_torch if d not in without] == [d for d in declared if d.startswith("torch")]
    assert any(d.startswith("torch") for d in with_torch) and len(with_torch) == len(declared) - 1
    assert all(p in {*os.listdir(ROOT)} for p in modal_images.PACKAGES)


def test_cpu_torch_alone_comes_from_the_cpu_index(monkeypatch) -> None:
    # uv resolves a package only from the first index that has it (extra indexes first), so no
    # requirement but torch may see PyTorch's index (it holds old jinja2, numpy, ...).
    calls = []
    real = modal.Image.uv_pip_install

    def record(self, *packages, **kwargs):
        calls.append((packages, kwargs))
        return real(self, *packages, **kwargs)

    monkeypatch.setattr(modal.Image, "uv_pip_install", record)
    modal_images.cpu_image.__wrapped__()
    torch = [d for d in modal_images.requirements(with_torch=True) if d.startswith("torch")]
    assert calls == [
        (tuple(torch), {"index_url": modal_images.TORCH_CPU_INDEX}),
        (tuple(modal_images.requirements(with_torch=False)), {}),
    ]


@pytest.mark.parametrize("kind", [*accelerators.DOCUMENTED, *accelerators.UNDOCUMENTED])
def test_every_known_gpu_has_a_family(kind: str) -> None:
    gpu = accelerators.parse_gpu(f"{kind}:2")
    assert gpu.kind == kind and gpu.count == 2
    assert gpu.documented == (kind in accelerators.DOCUMENTED)
    blackwell = {"RTX-PRO-6000", "B200", "B200+", "B300"}
    assert gpu.family == ("blackwell" if kind in blackwell else "ampere-hopper")
    assert accelerators.gpu_string(kind, 1) == kind and accelerators.gpu_string(kind, 4) == f"{kind}:4"


def test_warm_fills_numbas_cache_so_the_next_start_compiles_nothing(tmp_path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1"}
    argv = [sys.executable, "-m", "images.warm"]
    first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "data saved" in first.stdout
    assert list(tmp_path.rglob("*.nbi")), "no cache index written"
    second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "data loaded" in second.stdout
    assert "data saved" not in second.stdout
    assert "numba kernels warmed: fp8/bfloat16" in second.stderr

"""Modal images: one per accelerator family for the GPU servers, one for CPU work (router, conversion).

Every image carries this project's packages copied in (so numba's on-disk cache, keyed by the
source files, stays valid in every container) and its Python dependencies from ``pyproject.toml``
(the one list), and has numba's kernel cache warmed at build time (``python -m images.warm``).
The GPU images start from the pinned SGLang release image (:mod:`images.sglang`) and keep its CUDA
build of torch; the CPU image installs torch's CPU wheel. Building an image object contacts
nothing: Modal builds it at ``modal deploy``.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

import modal

from images import sglang
from images.accelerators import ARCH_LIST, Family

ROOT = Path(__file__).resolve().parents[1]
REMOTE_ROOT = "/root"  # where add_local_python_source puts the packages in a container
PACKAGES = (
    "mixfleet",
    "core",
    "clients",
    "engine",
    "launcher",
    "replica",
    "validate",
    "fleet",
    "router",
    "weight_sync",
    "images",
    "deploy",
    "trainer",
)
NUMBA_CACHE_DIR = "/root/.cache/mixfleet-numba"
CPU_PYTHON = "3.11"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def requirements(*, with_torch: bool) -> list[str]:
    """The project's runtime dependencies as ``pyproject.toml`` lists them, less ``modal`` (Modal
    mounts its own client into every container) and, unless ``with_torch``, less ``torch`` (the
    SGLang image's CUDA torch must stay)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    skip = {"modal"} | (set() if with_torch else {"torch"})
    return [d for d in deps if _name(d) not in skip]


def _with_project(image: modal.Image) -> modal.Image:
    # pyproject.toml travels too: a container imports the app again, and this module reads it.
    return (
        image.env({"NUMBA_CACHE_DIR": NUMBA_CACHE_DIR})
        .add_local_python_source(*PACKAGES, copy=True)
        .add_local_dir(ROOT / "fleet" / "presets", f"{REMOTE_ROOT}/fleet/presets", copy=True)
        .add_local_file(ROOT / "pyproject.toml", f"{REMOTE_ROOT}/pyproject.toml", copy=True)
        .run_commands(f"cd {REMOTE_ROOT} && python3 -m images.warm")
    )


@cache
def sglang_image(family: Family) -> modal.Image:
    """The GPU server image for ``family``: the pinned SGLang release (by digest when one is set,
    :func:`images.sglang.image_ref`) plus this project."""
    base = modal.Image.from_registry(sglang.image_ref()).env(
        {"TORCH_CUDA_ARCH_LIST": ARCH_LIST[family], "MIXFLEET_ACCELERATOR_FAMILY": family}
    )
    return _with_project(base.uv_pip_install(*requirements(with_torch=False)))


@cache
def cpu_image() -> modal.Image:
    """The router's and the weight conversion's image: Debian slim, CPU torch, this project.

    torch is installed alone from PyTorch's CPU index (``index_url``: the only index of that
    step), then every other dependency from PyPI. One ``uv pip install`` with the CPU index as
    ``extra_index_url`` would resolve each package only from the first index holding it, and uv
    puts extra indexes first: the CPU index also carries torch's own dependencies (jinja2 among
    them) in older versions only, so a floor such as ``jinja2>=3.1.6`` could not be met.
    """
    torch = [d for d in requirements(with_torch=True) if _name(d) == "torch"]
    base = modal.Image.debian_slim(python_version=CPU_PYTHON).uv_pip_install(
        *torch, index_url=TORCH_CPU_INDEX
    )
    return _with_project(base.uv_pip_install(*requirements(with_torch=False)))

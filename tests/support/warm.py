"""Compile every numba kernel of the project once, into numba's on-disk cache, before tests run.

The kernels cache their machine code (``core/numba_options.py``), but a fresh checkout has none:
each process that reaches a kernel first compiles it (about 40 s of CPU for the engine's GEMM), and
with the suite spread over workers, the engines and converters those workers start at once would
all compile the same kernels side by side. So when the suite runs on workers, ``tests/conftest.py``
starts ``python -m tests.support.warm`` as it begins (:func:`start`), while the workers import and
collect, and each worker's first test waits for it to end (:func:`wait`). On a warm cache it takes
a few seconds; it never fails a test (a kernel it could not compile is compiled where it is used,
and its output is shown at the end of the run).

What it runs: the weight quantizers on bfloat16 and float32 input (``images.warm``), FP4 encoding,
and a prefill then a decode step of the ``tiny`` model in every weight format with both KV cache
types.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LOCK_ENV = "MIXFLEET_TEST_WARM_LOCK"
REPO = Path(__file__).resolve().parents[2]


def warm() -> list[str]:
    import torch

    from engine.model.model import load_model
    from images.warm import warm as warm_quantizers
    from tests.support.models import make_model_dir
    from weight_sync.formats import fp4

    done = warm_quantizers()
    fp4.encode(torch.zeros(2), negative_zero_sign=True)
    with tempfile.TemporaryDirectory(prefix="warm-") as root:
        for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
            path = make_model_dir(root, "tiny", fmt)
            for kv in ("auto", "fp8_e4m3"):
                model = load_model(path, kv_cache_dtype=kv)
                caches = [model.new_sequence(), model.new_sequence()]
                model.forward([torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])], caches)
                model.forward([torch.tensor([7]), torch.tensor([8])], caches)
                done.append(f"tiny/{fmt}/kv-{kv}")
    return done


def start(workdir: Path) -> subprocess.Popen:
    """Start warming in the background; until it exits it holds an exclusive lock on a file in
    ``workdir`` whose path goes to the workers (``LOCK_ENV``, read by :func:`wait`). Its output
    goes to ``workdir / "warm.log"``."""
    lock = workdir / "warm.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # taken before the child exists, held by the child's copy of fd
        with open(workdir / "warm.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.warm"],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(fd,),
            )
    finally:
        os.close(fd)
    os.environ[LOCK_ENV] = str(lock)
    return proc


def wait() -> None:
    """Block until the warming :func:`start` began has exited (at once when none was started)."""
    path = os.environ.get(LOCK_ENV)
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH)


if __name__ == "__main__":
    print("numba kernels warmed:", ", ".join(warm()), flush=True)

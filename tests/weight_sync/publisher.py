"""A publisher for the fault tests: stages one version of real safetensors shards and publishes it.

``python -m tests.weight_sync.publisher ROOT VERSION PAYLOAD [ADAPTER CONTAINER]`` prints each
step's name (half a shard written, staging done, then every step the store reports) and waits for
a line ``go`` on stdin before going on, so a test can SIGKILL it at an exact point.
``publish(...)`` does the same in-process without pausing. ``ADAPTER`` is ``local`` (a
``LocalStore`` at ROOT, the default) or ``volume`` (a ``ModalVolumeStore`` on the stand-in volume
under ROOT, as container ``CONTAINER``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from tests.support.volume import volume_store
from weight_sync.manifest import Manifest, build_manifest
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

RUN, FMT = "faults", "nvfp4"
STREAM = FormatRef(RUN, FMT)


def open_store(root: Path, adapter: str = "local", container: str = "c0", step=None):
    if adapter == "local":
        return LocalStore(Path(root), on_step=step)
    return volume_store(Path(root), container, on_step=step)


def publish(
    root: Path,
    version: int,
    payload: str,
    step: Callable[[str], None] = lambda _s: None,
    *,
    adapter: str = "local",
    container: str = "c0",
) -> Manifest:
    store = open_store(root, adapter, container, step)
    staged = store.staging_dir(STREAM.at(version))
    seed = sum(payload.encode())
    blob = save({"w1": np.arange(seed, seed + 65536, dtype=np.float32).reshape(256, 256)})
    with open(staged / "model-00001-of-00002.safetensors", "wb") as f:
        f.write(blob[: len(blob) // 2])
        f.flush()
        step("staging_half_written")
        f.write(blob[len(blob) // 2 :])
    (staged / "model-00002-of-00002.safetensors").write_bytes(
        save({"w2": np.full((64, 64), seed, np.float32)})
    )
    (staged / "config.json").write_text(f'{{"payload": "{payload}"}}')
    build_manifest(staged, format=FMT, source_checksum=f"xxh3_128:{payload}").write(staged, fsync=False)
    step("staged")
    return store.publish(STREAM.at(version), staged)


def step_through(proc: subprocess.Popen, kill_at: str | None) -> list[str]:
    """Drive a process speaking this module's protocol (a step name per line, then ``go`` on
    stdin) to ``done``, or SIGKILL its group when it reports ``kill_at``; assert it ended so.
    Returns the steps it reported."""
    seen = []
    try:
        while line := proc.stdout.readline().strip():
            seen.append(line)
            if line == kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            if line == "done":
                break
            proc.stdin.write("go\n")
            proc.stdin.flush()
    finally:
        proc.wait(timeout=30)
    if kill_at is None:
        assert proc.returncode == 0 and seen[-1] == "done", seen
    else:
        assert proc.returncode == -signal.SIGKILL and seen[-1] == kill_at, (proc.returncode, seen)
    return seen


def main(argv: list[str]) -> int:
    root, version, payload, *where = argv
    adapter = where[0] if where else "local"
    container = where[1] if len(where) > 1 else "c0"

    def step(name: str) -> None:
        print(name, flush=True)
        if sys.stdin.readline().strip() != "go":
            sys.exit(3)

    publish(Path(root), int(version), payload, step, adapter=adapter, container=container)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

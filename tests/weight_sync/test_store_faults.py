"""Fault tests: a real publisher process is SIGKILLed at every step of the publish protocol.

For each adapter: ``LocalStore``, and ``ModalVolumeStore`` on the stand-in volume (the publisher
is one container; every reader afterwards is another, which sees only what was committed to the
volume). The publisher (``tests/weight_sync/publisher.py``, a real process) stages a version, then
calls the store's ``publish``; at each step (half a shard written, staging done, and every step the
store reports through ``on_step``) it prints the step's name and blocks until the test answers
on its stdin. The test kills it with SIGKILL at one step per case and checks what any reader
would see afterwards: the pointer names a complete version that verifies, never the half-written
one; a fresh publisher then completes the same version; and the version stays immutable.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.procs import REPO
from tests.weight_sync.publisher import FMT, RUN, STREAM, open_store, publish, step_through
from weight_sync.manifest import build_manifest
from weight_sync.store.base import VersionConflict

STEPS = [
    "staging_half_written",
    "staged",
    "files_synced",
    "manifest_written",
    "committed",
    "pointer_tmp_written",
    "pointer_replaced",
    "advanced",
]
# The volume store stages on local disk (so the publish copies the files in), commits the volume
# after the version and again after the pointer; what other containers see moves only then.
VOLUME_STEPS = [
    "staging_half_written",
    "staged",
    "copied",
    "files_synced",
    "manifest_written",
    "committed",
    "volume_committed",
    "pointer_tmp_written",
    "pointer_replaced",
    "advanced",
    "pointer_committed",
]
CASES = [("local", s) for s in STEPS] + [("volume", s) for s in VOLUME_STEPS]
# The first step at which a reader sees the new version committed / the pointer moved.
VISIBLE = {"local": ("committed", "pointer_replaced"), "volume": ("volume_committed", "pointer_committed")}


def _publisher(root, version: int, payload: str, adapter: str, container: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.weight_sync.publisher",
            str(root),
            str(version),
            payload,
            adapter,
            container,
        ],  # fmt: skip
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
        start_new_session=True,
    )


def _publish_through(
    root, version: int, payload: str, kill_at: str | None, adapter: str = "local", container: str = "w"
) -> list[str]:
    """Run a publisher, answering 'go' at every step; SIGKILL it when it reaches ``kill_at``."""
    return step_through(_publisher(root, version, payload, adapter, container), kill_at)


@pytest.mark.parametrize(("adapter", "steps"), [("local", STEPS), ("volume", VOLUME_STEPS)])
def test_publisher_reports_every_step(tmp_path, adapter, steps) -> None:
    assert _publish_through(tmp_path, 1, "a", None, adapter) == [*steps, "done"]
    assert open_store(tmp_path, adapter, "reader").read_pointer(STREAM) == 1


@pytest.mark.parametrize(("adapter", "kill_at"), CASES)
def test_kill_at_each_step_leaves_a_complete_version(tmp_path, adapter, kill_at) -> None:
    steps = STEPS if adapter == "local" else VOLUME_STEPS
    publish(tmp_path, 1, "a", adapter=adapter, container="setup")  # version 1 complete and current
    _publish_through(tmp_path, 2, "b", kill_at=kill_at, adapter=adapter, container="killed")

    store = open_store(tmp_path, adapter, "reader")
    pointer = store.read_pointer(STREAM)
    first_committed, first_moved = VISIBLE[adapter]
    moved = steps.index(kill_at) >= steps.index(first_moved)
    assert pointer == (2 if moved else 1)
    store.verify(STREAM.at(pointer))  # the pointer names a complete, verifiable version
    committed = steps.index(kill_at) >= steps.index(first_committed)
    assert store.versions(STREAM) == ([1, 2] if committed else [1])
    for v in store.versions(STREAM):
        store.verify(STREAM.at(v))

    # A fresh publisher completes version 2 (re-staging it from scratch is fine: same bytes).
    publish(tmp_path, 2, "b", adapter=adapter, container="again")
    assert store.read_pointer(STREAM) == 2
    assert store.verify(STREAM.at(2)).source_checksum == "xxh3_128:b"
    # ...and version 2 is immutable from then on.
    staged = store.staging_dir(STREAM.at(2))
    (staged / "config.json").write_text("{}")
    build_manifest(staged, format=FMT).write(staged)
    with pytest.raises(VersionConflict):
        store.commit(STREAM.at(2), staged)
    # Leftovers of the killed publisher are only hidden staging dirs / pointer temporaries.
    seen = tmp_path if adapter == "local" else tmp_path / "durable"
    visible = sorted(p.name for p in (seen / RUN / FMT).iterdir() if not p.name.startswith("."))
    assert visible == ["CURRENT", "v000001", "v000002"]

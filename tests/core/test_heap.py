"""Returning free C-heap pages (:mod:`core.heap`): a heap left with holes between long-lived
blocks keeps them resident until :func:`core.heap.trim`, measured in a fresh process; and the
router runs the trim on its period, from its config."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from core import heap
from fleet.specs import FleetSpec
from router.config import RouterConfig
from router.context import HEAP_TASK, RouterContext
from tests.support.procs import REPO

# A fresh process: a freed 16 MiB chunk raises glibc's dynamic mmap threshold, so 200 buffers of
# 0.6-1.4 MB then come from the heap, each followed by a 20 KB block that stays; the buffers are
# freed, leaving ~200 MB of holes. Prints the resident size after the buffers were written, after
# they were freed, and after a trim (bytes), then whether the trim returned memory.
FRAGMENT = """
from core import heap

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

big = bytearray(b"x") * (16 << 20)
del big
keep, grow = [], []
for i in range(200):
    grow.append(bytearray(b"x") * (600_000 + 4096 * i))
    keep.append(bytearray(b"k") * 20_000)
full = rss()
del grow
freed = rss()
released = heap.trim()
print(full, freed, rss(), released)
"""


@pytest.mark.skipif(not heap.AVAILABLE, reason="the C library is not glibc")
def test_holes_between_live_blocks_stay_resident_until_a_trim_returns_them() -> None:
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENT], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    full, freed, trimmed, released = int(out[0]), int(out[1]), int(out[2]), out[3]
    holes = 200 * 600_000 + 4096 * 199 * 100
    assert freed > full - holes // 10, "free() returned the holes itself: nothing for a trim to do"
    assert released == "True"
    assert trimmed < freed - holes * 9 // 10, (full, freed, trimmed)


def test_trim_every_refuses_a_period_that_is_not_positive_and_stops_when_cancelled() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="period_s"):
            await heap.trim_every(0)
        task = asyncio.create_task(heap.trim_every(0.01))
        await asyncio.sleep(0.1)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


FLEET = FleetSpec.model_validate({"name": "f", "groups": [{"name": "g", "accelerator": "cpu"}]})


@pytest.mark.skipif(not heap.AVAILABLE, reason="the C library is not glibc")
@pytest.mark.parametrize("period", [0.5, None])
def test_a_router_trims_its_heap_on_its_configured_period_only(period: float | None) -> None:
    async def scenario() -> tuple[set[str], set[str]]:
        ctx = RouterContext(RouterConfig(fleet=FLEET, auth_disabled=True, heap_trim_s=period))
        await ctx.start()
        try:
            running = {t.get_name() for t in asyncio.all_tasks()}
        finally:
            await ctx.stop()
        return running, {t.get_name() for t in asyncio.all_tasks()}

    running, after = asyncio.run(scenario())
    assert (HEAP_TASK in running) == (period is not None)
    assert HEAP_TASK not in after


def test_the_config_refuses_a_period_that_is_not_positive() -> None:
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="heap_trim_s"):
            RouterConfig(fleet=FLEET, auth_disabled=True, heap_trim_s=bad)

"""Spreading one kernel call over ``torch.get_num_threads()`` threads.

The engine's numba kernels release the GIL (``nogil``); ``parts`` decides how many threads a
call is worth, ``split`` cuts its range, and ``run`` runs the parts at once: all but the last on
a small pool, the last on the calling thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

# Below this many multiply-adds a native call runs on one thread (no hand-off to pool threads).
PARALLEL_MIN_WORK = 4_000_000


def parts(work: int, units: int) -> int:
    """How many threads a call of ``work`` multiply-adds over ``units`` divisible units should use."""
    threads = torch.get_num_threads()
    if threads <= 1 or work < PARALLEL_MIN_WORK:
        return 1
    return max(1, min(threads, units))


def split(n: int, k: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``k`` nearly equal non-empty ranges."""
    bounds = [n * i // k for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if a < b]


_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def run(calls: list[tuple[Callable[..., None], tuple]]) -> None:
    """Run native calls (each releasing the GIL) at once: all but the last on pool threads, the
    last on this thread; returns when all are done."""
    if len(calls) == 1:
        fn, args = calls[0]
        fn(*args)
        return
    workers = len(calls) - 1
    pool = _pools.get(workers)
    if pool is None:
        pool = _pools.setdefault(
            workers, concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="engine-kernel")
        )
    futures = [pool.submit(fn, *args) for fn, args in calls[:-1]]
    fn, args = calls[-1]
    fn(*args)
    for f in futures:
        f.result()

"""How the engine's kernels spread one call over threads: ``parts`` decides how many threads a call
is worth; :data:`WORKERS` (a :class:`core.parallel.Workers` pool of its own, so weight loading
never queues ahead of a forward step; the calling thread runs the last part) runs the parts, cut
by :func:`core.parallel.split`."""

from __future__ import annotations

import torch

from core.parallel import Workers

# Below this many multiply-adds a native call runs on one thread (no hand-off to pool threads).
PARALLEL_MIN_WORK = 4_000_000

WORKERS = Workers("engine-kernel", caller_runs_last=True)


def parts(work: int, units: int) -> int:
    """How many threads a call of ``work`` multiply-adds over ``units`` divisible units should use."""
    threads = torch.get_num_threads()
    if threads <= 1 or work < PARALLEL_MIN_WORK:
        return 1
    return max(1, min(threads, units))

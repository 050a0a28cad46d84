"""Run independent chunk tasks on torch's thread budget, without torch's intra-op threads.

Each quantizer splits a tensor into chunks whose tasks write disjoint slices of the outputs.
``run`` executes them on ``torch.get_num_threads()`` worker threads, each running torch ops
single-threaded (torch releases the GIL inside its kernels). This replaces torch's OpenMP
parallelism on purpose: an OpenMP team meets at a barrier after every op, so on a busy machine
one descheduled thread stalls the other for most of its time slice, while independent chunk
workers keep going. A caller that is itself one of several single-threaded workers (such as the
checkpoint converter, which sets torch's thread count to 1) gets its chunks run inline.

Per-thread scratch buffers (``scratch``) are kept between calls so that hot loops neither
allocate nor page-fault.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_local = threading.local()


def _forget_pool() -> None:
    # A forked child inherits the pool object but not its threads; it must start its own.
    global _lock, _pool, _pool_size
    _lock, _pool, _pool_size = threading.Lock(), None, 0


os.register_at_fork(after_in_child=_forget_pool)


def _init_worker() -> None:
    # Read the count first: torch initialises a thread's OpenMP setting lazily from its global
    # default, and that first read must not happen after (and undo) the line below.
    torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's OpenMP setting; also torch's default for new threads


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            pool = ThreadPoolExecutor(n, thread_name_prefix="weight-formats", initializer=_init_worker)
            started = threading.Barrier(n + 1)
            for _ in range(n):
                pool.submit(started.wait)
            started.wait()  # every worker has run _init_worker
            torch.set_num_threads(n)  # restore torch's default for threads created from now on
            _pool, _pool_size = pool, n
        return _pool


def run(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Results of ``tasks`` in order; on ``torch.get_num_threads()`` workers when that is > 1.

    Before: the tasks are independent (disjoint writes). After: all have finished; then the
    first exception raised by a task, in task order, propagates.
    """
    n = torch.get_num_threads()
    if n <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    pool = _workers(n)
    futures = [pool.submit(t) for t in tasks]
    wait(futures)
    return [f.result() for f in futures]


def run_ranges(n: int, step: int, task: Callable[[int, int], T]) -> list[T]:
    """``run`` of ``task(i, min(n, i + step))`` for ``i`` in ``range(0, n, step)``."""
    return run([lambda i=i: task(i, min(n, i + step)) for i in range(0, n, max(1, step))])


def scratch(kind: str, capacity: int, make: Callable[[int], T]) -> T:
    """This thread's buffer object of ``kind`` holding at least ``capacity`` elements.

    ``make(capacity)`` builds one; it must expose ``capacity``. Reused across calls, so callers
    must not keep results that alias it.
    """
    cache: dict[str, object] = _local.__dict__.setdefault("buffers", {})
    buf = cache.get(kind)
    if buf is None or buf.capacity < capacity:  # type: ignore[attr-defined]
        buf = make(capacity)
        cache[kind] = buf
    return buf  # type: ignore[return-value]

"""Independent tasks on torch's thread budget: the one way a call is spread over threads.

:class:`Workers` is a named pool of ``torch.get_num_threads()`` threads, each with torch's intra-op
threads set to 1; its tasks write disjoint slices of their outputs and release the GIL in their
kernels (torch ops, numba ``nogil`` kernels). Each purpose keeps its own pool (the engine's GEMMs,
the weight formats' quantizers), so a weight conversion inside an engine process never queues its
tasks ahead of a decode step's. This replaces torch's OpenMP parallelism on purpose: an OpenMP team
meets at a barrier after every op, so on a busy machine one descheduled thread stalls the others
for most of its time slice, while independent workers keep going. A caller whose torch thread count
is 1 (such as the checkpoint converter's own workers) runs its tasks inline.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

T = TypeVar("T")

_ALL: weakref.WeakSet[Workers] = weakref.WeakSet()


def split(n: int, k: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``k`` nearly equal non-empty ranges."""
    bounds = [n * i // k for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if a < b]


def _init_worker() -> None:
    # Read the count first: torch initialises a thread's OpenMP setting lazily from its global
    # default, and that first read must not happen after (and undo) the line below.
    torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's OpenMP setting; also torch's default for new threads


class Workers:
    """A pool named ``name`` (its threads' name prefix), started on first use and restarted when
    torch's thread count changes; a forked child starts its own. With ``caller_runs_last`` the
    calling thread runs the last task itself and the pool has one thread fewer (for kernels that
    use no torch threads, such as numba's: no hand-off for that part); otherwise it only waits."""

    def __init__(self, name: str, *, caller_runs_last: bool = False) -> None:
        self.name = name
        self.caller_runs_last = caller_runs_last
        self._forget()
        _ALL.add(self)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def _workers(self, size: int, threads: int) -> ThreadPoolExecutor:
        """The pool of ``size`` workers, started if needed; ``threads``: torch's thread count,
        restored after the workers set their own to 1."""
        with self._lock:
            if self._pool is None or self._size != size:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                pool = ThreadPoolExecutor(size, thread_name_prefix=self.name, initializer=_init_worker)
                started = threading.Barrier(size + 1)
                for _ in range(size):
                    pool.submit(started.wait)
                started.wait()  # every worker has run _init_worker
                torch.set_num_threads(threads)  # torch's default for threads created from now on
                self._pool, self._size = pool, size
            return self._pool

    def run(self, tasks: Sequence[Callable[[], T]]) -> list[T]:
        """Results of ``tasks`` in order; on ``torch.get_num_threads()`` workers when that and the
        number of tasks are > 1, else inline.

        Before: the tasks are independent (disjoint writes). After: all have finished; then the
        first exception raised by a task, in task order, propagates.
        """
        n = torch.get_num_threads()
        if n <= 1 or len(tasks) <= 1:
            return [t() for t in tasks]
        if not self.caller_runs_last:
            futures = [self._workers(n, n).submit(t) for t in tasks]
        else:
            pool = self._workers(n - 1, n)
            futures = [pool.submit(t) for t in tasks[:-1]]
            last = _call(tasks[-1])
            futures.append(last)
        wait(futures)
        return [f.result() for f in futures]

    def run_ranges(self, n: int, step: int, task: Callable[[int, int], T]) -> list[T]:
        """:meth:`run` of ``task(i, min(n, i + step))`` for ``i`` in ``range(0, n, step)``."""
        return self.run([lambda i=i: task(i, min(n, i + step)) for i in range(0, n, max(1, step))])


def _call(task: Callable[[], T]) -> Future[T]:
    """``task()`` run here, as a finished future (its result or its exception)."""
    done: Future[T] = Future()
    try:
        done.set_result(task())
    except BaseException as exc:  # noqa: BLE001 - delivered in task order by Workers.run
        done.set_exception(exc)
    return done


def _after_fork() -> None:
    # A forked child inherits the pool objects but not their threads; each must start its own.
    for w in list(_ALL):
        w._forget()


os.register_at_fork(after_in_child=_after_fork)

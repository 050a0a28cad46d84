"""Ending the background asyncio tasks a component started: the one way its ``stop`` does it;
:func:`raise_if_cancelled`, a cancellation Python 3.11 dropped, raised; and :class:`Interrupt`, a
task cancelled from outside and that cancellation taken back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_S = 2.0  # how long a cancelled task may run on (its cleanup included) before it is cancelled again


async def cancel_and_wait(tasks: Iterable[asyncio.Task], recancel_s: float = RECANCEL_S) -> None:
    """Cancel every task in ``tasks``, then return once each has ended. What a task ends with (its
    result, its cancellation or an error it raised on the way out) is dropped: the caller is
    stopping it. A task still running ``recancel_s`` after a cancellation is cancelled again, until
    it ends: on Python 3.11 ``asyncio.wait_for`` loses a cancellation that lands as its awaitable
    finishes (CPython gh-86296, fixed by 3.12's rewrite on ``asyncio.timeout``), and redis-py sends
    every command under ``wait_for`` when a socket timeout is set (redis/asyncio/connection.py
    1531-1534 of redis 8.2.0), so a loop that cancellation missed would otherwise run on and its
    stop never return. A cleanup that outlasts ``recancel_s`` is cancelled with it (a replica's
    engine left paused so is resumed by the next sidecar: ``replica/reconciler.py``). Cancelling
    the caller while it waits ends the wait; the tasks stay cancelled."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=recancel_s)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved, so that asyncio does not log it as never retrieved


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was cancelled and the cancellation did not reach
    it: Python 3.11's ``asyncio.wait_for`` (redis-py's send under a socket timeout, above) drops a
    cancel that lands in the step its write completes, leaving the task's ``cancelling()`` count
    raised."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Interrupt:
    """Cancel the task that created it, at most once, when :meth:`fire` is called (from a callback
    or another task) before :meth:`close`; :meth:`close` takes that cancellation back
    (``Task.uncancel``, as ``asyncio.timeout`` does), whatever the task's code ended in.

    Use: create it in the task, call :meth:`close` in an ``except CancelledError`` (its answer says
    whether to turn the cancellation into the caller's own outcome or raise it on) and again in
    the ``finally`` (a no-op then). Cancellations pending when it was created, or made by others
    meanwhile, stay pending: the task's count is left as it was without this one's."""

    __slots__ = ("task", "pending_before", "open", "fired", "only")  # one per request: no dict

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "create inside a task"
        self.task = task
        self.pending_before = task.cancelling()
        self.open = True
        self.fired = False
        self.only = False  # what close answers

    def fire(self) -> None:
        """Cancel the task, unless this already did or :meth:`close` was called."""
        if self.open and not self.fired:
            self.fired = True
            self.task.cancel()

    def close(self) -> bool:
        """Take back the cancellation :meth:`fire` made, the first time it is called; whether
        :meth:`fire` made one and no other cancellation came since this was created (the same
        answer on each call)."""
        if self.open:
            self.open = False
            self.only = self.fired and self.task.uncancel() <= self.pending_before
        return self.only

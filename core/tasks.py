"""Ending the background asyncio tasks a component started: the one way its ``stop`` does it; and
:func:`raise_if_cancelled`, a cancellation Python 3.11 dropped, raised."""

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

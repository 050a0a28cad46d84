"""Ending the background asyncio tasks a component started: the one way its ``stop`` does it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel every task in ``tasks``, then return once each has ended. What a task ends with (its
    result, its cancellation or an error it raised on the way out) is dropped: the caller is
    stopping it. Cancelling the caller while it waits cancels the wait, as ``asyncio.gather`` does."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

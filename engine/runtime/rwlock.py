"""SGLang's model-update lock: an asyncio reader-writer lock that prefers writers.

SGLang 0.5.23 holds its reader side for the whole of every generate request
(managers/tokenizer_manager.py 940-957) and its writer side for a weight update sent while
generation is not paused (tokenizer_manager.py 2301-2314), so such an update waits for every
request in flight to finish and new requests wait for the update. The semantics are those of
``utils/aio_rwlock.py`` (``RWLock``): a reader waits while a writer holds the lock or waits for it;
a writer waits while anyone holds it. No installed library offers an asyncio reader-writer lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["RWLock"]


class RWLock:
    """Shared (:meth:`reader`) and exclusive (:meth:`writer`) holds; waiting writers block new readers."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._waiting_writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
                self._writer = True
            finally:
                self._waiting_writers -= 1
                if not self._writer:  # cancelled while waiting: readers may go on
                    self._cond.notify_all()
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    def locked(self) -> bool:
        """Whether a reader or a writer holds the lock (SGLang's ``is_locked``)."""
        return self._writer or self._readers > 0

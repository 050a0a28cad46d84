"""The sidecar's hold: while it has its engine paused for an activation, new generations wait here,
not at the engine, so an abort of one ends it before the engine sees it.

SGLang 0.5.23 keeps a request that arrives while generation is paused in its tokenizer manager,
registered but outside the scheduler (managers/tokenizer_manager.py 926, 938-939). An
``/abort_request`` of it marks it aborted and sends the scheduler an abort of a request the
scheduler does not have (2241-2265), so once generation continues it runs to its end, and the
abort its handler would send when its client goes away is skipped (already marked, 2249-2250).
The router aborts a turn whose client went away (:func:`router.dispatch.abort_later`); held at the
engine during an activation, that turn would cost a whole generation that nobody reads. The
local engine keeps that behaviour (:mod:`engine.runtime.admission`), so the fleet's tests see it.

Requests the engine had before the pause are in its scheduler (retracted to its waiting queue),
where an abort ends them while paused: the scheduler takes requests while paused
(scheduler.py 2033-2036) and removes an aborted one from its waiting queue (5686-5706). Only a
request forwarded just before the hold closed, and not yet registered by SGLang when the pause
lands (the time to send and parse its body), can still wait at the engine.

A held request's version constraint is judged once the hold opens (:mod:`replica.sidecar`), against
the version then served: judged on arrival, a request asking for the old version exactly passed,
waited out the pause at the engine and ran on the new weights.

A held request that names no ``rid`` (or a batch's list) waits for the hold to open; no abort can
name it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["Hold"]


class _Held:
    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.aborted = False


class Hold:
    """Open, except while :meth:`closed` runs; :meth:`wait` waits while it is closed."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._held: dict[str, _Held] = {}

    @property
    def held(self) -> int:
        """Requests waiting with a rid now."""
        return len(self._held)

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """Closed for the body of the ``async with``; open again after it, however it ends."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()
            for held in self._held.values():
                held.done.set()

    async def wait(self, rid: object) -> bool:
        """Return once the hold is open: True, or False when :meth:`abort` named ``rid`` while it
        waited (the request must not go to the engine). ``rid``: the request's ``rid`` field."""
        if self._open.is_set():
            return True
        if not isinstance(rid, str) or not rid or rid in self._held:
            await self._open.wait()
            return True
        held = self._held[rid] = _Held()
        try:
            await held.done.wait()
        finally:
            del self._held[rid]
        return not held.aborted

    def abort(self, rid: str) -> bool:
        """End the request held under ``rid``: True when one waits here."""
        held = self._held.get(rid)
        if held is None:
            return False
        held.aborted = True
        held.done.set()
        return True

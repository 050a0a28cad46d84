"""Admission: the request states and the pause gate of SGLang 0.5.23's tokenizer manager, which
stand between the HTTP routes and the scheduler.

SGLang registers each request's state (``_init_req_state``, managers/tokenizer_manager.py 926)
*before* it waits out a pause (``is_pause_cond``, 938-939) and sends it to the scheduler only
after ``/continue_generation`` (2282-2286). So a request that arrives while generation is paused
is known by its rid but held outside the scheduler, where the scheduler's abort cannot reach it:

- ``abort`` of a registered rid marks it ``abort_sent`` and sends the scheduler an abort
  (``abort_request``, 2241-2265); a second abort of that rid is ignored (2249-2250). An abort of a
  request held at the gate therefore ends nothing: after the pause it runs to its end, and the
  abort its handler sends when its client goes away is then skipped (``abort_sent`` already set).
- An abort of an unknown rid is ignored (one tokenizer worker: 2252-2253).
- A handler that fails or is cancelled before its request was sent (at the gate) drops its state;
  once sent, it aborts it (``_release_req_states_on_failure``, 958-966, 3850-3873; ``_mark_state_dispatched``,
  1802-1810).
- An abort of every request (``abort_all``: a pause in mode ``abort``, an update with
  ``abort_all_requests``) goes to the scheduler alone: requests held at the gate survive it.

The engine keeps this so a fleet test of an abort during an activation fails where SGLang would:
the fleet's sidecar holds what arrives while it has the engine paused (:mod:`replica.hold`).
Every call runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

__all__ = ["Admission"]


@dataclass
class _State:
    dispatched: bool = False  # sent to the scheduler (past the gate)
    abort_sent: bool = False


class Admission:
    """The rids the routes have admitted and not yet released, and the pause gate."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.paused = False
        self.waiting = 0  # requests waiting out the pause now
        self._cond = asyncio.Condition()
        self._states: dict[str, _State] = {}

    def held(self, rids: list[str]) -> str | None:
        """The first of ``rids`` an admitted request holds, or one the scheduler runs: SGLang's
        "Duplicate request ID" (``_init_req_state``, tokenizer_manager.py 3833-3837)."""
        return next((r for r in rids if r in self._states), None) or self.scheduler.held(rids)

    def admit(self, rid: str) -> _State | None:
        """Register ``rid`` (SGLang's ``_init_req_state``); :meth:`release` with the token returned
        ends it. None when another request holds ``rid``: SGLang refuses this one (3833-3837)."""
        if rid in self._states:
            return None
        state = self._states[rid] = _State()
        return state

    async def wait_unpaused(self) -> None:
        """Return once generation is not paused (SGLang's ``is_pause_cond``)."""
        async with self._cond:
            self.waiting += 1
            try:
                await self._cond.wait_for(lambda: not self.paused)
            finally:
                self.waiting -= 1

    @staticmethod
    def dispatched(token: _State) -> None:
        """The request ``token`` admitted was sent to the scheduler (``_mark_state_dispatched``)."""
        token.dispatched = True

    def release(self, rid: str, token: _State, *, finished: bool) -> None:
        """The handler that admitted ``rid`` (``token``) is done: an unfinished request that
        reached the scheduler is aborted (at most once, :meth:`abort`); its state goes either way
        (``_release_req_states_on_failure``)."""
        if token.dispatched and not finished:
            self.abort(rid, "The client disconnected.")
        del self._states[rid]

    def abort(self, rid: str, message: str) -> Any:
        """SGLang's ``abort_request`` of one rid (``tokenizer_manager.py`` 2241-2253, one tokenizer
        worker): once per admitted rid, else nothing (None); the scheduler then aborts every
        request whose rid starts with it. Returns the scheduler's future of the abort it sent."""
        state = self._states.get(rid)
        if state is None or state.abort_sent:
            return None
        state.abort_sent = True
        return self.scheduler.abort(rid, message=message)

    def abort_dispatched(self, rid: str, message: str) -> None:
        """:meth:`abort` of ``rid`` only once it reached the scheduler: SGLang notices a client
        gone only while it waits for the request's output (``_stream_one_response``,
        tokenizer_manager.py 1954-1974)."""
        state = self._states.get(rid)
        if state is not None and state.dispatched:
            self.abort(rid, message)

    async def pause(self) -> None:
        """New requests wait at the gate (``pause_generation``, 2267-2269)."""
        async with self._cond:
            self.paused = True

    async def resume(self) -> None:
        """Requests at the gate go on (``continue_generation``, 2282-2286)."""
        async with self._cond:
            self.paused = False
            self._cond.notify_all()

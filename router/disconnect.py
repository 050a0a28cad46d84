"""A client that goes away cancels its request: pure ASGI middleware for the session routes and
the trainer's take.

For a ``POST`` under ``/v1/sessions/`` (a turn, through the token API or a chat API) or to
``/v1/batches/take``, once the request body has been read the middleware waits on the server's
``receive`` for ``http.disconnect``; when the client disconnects before the response has started,
the handler is cancelled (it runs in the server's task: uvicorn 0.55 cancels that task itself
only when a graceful shutdown times out, ``uvicorn/server.py`` 304, and that cancellation is
raised on). For a turn the cancellation reaches the engine request
(:func:`router.dispatch.run_turn` then sends ``/abort_request`` for it) and the turn is not
recorded: :func:`router.turns.record_turn` stores only after the generation returned (a
disconnect that lands during the store's own write, after the generation, may still leave the
turn recorded; a retry carrying an ``Idempotency-Key`` then gets that turn back). A take waiting
for trajectories (``wait_s``) puts back what it picked, at once, for the next take
(:meth:`router.state.base.StateStore.take`); one whose store call has answered already releases
its lease at once, unless a retry with its ``Idempotency-Key`` was answered that lease first
(:mod:`router.routes_trainer`, :meth:`~router.state.base.StateStore.release`).
After the answer has started nothing is cancelled, and a take's lease then times out like any
lease whose answer was lost. A take whose client left unseen (a proxy keeping the connection open)
waits on until its client's retry with the take's ``Idempotency-Key`` takes the key over
(:mod:`router.routes_trainer`).

A handler that reads ``receive`` itself after the body (Starlette's ``is_disconnected``, a
streaming response's disconnect listener) gets ``http.disconnect`` once the client is gone: the
middleware is the one reader of the server's ``receive``. Once the response has started, the
handler is not cancelled (a stream notices the disconnect itself). A cancelled request is
answered (to nobody) with status 499, so the request metrics count it as a 4xx. Other requests
pass through.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.tasks import Interrupt

PREFIXES = ("/v1/sessions/", "/v1/batches/take")  # the paths it watches start with one of these
DISCONNECT: Message = {"type": "http.disconnect"}
CLIENT_CLOSED = 499  # nginx's "client closed request": what the request metrics record


class CancelOnDisconnect:
    """Cancel the handler of a ``POST`` to a path under ``prefixes`` whose client disconnects
    before the answer."""

    def __init__(self, app: ASGIApp, prefixes: tuple[str, ...] = PREFIXES) -> None:
        self.app = app
        self.prefixes = prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith(self.prefixes)
        ):
            await self.app(scope, receive, send)
            return
        await _Exchange(receive, send).run(self.app, scope)


class _Exchange:
    """One request: the body passes through, then a watcher owns ``receive``. The app runs in the
    server's task; the watcher interrupts that task (:class:`core.tasks.Interrupt`), and the
    interruption is taken back however the app ends, answering 499 when it was the only
    cancellation."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self.receive = receive
        self.send_up = send
        self.gone = asyncio.Event()
        self.started = False
        self.watcher: asyncio.Task[None] | None = None
        self.interrupt = Interrupt()  # of the server's task, which makes the exchange and runs it

    async def run(self, app: ASGIApp, scope: Scope) -> None:
        interrupt = self.interrupt
        try:
            await app(scope, self.wrapped_receive, self.wrapped_send)
        except asyncio.CancelledError:
            if not interrupt.close():  # the server's, or another's: raise it
                raise
            # nobody reads it (the server drops writes after a disconnect); the edge metrics see 499
            await self.send_up({"type": "http.response.start", "status": CLIENT_CLOSED, "headers": []})
            await self.send_up({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            interrupt.close()  # however the app ended; the watcher cancels nothing from now on
            if self.watcher is not None:
                self.watcher.cancel()

    async def wrapped_receive(self) -> Message:
        if self.watcher is None:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
            elif not message.get("more_body", False):
                self.watcher = asyncio.ensure_future(self.watch())
            return message
        await self.gone.wait()
        return DISCONNECT

    async def wrapped_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send_up(message)

    async def watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        if not self.started:
            self.interrupt.fire()

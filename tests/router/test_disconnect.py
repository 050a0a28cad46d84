"""router.disconnect.CancelOnDisconnect on the ASGI contract itself (a server's ``receive`` and
``send`` driven by the test): a client gone before the answer (of a turn, of a take) cancels the
handler and is answered 499, the request's task left uncancelled; the server's own cancellation of
the request's task is raised on, also when it comes after the client's departure;
after the answer started, a disconnect cancels nothing. The same middleware in a live router:
tests/router/test_abort.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.disconnect import CLIENT_CLOSED, CancelOnDisconnect

SCOPE = {"type": "http", "method": "POST", "path": "/v1/sessions/s1/turns"}


class Exchange:
    """The server side of one request: the body, then ``http.disconnect`` once ``leave()`` is called."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.body_sent = False
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self.left.set()


def handler(log: list[str], *, start_first: bool = False):
    """An app that reads its body, optionally starts its answer, then waits for ``go``."""
    go = asyncio.Event()

    async def app(scope, receive, send) -> None:
        await receive()
        if start_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await go.wait()
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        if not start_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})
        log.append("answered")

    return app, go


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _waiting(log: list[str], *, start_first: bool = False, scope: dict = SCOPE):
    """A request (default: a session's turn) through the middleware, its handler waiting for
    ``go``: the exchange, the request's task and ``go``."""
    app, go = handler(log, start_first=start_first)
    ex = Exchange()
    task = asyncio.create_task(CancelOnDisconnect(app)(scope, ex.receive, ex.send))
    await _settle()
    return ex, task, go


@pytest.mark.parametrize("path", [SCOPE["path"], "/v1/batches/take"])
def test_a_client_gone_before_the_answer_cancels_the_handler_and_gets_499(path: str) -> None:
    async def main() -> None:
        log: list[str] = []
        ex, task, _ = await _waiting(log, scope={**SCOPE, "path": path})
        ex.leave()
        async with asyncio.timeout(5):
            await task  # returns: the request's task is not left cancelled
        assert log == ["cancelled"] and task.cancelling() == 0
        assert [m.get("status") for m in ex.sent] == [CLIENT_CLOSED, None]
        assert ex.sent[1] == {"type": "http.response.body", "body": b"", "more_body": False}

    asyncio.run(main())


def test_the_servers_cancellation_is_raised() -> None:
    async def main() -> None:
        log: list[str] = []
        ex, task, _ = await _waiting(log)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(5):
                await task
        assert log == ["cancelled"] and ex.sent == []

    asyncio.run(main())


def test_the_servers_cancellation_after_the_clients_departure_is_raised() -> None:
    async def main() -> None:
        log: list[str] = []
        ex, task, _ = await _waiting(log)
        ex.leave()
        while not task.cancelling():  # the watcher reads the disconnect and cancels the task
            await asyncio.sleep(0)
        task.cancel()  # and then the server, before the task ran again
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(5):
                await task
        assert log == ["cancelled"] and ex.sent == []

    asyncio.run(main())


async def _left_during(app) -> tuple[Exchange, asyncio.Task, list[int]]:
    """``app`` through the middleware, its client leaving while it waits: the exchange, the
    request's task, and (once it ends) the cancellations the task had pending on leaving the
    middleware."""
    ex = Exchange()
    pending: list[int] = []

    async def request() -> None:
        try:
            await CancelOnDisconnect(app)(SCOPE, ex.receive, ex.send)
        finally:
            pending.append(asyncio.current_task().cancelling())

    task = asyncio.create_task(request())
    await _settle()
    ex.leave()
    return ex, task, pending


def test_a_handler_that_finishes_in_spite_of_the_cancellation_leaves_its_task_uncancelled() -> None:
    async def main() -> None:
        async def app(scope, receive, send) -> None:
            await receive()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"late"})

        ex, task, pending = await _left_during(app)
        async with asyncio.timeout(5):
            await task
        assert task.cancelling() == 0 and pending == [0]
        assert [m.get("status") for m in ex.sent] == [200, None]

    asyncio.run(main())


def test_a_handler_that_turns_the_cancellation_into_an_error_raises_it_uncancelled() -> None:
    async def main() -> None:
        async def app(scope, receive, send) -> None:
            await receive()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                raise RuntimeError("cleanup failed") from None

        ex, task, pending = await _left_during(app)
        with pytest.raises(RuntimeError, match="cleanup failed"):
            async with asyncio.timeout(5):
                await task
        assert pending == [0] and ex.sent == []

    asyncio.run(main())


def test_a_client_gone_after_the_answer_started_cancels_nothing() -> None:
    async def main() -> None:
        log: list[str] = []
        ex, task, go = await _waiting(log, start_first=True)
        ex.leave()
        await _settle()
        go.set()
        async with asyncio.timeout(5):
            await task
        assert log == ["answered"] and [m.get("status") for m in ex.sent] == [200, None]

    asyncio.run(main())


def test_an_answered_request_leaves_no_watcher_and_others_pass_through() -> None:
    async def main() -> None:
        for scope in (SCOPE, {**SCOPE, "method": "GET"}, {**SCOPE, "path": "/v1/batches/L1/ack"}):
            log: list[str] = []
            app, go = handler(log)
            ex = Exchange()
            go.set()
            before = asyncio.all_tasks()
            async with asyncio.timeout(5):
                await CancelOnDisconnect(app)(scope, ex.receive, ex.send)
            await _settle()
            assert log == ["answered"] and asyncio.all_tasks() == before

    asyncio.run(main())

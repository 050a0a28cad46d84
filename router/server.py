"""The router's HTTP server: uvicorn's httptools protocol, extended so that canonical hot-route
requests (:mod:`router.hotpath`) skip the ASGI request cycle.

For a ``POST`` to a hot route whose head :meth:`HotPath.admit` accepts, on a connection with
nothing else in flight, :class:`HotProtocol` keeps the body itself and, once it is complete
and :meth:`HotPath.prepare` accepts it, runs the job in a task and writes status line, headers
and body in one write (uvicorn writes head and body separately, and builds a scope, a cycle
object and an event per request). Every other request - and a hot-route request that turns
out not to be canonical, replayed into uvicorn's own callbacks - takes uvicorn's path to the
ASGI app unchanged. Keep-alive, ``Connection: close``, HTTP/1.0, pipelining (a request that
arrives while a hot answer is pending queues behind it, in uvicorn's pipeline), graceful
shutdown and the keep-alive timeout work as in uvicorn: the in-flight hot request is
represented to uvicorn by a :class:`_HotCycle` with the attributes uvicorn reads.

Per request, less than uvicorn does: the ASGI scope is built only when the request goes to
ASGI, a 200 JSON answer's head is reused while uvicorn's default headers (``date``) stay the
same, and the keep-alive timeout is one timer per connection that stays armed and checks a
deadline set by each answer (uvicorn arms and cancels a timer per request).

:func:`protocol_for` returns the protocol class for an app, or None when the installed
uvicorn lacks what it builds on (the plain protocol is used then; the app's ASGI hot path
still applies).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from router.hotpath import JSON_TYPE, HotPath, Job, hot_route

log = logging.getLogger("mixfleet.router")

try:  # uvicorn's internals this builds on (checked in protocol_for)
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

_NEEDS = (
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "_unset_keepalive_if_required",
    "timeout_keep_alive_handler",
    "_start_asgi_task",
)


class _NoEvent:
    """Stands in for a cycle's ``message_event``: nothing waits on a hot cycle."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


class _HotCycle:
    """What uvicorn's protocol reads of ``self.cycle`` while a hot answer is pending."""

    __slots__ = ("response_complete", "disconnected", "keep_alive", "message_event")

    def __init__(self, keep_alive: bool) -> None:
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = keep_alive
        self.message_event = _NO_EVENT


def protocol_for(hot: HotPath) -> type | None:
    """A uvicorn ``http`` protocol class serving ``hot`` directly (None: not supported here)."""
    if HttpToolsProtocol is None or not all(hasattr(HttpToolsProtocol, n) for n in _NEEDS):
        log.warning("uvicorn's httptools protocol is not as expected: hot routes go through ASGI")
        return None

    class HotProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        _hot_route: str | None = None
        _last_target: tuple[bytes, bytes, str | None, str] | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._admitted: dict[tuple, bool] = {}

        def on_message_begin(self) -> None:
            # uvicorn's, except that its ASGI scope is built once the request goes to ASGI
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            self._hot_route = None
            self._scoped = False

        def _build_scope(self) -> None:
            """uvicorn's ``on_message_begin`` (the scope), keeping what was parsed since."""
            if self._scoped:
                return
            url, expect, headers = self.url, self.expect_100_continue, self.headers
            super().on_message_begin()
            self.url, self.expect_100_continue, self.headers = url, expect, headers
            self.scope["headers"] = headers
            self._scoped = True

        def on_headers_complete(self) -> None:
            route = self._hot_candidate()
            if route is None:
                self._build_scope()
                super().on_headers_complete()
                return
            self._hot_route = route
            self._hot_body: list[bytes] = []
            self._hot_size = 0

        def _hot_candidate(self) -> str | None:
            if (self.cycle is not None and not self.cycle.response_complete) or self.pipeline:
                return None  # an answer is pending on this connection: keep uvicorn's order
            if self.expect_100_continue or self.root_path or self.parser.should_upgrade():
                return None
            method = self.parser.get_method()
            last = self._last_target
            if last is not None and last[0] == self.url and last[1] == method:
                route, path = last[2], last[3]  # keep-alive clients repeat their target
            else:
                raw_path = httptools.parse_url(self.url).path
                path = raw_path.decode("ascii") if b"%" not in raw_path else ""
                route = hot_route(method.decode("ascii"), path) if path else None
                self._last_target = (self.url, method, route, path)
            if route is None:
                return None
            headers: dict[bytes, bytes] = {}
            for name, value in self.headers:
                headers.setdefault(name, value)
            if not hot.admit(headers, self._admitted):
                return None
            self._hot_path = path
            self._hot_headers = headers
            self._hot_t0 = time.perf_counter()
            return route

        def on_body(self, body: bytes) -> None:
            if self._hot_route is None:
                super().on_body(body)
                return
            self._hot_body.append(body)
            self._hot_size += len(body)
            if self._hot_size > hot.limit:
                self._to_asgi()

        def on_message_complete(self) -> None:
            route = self._hot_route
            if route is None:
                super().on_message_complete()
                return
            body = b"".join(self._hot_body)
            job = hot.prepare(route, self._hot_path, body, self._hot_headers)
            if job is None:
                self._to_asgi()
                super().on_message_complete()
                return
            self._hot_route = None
            keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            cycle = self.cycle = _HotCycle(keep_alive)  # type: ignore[assignment]
            task = self.loop.create_task(self._answer(cycle, route, job, self._hot_t0))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

        def _to_asgi(self) -> None:
            """Hand the request (head and the body so far) to uvicorn's own path."""
            self._hot_route = None
            self._build_scope()
            super().on_headers_complete()
            body = b"".join(self._hot_body)
            if body:
                super().on_body(body)

        # keep-alive timeout: uvicorn arms a timer after every response and cancels it when
        # the next request arrives; here one timer per connection stays armed and checks a
        # deadline (None while a request is in progress) when it fires
        _idle_deadline: float | None = None
        _idle_timer: Any = None

        def _unset_keepalive_if_required(self) -> None:
            self._idle_deadline = None
            super()._unset_keepalive_if_required()  # (its timer is never armed here)

        def on_response_complete(self) -> None:
            # uvicorn's, with the deadline instead of a new timer
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._idle_deadline = None
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
                return
            self._idle_deadline = self.loop.time() + self.timeout_keep_alive
            if self._idle_timer is None:
                self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._check_idle)

        def _check_idle(self) -> None:
            self._idle_timer = None
            deadline = self._idle_deadline
            if deadline is None:
                return  # a request is in progress: its response arms the timer again
            left = deadline - self.loop.time()
            if left > 0:
                self._idle_timer = self.loop.call_later(left, self._check_idle)
                return
            self.timeout_keep_alive_handler()

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

        async def _answer(self, cycle: _HotCycle, route: str, job: Job, t0: float) -> None:
            try:  # HotPath.run, one coroutine less
                result = await job()
            except Exception as exc:
                result = hot.refusal(route, exc)
            status, content, ctype, extra = hot.answered(route, result, t0)
            transport = self.transport
            if not cycle.disconnected and not transport.is_closing():
                length = str(len(content)).encode()
                if status == 200 and ctype is JSON_TYPE and not extra and cycle.keep_alive:
                    head = _ok_json_head(self.server_state.default_headers)
                    transport.write(b"".join((head, length, b"\r\n\r\n", content)))
                else:
                    parts = [STATUS_LINE[status]]
                    for name, value in self.server_state.default_headers:
                        parts += (name, b": ", value, b"\r\n")
                    parts += (b"content-type: ", ctype, b"\r\ncontent-length: ", length, b"\r\n")
                    for name, value in extra:
                        parts += (name, b": ", value, b"\r\n")
                    if not cycle.keep_alive:
                        parts.append(b"connection: close\r\n")
                    parts += (b"\r\n", content)
                    transport.write(b"".join(parts))
                    if not cycle.keep_alive:
                        transport.close()
            cycle.response_complete = True
            self.on_response_complete()

    _ok_head: list = [None, b""]  # [default headers it was built from, head]

    def _ok_json_head(default_headers: list[tuple[bytes, bytes]]) -> bytes:
        """Status line, default headers (uvicorn renews the list once a second, for ``date``),
        JSON content type and ``content-length: `` of a 200 answer; rebuilt when they change."""
        if _ok_head[0] is not default_headers:
            parts = [STATUS_LINE[200]]
            for name, value in default_headers:
                parts += (name, b": ", value, b"\r\n")
            parts.append(b"content-type: " + JSON_TYPE + b"\r\ncontent-length: ")
            _ok_head[:] = [default_headers, b"".join(parts)]
        return _ok_head[1]

    return HotProtocol


def uvicorn_http_option(app: Any) -> Any:
    """The ``http=`` argument for ``uvicorn.run(app, ...)``: the hot protocol for a router app
    (:class:`router.app.RouterApp`), else uvicorn's default."""
    hot = getattr(app, "hot", None)
    cls = protocol_for(hot) if isinstance(hot, HotPath) else None
    return cls if cls is not None else "auto"

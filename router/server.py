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

:func:`protocol_for` returns the protocol class for an app, or None when the installed
uvicorn lacks what it builds on (the plain protocol is used then; the app's ASGI hot path
still applies).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from router.hotpath import HotPath, Job, hot_route

log = logging.getLogger("mixfleet.router")

try:  # uvicorn's internals this builds on (checked in protocol_for)
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

_NEEDS = ("on_message_begin", "on_headers_complete", "on_body", "on_message_complete", "on_response_complete")


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
            super().on_message_begin()
            self._hot_route = None

        def on_headers_complete(self) -> None:
            route = self._hot_candidate()
            if route is None:
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
            super().on_headers_complete()
            body = b"".join(self._hot_body)
            if body:
                super().on_body(body)

        async def _answer(self, cycle: _HotCycle, route: str, job: Job, t0: float) -> None:
            status, content, ctype, extra = await hot.run(route, job, t0)
            transport = self.transport
            if not cycle.disconnected and not transport.is_closing():
                parts = [STATUS_LINE[status]]
                for name, value in self.server_state.default_headers:
                    parts += (name, b": ", value, b"\r\n")
                length = str(len(content)).encode()
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

    return HotProtocol


def uvicorn_http_option(app: Any) -> Any:
    """The ``http=`` argument for ``uvicorn.run(app, ...)``: the hot protocol for a router app
    (:class:`router.app.RouterApp`), else uvicorn's default."""
    hot = getattr(app, "hot", None)
    cls = protocol_for(hot) if isinstance(hot, HotPath) else None
    return cls if cls is not None else "auto"

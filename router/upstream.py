"""A lean HTTP/1.1 client for the router's hot path: ``POST`` a body to an engine replica over a
pooled keep-alive connection and read the whole response.

Why not aiohttp here: per request it costs the router several times more CPU than this
(request/response objects, payload registry, header multidicts, tracing hooks), and on the
turn path that was the largest single cost after the web framework. Everything else (health
polls, weight routes, streaming ``/generate``) keeps :mod:`fleet.sglang_client`.

Contract of :meth:`UpstreamPool.post`:

* Returns :class:`fleet.sglang_client.RawResponse` (status, whole body, lower-cased headers)
  for any status the server answers with; the caller classifies 4xx / 5xx.
* Raises :class:`fleet.sglang_client.EngineUnavailable` when no response arrived: connection
  refused or reset, connect timeout, no byte for ``read_timeout_s`` (the message then contains
  ``Timeout``), malformed HTTP. A pooled connection that the server closed before answering is
  retried once on a fresh connection first (nothing was processed on it).
* Connections are reused only after a complete keep-alive response, and only while idle for
  less than ``idle_s`` (shorter than a server's keep-alive timeout; uvicorn: 5 s). At most
  ``max_connections`` are open per pool; further requests wait for one to be released.
  ``http`` and ``https`` URLs, with an optional path prefix (``https://host/prefix``).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import httptools

from fleet.sglang_client import EngineUnavailable, RawResponse


class _Closed(Exception):
    """The connection closed before a complete response; ``fresh`` is False when no byte of a
    response had arrived (the request may be resent)."""

    def __init__(self, got_bytes: bool, cause: BaseException | None) -> None:
        super().__init__(repr(cause) if cause else "connection closed")
        self.got_bytes = got_bytes
        self.cause = cause


class _Endpoint:
    """A parsed base URL: where to connect and how to name the host in requests."""

    __slots__ = ("host", "port", "ssl", "prefix", "host_header", "key", "heads")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.prefix = parts.path.rstrip("/")
        default = 443 if self.ssl else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == default else f"{host}:{self.port}"
        self.key = (self.host, self.port, self.ssl)
        self.heads: dict[str, bytes] = {}

    def head(self, path: str) -> bytes:
        """The request head of a JSON ``POST`` to ``path`` up to the Content-Length value."""
        head = self.heads.get(path)
        if head is None:
            head = self.heads[path] = (
                f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode("latin-1")
        return head


class _Conn(asyncio.Protocol):
    """One connection; at most one request in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self.loop = loop
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.waiter: asyncio.Future[RawResponse] | None = None
        self.got_bytes = False
        self.last_data = 0.0
        self.idle_since = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._status = 0
        self._keep_alive = False
        self._framed = True  # Content-Length or chunked (else the body ends at EOF)

    # asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(_Closed(True, exc))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.waiter is not None and not self.waiter.done() and self.got_bytes and not self._framed:
            self._complete()  # an unframed body ends at EOF
            return
        self._fail(_Closed(self.got_bytes, exc))

    # httptools callbacks ----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()
        self._keep_alive = self.parser.should_keep_alive()
        names = [n for n, _ in self._headers]
        self._framed = "content-length" in names or "transfer-encoding" in names

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._complete()

    # request cycle ----------------------------------------------------------------------
    def _complete(self) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        waiter.set_result(RawResponse(self._status, body, dict(self._headers)))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def _check_timeout(self) -> None:
        self.timer = None
        if self.waiter is None or self.waiter.done():
            return  # idle: the next request arms the timer again
        left = self.last_data + self.read_timeout_s - self.loop.time()
        if left > 0:
            self.timer = self.loop.call_later(left, self._check_timeout)
            return
        self._fail(TimeoutError(f"no response byte for {self.read_timeout_s:g} s"))
        self.close()

    def send(self, data: bytes) -> asyncio.Future[RawResponse]:
        """Write one request; the future gets its response (or the reason there is none).
        The caller sets ``waiter`` back to None once it has the result. The read timer stays
        armed across requests (re-armed from the last byte when it fires during one), so a
        request does not create and cancel a timer of its own."""
        self._headers = []
        self._body = []
        self._framed = True
        self.got_bytes = False
        self.waiter = waiter = self.loop.create_future()
        self.last_data = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_later(self.read_timeout_s, self._check_timeout)
        self.transport.write(data)  # type: ignore[union-attr]
        return waiter

    def reusable(self) -> bool:
        return self._keep_alive and not self.closed

    def close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Keep-alive connections to every engine replica, shared by all requests of one router.
    Create and use inside the running event loop; ``await pool.close()`` at shutdown."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        idle_s: float = 2.0,
        max_connections: int = 1024,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_s = idle_s
        self.max_connections = max_connections
        self._endpoints: dict[str, _Endpoint] = {}
        self._idle: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self._releases = 0

    def endpoint(self, base_url: str) -> _Endpoint:
        ep = self._endpoints.get(base_url)
        if ep is None:
            ep = self._endpoints[base_url] = _Endpoint(base_url)
        return ep

    async def post(
        self, base_url: str, path: str, body: bytes, headers: Sequence[tuple[str, str]] = ()
    ) -> RawResponse:
        """``POST base_url + path`` with ``body`` (sent as ``application/json``) and ``headers``."""
        url = base_url + path
        try:
            ep = self.endpoint(base_url)
        except ValueError as exc:
            raise EngineUnavailable(url, str(exc)) from None
        lines = [str(len(body)), "\r\n"]
        for name, value in headers:
            if "\r" in value or "\n" in value:
                raise EngineUnavailable(url, f"header {name} holds a line break")
            lines += (name, ": ", value, "\r\n")
        lines.append("\r\n")
        data = b"".join((ep.head(path), "".join(lines).encode("latin-1", "replace"), body))
        key = ep.key
        for attempt in (0, 1):
            conn = self._take_idle(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(ep, url)
            ok = False
            try:
                response = await conn.send(data)
                ok = True
            except _Closed as exc:
                if reused and not exc.got_bytes and attempt == 0:
                    continue  # the server dropped an idle connection under us: resend once
                reason = _describe(exc.cause) if exc.cause else "ServerDisconnected"
                raise EngineUnavailable(url, reason) from None
            except TimeoutError as exc:
                raise EngineUnavailable(url, f"Timeout (read): {exc}") from None
            finally:
                conn.waiter = None
                self._release(key, conn, ok)
            return response
        raise AssertionError("unreachable")

    def _take_idle(self, key: tuple[str, int, bool]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            self._drop(conn)
        return None

    async def _connect(self, ep: _Endpoint, url: str) -> _Conn:
        if self._closed:
            raise EngineUnavailable(url, "router is shutting down")
        while self._open >= self.max_connections:
            if not self._evict_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                except BaseException:
                    if waiter.done() and not waiter.cancelled():
                        self._wake()  # woken, then cancelled: pass the free slot on
                    raise
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
        self._open += 1
        loop = asyncio.get_running_loop()
        context = None
        if ep.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Conn(loop, self.read_timeout_s),
                    ep.host,
                    ep.port,
                    ssl=context,
                    server_hostname=ep.host if context else None,
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            self._opened_failed()
            raise EngineUnavailable(url, f"Timeout (connect) after {self.connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            self._opened_failed()
            raise EngineUnavailable(url, f"Cannot connect: {_describe(exc)}") from None
        except BaseException:
            self._opened_failed()
            raise
        return conn

    def _opened_failed(self) -> None:
        self._open -= 1
        self._wake()

    def _release(self, key: tuple[str, int, bool], conn: _Conn, ok: bool) -> None:
        self._releases += 1
        if self._releases % 1024 == 0:
            self._prune()
        if ok and conn.reusable() and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(key, []).append(conn)
            if self._waiters:  # someone waits for a slot: free an idle one instead of keeping it
                self._evict_idle()
            return
        self._drop(conn)

    def _prune(self) -> None:
        """Drop idle connections that closed or went stale (e.g. to replicas no longer used)."""
        now = time.monotonic()
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since < self.idle_s]
            for c in idle:
                if c not in keep:
                    self._drop(c)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._open -= 1
        self._wake()

    def _evict_idle(self) -> bool:
        for idle in self._idle.values():
            if idle:
                self._drop(idle.pop(0))
                return True
        return False

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                self._drop(idle.pop())


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")

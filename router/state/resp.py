"""A small asyncio Redis client (RESP2) for the state store's per-request calls.

Why: redis-py's asyncio client spends ~100+ microseconds of CPU per command (pool, locks,
command and reply objects); a turn makes two such calls. This client keeps one connection and
pipelines automatically: every command issued during one event-loop iteration goes out in one
write, and replies are matched to callers in order. It is used for the hot calls only (reading
a session, appending a turn, route keys); :mod:`router.state.redis` keeps redis-py for the rest.

Contract of :meth:`RespClient.execute` / :meth:`RespClient.evalsha`:

* Returns the reply: ``bytes`` (bulk), ``int``, ``str`` (status), ``list`` or None; an error
  reply raises :class:`RespError` (a ``redis.exceptions.ResponseError``).
* A dropped or refused connection, a reply not arriving within ``command_timeout_s``, or a
  ``LOADING`` reply (Redis restarting) is retried - on a new connection, with backoff - until
  ``outage_s`` has passed since the first failure; then :class:`StateUnavailable` is raised.
  Only idempotent commands may be sent (a retried command may have been applied once already):
  reads, and the store's scripts, which are idempotent by request id.
* ``evalsha`` loads the script (``EVAL``) when the server does not know it (``NOSCRIPT``,
  e.g. after a restart).

URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS) and
``unix:///path[?db=N]``; :func:`supports` says whether a URL is one of them.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl
import time
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.exceptions import ResponseError

from router.state.base import StateUnavailable


class RespError(ResponseError):
    """An error reply (``-ERR ...``)."""


class _Incomplete(Exception):
    pass


def supports(url: str) -> bool:
    return urlsplit(url).scheme in ("redis", "rediss", "unix")


def encode_command(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, bytes):
            b = a
        elif isinstance(a, str):
            b = a.encode()
        elif isinstance(a, int | float) and not isinstance(a, bool):
            b = repr(a).encode()
        else:
            raise TypeError(f"cannot send {type(a).__name__} to redis")
        out += (b"$%d\r\n" % len(b), b, b"\r\n")
    return b"".join(out)


def parse_reply(buf: bytearray | bytes, pos: int) -> tuple[Any, int]:
    """One reply starting at ``pos``: (value, position after it). Raises _Incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    line = bytes(buf[pos + 1 : end])
    pos = end + 2
    if kind == 0x24:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise _Incomplete
        return bytes(buf[pos : pos + n]), pos + n + 2
    if kind == 0x3A:  # : integer
        return int(line), pos
    if kind == 0x2A:  # * array
        n = int(line)
        if n < 0:
            return None, pos
        items = []
        for _ in range(n):
            item, pos = parse_reply(buf, pos)
            items.append(item)
        return items, pos
    if kind == 0x2B:  # + status
        return line.decode(), pos
    if kind == 0x2D:  # - error
        return RespError(line.decode(errors="replace")), pos
    raise ValueError(f"bad RESP reply type {chr(kind)!r}")


class _Connection(asyncio.Protocol):
    """One connection; replies are handed to ``waiters`` in order. A reply outstanding for
    longer than ``timeout_s`` fails the connection (a watchdog runs while any is)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.sent: collections.deque[float] = collections.deque()
        self.closed = False
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        waiters = self.waiters
        sent = self.sent
        try:
            while waiters and pos < len(buf):
                reply, pos = parse_reply(buf, pos)
                waiter = waiters.popleft()
                sent.popleft()
                if not waiter.done():
                    waiter.set_result(reply)
        except _Incomplete:
            pass
        except ValueError as exc:
            self.fail(ConnectionError(f"redis protocol error: {exc}"))
            return
        if pos:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"redis connection lost: {exc}" if exc else "redis closed the connection"))

    def fail(self, exc: BaseException) -> None:
        self.closed = True
        self.sent.clear()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None

    def send(self, data: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        if self.closed:
            raise ConnectionError("redis connection closed")
        waiter = loop.create_future()
        now = loop.time()
        self.waiters.append(waiter)
        self.sent.append(now)
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            loop.call_soon(self.flush)
        if self.watchdog is None:
            self.watchdog = loop.call_at(now + self.timeout_s, self.check, loop)
        return waiter

    def check(self, loop: asyncio.AbstractEventLoop) -> None:
        self.watchdog = None
        if not self.sent or self.closed:
            return
        oldest = self.sent[0]
        if loop.time() - oldest >= self.timeout_s:
            self.fail(ConnectionError(f"no reply from redis within {self.timeout_s:g} s"))
            return
        self.watchdog = loop.call_at(oldest + self.timeout_s, self.check, loop)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and not self.closed:
            data = self.out[0] if len(self.out) == 1 else b"".join(self.out)
            self.out = []
            self.transport.write(data)  # type: ignore[union-attr]


class RespClient:
    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 2.0,
        command_timeout_s: float = 10.0,
        outage_s: float = 20.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported redis URL {url!r}")
        query = parse_qs(parts.query)
        self.unix_path = parts.path if parts.scheme == "unix" else None
        self.host = parts.hostname or "localhost"
        self.port = parts.port or 6379
        self.tls = parts.scheme == "rediss"
        db = query.get("db", [None])[0]
        if db is None and parts.scheme != "unix" and parts.path.strip("/"):
            db = parts.path.strip("/")
        self.db = int(db or 0)
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self.outage_s = outage_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._shas: dict[str, str] = {}

    async def execute(self, *args: Any) -> Any:
        data = encode_command(args)
        first_failure: float | None = None
        delay = 0.02
        while True:
            try:
                conn = self._conn
                if conn is None or conn.closed:
                    conn = await self._connect()
                reply = await conn.send(data, asyncio.get_running_loop())
                if isinstance(reply, RespError):
                    if str(reply).startswith("LOADING"):
                        raise ConnectionError(str(reply))
                    raise reply
                return reply
            except (ConnectionError, OSError, ssl.SSLError) as exc:
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure >= self.outage_s:
                    raise StateUnavailable(f"redis: {exc}") from None
                await asyncio.sleep(delay)
                delay = min(0.5, delay * 2)

    async def evalsha(self, script: str, keys: list[Any], args: list[Any]) -> Any:
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.execute("EVAL", script, len(keys), *keys, *args)

    async def _connect(self) -> _Connection:
        if self._connecting is not None:
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            def factory() -> _Connection:
                return _Connection(self.command_timeout_s)

            if self.unix_path is not None:
                coro = loop.create_unix_connection(factory, self.unix_path)
            else:
                coro = loop.create_connection(
                    factory,
                    self.host,
                    self.port,
                    ssl=ssl.create_default_context() if self.tls else None,
                )
            try:
                _, conn = await asyncio.wait_for(coro, self.connect_timeout_s)
            except TimeoutError:
                raise ConnectionError(f"redis connect timed out after {self.connect_timeout_s:g} s") from None
            hello = []
            if self.password is not None:
                auth = ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
                hello.append(conn.send(encode_command(auth), loop))
            if self.db:
                hello.append(conn.send(encode_command(("SELECT", self.db)), loop))
            for waiter in hello:
                reply = await waiter
                if isinstance(reply, RespError):
                    conn.fail(ConnectionError(str(reply)))
                    raise ConnectionError(f"redis refused the connection setup: {reply}")
            self._conn = conn
            self._connecting.set_result(conn)
            return conn
        except BaseException as exc:
            self._connecting.set_exception(exc if isinstance(exc, Exception) else ConnectionError(str(exc)))
            self._connecting.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            self._connecting = None

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.fail(ConnectionError("client closed"))
            self._conn = None

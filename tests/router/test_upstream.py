"""The hot path's engine client (router.upstream.UpstreamPool) against real loopback servers:
keep-alive reuse, a connection the server dropped, refusals and timeouts, response framings,
the connection limit."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fleet.sglang_client import EngineUnavailable
from router.upstream import UpstreamPool
from tests.support.procs import free_port


class Server:
    """A loopback HTTP/1.1 server answering every request with ``answer(n)`` (raw bytes; ``n``
    counts requests), optionally closing the connection afterwards or sleeping first (``delay``:
    seconds, or a function of ``n``)."""

    def __init__(self, answer, *, close_after: bool = False, delay=0.0) -> None:
        self.answer = answer
        self.close_after = close_after
        self.delay = delay
        self.connections = 0
        self.requests = 0
        self.open_now = 0
        self.max_open = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self.port = free_port()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                self.requests += 1
                delay = self.delay(self.requests) if callable(self.delay) else self.delay
                if delay:
                    await asyncio.sleep(delay)
                writer.write(self.answer(self.requests))
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_now -= 1
            writer.close()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given() -> None:
    async def main() -> None:
        async with Server(lambda n: ok(b'{"n":%d}' % n)) as srv:
            pool = UpstreamPool()
            for i in range(5):
                r = await pool.post(srv.url, "/generate", b'{"i":%d}' % i, [("Modal-Session-ID", "s1")])
                assert (r.status_code, r.content) == (200, b'{"n":%d}' % (i + 1))
            await pool.close()
        assert srv.connections == 1 and srv.bodies == [b'{"i":%d}' % i for i in range(5)]
        head = srv.heads[0].decode()
        assert head.startswith("POST /generate HTTP/1.1\r\n")
        assert "Modal-Session-ID: s1\r\n" in head and "Content-Type: application/json\r\n" in head

    run(main())


def test_a_connection_the_server_dropped_is_retried_on_a_fresh_one() -> None:
    async def main() -> None:
        # the server closes after each answer without saying so: the pooled connection is dead
        # when reused, and the request must still succeed (once, on a new connection)
        async with Server(lambda n: ok(), close_after=True) as srv:
            pool = UpstreamPool()
            for _ in range(3):
                await pool.post(srv.url, "/generate", b"{}")
                await asyncio.sleep(0.05)  # let the close arrive
            await pool.close()
        assert srv.requests == 3 and srv.connections == 3

    run(main())


def test_refused_and_timed_out_requests_are_engine_unavailable() -> None:
    async def main() -> None:
        pool = UpstreamPool(read_timeout_s=0.3)
        with pytest.raises(EngineUnavailable) as refused:
            await pool.post(f"http://127.0.0.1:{free_port()}", "/generate", b"{}")
        assert "Timeout" not in refused.value.message
        async with Server(lambda n: ok(), delay=2.0) as srv:
            with pytest.raises(EngineUnavailable) as slow:
                await pool.post(srv.url, "/generate", b"{}")
            assert "Timeout" in slow.value.message
        await pool.close()

    run(main())


def test_chunked_unframed_and_error_answers() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    unframed = b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil close"
    error = b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 13\r\n\r\n{"error":"x"}'

    async def main() -> None:
        pool = UpstreamPool()
        async with Server(lambda n: chunked) as srv:
            assert (await pool.post(srv.url, "/generate", b"{}")).content == b"abcde"
        async with Server(lambda n: unframed, close_after=True) as srv:
            r = await pool.post(srv.url, "/generate", b"{}")
            assert r.content == b"until close" and r.headers["content-type"] == "text/plain"
        async with Server(lambda n: error) as srv:
            r = await pool.post(srv.url + "/prefix", "/generate", b"{}")
            assert r.status_code == 503 and r.content == b'{"error":"x"}'
            assert srv.heads[0].startswith(b"POST /prefix/generate ")
        await pool.close()

    run(main())


def test_connections_are_capped_and_requests_wait_for_one() -> None:
    async def main() -> None:
        async with Server(lambda n: ok(), delay=0.05) as srv:
            pool = UpstreamPool(max_connections=2)
            answers = await asyncio.gather(*(pool.post(srv.url, "/generate", b"{}") for _ in range(9)))
            await pool.close()
        assert all(a.status_code == 200 for a in answers)
        assert srv.requests == 9 and srv.max_open <= 2

    run(main())


def test_read_timeout_holds_for_every_request_on_a_kept_alive_connection() -> None:
    """The read timer outlives single requests: it fires while the connection idles in the pool,
    and a later slow request on the same connection still times out; quick ones never do."""

    async def main() -> None:
        delays = {1: 0.0, 2: 0.25, 3: 1.0, 4: 0.0}
        async with Server(lambda n: ok(b"%d" % n), delay=lambda n: delays.get(n, 0.0)) as srv:
            pool = UpstreamPool(read_timeout_s=0.4)
            assert (await pool.post(srv.url, "/x", b"{}")).content == b"1"
            await asyncio.sleep(0.6)  # the timer armed by request 1 fires while idle
            assert (await pool.post(srv.url, "/x", b"{}")).content == b"2"  # 0.25 s < 0.4 s
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(EngineUnavailable, match="Timeout"):
                await pool.post(srv.url, "/x", b"{}")
            assert 0.35 < loop.time() - t0 < 0.9
            assert srv.connections == 1
            await asyncio.sleep(0.8)  # request 3 is answered on the closed connection: dropped
            assert (await pool.post(srv.url, "/x", b"{}")).content == b"4"
            assert srv.connections == 2
            await pool.close()

    run(main())

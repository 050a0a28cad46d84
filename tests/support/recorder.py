"""A recording HTTP proxy for tests: a loopback server that forwards every request unchanged to a
real upstream (an engine) and records what passed, so a test can check what the fleet actually
sent to the engine and what the engine answered.

``recording_proxy(upstream)`` yields a :class:`Recorder` whose ``url`` stands in for the
upstream's; ``exchanges(path)`` lists the ``(request body, response body)`` pairs of ``path``
(bodies as bytes, in arrival order). :func:`serve_in_thread` serves any such aiohttp handler (the
stand-in Modal proxy of ``tests/deploy`` too).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.procs import free_port

HOP = ("host", "content-length", "transfer-encoding", "connection")


@dataclass
class Recorder:
    """Forwards to ``upstream``; ``seen`` holds ``(method, path, request body, status, response
    body)`` of every exchange."""

    upstream: str
    url: str = ""
    seen: list[tuple[str, str, bytes, int, bytes]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        answer = await forward(self.upstream, request, body)
        self.seen.append((request.method, request.path, body, answer.status, answer.body))
        return answer

    def exchanges(self, path: str) -> list[tuple[bytes, bytes]]:
        return [(req, resp) for _m, p, req, _s, resp in list(self.seen) if p == path]


@contextlib.contextmanager
def recording_proxy(upstream: str) -> Iterator[Recorder]:
    """Serve a :class:`Recorder` of ``upstream`` on a free loopback port (its own thread and
    event loop) until the block ends."""
    with serving(Recorder(upstream), "recording-proxy") as rec:
        yield rec


@contextlib.contextmanager
def serving(proxy: Any, name: str) -> Iterator[Any]:
    """Serve ``proxy.handle`` (:func:`serve_in_thread`) until the block ends; yields ``proxy``
    with its ``url`` set to the server's."""
    with serve_in_thread(proxy.handle, name) as url:
        proxy.url = url
        yield proxy


@contextlib.contextmanager
def serve_in_thread(handler, name: str) -> Iterator[str]:
    """Serve every method and path with the aiohttp ``handler`` on a free loopback port, on a
    thread of its own with its own event loop; yields the server's URL until the block ends."""
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    assert started.wait(30), f"{name} did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


async def forward(upstream: str, request: web.Request, body: bytes) -> web.Response:
    """``request`` (its ``body`` already read) sent unchanged to ``upstream``; its answer."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    async with (
        aiohttp.ClientSession() as http,
        http.request(request.method, upstream + request.path_qs, data=body, headers=headers) as r,
    ):
        return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

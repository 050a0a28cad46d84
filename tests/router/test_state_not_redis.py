"""A server that is not Redis on the router's ``--state`` port: ``mixfleet router`` refuses to start
on it with one line (exit 2), and a running router whose Redis port is taken over by one answers
its usual 503 naming the state URL, never a 500."""

from __future__ import annotations

import contextlib
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from tests.support.loopback import LoopbackServer
from tests.support.procs import free_port, mixfleet_argv, redis_server
from tests.support.router import router_process, write_preset

HTTP_ANSWER = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
WRONG_REPLY = b"+OK\r\n"  # well-formed RESP, but not the map redis-py's HELLO 3 handshake reads


@contextlib.contextmanager
def answering(port: int, reply: bytes) -> Iterator[None]:
    """A TCP server on ``port`` answering ``reply`` to every read (until the block ends)."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with contextlib.suppress(OSError):
                while self.request.recv(65536):
                    self.request.sendall(reply)

    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    server = Server(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def test_router_refuses_to_start_on_an_http_server_with_one_line(tmp_path) -> None:
    """An HTTP server (a real one: http.server) on the ``--state`` port."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a"}])
    http = LoopbackServer(BaseHTTPRequestHandler)
    state = http.url.replace("http://", "redis://") + "/0"
    try:
        r = subprocess.run(
            mixfleet_argv("router", "--preset", str(preset), "--port", str(free_port()), "--state", state)
            + ["--insecure-no-auth"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        http.close()
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert f"--state {state} does not answer as Redis" in line, line


@pytest.mark.parametrize("reply", [HTTP_ANSWER, WRONG_REPLY], ids=["http", "wrong-reply"])
def test_a_router_whose_redis_port_is_taken_by_another_server_answers_503_naming_it(tmp_path, reply) -> None:
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    port = free_port()
    state = f"redis://127.0.0.1:{port}/0"
    with contextlib.ExitStack() as stack:
        redis = contextlib.ExitStack()
        stack.callback(redis.close)
        redis.enter_context(redis_server(port=port))
        router = stack.enter_context(router_process(preset, state=state))
        c = stack.enter_context(httpx.Client(base_url=router.url, headers=router.headers, timeout=120))
        assert c.get("/v1/batches/stats").status_code == 200
        redis.close()
        stack.enter_context(answering(port, reply))
        for method, path, body in (
            ("POST", "/v1/sessions", {}),
            ("GET", "/v1/sessions/abc", None),
            ("POST", "/v1/batches/take", {"size": 1}),
            ("GET", "/v1/batches/stats", None),
        ):
            r = c.request(method, path, json=body)
            assert r.status_code == 503, (path, r.status_code, r.text)
            detail = r.json()["detail"]
            assert f"{state} does not answer as Redis" in detail, detail
            assert "Retry-After" in r.headers
        health = httpx.get(f"{router.url}/healthz", timeout=30)
        assert health.status_code == 503 and health.json()["state"] is False

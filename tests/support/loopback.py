"""A stand-in HTTP server on a free loopback port, for tests whose far side cannot be a real
process (a router answering scripted statuses, an engine answering slowly on purpose)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.procs import free_port


class LoopbackServer:
    """Serves ``handler`` (one thread per request) on ``url`` until :meth:`close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

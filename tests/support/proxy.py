"""A TCP proxy on a free loopback port in front of a real server, for tests that need a lost
answer or a slow link at one exact moment: every chunk passes through a hook that may hold it,
change it, or cut the connection."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

from tests.support.procs import free_port

Hook = Callable[[str, bytes, dict[str, Any]], bytes | None]
"""``hook(direction, chunk, conn)``: ``direction`` is ``"up"`` (client to server) or ``"down"``;
``conn`` a dict per connection for the hook's own notes; returns the bytes to forward, or None to
close both sides of the connection instead (the chunk is not forwarded)."""


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` (``self.port``) to ``upstream`` until :meth:`close`."""

    def __init__(self, upstream: tuple[str, int], hook: Hook) -> None:
        self.upstream = upstream
        self.hook = hook
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.sockets: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            conn: dict[str, Any] = {}
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                threading.Thread(
                    target=self._pump, args=(src, dst, direction, conn, client, server), daemon=True
                ).start()

    def _pump(self, src, dst, direction: str, conn: dict[str, Any], *both: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                out = self.hook(direction, data, conn)
                if out is None:
                    break
                dst.sendall(out)
        for s in both:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()

"""TCP ports on this machine for the processes mixfleet starts itself.

Asking the kernel for port 0 and closing the socket returns a port that is free *now*; asked
again before the first process has bound it (an engine takes seconds to import), the kernel may
return the same port, and two engines would then be told to share it. :func:`free_port` never
hands out a port twice in one process.
"""

from __future__ import annotations

import socket
import threading

_given: set[tuple[str, int]] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1", ports: range | None = None) -> int:
    """A TCP port on ``host`` that was free a moment ago and that this process has not handed
    out before: the kernel's choice, or with ``ports`` the first such port of that range (a range
    outside the kernel's ephemeral one is never taken meanwhile by another process's port 0 or by
    an outgoing connection's source port)."""
    with _lock:
        if ports is not None:
            for port in ports:
                if (host, port) not in _given and port_is_free(host, port):
                    _given.add((host, port))
                    return port
            span = f"{ports.start}-{ports.stop - 1}"
            raise OSError(f"no free TCP port on {host} in {span} that was not handed out already")
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if (host, port) not in _given:
                _given.add((host, port))
                return port
    raise OSError(f"no free TCP port on {host} that was not handed out already")


def release_port(host: str, port: int) -> None:
    """Let :func:`free_port` hand out ``host:port`` again (its process has exited: a restarted engine
    may take its predecessor's port); a port never handed out is ignored."""
    with _lock:
        _given.discard((host, port))


def port_is_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind ``host:port`` now (``SO_REUSEADDR``, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True

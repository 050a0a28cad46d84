"""Session and trajectory state: the port (:mod:`router.state.base`) and the factory that picks
its adapter from a state URL."""

from __future__ import annotations

from router.state.base import StateStore
from router.state.memory import MemoryStore
from router.state.redis import RedisStore
from router.state.retention import Retention


def open_store(url: str, *, retention: Retention | None = None) -> StateStore:
    """``memory`` -> :class:`MemoryStore`; ``redis://``, ``rediss://`` or ``unix://`` URLs ->
    :class:`RedisStore`; both keep ``retention``'s bounds (default: :class:`Retention`'s).
    Raises ValueError naming the URL for anything else."""
    if url == "memory":
        return MemoryStore(retention)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, retention=retention)
    raise ValueError(f"state URL must be 'memory' or redis://...: {url!r}")

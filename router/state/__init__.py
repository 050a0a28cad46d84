"""Session and trajectory state: the port (:mod:`router.state.base`) and the factory that picks
its adapter from a state URL."""

from __future__ import annotations

from router.state.base import StateStore
from router.state.memory import MemoryStore
from router.state.redis import RedisStore


def open_store(url: str, *, retention_s: float = 3600.0) -> StateStore:
    """``memory`` -> :class:`MemoryStore`; ``redis://``, ``rediss://`` or ``unix://`` URLs ->
    :class:`RedisStore`. Raises ValueError naming the URL for anything else."""
    if url == "memory":
        return MemoryStore(retention_s=retention_s)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, retention_s=retention_s)
    raise ValueError(f"state URL must be 'memory' or redis://...: {url!r}")

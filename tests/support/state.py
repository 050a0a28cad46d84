"""State stores for tests: :func:`opened` opens the store a state URL names and closes it after."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from router.state import open_store
from router.state.base import StateStore


@contextlib.asynccontextmanager
async def opened(url: str, **kw) -> AsyncIterator[StateStore]:
    store = open_store(url, **kw)
    try:
        yield store
    finally:
        await store.close()

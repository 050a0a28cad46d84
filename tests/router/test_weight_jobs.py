"""A weight job's view read while the job ends or starts on another router: never a false
``failed``; a job whose router stopped (its lock gone) reads ``failed``.

Each race is made deterministic by a state store (the real :class:`MemoryStore`, delegated to)
that lets the other router act right after a read returns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from router.config import WeightsConfig
from router.publishing import LOCK_TTL_S, ORPHANED, PublishService, _as_held
from router.state.memory import MemoryStore

RUNNING = {"job_id": "j1", "state": "running", "error": None, "result": None}
DONE = {**RUNNING, "state": "done", "result": {"version": 1}}


class ActsAfterRead:
    """A state store whose ``after`` (another router's step) runs once, right after the first
    read of ``method`` returns."""

    def __init__(self, store: MemoryStore, method: str, after: Callable[[], Awaitable[Any]]) -> None:
        self.store, self.method, self.after = store, method, after

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.store, name)
        if name != self.method or self.after is None:
            return real

        async def read(*args: Any) -> Any:
            value = await real(*args)
            after, self.after = self.after, None
            await after()
            return value

        return read


async def _running(store: MemoryStore) -> None:
    assert await store.acquire_job_lock("j1", LOCK_TTL_S)
    await store.put_job("j1", RUNNING, 50)


async def _finish(store: MemoryStore) -> None:  # as finish_job: the final view, then the lock freed
    await store.put_job("j1", DONE, 50)
    assert await store.release_job_lock("j1")


@pytest.mark.anyio
async def test_a_job_that_ends_while_it_is_read_does_not_read_failed() -> None:
    store = MemoryStore()
    await _running(store)
    ctx = SimpleNamespace(store=ActsAfterRead(store, "get_job", lambda: _finish(store)))
    view = await PublishService(WeightsConfig()).job_view(ctx, "j1")
    assert view is not None and view["state"] == "running", view  # as it was when read
    assert (await PublishService(WeightsConfig()).job_view(ctx, "j1"))["state"] == "done"


@pytest.mark.anyio
async def test_a_job_that_starts_while_the_jobs_are_listed_does_not_read_failed() -> None:
    store = MemoryStore()
    ctx = SimpleNamespace(store=ActsAfterRead(store, "job_lock_holder", lambda: _running(store)))
    holder = await ctx.store.job_lock_holder()  # None: the job had not started
    listed = await store.list_jobs(10)
    assert holder is None and [await _as_held(ctx, j, holder) for j in listed] == [RUNNING]


@pytest.mark.anyio
async def test_a_running_job_whose_lock_is_gone_reads_failed() -> None:
    store = MemoryStore()
    await _running(store)
    assert await store.release_job_lock("j1")  # its router stopped: the lock lapsed, no final view
    view = await PublishService(WeightsConfig()).job_view(SimpleNamespace(store=store), "j1")
    assert view == {**RUNNING, "state": "failed", "error": ORPHANED}

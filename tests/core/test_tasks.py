"""``core.tasks.cancel_and_wait``: every task has ended when it returns, whatever each ended with."""

from __future__ import annotations

import asyncio

from core.tasks import cancel_and_wait


def test_every_task_ends_whether_it_loops_fails_on_cancel_or_has_finished() -> None:
    async def scenario() -> list[asyncio.Task]:
        cleaned = asyncio.Event()

        async def loop() -> None:
            while True:
                await asyncio.sleep(0.01)

        async def fails_on_cancel() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                cleaned.set()
                raise RuntimeError("cleanup failed")

        async def done() -> int:
            return 1

        tasks = [asyncio.create_task(c) for c in (loop(), fails_on_cancel(), done())]
        await asyncio.sleep(0.05)  # every task has started; the third has finished
        await cancel_and_wait(tasks)
        assert cleaned.is_set()
        return tasks

    looping, failing, finished = asyncio.run(scenario())
    assert looping.cancelled()
    assert isinstance(failing.exception(), RuntimeError)
    assert finished.result() == 1


def test_no_tasks_is_nothing_to_do() -> None:
    asyncio.run(cancel_and_wait([]))

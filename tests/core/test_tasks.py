"""``core.tasks.cancel_and_wait``: every task has ended when it returns, whatever each ended with."""

from __future__ import annotations

import asyncio
import contextlib

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


def test_a_task_that_lost_a_cancellation_is_cancelled_again() -> None:
    """A loop whose cancellation was lost (as Python 3.11's ``asyncio.wait_for`` loses one that
    lands as its awaitable finishes) runs on; it is cancelled again and ends."""

    async def scenario() -> tuple[asyncio.Task, int]:
        lost = 0

        async def loses_the_first() -> None:
            nonlocal lost
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    lost += 1
                    if lost > 1:
                        raise
                    asyncio.current_task().uncancel()  # the cancellation is lost: the loop goes on

        task = asyncio.create_task(loses_the_first())
        await asyncio.sleep(0.01)
        async with asyncio.timeout(30):
            await cancel_and_wait([task], recancel_s=0.05)
        return task, lost

    task, lost = asyncio.run(scenario())
    assert task.cancelled()
    assert lost == 2


def test_cancelling_the_caller_ends_the_wait_and_leaves_the_tasks_cancelled() -> None:
    async def scenario() -> asyncio.Task:
        async def slow_to_stop() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0.2)  # cleanup that outlasts the caller's patience

        task = asyncio.create_task(slow_to_stop())
        await asyncio.sleep(0.01)
        stopper = asyncio.create_task(cancel_and_wait([task]))
        await asyncio.sleep(0.05)
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
        assert not task.done() and task.cancelling()
        await asyncio.wait([task])
        return task

    assert asyncio.run(scenario()).cancelled()

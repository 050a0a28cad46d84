"""``core.tasks.cancel_and_wait``: every task has ended when it returns, whatever each ended with;
``core.tasks.Interrupt``: a task cancelled from outside, that cancellation taken back."""

from __future__ import annotations

import asyncio
import contextlib

from core.tasks import Interrupt, cancel_and_wait


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


def _interrupted(other_cancels: int, fire_times: int) -> tuple[bool, bool, int]:
    """Run a task that sleeps under an Interrupt fired ``fire_times`` (from a callback) while
    ``other_cancels`` other cancellations land; whether the sleep was cancelled, what ``close``
    answered, and the task's pending cancellations after it."""

    async def body() -> tuple[bool, bool, int]:
        interrupt = Interrupt()
        loop = asyncio.get_running_loop()
        for _ in range(fire_times):
            loop.call_soon(interrupt.fire)
        for _ in range(other_cancels):
            loop.call_soon(asyncio.current_task().cancel)
        cancelled = False
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cancelled = True
        only = interrupt.close()
        assert interrupt.close() == only  # the same answer again; nothing taken back twice
        interrupt.fire()  # closed: cancels nothing
        return cancelled, only, asyncio.current_task().cancelling()

    return asyncio.run(body())


def test_an_interrupt_that_fired_is_taken_back_and_was_the_only_cancellation() -> None:
    assert _interrupted(other_cancels=0, fire_times=1) == (True, True, 0)
    assert _interrupted(other_cancels=0, fire_times=3) == (True, True, 0)  # fires once


def test_an_interrupt_beside_another_cancellation_leaves_that_one_pending() -> None:
    assert _interrupted(other_cancels=1, fire_times=1) == (True, False, 1)


def test_an_interrupt_that_never_fired_takes_nothing_back() -> None:
    assert _interrupted(other_cancels=0, fire_times=0) == (False, False, 0)
    assert _interrupted(other_cancels=1, fire_times=0) == (True, False, 1)


def test_an_interrupt_counts_only_what_came_after_it() -> None:
    """A cancellation already pending when the interrupt was made is not its own."""

    async def body() -> tuple[bool, int]:
        task = asyncio.current_task()
        task.cancel()  # pending, not yet delivered
        interrupt = Interrupt()
        interrupt.fire()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)
        return interrupt.close(), task.cancelling()

    assert asyncio.run(body()) == (True, 1)

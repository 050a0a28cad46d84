"""core.parallel: results in task order, the first error in task order after all tasks ran, the
caller running the last task when asked, and ranges cut evenly."""

from __future__ import annotations

import threading

import pytest
import torch

from core.parallel import Workers, split


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("caller_runs_last", [False, True])
def test_results_in_order_and_where_they_ran(two_threads, caller_runs_last: bool) -> None:
    w = Workers("test-pool", caller_runs_last=caller_runs_last)
    names = w.run([lambda: threading.current_thread().name] * 3)
    on_caller = names[-1] == threading.current_thread().name
    assert on_caller == caller_runs_last
    assert all(n.startswith("test-pool") for n in (names if not caller_runs_last else names[:-1]))
    assert w.run_ranges(10, 4, lambda a, b: (a, b)) == [(0, 4), (4, 8), (8, 10)]
    assert torch.get_num_threads() == 2  # the pool's workers use 1; torch's count stays the caller's


@pytest.mark.parametrize("caller_runs_last", [False, True])
def test_first_error_in_task_order_after_every_task(two_threads, caller_runs_last: bool) -> None:
    done: list[int] = []

    def ok(i: int) -> int:
        done.append(i)
        return i

    def bad(msg: str) -> int:
        raise RuntimeError(msg)

    w = Workers("test-errors", caller_runs_last=caller_runs_last)
    with pytest.raises(RuntimeError, match="first"):
        w.run([lambda: ok(0), lambda: bad("first"), lambda: ok(2), lambda: bad("last")])
    assert sorted(done) == [0, 2]


def test_split_cuts_nearly_equal_non_empty_ranges() -> None:
    assert split(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split(2, 4) == [(0, 1), (1, 2)]

"""The chunk runner: same bytes on 1 or 2 threads, errors propagate, torch's thread settings survive."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.formats import cases
from weight_sync.formats import _common, fp8, mxfp4, nvfp4


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def _all(w: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for d in (fp8.quantize(w), nvfp4.quantize(w), mxfp4.quantize(w)):
        out += [t.reshape(-1).view(torch.uint8) for t in d.values()]
    return out


def test_one_and_two_threads_give_the_same_bytes(monkeypatch, threads):
    monkeypatch.setattr(_common, "CHUNK_ELEMENTS", 2048)
    w = cases.weights((300, 256), torch.bfloat16, seed=31)
    threads(1)
    single = _all(w)
    threads(2)
    double = _all(w)
    assert all(torch.equal(a, b) for a, b in zip(single, double, strict=True))


def test_task_errors_propagate_after_all_tasks_finish(threads):
    threads(2)
    done = []

    def ok(i: int) -> int:
        done.append(i)
        return i

    def bad() -> int:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _common.WORKERS.run([lambda: ok(0), bad, lambda: ok(2), lambda: ok(3)])
    assert sorted(done) == [0, 2, 3]
    assert _common.WORKERS.run_ranges(10, 3, lambda a, b: (a, b)) == [(0, 3), (3, 6), (6, 9), (9, 10)]


@pytest.mark.parametrize("n", [3, 2])
def test_torch_thread_settings_are_left_alone(threads, n):
    threads(n)  # a new count makes a new worker pool, whose workers switch themselves to 1
    workers = _common.WORKERS.run([lambda: torch.get_num_threads()] * 4)
    assert workers == [1] * 4
    assert torch.get_num_threads() == n
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [n]  # a thread started later still gets torch's default


def test_a_forked_child_gets_its_own_workers(threads):
    import multiprocessing

    threads(2)
    w = cases.weights((64, 256), torch.bfloat16, seed=32)
    want = mxfp4.quantize(w)["blocks"]
    _common.WORKERS.run([lambda: None, lambda: None])  # the parent's worker pool exists before the fork
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_quantize_in_child, (w,)).get(timeout=120)
    assert torch.equal(got, want)


def _quantize_in_child(w: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(2)
    old = _common.CHUNK_ELEMENTS
    _common.CHUNK_ELEMENTS = 1024  # several chunks: the child's own pool runs them
    try:
        return mxfp4.quantize(w)["blocks"]
    finally:
        _common.CHUNK_ELEMENTS = old

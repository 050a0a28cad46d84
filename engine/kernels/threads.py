"""Native kernels for the CPU engine: LLVM IR compiled for the host CPU, and a thread splitter.

``compile_ir(ir, name)`` parses and verifies an IR module, compiles it with llvmlite (numba's
code generator, so no C compiler is needed) for the host CPU and its vector extensions, and
returns a handle whose ``function(name, *argtypes)`` gives a ctypes callable. Calls through it
release the GIL, which ``run`` uses to spread one product over ``torch.get_num_threads()``
threads: all parts but the last on a small pool, the last on the calling thread.

Callers decide what to do when compiling fails (no llvmlite, an LLVM too old for the IR): the
kernels here are speed paths with a torch fallback.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
from collections.abc import Callable
from typing import Any

import torch

# Below this many multiply-adds a native call runs on one thread (no hand-off to pool threads).
PARALLEL_MIN_WORK = 4_000_000


class Compiled:
    """A compiled module; keeps the LLVM execution engine (and so the machine code) alive."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def function(self, name: str, *argtypes: Any) -> Callable[..., None]:
        """The module's ``void name(argtypes...)`` as a ctypes function (releases the GIL)."""
        return ctypes.CFUNCTYPE(None, *argtypes)(self._engine.get_function_address(name))


def compile_ir(ir: str) -> Compiled:
    """Compile the IR module ``ir`` for this CPU (raises on any problem)."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    tm = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    mod = llvm.parse_assembly(ir)
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    return Compiled(engine)


def parts(work: int, units: int) -> int:
    """How many threads a call of ``work`` multiply-adds over ``units`` divisible units should use."""
    threads = torch.get_num_threads()
    if threads <= 1 or work < PARALLEL_MIN_WORK:
        return 1
    return max(1, min(threads, units))


def split(n: int, k: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``k`` nearly equal non-empty ranges."""
    bounds = [n * i // k for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if a < b]


_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def run(calls: list[tuple[Callable[..., None], tuple]]) -> None:
    """Run native calls (each releasing the GIL) at once: all but the last on pool threads, the
    last on this thread; returns when all are done."""
    if len(calls) == 1:
        fn, args = calls[0]
        fn(*args)
        return
    workers = len(calls) - 1
    pool = _pools.get(workers)
    if pool is None:
        pool = _pools.setdefault(
            workers, concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="engine-kernel")
        )
    futures = [pool.submit(fn, *args) for fn, args in calls[:-1]]
    fn, args = calls[-1]
    fn(*args)
    for f in futures:
        f.result()

"""Returning a process's free C-heap pages to the system: the one place this is done
(glibc's ``malloc_trim``; :func:`trim`, :func:`trim_every`).

Why a long-running service needs it. glibc's ``free`` gives memory back to the system only
from the top of a heap (or a whole mmapped chunk); and its mmap threshold is dynamic: once a
mmapped chunk is freed, blocks up to that size come from the heap (mallopt(3), M_MMAP_THRESHOLD:
up to 32 MiB on 64-bit systems). A router turn at 128K tokens allocates a few short-lived
buffers of 0.5-1 MB (the context's ids, their JSON text, the engine's request body), each a
little larger than the session's previous turn's, between long-lived objects (stored turn
blocks, contexts): the freed space stays resident, a hole that the next, larger buffers do not
fit. ``malloc_trim(0)`` returns every free whole page of every arena, wherever it lies
(malloc_trim(3): since glibc 2.8), and the next allocation there faults it in again.

Not fixing the threshold instead (``M_MMAP_THRESHOLD``, which also turns the dynamic one off):
every such buffer would then be a fresh mmap, faulted in page by page on every turn, which costs a
long turn more CPU than a trim every few seconds does (figures in the commit that added this).

Where glibc is not the C library (macOS, musl) :func:`trim` does nothing and returns False.
"""

from __future__ import annotations

import asyncio
import ctypes
import platform


def _malloc_trim():
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # pragma: no cover - a glibc without it
        return None
    fn.argtypes = (ctypes.c_size_t,)
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _malloc_trim()
AVAILABLE = _MALLOC_TRIM is not None
"""Whether :func:`trim` can return memory here (the C library is glibc)."""


def trim() -> bool:
    """Return the heap's free whole pages to the system (``malloc_trim(0)``; it takes each
    arena's lock while it runs). True when some memory was returned; False when none was, or
    where glibc is not the C library."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


async def trim_every(period_s: float) -> None:
    """:func:`trim` every ``period_s`` seconds until cancelled, each on a worker thread (ctypes
    releases the GIL for the call, so the event loop runs on meanwhile)."""
    if period_s <= 0:
        raise ValueError(f"period_s must be > 0, got {period_s!r}")
    while True:
        await asyncio.sleep(period_s)
        await asyncio.to_thread(trim)

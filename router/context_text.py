"""The JSON text of each session's engine input, kept so that a turn encodes only what it appends.

SGLang has no append API: every turn sends the engine the session's whole context as JSON
(``input_ids``), and encoding 128K ids is ~0.9 ms of the router's CPU per turn, growing with the
context. :class:`ContextText` keeps, per session, the last whole input this process sent (the
ids and their JSON text). A turn's whole input that starts with those ids (the next turn of the
session: the stored context is the last input and its output, then the new tokens) reuses the
text and encodes only the new tail; anything else (a fork, a session whose turns another router
process served, an evicted entry) is encoded whole. The check is an exact comparison of the ids,
so the text is always that of the input, whatever the store or the other processes did.

The cache holds at most ``max_bytes`` (the ids' bytes and the text's; about 11 bytes per
context token). An entry is dropped by :meth:`ContextText.forget` (its session finished or was
deleted); to make room, entries unused for ``stale_s`` are dropped, least recently used first;
when that is not enough the new entry is not kept. So when more sessions are open than the
bound holds, the sessions already kept keep their entries while they fit (a least-recently-used
rule would drop each one just before its next turn: agents take turns in rounds) and the others
encode their whole inputs, as without the cache. With several router processes on one store an entry helps
only the turns of its session that reach the same process (an agent's keep-alive connection
does).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.jsonio import dumps


class ContextText:
    """Per-process cache of each session's last engine input and its JSON text (module docstring)."""

    def __init__(
        self, max_bytes: int, stale_s: float = 600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stale_s = stale_s
        self.size = 0
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, session_id: str, ids: np.ndarray) -> tuple[bytes, bool]:
        """The JSON text of ``ids`` (a one-dimensional integer array) as a list: ``dumps(ids)``
        byte for byte, built from the session's cached text when ``ids`` starts with its cached
        ids (then True: reused); ``ids`` and the text then become the session's entry, if the
        bound allows."""
        entry = self._pop(session_id)
        text = _extend(entry, ids) if entry is not None else None
        reused = text is not None
        if text is None:
            text = dumps(ids)
        self._keep(session_id, _Entry(ids, text, self._clock()))
        return text, reused

    def forget(self, session_id: str) -> None:
        """Drop the session's entry (its session finished or was deleted), if any."""
        self._pop(session_id)

    def _pop(self, session_id: str) -> _Entry | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.size -= entry.nbytes
        return entry

    def _keep(self, session_id: str, entry: _Entry) -> None:
        """Keep ``entry``, dropping stale entries (least recently used first) to make room; not
        kept when that is not enough."""
        stale = entry.used - self.stale_s
        while self.size + entry.nbytes > self.max_bytes and self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest].used > stale:
                break
            self._pop(oldest)
        if self.size + entry.nbytes <= self.max_bytes:
            self._entries[session_id] = entry
            self.size += entry.nbytes


@dataclass(frozen=True)
class _Entry:
    ids: np.ndarray
    text: bytes
    used: float

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + len(self.text)


def _extend(entry: _Entry, ids: np.ndarray) -> bytes | None:
    """The text of ``ids`` from ``entry`` when ``ids`` extends its ids; None when it does not."""
    n = len(entry.ids)
    if n == 0 or len(ids) < n or not np.array_equal(ids[:n], entry.ids):
        return None
    if len(ids) == n:
        return entry.text
    return b"".join((entry.text[:-1], b",", dumps(ids[n:])[1:]))

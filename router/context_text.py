"""Each session's last engine input, kept so that a turn encodes and reads only what it appends.

Every turn sends the engine the session's whole context as JSON (``input_ids``: a stateless
``/generate``; SGLang's sessions, which would keep it on the engine, pin its KV or copy it every
turn: ``docs/sglang-contract.md``), and encoding the ids costs CPU in proportion to the context.
:class:`ContextText` keeps, per session, the last whole input this process sent (the ids and
their JSON text). A turn's whole input that starts with those ids (the next turn of the session:
the stored context is the last input and its output, then the new tokens) reuses the text and
encodes only the new tail; anything else (a fork, a session whose turns another router process
served, an evicted entry) is encoded whole. The check is an exact comparison of the ids, so the
text is always that of the input, whatever the store or the other processes did.

Once that input's turn is stored (:meth:`ContextText.stored`), the entry also knows the context
the turn left in the state store (the whole input, then the output: an extension appends to a
stored context that is the input's prefix, a fork starts its segment with the whole input) and
after how many turns (:meth:`ContextText.known`). The next turn then reads the store's context
only when the session's ``n_turns`` moved on since (``known_turns`` of
:meth:`~router.state.base.StateStore.get_session_context`: a context after a given number of
turns never changes, and session ids are never reused), so a turn at 128K tokens does not read
512 KB back from Redis.

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
from dataclasses import dataclass, replace

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

    def stored(self, session_id: str, ids: np.ndarray, turns: int, output_ids: np.ndarray) -> None:
        """The turn whose whole input was ``ids`` (the very array :meth:`encode` was last given for
        the session; else nothing is noted) is stored: after ``turns`` turns the session's context
        is ``ids`` then ``output_ids``."""
        entry = self._entries.get(session_id)
        if entry is not None and entry.ids is ids:
            self._pop(session_id)
            self._keep(session_id, replace(entry, turns=turns, output=output_ids))

    def known(self, session_id: str) -> tuple[int, np.ndarray] | None:
        """The number of turns and the context they left (uint32) noted by :meth:`stored`, if the
        session's entry has them."""
        entry = self._entries.get(session_id)
        if entry is None or entry.turns is None or entry.output is None:
            return None
        return entry.turns, np.concatenate((entry.ids, entry.output))

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
    turns: int | None = None  # once stored: the session's turns then, and the turn's output ids
    output: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + len(self.text) + (0 if self.output is None else self.output.nbytes)


def _extend(entry: _Entry, ids: np.ndarray) -> bytes | None:
    """The text of ``ids`` from ``entry`` when ``ids`` extends its ids; None when it does not."""
    n = len(entry.ids)
    if n == 0 or len(ids) < n or not np.array_equal(ids[:n], entry.ids):
        return None
    if len(ids) == n:
        return entry.text
    return b"".join((memoryview(entry.text)[:-1], b",", dumps(ids[n:])[1:]))  # the cached text uncopied

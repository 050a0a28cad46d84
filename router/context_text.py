"""The JSON text of each session's engine input, kept so that a turn encodes only what it appends.

SGLang has no append API: every turn sends the engine the session's whole context as JSON
(``input_ids``), and encoding 128K ids is ~0.9 ms of the router's CPU per turn, growing with the
context. :class:`ContextText` keeps, per session, the last whole input this process sent (the
ids and their JSON text). A turn's whole input that starts with those ids (the next turn of the
session: the stored context is the last input and its output, then the new tokens) reuses the
text and encodes only the new tail; anything else (a fork, a session whose turns another router
process served, an evicted entry) is encoded whole. The check is an exact comparison of the ids,
so the text is always that of the input, whatever the store or the other processes did.

Entries are evicted least recently used beyond ``max_bytes`` (the ids' bytes and the text's;
about 11 bytes per context token) and dropped by :meth:`ContextText.forget`. With several router
processes on one store an entry helps only the turns of its session that reach the same process
(an agent's keep-alive connection does).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from core.jsonio import dumps


class ContextText:
    """Per-process cache of each session's last engine input and its JSON text (module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, tuple[np.ndarray, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, session_id: str, ids: np.ndarray) -> bytes:
        """The JSON text of ``ids`` (a one-dimensional integer array) as a list: ``dumps(ids)``
        byte for byte, built from the session's cached text when ``ids`` starts with its cached
        ids; ``ids`` and the text then become the session's entry."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.size -= _nbytes(entry)
        text = _extend(entry, ids) if entry is not None else None
        if text is None:
            text = dumps(ids)
        entry = (ids, text)
        if _nbytes(entry) <= self.max_bytes:
            self._entries[session_id] = entry
            self.size += _nbytes(entry)
            while self.size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.size -= _nbytes(old)
        return text

    def forget(self, session_id: str) -> None:
        """Drop the session's entry (its session finished or was deleted), if any."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.size -= _nbytes(entry)


def _extend(entry: tuple[np.ndarray, bytes], ids: np.ndarray) -> bytes | None:
    """The text of ``ids`` from ``entry`` (cached ids and their text) when ``ids`` extends the
    cached ids; None when it does not."""
    have, text = entry
    n = len(have)
    if n == 0 or len(ids) < n or not np.array_equal(ids[:n], have):
        return None
    if len(ids) == n:
        return text
    return b"".join((text[:-1], b",", dumps(ids[n:])[1:]))


def _nbytes(entry: tuple[np.ndarray, bytes]) -> int:
    return entry[0].nbytes + len(entry[1])

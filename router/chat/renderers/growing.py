"""A text that grows only at its end, read near its end in time independent of its length: the
decoded text of a reply being sampled (:class:`router.chat.renderers.qwen3.ReplyScan`).

:class:`GrowingText` keeps the text in blocks of about :data:`BLOCK` characters (a piece longer
than that is one block of its own), so appending a piece costs O(piece + BLOCK) and reading a span
O(span + BLOCK + log blocks), where rebuilding one ``str`` would copy the whole text each time.
For the ends of the parts of a reply it also answers where the last character not in a set comes
before a position (:meth:`GrowingText.last_not`, from a running index kept per block) and the
first from a position on (:meth:`GrowingText.first_not`, resumed where the last asking stopped):
what ``str.strip`` needs without scanning a run of whitespace again for each token.
"""

from __future__ import annotations

import bisect

BLOCK = 1024
"""Characters a block holds before the next piece starts a new one."""

WHITESPACE = None
"""The set of characters ``str.strip()`` removes with no argument (``str.isspace``)."""

STRIPPED = ("\n", WHITESPACE)
"""The sets :meth:`GrowingText.last_not` and :meth:`GrowingText.first_not` answer for."""


class GrowingText:
    """A text, ``text`` to start with, grown by :meth:`append`; ``len`` and slicing with
    ``[start:stop]`` (no step, indices in range) read it as the ``str`` it stands for."""

    def __init__(self, text: str = "") -> None:
        self.blocks: list[str] = []
        self.starts: list[int] = []  # the index in the text of each block's first character
        self.size = 0
        # per set of STRIPPED: the index of the last character not in it up to each block's end
        self.last: dict[str | None, list[int]] = {chars: [] for chars in STRIPPED}
        self.first: dict[tuple[str | None, int], tuple[int, int]] = {}  # first_not's found / scanned
        if text:
            self.append(text)

    def __len__(self) -> int:
        return self.size

    def append(self, piece: str) -> None:
        if not piece:
            return
        grow = bool(self.blocks) and len(self.blocks[-1]) + len(piece) <= BLOCK
        if grow:
            self.blocks[-1] += piece
        else:
            self.blocks.append(piece)
            self.starts.append(self.size)
        for chars, last in self.last.items():
            kept = len(piece.rstrip(chars))
            at = self.size + kept - 1 if kept else (last[-1] if last else -1)
            if grow:
                last[-1] = at
            else:
                last.append(at)
        self.size += len(piece)

    def __getitem__(self, span: slice) -> str:
        start, stop = span.start or 0, self.size if span.stop is None else span.stop
        if start >= stop:
            return ""
        at = self.starts[-1]
        if start >= at:  # within the last block: the common case, reading near the end
            return self.blocks[-1][start - at : stop - at]
        k = bisect.bisect_right(self.starts, start) - 1
        pieces = []
        while k < len(self.blocks) and self.starts[k] < stop:
            at = self.starts[k]
            pieces.append(self.blocks[k][max(start - at, 0) : stop - at])
            k += 1
        return "".join(pieces)

    def last_not(self, chars: str | None, stop: int) -> int:
        """The index of the last character before ``stop`` not in ``chars`` (a set of
        :data:`STRIPPED`), else -1."""
        if stop <= 0:
            return -1
        k = len(self.starts) - 1
        if stop <= self.starts[k]:
            k = bisect.bisect_right(self.starts, stop - 1) - 1
        kept = len(self.blocks[k][: stop - self.starts[k]].rstrip(chars))
        if kept:
            return self.starts[k] + kept - 1
        return self.last[chars][k - 1] if k else -1

    def first_not(self, chars: str | None, start: int, stop: int) -> int:
        """The index of the first character in ``[start, stop)`` not in ``chars`` (a set of
        :data:`STRIPPED`), else ``stop``. Each (``chars``, ``start``) resumes the scan where its
        last asking stopped: the text before the end does not change."""
        found, scanned = self.first.get((chars, start), (-1, start))
        if found < 0 and scanned < self.size:
            rest = self[scanned:]
            kept = len(rest.lstrip(chars))
            found, scanned = (self.size - kept if kept else -1), self.size
            self.first[(chars, start)] = (found, scanned)
        return stop if found < 0 else min(found, stop)

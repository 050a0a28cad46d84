"""The result of one validation level for one group (every level module returns one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NAMES = {
    1: "precision contract",
    2: "quantizer and converter",
    3: "one operator",
    4: "fixed-prefix scoring",
    5: "routes and request state",
    6: "live update",
}


@dataclass(frozen=True)
class LevelResult:
    """``ok``: True passed, False failed; ``summary`` one line; ``failures`` one line each naming
    what failed; ``notes`` what the level could not run and why (not failures); ``details`` the
    figures (JSON-able), ``plot`` the series the HTML page plots (JSON-able)."""

    level: int
    ok: bool
    summary: str
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    plot: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def checked(
        cls,
        level: int,
        summary: str,
        failures: list[str] | tuple[str, ...],
        notes: list[str] | tuple[str, ...] = (),
        **figures: dict[str, Any],
    ) -> LevelResult:
        """The level's result: passed when nothing failed; a failed level's summary is its count of
        failures and the first one (``summary`` describes a level that passed)."""
        if failures:
            summary = f"{len(failures)} problem(s): {failures[0]}"
        return cls(level, not failures, summary, tuple(failures), tuple(notes), **figures)

    @property
    def name(self) -> str:
        return NAMES[self.level]

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "name": self.name,
            "ok": self.ok,
            "summary": self.summary,
            "failures": list(self.failures),
            "notes": list(self.notes),
            "details": self.details,
            "plot": self.plot,
        }

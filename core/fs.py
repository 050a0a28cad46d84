"""Directories a command or service writes into, made or refused in one line."""

from __future__ import annotations

from pathlib import Path

from core.errors import UserError


def make_dir(path: Path, what: str) -> Path:
    """``path``, made a directory (with its parents) if it is none yet. Raises ``UserError`` naming
    it as ``what`` (a flag, "store") when it cannot be one: a file there or above it, no
    permission, a read-only filesystem."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "not a directory" if isinstance(exc, FileExistsError | NotADirectoryError) else exc.strerror
        raise UserError(f"{what} {path}: {why}") from None
    return path

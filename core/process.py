"""Whether a process exists, by its pid (the one place this is asked)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0): a zombie, dead but not reaped, does; so does
    someone else's process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True

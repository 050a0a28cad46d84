"""A deleter for the fault tests: deletes one committed version, pausing at every store step.

``python -m tests.weight_sync.deleter ROOT VERSION ADAPTER CONTAINER`` deletes version VERSION of
:data:`tests.weight_sync.publisher.STREAM`, printing each step the store reports (``trashed``,
``trash_committed``, ...) and waiting for a line ``go`` on stdin before going on, so a test can
SIGKILL it at an exact point; it prints ``done`` at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.weight_sync.publisher import STREAM, open_store


def main(argv: list[str]) -> int:
    root, version, adapter, container = argv

    def step(name: str) -> None:
        print(name, flush=True)
        if sys.stdin.readline().strip() != "go":
            sys.exit(3)

    open_store(Path(root), adapter, container, step).delete(STREAM.at(int(version)))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``python -m tests.deploy.pinned_router LISTING ARGS...``: the ``mixfleet`` command (ARGS, e.g.
``router --modal-app mixfleet ...``) in a process where the one call that asks Modal for a server's
containers, :meth:`router.pinning.modal_server.ModalServerContainers.list_containers`, answers
from the JSON file LISTING (``{"<server>": [{"container_id": ..., "host": ..., "port": ...}]}``,
read again on every call, so a test changes what Modal lists) with the installed client's own
``modal.types.ServerContainerInfo`` values. Everything else is the real router."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from modal.types import ServerContainerInfo

from router.pinning.modal_server import ModalServerContainers


def listing_from(path: Path):
    async def list_containers(self: ModalServerContainers, name: str) -> list[Any]:
        listed = json.loads(path.read_text()) if path.exists() else {}
        return [ServerContainerInfo(**c) for c in listed.get(name, [])]

    return list_containers


def main(argv: list[str]) -> int:
    ModalServerContainers.list_containers = listing_from(Path(argv[0]))  # type: ignore[method-assign]
    from mixfleet.cli import main as mixfleet

    return mixfleet(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

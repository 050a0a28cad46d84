"""A progress bar for the trainer kit's long phases (tqdm, on stderr)."""

from __future__ import annotations

from typing import Any


class Progress:
    """A progress bar over ``total`` steps; ``update`` shows named values; ``enabled`` False shows
    nothing."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)

    def update(self, **values: Any) -> None:
        self.bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in values.items()})
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

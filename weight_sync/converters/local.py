"""The local converter: publications run in this process, their conversions in a pool of worker
processes kept across publications (:class:`weight_sync.publish.ConversionPool`).

The pool is made by :meth:`LocalConverter.start_pool` (``workers`` processes when given, else
one per core and at least one per format; none with ``workers=0``: conversions then run in this
process, one format at a time) and stopped by :meth:`LocalConverter.close`, which joins its
workers: after ``close`` no worker process and no semaphore of the pool is left.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

from weight_sync.converters.base import Converter, ConvertRequest
from weight_sync.publish import ConversionPool, Event, no_events
from weight_sync.store.base import VersionStore


class LocalConverter(Converter):
    """Publications in this process (see the module docstring). Thread-safe."""

    name = "local"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers
        self.pool: ConversionPool | None = None
        self._lock = threading.Lock()
        self._warmer: threading.Thread | None = None

    def start(self, formats: int) -> None:
        """Start the pool's workers and load the converter in them, in the background."""
        self.start_pool(formats, warm=True)

    def start_pool(self, formats: int, *, warm: bool = True) -> ConversionPool | None:
        """The conversion pool, made on first call (``warm``: its workers start and load the
        converter in the background): ``workers`` processes when given, else
        :meth:`ConversionPool.for_formats` of ``formats``. ``None`` when ``workers`` is 0."""
        if self.workers == 0:
            return None
        with self._lock:
            if self.pool is None:
                self.pool = (
                    ConversionPool(self.workers)
                    if self.workers is not None
                    else ConversionPool.for_formats(formats)
                )
                if warm:
                    self._warmer = threading.Thread(
                        target=_warm, args=(self.pool,), name="conversion-warmup", daemon=True
                    )
                    self._warmer.start()
            return self.pool

    def publish_kwargs(self, formats: int) -> dict[str, Any]:
        """The publisher's pool arguments: the kept pool, or ``workers=0`` without one."""
        pool = self.start_pool(formats, warm=False)  # the publish starts the workers itself
        return {"conversion_pool": pool} if pool is not None else {"workers": 0}

    def publish(
        self, store: VersionStore, request: ConvertRequest, on_event: Event = no_events
    ) -> dict[str, Any]:
        from weight_sync.publish import publish_checkpoint, publish_delta

        kwargs = {"mode": request.mode, **self.publish_kwargs(len(request.formats)), "on_event": on_event}
        r = request
        checkpoint = Path(r.checkpoint)
        if r.delta_of is not None:
            result = publish_delta(store, r.run_id, r.version, checkpoint, r.delta_of, r.formats, **kwargs)
        else:
            result = publish_checkpoint(store, r.run_id, r.version, checkpoint, r.formats, **kwargs)
        return result.to_dict()

    def close(self) -> None:
        """Stop the pool and join its workers; a conversion still running (a publication's or
        the warm-up's) is killed, which the publication protocol survives (no pointer names an
        incomplete version). Blocking; idempotent."""
        with self._lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.close(terminate=True)
        if self._warmer is not None:
            self._warmer.join(timeout=30)
            self._warmer = None


def _warm(pool: ConversionPool) -> None:
    with contextlib.suppress(Exception):  # a pool closed while it warms up
        pool.warm()


__all__ = ["LocalConverter"]

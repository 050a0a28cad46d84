"""A replica's reconciler stops on its first cancellation even when a wake lands in the same
event-loop tick as the stop (a publish notice arriving with SIGTERM). Python 3.11's
``asyncio.wait_for`` loses such a cancellation (CPython gh-86296; a loop waiting with it runs on),
so the loops wait with ``asyncio.timeout`` (``core/tasks.py``)."""

from __future__ import annotations

import asyncio

from clients.engine import SGLangClient, make_http_client
from replica.reconciler import Reconciler, ReconcileSettings
from weight_sync.store.local import LocalStore


def test_stop_ends_every_loop_on_the_first_cancellation_when_woken_in_the_same_tick(tmp_path) -> None:
    settings = ReconcileSettings(
        group="cpu-bf16",
        weight_format="bf16",
        run_id="run",
        replica_id="r0",
        advertise_url="http://127.0.0.1:1",
        staging_dir=tmp_path / "stage",
        poll_s=1.0,
        heartbeat_s=1.0,
    )

    async def scenario() -> list[asyncio.Task]:
        http = make_http_client(timeout_s=5)
        rec = Reconciler(settings, LocalStore(tmp_path / "store"))
        try:
            await rec.start(SGLangClient(http, "http://127.0.0.1:1"))  # no engine: its loops keep waiting
            await asyncio.sleep(0.3)  # the watch loop has read the (absent) pointer and waits for a wake
            tasks = list(rec._tasks)
            rec.wake()
            async with asyncio.timeout(30):
                await rec.stop()  # in the tick of the wake
            return tasks
        finally:
            await http.close()

    tasks = asyncio.run(scenario())
    assert [t.get_name() for t in tasks] == ["watch", "reconcile", "engine"]
    assert all(t.cancelled() for t in tasks)
    assert [t.cancelling() for t in tasks] == [1, 1, 1], "a loop outlived its first cancellation"

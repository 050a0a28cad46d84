"""A replica's weight sync on a Modal Volume store, under Modal's rules (the stand-in volume).

The replica's container stages version 0 from the volume to its own disk and a real local engine
serves that copy; the reconciler (the sidecar's, in this process) watches the pointer on the
volume every 0.1 s while a publisher in another container commits version 1. The replica sees
version 1 only through reloads, stages it from the volume while its pointer reads go on (each
read skips the reload while a file of the volume is open here, so none fails), and activates it.
Every reload passed the stand-in's check of every process of the machine, the engine included:
the engine never held a file of the volume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from clients.engine import SGLangClient, make_http_client
from replica.reconciler import Reconciler, ReconcileSettings
from tests.support.engines import engine_process
from tests.support.models import make_model_dir
from tests.support.volume import open_file_under, volume_store
from weight_sync.publish import publish_checkpoint
from weight_sync.stage import stage_version
from weight_sync.types import FormatRef

RUN, FMT = "run", "bf16"
STREAM = FormatRef(RUN, FMT)


@pytest.mark.timeout(300)
def test_reconciler_activates_a_version_published_to_the_volume(tmp_path, caplog) -> None:
    models = tmp_path / "models"
    base, trained = make_model_dir(models, "tiny", FMT), make_model_dir(models, "tiny", FMT, seed=2)
    publisher = volume_store(tmp_path, "publisher")
    publish_checkpoint(publisher, RUN, 0, base, [FMT], workers=0)

    replica = volume_store(tmp_path, "replica")
    stage = tmp_path / "replica" / "local-disk"
    staged = stage_version(replica, STREAM.at(replica.read_pointer(STREAM)), stage)
    assert staged.version == 0 and replica.mount not in staged.path.parents
    settings = ReconcileSettings(
        group="cpu-bf16",
        weight_format=FMT,
        run_id=RUN,
        replica_id="r0",
        advertise_url="http://127.0.0.1:1",
        staging_dir=stage,
        stage_rate_bytes_per_s=2e6,  # staging v1 takes over a second: pointer reads overlap it
        poll_s=0.1,
        heartbeat_s=0.2,
        backoff_initial_s=0.2,
        backoff_max_s=1.0,
    )

    async def scenario(engine_url: str) -> Reconciler:
        http = make_http_client(timeout_s=60)
        rec = Reconciler(settings, replica)
        try:
            await rec.start(SGLangClient(http, engine_url))
            deadline = time.monotonic() + 60
            while not (rec.state.ready and rec.state.active_version == 0):
                assert time.monotonic() < deadline, rec.status()
                await asyncio.sleep(0.05)
            await asyncio.to_thread(publish_checkpoint, publisher, RUN, 1, trained, [FMT], workers=0)
            deadline = time.monotonic() + 120
            while rec.state.active_version != 1:
                assert time.monotonic() < deadline, rec.status()
                await asyncio.sleep(0.05)
            while sorted(p.name for p in stage.iterdir()) != ["v000001"]:  # removed after activating
                assert time.monotonic() < deadline, sorted(p.name for p in stage.iterdir())
                await asyncio.sleep(0.05)
            info = await rec.engine.model_info()
            assert Path(info["model_path"]) == (stage / "v000001").resolve(), info
            return rec
        finally:
            await rec.stop()
            await http.close()

    with (
        caplog.at_level(logging.WARNING, logger="mixfleet.sidecar"),
        engine_process(staged.path, weight_version=0) as engine_url,
    ):
        rec = asyncio.run(scenario(engine_url))
    assert rec.state.error is None and rec.state.failures == 0, rec.status()
    assert [a.version for a in rec.state.activations] == [1]
    assert rec.state.activations[0].stage_s > 1.0  # ~10 pointer reads while a volume file was open
    assert not [r.getMessage() for r in caplog.records], "no pointer read or activation failed"
    assert replica.volume.events.count("reload") >= 3  # before staging v0, then polls
    assert "commit" not in replica.volume.events, "a replica never writes to the volume"
    assert open_file_under(replica.mount) is None
    assert sorted(p.name for p in stage.iterdir()) == ["v000001"]

"""A turn in flight survives an activation whose engine answers ``/health`` as SGLang 0.5.23 does.

SGLang's ``/health`` sends a one-token generation and answers once any scheduler output arrived
after it started (entrypoints/http_server.py 721-799): while the sidecar has generation paused
for an activation, and while the engine loads the new weights, it does not answer. The local
engine answers ``/health`` at once even then, so a front proxy stands in for that part: it
passes everything to a real local engine, holds ``/health`` from ``/pause_generation`` until
``/continue_generation``, and holds ``/update_weights_from_disk`` ``LOAD_S`` seconds (a model
that takes that long to load). The sidecar (a real ``mixfleet sidecar`` process, heartbeating to
a real router whose ``--heartbeat-timeout`` is shorter than the activation) must keep its
replica ready through the activation: the router then keeps the turn running on it (no failover,
nothing abandoned), and the turn comes back with two version spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from tests.support.engines import engine_process
from tests.support.metrics import samples_of
from tests.support.procs import free_port, mixfleet_argv, process, wait_started
from tests.support.recorder import forward, serve_in_thread
from tests.support.router import router_process, write_preset
from weight_sync.convert import convert_checkpoint
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore
from weight_sync.types import VersionRef

RUN = "run"
LOAD_S = 4.0  # longer than the router's heartbeat timeout below
HELLO = [72, 101, 108, 108, 111]  # greedy decoding of tiny from here runs >1000 tokens without EOS
N = 1000


@dataclass
class PausingHealthFront:
    """A pass-through proxy of ``upstream`` whose ``/health`` is held while generation is paused
    (until ``/continue_generation``, at most 20 s, then 503 as SGLang answers), whose
    ``/update_weights_from_disk`` reaches the engine ``load_s`` late, and which notes when a
    ``/generate`` arrived (``generating``)."""

    upstream: str
    load_s: float
    paused: bool = False
    generating: threading.Event = field(default_factory=threading.Event)

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/health":
            for _ in range(400):
                if not self.paused:
                    break
                await asyncio.sleep(0.05)
            else:
                return web.Response(status=503)
        elif request.path == "/update_weights_from_disk":
            await asyncio.sleep(self.load_s)
        elif request.path == "/generate":
            self.generating.set()
        answer = await forward(self.upstream, request, await request.read())
        if request.path == "/pause_generation":
            self.paused = True
        elif request.path == "/continue_generation":
            self.paused = False
        return answer


@contextlib.contextmanager
def _sidecar(engine_url: str, store: Path, router_url: str, key: str, work: Path) -> Iterator[str]:
    port = free_port()
    argv = mixfleet_argv(
        "sidecar", "--engine", engine_url, "--group", "cpu", "--format", "bf16", "--store", str(store),
        "--run", RUN, "--port", str(port), "--router", router_url, "--replica-id", "cpu-0",
        "--staging-dir", str(work / "staging"), "--stage-mode", "inplace", "--poll-s", "0.2",
        "--heartbeat-s", "0.5",
    )  # fmt: skip
    log = work / "sidecar.log"
    with process(argv, log=log, env={"MIXFLEET_API_KEY": key}) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_started("sidecar", url, "/health", proc, log, 120)
        yield url


def _ready(router, group: str = "cpu") -> bool:
    groups = httpx.get(router.url + "/v1/groups", headers=router.headers, timeout=10).json()["groups"]
    return next(g for g in groups if g["name"] == group)["ready_replicas"] == 1


@pytest.mark.timeout(180)
def test_a_turn_survives_an_activation_during_which_the_engine_does_not_answer_health(
    tmp_path: Path, tiny_base: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    publish_checkpoint(store, RUN, 1, tiny_base, ["bf16"], workers=0)
    v2 = VersionRef(RUN, "bf16", 2)
    staged = store.staging_dir(v2)
    convert_checkpoint(tiny_base, staged, "bf16", workers=1)  # the same weights: the same tokens
    store.commit(v2, staged)
    model = store.version_dir(VersionRef(RUN, "bf16", 1))
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "weight_format": "bf16"}])
    with engine_process(model, weight_version=1) as engine:
        front = PausingHealthFront(engine, LOAD_S)
        _run_turn_across_an_activation(front, store, v2, preset, tmp_path)


def _run_turn_across_an_activation(
    front: PausingHealthFront, store: LocalStore, v2: VersionRef, preset: Path, tmp_path: Path
) -> None:
    with (
        serve_in_thread(front.handle, "pausing-health") as front_url,
        router_process(preset, extra_args=("--heartbeat-timeout", "2")) as router,
        _sidecar(front_url, store.root, router.url, router.key, tmp_path),
        httpx.Client(base_url=router.url, headers=router.headers, timeout=120) as c,
    ):
        deadline = time.monotonic() + 60
        while not _ready(router):
            assert time.monotonic() < deadline, "the replica never joined"
            time.sleep(0.2)
        sid = c.post("/v1/sessions", json={"group": "cpu"}).json()["session_id"]
        answer: dict = {}
        body = {"input_ids": HELLO, "sampling_params": {"max_new_tokens": N, "temperature": 0.0}}
        turn = threading.Thread(
            target=lambda: answer.update(r=c.post(f"/v1/sessions/{sid}/turns", json=body))
        )
        turn.start()
        assert front.generating.wait(30), "the turn never reached the engine"
        time.sleep(0.2)
        store.advance(v2)  # the sidecar activates version 2 while the turn runs
        turn.join(timeout=120)
        r = answer["r"]
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["group"], out["moved_from"], out["timings"]["attempts"]) == ("cpu", None, 1)
        assert [s["version"] for s in out["weight_versions"]] == [1, 2], out["weight_versions"]
        assert len(out["output_ids"]) == N
        samples = samples_of(c.get("/metrics").text)
        assert samples[("mixfleet_router_failovers_total", (("group", "cpu"), ("reason", "lost")))] == 0
        assert _ready(router)

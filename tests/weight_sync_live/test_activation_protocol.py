"""Which activation protocol a sidecar runs by default (``--activation auto``).

SGLang cannot run here, so a stand-in speaks the part of its HTTP API a sidecar uses (health,
``/model_info``, ``/server_info``, ``/pause_generation``, ``/update_weights_from_disk``,
``/continue_generation``, ``/metrics``) and records the control calls. The sidecar is the real
``mixfleet sidecar`` process on a real store. An engine whose ``/server_info`` says nothing of
how it updates (upstream SGLang) must be paused around the update, in that order; one that
says ``"weight_update": "swap_between_steps"`` (the local engine, tested live in
``test_fleet.py``) is updated without a pause.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.support.procs import free_port, mixfleet_argv, process, wait_http
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

CONTROL = ("/pause_generation", "/update_weights_from_disk", "/continue_generation")


class StandInEngine:
    """An HTTP server answering as an SGLang server would, recording control calls in order."""

    def __init__(self, weight_version: int, weight_update: str | None) -> None:
        self.version = weight_version
        self.weight_update = weight_update
        self.calls: list[str] = []
        self.paused = False
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: object, ctype: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._send(200, {})
                elif self.path in ("/model_info", "/get_model_info"):
                    self._send(200, {"model_path": "stand-in", "weight_version": str(engine.version)})
                elif self.path in ("/server_info", "/get_server_info"):
                    info = {"model_path": "stand-in", "weight_version": str(engine.version)}
                    if engine.weight_update is not None:
                        info["weight_update"] = engine.weight_update
                    self._send(200, info)
                elif self.path == "/metrics":
                    self._send(200, "sglang:num_running_reqs 0\n", "text/plain")
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path not in CONTROL:
                    self._send(404, {"error": {"message": "not found"}})
                    return
                engine.calls.append(self.path)
                if self.path == "/pause_generation":
                    engine.paused = True
                elif self.path == "/continue_generation":
                    engine.paused = False
                else:
                    engine.version = int(body["weight_version"])
                    assert Path(body["model_path"]).is_dir()
                    self._send(200, {"success": True, "message": "updated"})
                    return
                self._send(200, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_base: Path, tiny_seed2: Path) -> LocalStore:
    s = LocalStore(tmp_path_factory.mktemp("activation-store"))
    publish_checkpoint(s, "run", 1, tiny_base, ["bf16"], workers=0)
    return s


def _updated_by_sidecar(
    store: LocalStore, work: Path, weight_update: str | None, tiny_seed2: Path
) -> tuple[list[str], dict]:
    """Run a sidecar (default activation) before a stand-in engine, publish the next version,
    wait until the sidecar reports it active; return the engine's control calls after the
    sidecar's start-up ``/continue_generation`` (which resumes an engine a predecessor may have
    left paused) and the sidecar's last activation."""
    engine = StandInEngine(store.read_pointer(FormatRef("run", "bf16")), weight_update)
    port = free_port()
    argv = mixfleet_argv(
        "sidecar", "--engine", engine.url, "--group", "g", "--format", "bf16", "--store", str(store.root),
        "--run", "run", "--port", str(port), "--replica-id", "g-0", "--staging-dir", str(work / "staging"),
        "--stage-mode", "inplace", "--poll-s", "0.2", "--heartbeat-s", "0.5",
    )  # fmt: skip
    try:
        with process(argv, log=work / "sidecar.log") as proc:
            wait_http(f"http://127.0.0.1:{port}/v1/status", timeout=60, proc=proc)
            target = store.read_pointer(FormatRef("run", "bf16")) + 1
            publish_checkpoint(store, "run", target, tiny_seed2, ["bf16"], workers=0)
            deadline = time.monotonic() + 60
            while True:
                st = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).json()
                if st["active_version"] == target:
                    break
                assert time.monotonic() < deadline, (st, (work / "sidecar.log").read_text()[-2000:])
                time.sleep(0.1)
            assert engine.calls[0] == "/continue_generation", engine.calls
            return engine.calls[1:], st["last_activation"]
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_auto_pauses_an_engine_that_does_not_swap(
    store: LocalStore, tmp_path: Path, tiny_seed2: Path
) -> None:
    calls, act = _updated_by_sidecar(store, tmp_path, None, tiny_seed2)
    assert calls == list(CONTROL), calls
    assert act["pause_s"] > 0


@pytest.mark.timeout(120)
def test_auto_does_not_pause_an_engine_that_swaps(
    store: LocalStore, tmp_path: Path, tiny_seed2: Path
) -> None:
    calls, act = _updated_by_sidecar(store, tmp_path, "swap_between_steps", tiny_seed2)
    assert calls == ["/update_weights_from_disk"], calls
    assert act["pause_s"] == 0

"""The activation protocol a sidecar runs, call by call, against SGLang's answers.

SGLang cannot run here, so a stand-in speaks the part of its 0.5.23 HTTP API a sidecar uses
(health, ``/model_info``, ``/server_info``, ``/metrics``, ``/pause_generation``,
``/update_weights_from_disk``, ``/flush_cache``, ``/update_weight_version``,
``/continue_generation``) and records the control calls with their bodies. The sidecar is the
real ``mixfleet sidecar`` process on a real store. Checked: the one protocol (retract -> update
with the format's request -> continue), and the recovery SGLang's answers call for when an update
swapped the weights but its flush was refused (``success: false`` "Weights were updated, but the
cache was not flushed", 400; ``/model_info`` still on the old version): flush while paused, then
``/update_weight_version``, never a second load, the engine never left paused. That answer cannot
be provoked on the local engine after a retract (its running batch is then empty), which is why
this stand-in exists; the local engine refuses the in_place protocol the same way
(tests/engine/test_control.py).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from core.sglang_release import (
    FLUSH_OK_TEXT,
    FLUSH_REFUSED_TEXT,
    UPDATE_NOT_FLUSHED_MESSAGE,
    update_weights_request,
)
from tests.support.procs import free_port, mixfleet_argv, process, wait_http
from weight_sync.publish import publish_checkpoint
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef

CONTROL = (
    "/pause_generation",
    "/update_weights_from_disk",
    "/flush_cache",
    "/update_weight_version",
    "/continue_generation",
)


class _QuietServer(ThreadingHTTPServer):
    """The stand-in's server: a client that left mid-answer (a sidecar stopping while it polls
    health) is not a traceback on the test run's output (``socketserver.BaseServer.handle_error``)."""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StandInEngine:
    """An HTTP server answering as SGLang 0.5.23 does, recording control calls and bodies in order.

    ``/model_info`` names the tokenizer manager's version, which moves only on a successful
    update or ``/update_weight_version``; ``not_flushed`` updates are answered as SGLang answers an
    update whose flush the scheduler refused, and ``flush_refusals`` ``/flush_cache`` calls are
    refused before one succeeds."""

    def __init__(self, weight_version: int, *, not_flushed: int = 0, flush_refusals: int = 0) -> None:
        self.version = weight_version  # what /model_info reports
        self.scheduler_version = weight_version  # what new tokens would carry
        self.not_flushed = not_flushed
        self.flush_refusals = flush_refusals
        self.calls: list[tuple[str, dict]] = []
        self.paused: str | None = None
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: object, ctype: str | None = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                if ctype is not None:
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
                    self._send(200, {"model_path": "stand-in", "weight_version": "default"})
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
                engine.calls.append((self.path, body))
                code, answer, ctype = engine.answer(self.path, body)
                self._send(code, answer, ctype)

        self.server = _QuietServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, body: dict) -> tuple[int, object, str | None]:
        json_type = "application/json"
        if path == "/pause_generation":
            self.paused = body.get("mode", "abort")
            return 200, {"message": "Generation paused successfully.", "status": "ok"}, json_type
        if path == "/continue_generation":
            self.paused = None
            return 200, {"message": "Generation continued successfully.", "status": "ok"}, json_type
        if path == "/flush_cache":
            if self.flush_refusals > 0:
                self.flush_refusals -= 1
                return 400, FLUSH_REFUSED_TEXT, None  # SGLang's Response(content=...): no content type
            return 200, FLUSH_OK_TEXT, None
        if path == "/update_weight_version":
            self.version = self.scheduler_version = int(body["new_version"])
            message = f"Weight version updated to {body['new_version']}"
            return 200, {"success": True, "message": message, "new_version": body["new_version"]}, json_type
        assert Path(body["model_path"]).is_dir()
        self.scheduler_version = int(body["weight_version"])  # swapped and recorded either way
        if self.not_flushed > 0:
            self.not_flushed -= 1
            return (
                400,
                {"success": False, "message": UPDATE_NOT_FLUSHED_MESSAGE, "num_paused_requests": 0},
                json_type,
            )
        self.version = self.scheduler_version
        message = f"Succeeded to update model weights. Weight version updated to {body['weight_version']}."
        return 200, {"success": True, "message": message, "num_paused_requests": 0}, json_type

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_base: Path, tiny_seed2: Path) -> LocalStore:
    s = LocalStore(tmp_path_factory.mktemp("activation-store"))
    publish_checkpoint(s, "run", 1, tiny_base, ["bf16"], workers=0)
    return s


def _updated_by_sidecar(
    store: LocalStore, work: Path, engine: StandInEngine, tiny_seed2: Path
) -> tuple[int, dict]:
    """Run a sidecar before ``engine``, publish the next version, wait until the sidecar reports
    it active; return the version and the sidecar's status. The engine's first call is the
    sidecar's start-up ``/continue_generation`` (which resumes an engine a predecessor may have
    left paused)."""
    port = free_port()
    argv = mixfleet_argv(
        "sidecar", "--engine", engine.url, "--group", "g", "--format", "bf16", "--store", str(store.root),
        "--run", "run", "--port", str(port), "--replica-id", "g-0", "--staging-dir", str(work / "staging"),
        "--stage-mode", "inplace", "--poll-s", "0.2", "--heartbeat-s", "0.5",
    )  # fmt: skip
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
    assert engine.calls[0][0] == "/continue_generation", engine.calls
    return target, st


def _expected_update(calls: list[tuple[str, dict]], target: int) -> dict:
    (update,) = [body for path, body in calls if path == "/update_weights_from_disk"]
    assert Path(update["model_path"]).is_dir()
    assert update == update_weights_request(update["model_path"], target, "bf16")
    assert update["flush_cache"] is True and update["weight_version"] == str(target)
    return update


@pytest.mark.timeout(120)
def test_the_sidecar_activates_by_retract_update_continue(
    store: LocalStore, tmp_path: Path, tiny_seed2: Path
) -> None:
    engine = StandInEngine(store.read_pointer(FormatRef("run", "bf16")))
    try:
        target, st = _updated_by_sidecar(store, tmp_path, engine, tiny_seed2)
    finally:
        engine.close()
    calls = engine.calls[1:]
    assert [p for p, _ in calls] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert calls[0][1] == {"mode": "retract"}
    _expected_update(calls, target)
    assert st["last_activation"]["pause_s"] > 0 and st["error"] is None
    assert engine.paused is None and engine.version == target


@pytest.mark.timeout(120)
def test_an_update_whose_flush_was_refused_is_completed_while_paused(
    store: LocalStore, tmp_path: Path, tiny_seed2: Path
) -> None:
    engine = StandInEngine(store.read_pointer(FormatRef("run", "bf16")), not_flushed=1, flush_refusals=2)
    try:
        target, st = _updated_by_sidecar(store, tmp_path, engine, tiny_seed2)
    finally:
        engine.close()
    calls = engine.calls[1:]
    assert [p for p, _ in calls] == [
        "/pause_generation",
        "/update_weights_from_disk",  # weights swapped, flush refused: 400
        "/flush_cache",
        "/flush_cache",
        "/flush_cache",  # the third succeeds, still paused
        "/update_weight_version",
        "/continue_generation",
    ], calls
    _expected_update(calls, target)  # loaded once, never again
    assert calls[5][1] == {"new_version": str(target), "abort_all_requests": False}
    assert st["error"] is None and st["failures"] == 0
    assert engine.paused is None and engine.version == engine.scheduler_version == target

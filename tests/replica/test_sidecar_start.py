"""A sidecar's start beside an engine that is already serving: the version the engine serves at
start is learned once, not reported as drift; a real change underneath (an engine restarted on
other weights) still is. The sidecar is the real ``mixfleet sidecar`` process; the engine is a
stand-in speaking the part of SGLang's API the sidecar uses, whose ``/continue_generation``
(sent once at start) answers slowly, so the sidecar's engine loop polls in between."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from tests.support.loopback import LoopbackServer
from tests.support.procs import free_port, mixfleet_argv, process, wait_http

DRIFT = "engine reports version"


class SlowContinueEngine(LoopbackServer):
    """Answers health, model/server info (``version``), metrics; ``/continue_generation`` after
    ``continue_delay_s``."""

    def __init__(self, version: int, continue_delay_s: float) -> None:
        self.version = version
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, body: object, ctype: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path in ("/model_info", "/server_info"):
                    self._send({"model_path": "stand-in", "weight_version": str(engine.version)})
                elif self.path == "/metrics":
                    self._send("sglang:num_running_reqs 0\n", "text/plain")
                else:
                    self._send({})

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/continue_generation":
                    time.sleep(continue_delay_s)
                self._send({})

        super().__init__(Handler)


def _status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).json()


def _wait(pred, port: int, log: Path, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(port)
        if pred(st):
            return st
        assert time.monotonic() < deadline, (st, log.read_text()[-2000:])
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_the_start_up_version_is_not_drift_and_a_real_change_is(tmp_path: Path) -> None:
    engine = SlowContinueEngine(version=0, continue_delay_s=1.5)
    store, staging = tmp_path / "store", tmp_path / "staging"
    store.mkdir()
    port = free_port()
    log = tmp_path / "sidecar.log"
    argv = mixfleet_argv(
        "sidecar", "--engine", engine.url, "--group", "g", "--format", "fp8", "--store", str(store),
        "--run", "run", "--port", str(port), "--replica-id", "g-0", "--staging-dir", str(staging),
        "--poll-s", "0.2", "--heartbeat-s", "0.2",
    )  # fmt: skip
    try:
        with process(argv, log=log) as proc:
            wait_http(f"http://127.0.0.1:{port}/v1/status", timeout=60, proc=proc)
            st = _wait(lambda s: s["ready"] and s["active_version"] == 0, port, log)
            time.sleep(1.0)  # several engine polls after the start
            assert st["error"] is None
            assert DRIFT not in log.read_text(), log.read_text()[-2000:]
            engine.version = 5  # the engine was restarted on other weights underneath
            _wait(lambda s: s["active_version"] == 5, port, log)
            assert f"{DRIFT} 5, expected 0" in log.read_text()
    finally:
        engine.close()

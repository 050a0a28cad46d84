"""An unexpected failure inside the router (here: a state store whose ``get_session`` raises what no
store should) is a 500 in the API's error shape (router/app.py ``_failed``): an ``ErrorBody`` on
the router's own API, OpenAI's ``{"error": {...}}`` and Anthropic's ``{"type": "error", "error":
{...}}`` under their chat prefixes, naming the exception's type only (no message, no traceback),
logged once by the server with its traceback; the router answers the next request as before.

A real uvicorn serves the router app (``create_app`` on that store, its public hook) on a port of
this process's block; the official ``openai`` and ``anthropic`` clients read the chat 500s."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import uvicorn

from fleet.specs import load_preset
from router.app import create_app
from router.config import RouterConfig
from router.state.base import SessionInfo
from router.state.memory import MemoryStore
from tests.support.procs import free_port

KEY = "k" * 32
SECRET = "password=hunter2 at /srv/secret.py"  # what the failure says: never in an answer
DETAIL = "internal error of the router: RuntimeError"


class FailingStore(MemoryStore):
    """The in-memory store, whose ``get_session`` raises an unexpected RuntimeError while
    ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    async def get_session(self, session_id: str) -> SessionInfo | None:
        if self.failing:
            raise RuntimeError(SECRET)
        return await super().get_session(session_id)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """``app`` served by uvicorn in a thread (its lifespan included) until the block ends."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _logged(caplog: pytest.LogCaptureFixture, n: int) -> list[logging.LogRecord]:
    """The records with an exception, once ``n`` are there (or 10 s passed) and a moment after:
    the server logs a request's exception after it sent the 500 (Starlette's
    ``ServerErrorMiddleware`` answers, then re-raises to uvicorn), so a client can read the answer
    before the record exists."""
    deadline = time.monotonic() + 10
    while sum(1 for rec in caplog.records if rec.exc_info) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # one more would be a second record of a failure
    return [rec for rec in caplog.records if rec.exc_info]


def _no_internals(r: httpx.Response) -> None:
    for leak in ("Traceback", "hunter2", "secret.py", 'File "'):
        assert leak not in r.text, r.text


def test_an_unexpected_failure_is_a_500_in_each_apis_shape_logged_once(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FailingStore()
    config = RouterConfig(
        fleet=load_preset("local"),
        api_keys={KEY: frozenset({"rollout", "trainer", "admin"})},
        poll_interval_s=60.0,
        chat_model=tiny_dir,
    )
    group = config.fleet.groups[0].name
    headers = {"Authorization": f"Bearer {KEY}"}
    caplog.set_level(logging.ERROR)
    with serving(create_app(config, store=store)) as url, httpx.Client(base_url=url, headers=headers) as http:
        hb = {"replica_id": "r0", "group": group, "url": "http://127.0.0.1:9", "ready": True}
        assert http.post("/v1/replicas/heartbeat", json=hb).status_code == 200
        sid = http.post("/v1/sessions", json={"group": group}).json()["session_id"]
        oa = openai.OpenAI(base_url=f"{url}/v1/sessions/{sid}/openai/v1", api_key=KEY, max_retries=0)
        an = anthropic.Anthropic(base_url=f"{url}/v1/sessions/{sid}/anthropic", api_key=KEY, max_retries=0)
        assert http.get(f"/v1/sessions/{sid}").status_code == 200
        caplog.clear()
        store.failing = True

        r = http.get(f"/v1/sessions/{sid}")
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
        assert r.json() == {"detail": DETAIL}
        assert r.headers["connection"] == "close"  # the server closes it: no request may follow on it
        _no_internals(r)

        r = http.get(f"/v1/sessions/{sid}/openai/v1/models")
        assert r.status_code == 500, r.text
        body = r.json()
        assert body["error"] == {"message": DETAIL, "type": "server_error", "param": None, "code": None}, body
        _no_internals(r)
        with pytest.raises(openai.InternalServerError) as oa_error:
            oa.models.list()
        assert oa_error.value.status_code == 500 and oa_error.value.type == "server_error"

        r = http.get(f"/v1/sessions/{sid}/anthropic/v1/models")
        assert r.status_code == 500, r.text
        body = r.json()
        assert (body["type"], body["error"]) == ("error", {"type": "api_error", "message": DETAIL}), body
        _no_internals(r)
        with pytest.raises(anthropic.InternalServerError) as an_error:
            an.models.list()
        assert an_error.value.status_code == 500 and an_error.value.body["error"]["type"] == "api_error"

        logged = _logged(caplog, 5)
        assert [rec.exc_info[0] for rec in logged] == [RuntimeError] * 5, [rec.getMessage() for rec in logged]

        store.failing = False  # the router answers the next requests as before
        assert http.get(f"/v1/sessions/{sid}").json()["session_id"] == sid
        assert [m.id for m in oa.models.list()] == [m.id for m in an.models.list()]
        assert http.get("/healthz").status_code == 200

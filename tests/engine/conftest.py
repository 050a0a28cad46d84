"""Fixtures of the engine runtime tests: the ``tiny`` model built once, real engine processes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.engines import engine_process

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_config(tiny_dir: Path) -> dict[str, Any]:
    return json.loads((tiny_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[str]:
    """One engine for a whole test module (tests leave it idle and unpaused)."""
    with engine_process(tiny_dir) as url:
        yield url


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One client for a module's tests. It drops a connection idle for 2 s, as the fleet's engine
    client does (``clients/engine.py``): the engine's server closes one idle for 5 s (uvicorn's
    default, SGLang's ``SGLANG_TIMEOUT_KEEP_ALIVE``, environ.py 337), and a client keeping it as
    long (httpx's default) may send its next request as the server closes it ("Server
    disconnected without sending a response")."""
    limits = httpx.Limits(keepalive_expiry=2.0)
    with httpx.Client(timeout=120.0, trust_env=False, limits=limits) as c:
        yield c


class StreamReader:
    """Consumes one SSE ``/generate`` stream on a thread; ``chunks`` grows as data arrives."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with (
                httpx.Client(timeout=120.0, trust_env=False) as c,
                c.stream("POST", url + "/generate", json={**body, "stream": True}) as r,
            ):
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        self.done = True
                        return
                    self.chunks.append(json.loads(data))
        except BaseException as exc:  # surfaced by wait()
            self.error = exc

    def wait_for(self, n_chunks: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.chunks) < n_chunks and not self.done:
            if self.error or time.monotonic() > deadline:
                raise AssertionError(f"stream stalled at {len(self.chunks)} chunks: {self.error!r}")
            time.sleep(0.005)

    def settled(self, quiet_s: float = 0.3, timeout: float = 30.0) -> int:
        """The number of chunks once none has arrived for ``quiet_s`` (a paused engine's chunks
        sent before the pause may still be on their way on a loaded machine)."""
        deadline = time.monotonic() + timeout
        seen, since = len(self.chunks), time.monotonic()
        while time.monotonic() - since < quiet_s:
            if time.monotonic() > deadline:
                raise AssertionError(f"stream never went quiet ({len(self.chunks)} chunks)")
            time.sleep(0.01)
            if len(self.chunks) != seen:
                seen, since = len(self.chunks), time.monotonic()
        return seen

    def result(self, timeout: float = 120.0) -> dict[str, Any]:
        self._thread.join(timeout)
        if self.error:
            raise self.error
        assert self.done, "stream did not end with [DONE]"
        return self.chunks[-1]


def sse_events(text: str) -> list[Any]:
    """A stream's events, ``[DONE]`` as the string, the others parsed."""
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def generate(client: httpx.Client, url: str, **body: Any) -> dict[str, Any]:
    r = client.post(url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()

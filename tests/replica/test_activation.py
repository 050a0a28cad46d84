"""replica.activation.activate (the one activation coroutine) on a real local engine, and the
per-format update request it sends (core.sglang_release.update_weights_request)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from clients.engine import SGLangClient, make_http_client
from core.formats import FORMATS
from core.sglang_release import update_weights_request
from replica import activation
from replica.activation import ActivationFailed, activate
from replica.reconciler import parse_prometheus
from tests.support.engines import engine_process
from tests.support.recorder import forward, serving

PROMPT = [256, 72, 101, 108, 108, 111, 33, 10]


def test_update_request_per_format() -> None:
    common = {"model_path": "/s/v7", "weight_version": "7", "flush_cache": True, "abort_all_requests": False}
    expected = {"bf16": False, "fp8": True, "nvfp4": True, "mxfp4": True}
    assert set(FORMATS) == set(expected)
    for fmt, recapture in expected.items():
        assert update_weights_request("/s/v7", 7, fmt) == {**common, "recapture_cuda_graph": recapture}
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        update_weights_request("/s/v7", 7, "int3")


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[str]:
    with engine_process(tiny_dir, weight_version=1) as url:
        yield url


def run(url: str, call) -> None:
    async def main() -> None:
        http = make_http_client()
        try:
            await call(SGLangClient(http, url))
        finally:
            await http.close()

    asyncio.run(main())


def test_activate_under_load_then_a_refused_version_keeps_the_old_one(engine: str, tiny_dir: Path) -> None:
    """A request in flight crosses the activation (two spans); a refused update raises
    ActivationFailed naming the engine's reason, the engine is not left paused and still serves
    the old version."""

    async def main(c: SGLangClient) -> None:
        body = json.dumps(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        )
        tokens = parse_prometheus(await c.metrics()).get("sglang:generation_tokens_total", 0.0)
        running = asyncio.create_task(c.post_generate(body.encode()))
        while parse_prometheus(await c.metrics()).get("sglang:generation_tokens_total", 0.0) < tokens + 5:
            await asyncio.sleep(0.01)
        times = await activate(c, str(tiny_dir), 2, "bf16")
        assert times.pause_s >= times.update_s > 0 and "Weight version updated to 2" in times.message
        spans = json.loads((await running).content)["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == ["1", "2"] and spans[-1]["end"] == 400, spans
        with pytest.raises(ActivationFailed) as failed:
            await activate(c, str(tiny_dir / "missing"), 3, "bf16")
        assert failed.value.version == 3 and not failed.value.weights_loaded
        assert "does not exist" in failed.value.message
        state = (await c.server_info())["internal_states"][0]
        assert state["paused"] is None
        assert await c.weight_version() == 2

    run(engine, main)


def test_an_engine_that_refuses_every_continue_fails_the_activation(
    engine: str, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that answers each ``/continue_generation`` with an error (here a proxy before the
    real engine) stays paused: the activation fails saying so, with the weights loaded, where it
    returned as if it served (its ``/model_info`` names the version) while nobody was served."""
    monkeypatch.setattr(activation, "CONTINUE_TRIES", 2)

    class RefusesContinue:
        url = ""

        async def handle(self, request: web.Request) -> web.Response:
            if request.path == "/continue_generation":
                return web.json_response({"error": {"message": "continue refused"}}, status=503)
            return await forward(engine, request, await request.read())

    async def main(c: SGLangClient) -> None:
        with pytest.raises(ActivationFailed) as failed:
            await activate(c, str(tiny_dir), 4, "bf16")
        assert failed.value.weights_loaded and "stayed paused after taking version 4" in failed.value.message

    with serving(RefusesContinue(), "refuses-continue") as proxy:
        run(proxy.url, main)
    with httpx.Client(timeout=30) as c:  # the real engine: paused, as the activation now says
        assert c.get(engine + "/server_info").json()["internal_states"][0]["paused"] is not None
        assert c.post(engine + "/continue_generation", json={}).status_code == 200

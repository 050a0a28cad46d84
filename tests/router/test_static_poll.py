"""How the router polls a static replica (an engine in the preset, no sidecar), against a
loopback server that answers as SGLang 0.5.23 does: the served version from ``/model_info``
(``/server_info``'s is the start-up one), the load from ``/metrics`` (``/server_info``'s
``internal_states`` carry no request counts)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from clients.engine import make_http_client
from fleet.specs import FleetSpec, GroupSpec
from router.config import RouterConfig
from router.context import RouterContext
from tests.support.procs import free_port

METRICS = (
    "# TYPE sglang:num_running_reqs gauge\n"
    'sglang:num_running_reqs{model_name="m"} 3.0\n'
    "# TYPE sglang:num_queue_reqs gauge\n"
    'sglang:num_queue_reqs{model_name="m"} 2.0\n'
    "# TYPE sglang:gen_throughput gauge\n"
    'sglang:gen_throughput{model_name="m"} 42.5\n'
)


def _handler(answer):
    async def handle(_: web.Request) -> web.StreamResponse:
        return answer()

    return handle


async def _poll(with_metrics: bool) -> tuple[bool, int | None, int, int, float]:
    """(ready, version, running, queued, tokens/s) of one poll of a static replica whose engine
    started on version 1 and now serves 5 (SGLang's /model_info and /server_info,
    entrypoints/http_server.py 812-890; internal_states as
    managers/scheduler_components/internal_state.py 45-74 builds them)."""
    server_info = {"weight_version": "1", "internal_states": [{"last_gen_throughput": 0.0}]}
    answers = {
        "/health": web.Response,
        "/model_info": lambda: web.json_response({"weight_version": "5"}),
        "/server_info": lambda: web.json_response(server_info),
    }
    if with_metrics:
        answers["/metrics"] = lambda: web.Response(text=METRICS)
    app = web.Application()
    for path, answer in answers.items():
        app.router.add_get(path, _handler(answer))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fleet = FleetSpec(
        name="t", groups=(GroupSpec(name="g", accelerator="cpu", replicas=(f"http://127.0.0.1:{port}",)),)
    )
    ctx = RouterContext(RouterConfig(fleet=fleet, auth_disabled=True))
    ctx.http = make_http_client()
    try:
        await ctx.poll_once()
    finally:
        await ctx.http.close()
        await runner.cleanup()
    r = ctx.registry.replicas["g/0"]
    return r.ready, r.active_version, r.running, r.queued, r.tokens_per_s


def test_a_static_replica_is_polled_as_sglang_reports() -> None:
    assert asyncio.run(_poll(with_metrics=True)) == (True, 5, 3, 2, 42.5)


def test_a_static_replica_without_metrics_is_ready_with_no_load() -> None:
    """A server started without --enable-metrics has no /metrics (http_server.py 314-315)."""
    assert asyncio.run(_poll(with_metrics=False)) == (True, 5, 0, 0, 0.0)

"""Every route of the router reads its JSON body one way (router.json_route): strictly, by
core.jsonio; a body that is not strict JSON (a lone surrogate escape, NaN) is a 422 json_invalid,
never a 500."""

from __future__ import annotations

import importlib
import pkgutil

from fastapi import APIRouter
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

import router
from fleet.specs import load_preset
from router.app import create_app
from router.config import RouterConfig
from router.json_route import JsonRoute

KEY = "k" * 32


def _app():
    config = RouterConfig(
        fleet=load_preset("local"),
        api_keys={KEY: frozenset({"rollout", "trainer", "admin"})},
        poll_interval_s=60.0,
    )
    return create_app(config)


def test_every_api_route_is_a_json_route() -> None:
    """Every route of every APIRouter in the ``router`` package (the app's own are GETs)."""
    routes = []
    for info in pkgutil.walk_packages(router.__path__, "router."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, APIRouter) and value.routes:
                routes += [(info.name, r.path) for r in value.routes if not isinstance(r, JsonRoute)]
    assert routes == []
    methods = {
        m
        for r in _app().routes
        if isinstance(r, APIRoute) and not isinstance(r, JsonRoute)
        for m in r.methods
    }
    assert methods <= {"GET", "HEAD"}


def test_a_body_that_is_not_strict_json_is_a_422_naming_it() -> None:
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with TestClient(_app(), headers=headers) as client:
        group = load_preset("local").groups[0].name
        hb = {"replica_id": "r0", "group": group, "url": "http://127.0.0.1:9", "ready": True}
        assert client.post("/v1/replicas/heartbeat", json=hb).status_code == 200
        sid = client.post("/v1/sessions", json={"group": group}).json()["session_id"]
        for body in (b'{"input_ids": [1], "note": "a\\ud800"}', b'{"input_ids": [NaN]}'):
            r = client.post(f"/v1/sessions/{sid}/turns", content=body)
            assert r.status_code == 422 and r.json()["errors"][0]["type"] == "json_invalid", r.text
        r = client.post(f"/v1/sessions/{sid}/openai/v1/chat/completions", content=b'{"messages": "\\udc00"}')
        assert r.status_code == 400 and r.json()["errors"][0]["type"] == "json_invalid", (
            r.text
        )  # the API's 400
        r = client.post("/v1/batches/take", content=b'{"size": Infinity}')
        assert r.status_code == 422 and r.json()["errors"][0]["type"] == "json_invalid", r.text

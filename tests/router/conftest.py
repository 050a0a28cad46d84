"""Shared fixtures: the tiny model (built once per session), a real engine process, a real router."""

from __future__ import annotations

import secrets

import httpx
import pytest
import redis

from tests.support.engines import engine_process
from tests.support.procs import redis_server
from tests.support.router import router_process, write_preset

KEYS = {
    "all": secrets.token_hex(16),
    "rollout": secrets.token_hex(16),
    "trainer": secrets.token_hex(16),
}


@pytest.fixture(scope="session")
def tiny_bf16(tiny_dir):
    return tiny_dir


@pytest.fixture(scope="module")
def engine_url(tiny_bf16):
    with engine_process(tiny_bf16) as url:
        yield url


@pytest.fixture(scope="module")
def router(engine_url, tmp_path_factory):
    """A router over two groups: ``cpu-a`` (the engine, static) and ``cpu-b`` (heartbeats only)."""
    d = tmp_path_factory.mktemp("router")
    preset = write_preset(
        d / "preset.toml",
        [
            {"name": "cpu-a", "replicas": [engine_url], "sessions_per_replica": 8},
            {"name": "cpu-b", "sessions_per_replica": 8},
        ],
    )
    keys = {
        KEYS["all"]: ["rollout", "trainer", "admin"],
        KEYS["rollout"]: ["rollout"],
        KEYS["trainer"]: ["trainer"],
    }
    with router_process(
        preset, keys=keys, extra_args=("--heartbeat-timeout", "2", "--max-body-bytes", "65536")
    ) as handle:
        yield handle


@pytest.fixture
def client(router):
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def redis_url():
    """A real redis-server on a free loopback port, for the module's tests."""
    with redis_server() as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
def store_url(request, redis_url) -> str:
    """Each state backend in turn: ``memory``, then the (flushed) real Redis."""
    if request.param == "memory":
        return "memory"
    redis.Redis.from_url(redis_url).flushdb()
    return redis_url

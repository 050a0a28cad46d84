"""Every long-running server of mixfleet raises its soft open-file limit at start
(:func:`core.process.raise_open_file_limit`): started under a soft limit of 256 (its hard limit
unchanged, as on a host whose default soft limit is 1,024), a real router answers every one of
400 keep-alive connections held open at once, and the router, the sidecar and the local engine
each run with the raised limit (``/proc/PID/limits``). Under a hard limit that low the router
still starts, and says so in one warning line."""

from __future__ import annotations

import asyncio
import resource

from core.process import open_files_wanted
from tests.support.engines import engine_argv
from tests.support.procs import (
    free_port,
    mixfleet_argv,
    open_files_limit,
    process,
    soft_open_files,
    wait_started,
)
from tests.support.router import router_process, write_preset

LOW = 256
CONNECTIONS = 400


def raised() -> int:
    """The soft limit a server started under :data:`LOW` (and this process's hard limit) runs with."""
    return open_files_wanted(resource.getrlimit(resource.RLIMIT_NOFILE)[1])


async def healthz_on_open_connections(port: int, n: int) -> list[str]:
    """Open ``n`` connections to ``port`` and hold them all open; then send ``GET /healthz`` on
    each and read its answer. Returns each connection's status line, or its error."""
    conns = await asyncio.gather(
        *(asyncio.open_connection("127.0.0.1", port) for _ in range(n)), return_exceptions=True
    )

    async def ask(conn) -> str:
        if isinstance(conn, BaseException):
            return f"connect: {conn!r}"
        reader, writer = conn
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: router\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            return head.split(b"\r\n", 1)[0].decode()
        except (OSError, asyncio.IncompleteReadError) as exc:
            return f"request: {exc!r}"

    try:
        async with asyncio.timeout(10):
            return await asyncio.gather(*(ask(c) for c in conns))
    finally:
        for conn in conns:
            if not isinstance(conn, BaseException):
                conn[1].close()


def test_router_under_a_low_soft_limit_answers_every_connection(tmp_path) -> None:
    assert raised() > CONNECTIONS + 100, "the hard open-file limit here is too low for this test"
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "sessions_per_replica": 8}])
    with router_process(preset, preexec_fn=soft_open_files(LOW)) as router:
        answers = asyncio.run(healthz_on_open_connections(router.port, CONNECTIONS))
        soft = open_files_limit(router.proc.pid)[0]
    failed = [a for a in answers if a != "HTTP/1.1 200 OK"]
    assert not failed, f"{len(failed)} of {CONNECTIONS} connections not answered: {sorted(set(failed))}"
    assert soft == raised()


def test_router_under_a_low_hard_limit_starts_and_says_so(tmp_path) -> None:
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "sessions_per_replica": 8}])
    with router_process(preset, preexec_fn=soft_open_files(LOW, LOW)) as router:
        assert open_files_limit(router.proc.pid) == (LOW, LOW)
        warnings = [line for line in router.log.read_text().splitlines() if "open-file limit" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and f"is {LOW} (hard limit {LOW})" in warnings[0]


def test_sidecar_raises_its_soft_limit(tmp_path) -> None:
    port = free_port()
    argv = mixfleet_argv(
        "sidecar",
        *("--engine", f"http://127.0.0.1:{free_port()}", "--group", "cpu-a", "--format", "bf16"),
        *("--store", str(tmp_path), "--run", "run", "--port", str(port), "--log-level", "warning"),
    )
    log = tmp_path / "sidecar.log"
    with process(argv, log=log, preexec_fn=soft_open_files(LOW)) as proc:
        wait_started("sidecar", f"http://127.0.0.1:{port}", "/v1/status", proc, log, 60)
        assert open_files_limit(proc.pid)[0] == raised()


def test_engine_raises_its_soft_limit(tiny_dir, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "engine.log"
    with process(engine_argv(tiny_dir, port), log=log, preexec_fn=soft_open_files(LOW)) as proc:
        wait_started("engine", f"http://127.0.0.1:{port}", "/health", proc, log, 120)
        assert open_files_limit(proc.pid)[0] == raised()

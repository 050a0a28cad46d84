"""Real local engine processes for tests: ``mixfleet engine`` on a free loopback port.

``engine_process(model_dir, **flags)`` starts one engine, waits until ``/health`` answers,
yields its base URL and kills the process group on exit. Extra keyword flags become CLI flags
(``kv_cache_dtype="fp8_e4m3"`` -> ``--kv-cache-dtype fp8_e4m3``; ``True`` -> a bare flag).
Engines default to one torch thread (tests share two cores).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.procs import free_port, mixfleet_argv, process, wait_started


def engine_argv(model_dir: str | Path, port: int, **flags: object) -> list[str]:
    """argv of ``mixfleet engine`` for ``model_dir`` on ``port`` with ``flags`` (see module doc)."""
    flags.setdefault("threads", 1)
    argv = ["engine", "--model", str(model_dir), "--port", str(port)]
    for name, value in flags.items():
        if value is None or value is False:
            continue
        opt = "--" + name.replace("_", "-")
        argv += [opt] if value is True else [opt, str(value)]
    return mixfleet_argv(*argv)


@contextlib.contextmanager
def engine_process(
    model_dir: str | Path,
    port: int | None = None,
    *,
    timeout: float = 180.0,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    **flags: object,
) -> Iterator[str]:
    """Start an engine serving ``model_dir`` (``env`` added to the environment it inherits);
    yield ``http://127.0.0.1:PORT`` once it is healthy.

    On a failed start the error carries the tail of the engine's log.
    """
    port = port or free_port()
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="engine-"))) / "engine.log"
        proc = stack.enter_context(process(engine_argv(model_dir, port, **flags), log=log, env=env))
        url = f"http://127.0.0.1:{port}"
        wait_started("engine", url, "/health", proc, log, timeout)
        pid = httpx.get(url + "/server_info", timeout=10).json().get("pid")
        if pid != proc.pid:  # it failed to bind, and another process answers on its port
            raise RuntimeError(f"engine on {url} is process {pid}, not the one started ({proc.pid})")
        yield url

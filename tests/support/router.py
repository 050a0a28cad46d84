"""Real router processes for tests: ``mixfleet router`` on a free loopback port.

``write_preset(path, groups)`` writes a preset TOML (each group a dict of GroupSpec fields;
``replicas`` a list of engine URLs). ``router_process(preset, ...)`` starts the router, waits for
``/healthz``, yields a :class:`RouterHandle` (URL, a key with every scope, headers) and kills
the process group on exit.

Typical use::

    with engine_process(model_dir) as engine:
        preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-bf16", "replicas": [engine]}])
        with router_process(preset) as router:
            httpx.post(router.url + "/v1/sessions", headers=router.headers)
"""

from __future__ import annotations

import contextlib
import json
import secrets
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.procs import free_port, mixfleet_argv, process, wait_started

ALL_SCOPES = ["rollout", "trainer", "admin"]


@dataclass(frozen=True)
class RouterHandle:
    url: str
    key: str
    port: int
    log: Path
    proc: Any

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def write_preset(path: str | Path, groups: list[dict[str, Any]], name: str = "test") -> Path:
    """Write a preset; groups default to ``accelerator = "cpu"``."""
    lines = [f"name = {_toml_value(name)}", ""]
    for g in groups:
        lines.append("[[groups]]")
        for k, v in {"accelerator": "cpu", **g}.items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    path = Path(path)
    path.write_text("\n".join(lines))
    return path


@contextlib.contextmanager
def router_process(
    preset: str | Path,
    *,
    state: str = "memory",
    policy: str = "capacity",
    port: int | None = None,
    keys: dict[str, list[str]] | None = None,
    extra_args: tuple[str, ...] = (),
    log: Path | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    program: tuple[str, ...] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[RouterHandle]:
    """Start ``mixfleet router --preset preset``; yield once ``/healthz`` answers 200.

    ``keys`` defaults to one fresh key with every scope (``handle.key``); with ``keys`` given,
    ``handle.key`` is the first one. ``env`` adds environment variables (e.g. ``MIXFLEET_STORE``).
    ``program`` is the argv prefix that runs the ``mixfleet`` command (default
    :func:`mixfleet_argv`'s). ``preexec_fn`` runs in the child before the router starts
    (:func:`tests.support.procs.process`).
    """
    port = port or free_port()
    if keys is None:
        keys = {secrets.token_hex(16): ALL_SCOPES}
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="router-"))) / "router.log"
        argv = (list(program) if program is not None else mixfleet_argv()) + [
            "router",
            "--preset",
            str(preset),
            "--port",
            str(port),
            "--state",
            state,
            "--policy",
            policy,
            "--log-level",
            "warning",
            *extra_args,
        ]
        full_env = {**(env or {}), "MIXFLEET_API_KEYS": json.dumps(keys)}
        proc = stack.enter_context(process(argv, log=log, env=full_env, preexec_fn=preexec_fn))
        url = f"http://127.0.0.1:{port}"
        wait_started("router", url, "/healthz", proc, log, timeout)
        yield RouterHandle(url=url, key=next(iter(keys)), port=port, log=log, proc=proc)


def redis_router_files(tmp_path: Path) -> tuple[Path, int, str, Path, Path]:
    """What a test of a router on a redis-server it restarts needs: a one-group preset, a free
    port for redis-server and its state URL, a data directory for redis-server (kept across its
    restarts) and the router's log file."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="redis-", dir=tmp_path))
    return preset, port, f"redis://127.0.0.1:{port}/0", data, tmp_path / "router.log"


WORKER_HEADER = "x-mixfleet-router"  # router.app.ROUTER_HEADER: "<host>/<pid>" of the answering process
WORKER_TRIES = 200


def until_workers(send: Callable[[], Any], workers: int = 2, tries: int = WORKER_TRIES) -> list[Any]:
    """The answers of ``send()`` (one request on a connection of its own; an answer with httpx's
    ``headers``), sent again until ``workers`` router processes answered one (at most ``tries``).
    Which worker accepts a new connection is the kernel's choice, and a busy machine may hand one
    worker dozens in a row, so the bound is generous; AssertionError naming the workers seen."""
    answers: list[Any] = []
    seen: set[str] = set()
    for _ in range(tries):
        answers.append(send())
        seen.add(answers[-1].headers[WORKER_HEADER])
        if len(seen) >= workers:
            return answers
    raise AssertionError(f"only workers {sorted(seen)} answered in {tries} requests")

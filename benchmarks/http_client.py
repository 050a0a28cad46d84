"""Client CPU per engine request: the project's engine client (aiohttp) vs httpx, side by side.

What is measured. A stub engine (a bare ASGI app under uvicorn, in its own process, so its CPU
is not counted) answers every ``POST /generate`` with a fixed ~1 KB JSON body. In this process,
each client sends ``--requests`` requests of a turn-sized body (200 input ids, 64-token sampling
params) with ``--concurrency`` in flight, after ``--warmup`` untimed ones, and the process's own
CPU time (user + system, ``getrusage``) is divided by the request count:

* baseline: ``httpx.AsyncClient`` (one client, keep-alive pool), ``post`` then ``.content``;
* project: :class:`clients.engine.SGLangClient` on :func:`clients.engine.make_http_client`
  (aiohttp), ``post_generate`` (one request, the whole answer read).

The two run alternately, ``--rounds`` times each, in one run; the figures printed are each
client's median over its rounds, then the ratio baseline / project (CPU per request and
throughput). Wall-clock throughput shares the machine with the stub server.

Run: ``.venv/bin/python benchmarks/http_client.py [--requests 2000] [--concurrency 16] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ANSWER = b'{"output_ids":[1,2,3],"meta_info":{"x":1}}' * 20
BODY = json.dumps({"input_ids": list(range(200)), "sampling_params": {"max_new_tokens": 64}}).encode()


async def stub_app(scope, receive, send) -> None:
    """The stub engine: every HTTP request gets ``ANSWER``."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def timed(one, n: int, concurrency: int, warmup: int) -> tuple[float, float]:
    """(CPU microseconds per request, requests per second) of ``n`` calls of ``one``."""
    await asyncio.gather(*(one() for _ in range(warmup)))
    sem = asyncio.Semaphore(concurrency)

    async def limited() -> None:
        async with sem:
            await one()

    c0, w0 = cpu_s(), time.perf_counter()
    await asyncio.gather(*(limited() for _ in range(n)))
    return (cpu_s() - c0) / n * 1e6, n / (time.perf_counter() - w0)


async def run_httpx(url: str, n: int, concurrency: int, warmup: int) -> tuple[float, float]:
    import httpx

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(limits=limits, trust_env=False, timeout=60.0) as c:

        async def one() -> None:
            r = await c.post(url + "/generate", content=BODY, headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.content == ANSWER

        return await timed(one, n, concurrency, warmup)


async def run_project(url: str, n: int, concurrency: int, warmup: int) -> tuple[float, float]:
    from clients.engine import SGLangClient, make_http_client

    http = make_http_client(max_connections=64)
    client = SGLangClient(http, url)
    try:

        async def one() -> None:
            r = await client.post_generate(BODY)
            assert r.status_code == 200 and r.content == ANSWER

        return await timed(one, n, concurrency, warmup)
    finally:
        await http.close()


def serve(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the stub server exited ({proc.returncode})")
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the stub server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    from core.tcp import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        wait_up(url, proc)
        results: dict[str, list[tuple[float, float]]] = {"httpx": [], "project": []}
        for _ in range(args.rounds):
            results["httpx"].append(asyncio.run(run_httpx(url, args.requests, args.concurrency, args.warmup)))
            results["project"].append(
                asyncio.run(run_project(url, args.requests, args.concurrency, args.warmup))
            )
    finally:
        proc.terminate()
        proc.wait(10)
    print(
        f"{args.requests} POST /generate per round, {args.concurrency} in flight, {args.rounds} rounds each; "
        "client process CPU (user+sys) per request, stub engine in its own process"
    )
    med = {}
    for name, label in (("httpx", "httpx.AsyncClient (baseline)"), ("project", "SGLangClient on aiohttp")):
        us = statistics.median(r[0] for r in results[name])
        rps = statistics.median(r[1] for r in results[name])
        med[name] = (us, rps)
        print(f"  {label:32s} {us:8.0f} us CPU/request {rps:8.0f} requests/s")
    print(
        f"ratio httpx / aiohttp: CPU per request {med['httpx'][0] / med['project'][0]:.1f}x, "
        f"throughput {med['project'][1] / med['httpx'][1]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

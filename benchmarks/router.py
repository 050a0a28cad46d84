"""Router overhead: added latency and sustained turns/s, beside sglang-router, in one run.

What is measured. A fast stub backend speaks SGLang's ``/generate`` (fixed answer: 8 output
tokens with log-probs and 16-id sampling masks, as the local engine would send them). Closed-loop
clients (raw HTTP/1.1 keep-alive, one connection per session) run for ``--seconds`` at each
concurrency against:

* ``direct``            the stub itself (the baseline),
* ``mixfleet turns``    ``POST /v1/sessions/{id}/turns`` through the mixfleet router (auth on,
                        memory state: routing, failover bookkeeping, behavior-record encoding and
                        recording included),
* ``mixfleet generate`` the router's SGLang-native ``POST /generate`` passthrough (session key
                        header, sticky routing),
* ``sglang-router``     ``POST /generate`` through ``sglang-router`` (PyPI, Rust) in front of the
                        same stub, when it is installed.

Added latency = percentile through the router minus the same percentile direct. Throughput =
completed requests / seconds. Ratios are printed against sglang-router measured in the same run.
All processes share this machine's cores, so absolute numbers depend on the machine.

Run: ``.venv/bin/python benchmarks/router.py [--seconds 5] [--concurrency 1 64 256]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

N_OUT = 8
SUPPORT = 16


# ------------------------------------------------------------------ stub backend


def _stub_generate_body() -> bytes:
    out = list(range(100, 100 + N_OUT))
    masks = [sorted({t, *range(t + 1, t + SUPPORT)}) for t in out]
    lp = -0.6931471805599453
    meta = {
        "id": "stub",
        "finish_reason": {"type": "length", "length": N_OUT},
        "prompt_tokens": 4,
        "completion_tokens": N_OUT,
        "cached_tokens": 0,
        "weight_version": "0",
        "weight_versions": [{"version": 0, "start": 0, "end": N_OUT}],
        "output_token_logprobs": [[lp, t, None] for t in out],
        "output_token_sampling_mask": masks,
        "output_token_sampling_logprobs": [lp for _ in out],
        "output_token_sampling_support_logprobs": [[-2.772588722239781] * len(m) for m in masks],
    }
    return json.dumps({"text": "", "output_ids": out, "meta_info": meta}).encode()


async def serve_stub(port: int) -> None:
    generate = _stub_generate_body()
    small = {
        b"/health": b"",
        b"/health_generate": b"",
        b"/model_info": json.dumps(
            {"model_path": "stub", "is_generation": True, "vocab_size": 4096, "weight_version": "0"}
        ).encode(),
        b"/server_info": json.dumps({"weight_version": "0", "internal_states": [{}]}).encode(),
        b"/get_model_info": json.dumps({"model_path": "stub", "is_generation": True}).encode(),
        b"/get_server_info": json.dumps({"weight_version": "0", "internal_states": [{}]}).encode(),
        b"/get_weight_version": b'{"weight_version":"0"}',
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, _, rest = head.partition(b"\r\n")
                _method, path, _ = line.split(b" ", 2)
                length = 0
                for h in rest.split(b"\r\n"):
                    if h[:15].lower() == b"content-length:":
                        length = int(h[15:])
                if length:
                    await reader.readexactly(length)
                path = path.split(b"?", 1)[0]
                body = generate if path == b"/generate" else small.get(path)
                status = b"200 OK" if body is not None else b"404 Not Found"
                body = body or b""
                writer.write(
                    b"HTTP/1.1 "
                    + status
                    + b"\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# ------------------------------------------------------------------ closed-loop client


class Conn:
    """One keep-alive HTTP/1.1 connection (the load generator's; minimal CPU per request)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        hdr = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{hdr}\r\n".encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = None
        chunked = False
        for h in head.split(b"\r\n")[1:]:
            low = h.lower()
            if low.startswith(b"content-length:"):
                length = int(h[15:])
            elif low.startswith(b"transfer-encoding:") and b"chunked" in low:
                chunked = True
        if chunked:
            data = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                data += chunk[:-2]
            return status, data
        return status, await self.reader.readexactly(length or 0)


async def closed_loop(port: int, concurrency: int, seconds: float, make_request) -> tuple[list[float], int]:
    """Run ``concurrency`` loops for ``seconds``; returns per-request latencies (s) and errors."""
    latencies: list[float] = []
    errors = [0]
    stop = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        conn = Conn(port)
        method, path, body, headers = await make_request(conn, i)
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            status, _ = await conn.request(method, path, body, headers)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                errors[0] += 1

    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return latencies, errors[0]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ------------------------------------------------------------------ processes


def _free_port() -> int:
    from tests.support.procs import free_port

    return free_port()


def _wait(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    from tests.support.procs import wait_http

    wait_http(url, timeout=timeout, proc=proc)


@contextlib.contextmanager
def spawn(argv: list[str], env: dict[str, str] | None = None, log: Path | None = None):
    from tests.support.procs import process

    with process(argv, env=env, log=log) as p:
        yield p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_stub:
        asyncio.run(serve_stub(args.serve_stub))
        return 0

    from tests.support.procs import mixfleet_argv
    from tests.support.router import write_preset

    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    key = secrets.token_hex(16)
    auth = {"authorization": f"Bearer {key}"}
    with contextlib.ExitStack() as stack:
        stub_port = _free_port()
        stub = stack.enter_context(spawn([sys.executable, __file__, "--serve-stub", str(stub_port)]))
        _wait(f"http://127.0.0.1:{stub_port}/health", stub)
        stub_url = f"http://127.0.0.1:{stub_port}"

        mf_port = _free_port()
        preset = write_preset(
            tmp / "p.toml", [{"name": "stub", "sessions_per_replica": 100_000, "replicas": [stub_url]}]
        )
        mf = stack.enter_context(
            spawn(
                mixfleet_argv(
                    "router", "--preset", str(preset), "--port", str(mf_port), "--log-level", "warning"
                ),
                env={"MIXFLEET_API_KEYS": json.dumps({key: ["rollout", "trainer", "admin"]})},
                log=tmp / "mf.log",
            )
        )
        _wait(f"http://127.0.0.1:{mf_port}/healthz", mf)
        time.sleep(1.5)  # first health poll

        sg_port = None
        exe = shutil.which("sglang-router", path=str(Path(sys.executable).parent)) or shutil.which(
            "sglang-router"
        )
        sg_note = "not installed (pip install sglang-router)"
        if exe:
            sg_port = _free_port()
            sg = stack.enter_context(
                spawn(
                    [
                        exe,
                        "launch",
                        "--worker-urls",
                        stub_url,
                        "--port",
                        str(sg_port),
                        "--host",
                        "127.0.0.1",
                        "--policy",
                        "round_robin",
                        "--log-level",
                        "warn",
                    ],
                    log=tmp / "sg.log",
                )
            )
            try:
                _wait(f"http://127.0.0.1:{sg_port}/health", sg, timeout=60)
                sg_note = "sglang-router " + _version("sglang-router")
            except (RuntimeError, TimeoutError) as exc:
                sg_note = f"failed to start: {exc}; log: {(tmp / 'sg.log').read_text()[-500:]}"
                sg_port = None

        gen_body = json.dumps(
            {
                "input_ids": [1, 2, 3, 4],
                "sampling_params": {"max_new_tokens": N_OUT},
                "return_logprob": True,
                "return_sampling_mask": True,
            }
        ).encode()
        turn_body = json.dumps(
            {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": N_OUT}}
        ).encode()

        async def direct(conn, i):
            return "POST", "/generate", gen_body, {}

        async def mf_turns(conn, i):
            status, data = await conn.request("POST", "/v1/sessions", b"{}", auth)
            assert status == 200, data
            sid = json.loads(data)["session_id"]
            return "POST", f"/v1/sessions/{sid}/turns", turn_body, auth

        async def mf_generate(conn, i):
            return "POST", "/generate", gen_body, {**auth, "x-session-id": f"s{i}"}

        async def sg_generate(conn, i):
            return "POST", "/generate", gen_body, {}

        targets = [
            ("direct", stub_port, direct),
            ("mixfleet turns", mf_port, mf_turns),
            ("mixfleet generate", mf_port, mf_generate),
        ]
        if sg_port:
            targets.append(("sglang-router", sg_port, sg_generate))
        print(
            f"router benchmark: stub answers {N_OUT} tokens with {SUPPORT}-id masks; {args.seconds:.0f} s "
            f"per point; {os.cpu_count()} cores shared by stub, routers and client; {sg_note}"
        )
        results: dict[tuple[str, int], tuple[list[float], int, float]] = {}
        for c in args.concurrency:
            for name, port, make in targets:
                t0 = time.perf_counter()
                lat, errs = asyncio.run(closed_loop(port, c, args.seconds, make))
                results[(name, c)] = (lat, errs, time.perf_counter() - t0)
        print(
            f"{'target':<18}{'conc':>5}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}"
            f"{'errors':>8}"
        )
        for c in args.concurrency:
            base = results[("direct", c)][0]
            for name, _, _ in targets:
                lat, errs, wall = results[(name, c)]
                rps = len(lat) / args.seconds
                p50, p99 = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
                add50 = p50 - pct(base, 0.5) * 1e3
                add99 = p99 - pct(base, 0.99) * 1e3
                print(
                    f"{name:<18}{c:>5}{rps:>10.0f}{p50:>9.2f}{p99:>9.2f}{add50:>9.2f}{add99:>9.2f}{errs:>8}"
                )
        if sg_port:
            print("\nthroughput ratio vs sglang-router (same stub, same run; target >= 0.5):")
            for c in args.concurrency:
                sg_rps = len(results[("sglang-router", c)][0])
                for name in ("mixfleet turns", "mixfleet generate"):
                    ratio = len(results[(name, c)][0]) / sg_rps if sg_rps else float("nan")
                    print(f"  {name:<18} at {c:>3} sessions: {ratio:.2f}x")
            print("added latency p50 / p99 vs sglang-router's (ms):")
            for c in args.concurrency:
                base = results[("direct", c)][0]
                row = []
                for name in ("mixfleet turns", "mixfleet generate", "sglang-router"):
                    lat = results[(name, c)][0]
                    row.append(
                        f"{name} {statistics.median(lat) * 1e3 - statistics.median(base) * 1e3:+.2f}/"
                        f"{(pct(lat, 0.99) - pct(base, 0.99)) * 1e3:+.2f}"
                    )
                print(f"  {c:>3} sessions: " + ";  ".join(row))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())

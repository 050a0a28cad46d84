"""Router overhead: added latency and sustained turns/s, beside sglang-router, in one run.

What is measured. A fast stub backend speaks SGLang's ``/generate`` (fixed answer: 64 output
tokens with log-probs and 32-id sampling masks, as SGLang 0.5.23 sends them in support mode,
:func:`stub_generate_body`; ``--out-tokens`` and ``--support`` change that shape, so that a turn's
CPU can be split into its constant part and the part that grows with the records). Clients (one
keep-alive HTTP/1.1 connection per session, requests prebuilt, uvloop; the same client for every
target) run for ``--seconds`` against:

* ``direct``            the stub itself (the baseline),
* ``turns memory``      ``POST /v1/sessions/{id}/turns`` through a mixfleet router with in-memory
                        state (auth on: routing, failover bookkeeping, behavior-record parsing,
                        encoding and recording included); each turn appends 4 ids to its
                        session's context (``append_ids``: the turn an agent takes, its
                        context growing by the 4 ids and the 64 generated each turn),
* ``turns redis``       the same through a second mixfleet router whose state is a private
                        redis-server,
* ``turns ... +sup``    with ``--support-answer``: the same turns asking ``return_support`` (the
                        answer carries every record's support, as a trajectory read does; the
                        default answer leaves them out), beside the default in the same run,
* ``generate memory``   the in-memory router's SGLang-native ``POST /generate`` passthrough
                        (session key header, sticky routing),
* ``sglang-router``     ``POST /generate`` through ``sglang-router`` (PyPI, Rust) in front of the
                        same stub, when it is installed.

Two loads:

* sustained (closed loop): each of 256 sessions sends its next request as soon as the
  previous one is answered. Throughput = completed requests / seconds; this saturates the
  machine, so latency there is mostly queueing (sessions / throughput).
* paced (the "load" column shows the rate): ``--paced-sessions`` sessions together offer each
  ``--paced-rate`` in requests/s (each session sends every sessions/rate seconds, from a random
  phase; a late answer delays only that session). Added latency = p50 / p99 through the router
  minus the same percentile direct, at the same offered load: the router's own cost per request
  plus its queueing at that load. (A real engine takes 0.1-10 s per turn, so 256 sessions offer
  roughly 25-2,500 turns/s; the defaults, 250 and 1,000, sit inside that range.)

Targets, at 256 sessions on the paced loads: added p50 <= 2 ms at 250 turns/s and <= 4 ms at
1,000 turns/s, added p99 <= 10 ms at 250 turns/s. The sustained throughput is printed as a ratio
to sglang-router's (no target), and the routers' CPU per request beside each other.

The targets run interleaved, ``--rounds`` times, and the median round is reported (the
machine is shared). CPU per request is the router process's user+system time (all its threads)
divided by the requests it served: unlike throughput it hardly depends on what else runs.
"wait us" is the time its threads spent runnable but waiting for a core, per request
(:func:`wait_seconds`): the part of the added latency that is the machine's contention, not the
router's work. All processes share this machine's cores, so absolute numbers depend on the
machine.

Run: ``.venv/bin/python benchmarks/router.py [--seconds 5] [--rounds 3] [--concurrency 256]
[--paced-rate 250 1000] [--state memory redis] [--out-tokens 64] [--support 32]
[--support-answer] [--out r.json]``
(sglang-router: ``pip install -e '.[bench]'``; ``--out``: also write every median point as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import math
import os
import random
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvicorn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

N_OUT = 64
SUPPORT = 32


def _event_loop_policy() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# ------------------------------------------------------------------ stub backend


def float32(x: float) -> float:
    """``x`` rounded to float32, as an engine's log-probs are: the local engine sends the floats of
    float32 tensors (``engine/runtime/sampler.py``'s ``.tolist()``), and SGLang 0.5.23 computes
    the mask's selected and support log-probs in float32 (``srt/layers/sampler.py`` 569-574,
    619-623)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def stub_generate_body(out: list[int] | None = None, support: int = SUPPORT) -> bytes:
    """The stub engine's ``/generate`` answer for output ids ``out`` (default 100 .. 100 + N_OUT),
    each with a support of ``support`` ids, as SGLang 0.5.23 answers in support mode (what the
    fleet asks): every mask ranked by its weights, highest first, equal ones by ascending id
    (layers/sampler.py 607-616), and ``output_token_sampling_logprobs`` per token the support's
    log-probs (random, float32) aligned with it (618-624); no other mask key."""
    out = list(range(100, 100 + N_OUT)) if out is None else out
    rng = random.Random(0)
    masks, rows = [], []
    for t in out:
        weights = [rng.random() + 1e-3 for _ in range(support)]
        total = sum(weights)
        ranked = sorted(
            ((float32(math.log(w / total)), i) for w, i in zip(weights, range(t, t + support), strict=True)),
            key=lambda pair: (-pair[0], pair[1]),
        )
        masks.append([i for _, i in ranked])
        rows.append([lp for lp, _ in ranked])
    raw = float32(-math.log(2 * support))  # before filtering: half the mass outside the support
    meta = {
        "id": "stub",
        "finish_reason": {"type": "length", "length": len(out)},
        "prompt_tokens": 4,
        "completion_tokens": len(out),
        "cached_tokens": 0,
        "weight_version": "0",
        "weight_versions": [{"version": "0", "start": 0, "end": len(out)}],
        "output_token_logprobs": [[raw, t, None] for t in out],
        "output_token_sampling_mask": masks,
        "output_token_sampling_logprobs": rows,
    }
    return json.dumps({"text": "", "output_ids": out, "meta_info": meta}).encode()


async def serve_stub(
    port: int, generate: bytes | None = None, delay_s: float = 0.0, vocab_size: int = 4096
) -> None:
    """A stub SGLang engine on ``port``: ``/generate`` answers ``generate`` (default
    :func:`stub_generate_body`) after ``delay_s`` seconds; the info, health and abort routes answer
    at once."""
    generate = stub_generate_body() if generate is None else generate
    info = {"model_path": "stub", "is_generation": True, "vocab_size": vocab_size, "weight_version": "0"}
    server = json.dumps({"weight_version": "0", "internal_states": [{}]}).encode()
    small = {
        b"/health": b"",
        b"/health_generate": b"",
        b"/abort_request": b"",
        b"/model_info": json.dumps(info).encode(),
        b"/get_model_info": json.dumps(info).encode(),
        b"/server_info": server,
        b"/get_server_info": server,
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
                if path == b"/generate" and delay_s:
                    await asyncio.sleep(delay_s)
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


# ------------------------------------------------------------------ client


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the load generator (minimal CPU per request:
    requests are prebuilt bytes; responses framed by Content-Length or chunked)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    @classmethod
    async def open(cls, port: int) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, "127.0.0.1", port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            parsed = _parse_response(self.buf)
            if parsed is not None:
                status, body, used = parsed
                del self.buf[:used]
                self.waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def send(self, request: bytes) -> tuple[int, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)  # type: ignore[union-attr]
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _parse_response(buf: bytearray) -> tuple[int, bytes, int] | None:
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    status = int(head[9:12])
    start = end + 4
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        length = int(head[i + 17 : j if j >= 0 else len(head)])
        if len(buf) < start + length:
            return None
        return status, bytes(buf[start : start + length]), start + length
    if b"transfer-encoding: chunked" not in head:
        return status, b"", start
    body = bytearray()
    pos = start
    while True:
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        size = int(bytes(buf[pos:nl]).split(b";")[0], 16)
        if len(buf) < nl + 2 + size + 2:
            return None
        body += buf[nl + 2 : nl + 2 + size]
        pos = nl + 2 + size + 2
        if size == 0:
            return status, bytes(body), pos


def build_request(method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    hdr = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (
        f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{hdr}\r\n"
    ).encode() + body


MakeRequest = Callable[[Conn, int], Awaitable[bytes]]


async def run_load(
    port: int,
    sessions: int,
    seconds: float,
    make_request: MakeRequest,
    period: float | None = None,
    pid: int | None = None,
) -> tuple[list[float], int, float, float, float]:
    """``sessions`` loops for ``seconds``: back to back (``period`` None) or one request every
    ``period`` seconds each. Returns latencies (s), non-200 answers, client CPU seconds, and the
    CPU seconds and run-queue wait (:func:`wait_seconds`) of process ``pid`` (NaN without one)
    over the timed part only (connections and sessions are set up before it)."""
    latencies: list[float] = []
    errors = [0]
    conns = [await Conn.open(port) for _ in range(sessions)]
    requests = [await make_request(c, i) for i, c in enumerate(conns)]
    server0 = cpu_seconds(pid) if pid else float("nan")
    wait0 = wait_seconds(pid) if pid else float("nan")
    cpu0 = time.process_time()
    t_start = time.perf_counter()
    stop = t_start + seconds
    rng = random.Random(7)

    async def loop(conn: Conn, request: bytes) -> None:
        perf = time.perf_counter
        due = t_start + (rng.random() * period if period else 0.0)
        while True:
            if period:
                now = perf()
                if due > now:
                    await asyncio.sleep(due - now)
                due += period
            t0 = perf()
            if t0 >= stop:
                return
            status, _ = await conn.send(request)
            latencies.append(perf() - t0)
            if status != 200:
                errors[0] += 1

    try:
        await asyncio.gather(*(loop(c, r) for c, r in zip(conns, requests, strict=True)))
        client = time.process_time() - cpu0
        server = cpu_seconds(pid) - server0 if pid else float("nan")
        wait = wait_seconds(pid) - wait0 if pid else float("nan")
    finally:
        for c in conns:
            c.close()
    return latencies, errors[0], client, server, wait


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and of every living process below it (all their
    threads: ``mixfleet router --workers N``'s workers are children of its supervisor) from /proc;
    NaN when ``pid`` is gone."""
    from tests.support.procs import descendants

    ticks = 0
    for p in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone: the process itself (NaN), or a child that exited meanwhile
            if p == pid:
                return float("nan")
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_seconds(pid: int) -> float:
    """Seconds the threads of a process and of every living process below it spent runnable but
    waiting for a CPU (the second field of each thread's ``/proc/<p>/task/<t>/schedstat``): time
    in a request's latency that is the machine's contention (clients and stub share its cores),
    not the process's own work. NaN when ``pid`` is gone."""
    from tests.support.procs import descendants

    ns = 0
    for p in [pid, *descendants(pid)]:
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            if p == pid:
                return float("nan")
            continue
        for task in tasks:
            with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that exited meanwhile
                ns += int((task / "schedstat").read_text().split()[1])
    return ns / 1e9


# ------------------------------------------------------------------ processes


@contextlib.contextmanager
def spawn(argv: list[str], env: dict[str, str] | None = None, log: Path | None = None):
    from tests.support.procs import process

    with process(argv, env=env, log=log) as p:
        yield p


def _wait(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    from tests.support.procs import wait_http

    wait_http(url, timeout=timeout, proc=proc)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


class Target:
    def __init__(self, name: str, port: int, make: MakeRequest, pid: int | None) -> None:
        self.name, self.port, self.make, self.pid = name, port, make, pid


class Point:
    """One run of one target at one load: throughput, latencies, CPU, run-queue wait."""

    def __init__(
        self, lat: list[float], errors: int, seconds: float, cpu: float, client_cpu: float, wait: float
    ) -> None:
        self.lat = lat
        self.errors = errors
        self.rps = len(lat) / seconds
        self.p50 = pct(lat, 0.5) * 1e3
        self.p99 = pct(lat, 0.99) * 1e3
        self.cpu_us = cpu / len(lat) * 1e6 if lat else float("nan")
        self.wait_us = wait / len(lat) * 1e6 if lat else float("nan")
        self.cpu_util = cpu / seconds
        self.client_util = client_cpu / seconds


def median_point(points: list[Point]) -> Point:
    """The round with the median throughput."""
    return sorted(points, key=lambda p: p.rps)[len(points) // 2]


def measure(target: Target, sessions: int, seconds: float, period: float | None) -> Point:
    lat, errs, client_cpu, cpu, wait = asyncio.run(
        run_load(target.port, sessions, seconds, target.make, period, target.pid)
    )
    return Point(lat, errs, seconds, cpu, client_cpu, wait)


# the routers' idle keep-alive: uvicorn's default timeout_keep_alive (0.55 config.py 233), which
# `mixfleet router` keeps; a paced session's period stays a second below it
KEEP_ALIVE_S = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default
MAX_PERIOD_S = KEEP_ALIVE_S - 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[256], help="sustained loads (none: skip)")
    ap.add_argument("--paced-sessions", type=int, default=256)
    ap.add_argument(
        "--paced-rate", type=float, nargs="*", default=[250.0, 1000.0], help="requests/s offered (none: skip)"
    )
    ap.add_argument("--state", nargs="+", default=["memory", "redis"], choices=("memory", "redis"))
    ap.add_argument("--out", type=Path, default=None, help="also write every median point here as JSON")
    ap.add_argument("--out-tokens", type=int, default=N_OUT, help="output tokens of the stub's answer")
    ap.add_argument("--support", type=int, default=SUPPORT, help="ids in each output token's mask (>= 1)")
    ap.add_argument(
        "--support-answer", action="store_true", help="also time turns that ask return_support (same run)"
    )
    ap.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.out_tokens < 1 or args.support < 1:
        ap.error("--out-tokens and --support must be at least 1")
    slow = [r for r in args.paced_rate if r > 0 and args.paced_sessions / r > MAX_PERIOD_S]
    if slow:
        ap.error(
            f"--paced-rate {slow[0]:g}: each of {args.paced_sessions} sessions would send every "
            f"{args.paced_sessions / slow[0]:g} s, and the routers close a connection idle for "
            f"{KEEP_ALIVE_S} s (uvicorn's timeout_keep_alive); offer at least "
            f"{args.paced_sessions / MAX_PERIOD_S:g}/s or pass fewer --paced-sessions"
        )
    _event_loop_policy()
    if args.serve_stub:
        out = list(range(100, 100 + args.out_tokens))
        asyncio.run(serve_stub(args.serve_stub, stub_generate_body(out, args.support)))
        return 0

    from tests.support.procs import free_port, mixfleet_argv, redis_server
    from tests.support.router import write_preset

    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    key = secrets.token_hex(16)
    auth = {"authorization": f"Bearer {key}"}
    load0 = os.getloadavg()
    with contextlib.ExitStack() as stack:
        stub_port = free_port()
        stub = stack.enter_context(
            spawn(
                [
                    sys.executable,
                    __file__,
                    "--serve-stub",
                    str(stub_port),
                    "--out-tokens",
                    str(args.out_tokens),
                    "--support",
                    str(args.support),
                ]
            )
        )
        _wait(f"http://127.0.0.1:{stub_port}/health", stub)
        stub_url = f"http://127.0.0.1:{stub_port}"

        preset = write_preset(
            tmp / "p.toml", [{"name": "stub", "sessions_per_replica": 100_000, "replicas": [stub_url]}]
        )
        routers: dict[str, tuple[int, subprocess.Popen]] = {}  # state kind -> (port, process)
        for kind in dict.fromkeys(args.state):
            state = "memory" if kind == "memory" else stack.enter_context(redis_server())
            port = free_port()
            proc = stack.enter_context(
                spawn(
                    mixfleet_argv(
                        "router",
                        "--preset",
                        str(preset),
                        "--port",
                        str(port),
                        "--log-level",
                        "warning",
                        "--state",
                        state,
                    ),
                    env={"MIXFLEET_API_KEYS": json.dumps({key: ["rollout", "trainer", "admin"]})},
                    log=tmp / f"mf-{kind}.log",
                )
            )
            _wait(f"http://127.0.0.1:{port}/healthz", proc)
            routers[kind] = (port, proc)
        time.sleep(1.5)  # first health poll

        sg = None
        exe = shutil.which("sglang-router", path=str(Path(sys.executable).parent)) or shutil.which(
            "sglang-router"
        )
        sg_note = "sglang-router not installed (pip install sglang-router)"
        if exe:
            sg_port = free_port()
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
                        "--prometheus-host",  # its own metrics port: a fixed default collides with
                        "127.0.0.1",  # another run's sglang-router ("Address already in use")
                        "--prometheus-port",
                        str(free_port()),
                    ],
                    log=tmp / "sg.log",
                )
            )
            try:
                _wait(f"http://127.0.0.1:{sg_port}/health", sg, timeout=60)
                sg_note = "sglang-router " + _version("sglang-router")
            except (RuntimeError, TimeoutError) as exc:
                sg_note = f"sglang-router failed to start: {exc}; log: {(tmp / 'sg.log').read_text()[-500:]}"
                sg = None

        n_out, support = args.out_tokens, args.support
        gen_body = json.dumps(
            {
                "input_ids": [1, 2, 3, 4],
                "sampling_params": {"max_new_tokens": n_out, "top_k": 4096},  # a mask needs a finite top_k
                "return_logprob": True,
                "return_sampling_mask": True,
            }
        ).encode()
        turn = {"append_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": n_out, "top_k": support}}
        # append_ids: each turn extends its session's context (the same full input_ids every turn
        # would make every turn after the first a fork); a top_k: a masked turn, as the stub
        # answers (an unfiltered one asks none)
        turn_body = json.dumps(turn).encode()
        support_body = json.dumps({**turn, "return_support": True}).encode()
        new_session = build_request("POST", "/v1/sessions", b"{}", auth)

        async def direct(conn: Conn, i: int) -> bytes:
            return build_request("POST", "/generate", gen_body, {})

        def mf_turns(body: bytes) -> MakeRequest:
            async def make(conn: Conn, i: int) -> bytes:
                status, data = await conn.send(new_session)
                assert status == 200, data
                sid = json.loads(data)["session_id"]
                return build_request("POST", f"/v1/sessions/{sid}/turns", body, auth)

            return make

        async def mf_generate(conn: Conn, i: int) -> bytes:
            return build_request("POST", "/generate", gen_body, {**auth, "x-session-id": f"s{i}"})

        targets = [Target("direct", stub_port, direct, stub.pid)]
        for kind, (port, proc) in routers.items():
            targets.append(Target(f"turns {kind}", port, mf_turns(turn_body), proc.pid))
            if args.support_answer:
                targets.append(Target(f"turns {kind} +sup", port, mf_turns(support_body), proc.pid))
        first, (port, proc) = next(iter(routers.items()))
        targets.append(Target(f"generate {first}", port, mf_generate, proc.pid))
        if sg is not None:
            targets.append(Target("sglang-router", sg_port, direct, sg.pid))
        print(
            f"router benchmark: stub answers {n_out} tokens with {support}-id masks "
            "(SGLang support mode, ranked); "
            f"{args.seconds:g} s per point, {args.rounds} interleaved rounds (median shown); "
            f"states {' and '.join(routers)}; "
            f"{os.cpu_count()} cores shared by stub, routers and client; {sg_note}; "
            f"load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}"
        )
        loads: list[tuple[str, int, float | None]] = [("sustained", c, None) for c in args.concurrency]
        rates = [r for r in args.paced_rate if r > 0]
        loads += [(f"{r:g}/s", args.paced_sessions, args.paced_sessions / r) for r in rates]
        results: dict[tuple[str, int, str], list[Point]] = {}
        for _ in range(args.rounds):
            for kind, sessions, period in loads:
                for t in targets:
                    point = measure(t, sessions, args.seconds, period)
                    results.setdefault((kind, sessions, t.name), []).append(point)
        load1 = os.getloadavg()

        print(
            f"\n{'load':<10}{'target':<19}{'sess':>5}{'req/s':>8}{'(min-max)':>14}{'p50 ms':>8}{'p99 ms':>8}"
            f"{'+p50':>7}{'+p99':>7}{'cpu us/req':>11}{'wait us':>8}{'cpu %':>6}{'client %':>9}{'errors':>7}"
        )
        med: dict[tuple[str, int, str], Point] = {}
        rows: list[dict] = []
        for kind, sessions, _ in loads:
            base = median_point(results[(kind, sessions, "direct")])
            for t in targets:
                points = results[(kind, sessions, t.name)]
                p = med[(kind, sessions, t.name)] = median_point(points)
                lo, hi = min(x.rps for x in points), max(x.rps for x in points)
                errs = sum(x.errors for x in points)
                print(
                    f"{kind:<10}{t.name:<19}{sessions:>5}{p.rps:>8.0f}{f'({lo:.0f}-{hi:.0f})':>14}"
                    f"{p.p50:>8.2f}{p.p99:>8.2f}{p.p50 - base.p50:>+7.2f}{p.p99 - base.p99:>+7.2f}"
                    f"{p.cpu_us:>11.0f}{p.wait_us:>8.0f}{p.cpu_util * 100:>6.0f}{p.client_util * 100:>9.0f}"
                    f"{errs:>7}"
                )
                rows.append(
                    {
                        "load": kind,
                        "sessions": sessions,
                        "target": t.name,
                        "rps": round(p.rps, 1),
                        "rps_min_max": [round(lo, 1), round(hi, 1)],
                        "p50_ms": round(p.p50, 3),
                        "p99_ms": round(p.p99, 3),
                        "added_p50_ms": round(p.p50 - base.p50, 3),
                        "added_p99_ms": round(p.p99 - base.p99, 3),
                        "cpu_us_per_request": round(p.cpu_us, 1),
                        "run_queue_wait_us_per_request": round(p.wait_us, 1),
                        "errors": errs,
                    }
                )
        mixfleet = [t.name for t in targets if t.name not in ("direct", "sglang-router")]
        if sg is not None and args.concurrency:
            print("\nsustained throughput vs sglang-router (same stub, same run; no target):")
            for c in args.concurrency:
                sg_p = med[("sustained", c, "sglang-router")]
                for name in mixfleet:
                    p = med[("sustained", c, name)]
                    print(
                        f"  {name:<18} at {c:>3} sessions: {p.rps / sg_p.rps:.2f}x sglang-router's requests/s"
                    )
        print("\nrouter CPU per request (us; mixfleet: per turn), median round:")
        for kind, sessions, _ in loads:
            row = [f"{t.name} {med[(kind, sessions, t.name)].cpu_us:.0f}" for t in targets[1:]]
            print(f"  {kind:<10} {sessions:>3} sessions: " + ", ".join(row))
        goals = {250.0: (2.0, 10.0), 1000.0: (4.0, None)}
        for r in rates:
            paced = (f"{r:g}/s", args.paced_sessions)
            base = med[(*paced, "direct")]
            p50_goal, p99_goal = goals.get(r, (None, None))
            goal = ", ".join(
                f"{name} <= {v:g} ms" for name, v in (("p50", p50_goal), ("p99", p99_goal)) if v is not None
            )
            print(
                f"\nadded latency at {args.paced_sessions} sessions offering {r:g} req/s"
                + (f" (target: {goal}):" if goal else ":")
            )
            for t in targets[1:]:
                p = med[(*paced, t.name)]
                print(f"  {t.name:<18} p50 {p.p50 - base.p50:+.2f} ms, p99 {p.p99 - base.p99:+.2f} ms")
        print(f"\nload average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.out is not None:
        report = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cores": os.cpu_count(),
            "baseline": sg_note,
            "load_average_start": load0,
            "load_average_end": load1,
            "points": rows,
        }
        args.out.write_text(json.dumps(report, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

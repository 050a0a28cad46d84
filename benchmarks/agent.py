"""Agent sessions: long multi-turn trajectories through the router on a stub SGLang engine.

What is measured. ``--sessions`` concurrent agents (default 256) each run ``--turns`` turns (57)
whose context grows linearly to ``--max-context`` tokens (128K). Each ``--input`` mode is one
pass of such sessions: ``full`` sends the full context every turn (the previous turn's input,
its 64 generated tokens, then new tool tokens: the router checks it against the stored
context), ``append`` only the new tool tokens (``append_ids``: the router prepends the stored
context, the previous input and output, for the engine). The stub
engine (``benchmarks/router.py``'s: the exact ``meta_info`` shape of SGLang with log-probs and
32-id sampling masks, 64 tokens a turn) answers every ``/generate`` after ``--engine-s`` seconds,
standing in for the engine's own time. Printed:

* the router's added latency p50 / p99 per turn by context size: a turn's latency through the
  router (``POST /v1/sessions/{id}/turns``, a real router process) minus the same percentile of
  the same requests sent straight to the stub (``POST /generate``), at the same concurrency; and
  that added p50 split in two: "own", the p50 of each turn's latency less its engine leg (the
  router's ``timings.engine_ms``: everything the router does besides waiting for the engine), and
  "leg", the rest (the engine leg's time over the direct request: the router's engine client and
  the whole-context body it sends, which SGLang's contract requires: ``docs/sglang-contract.md``);
  and of "own", the p50 of the dispatcher's part ("dispatch": the answer's ``timings.router_ms``,
  the context's JSON text before the engine call, the failover's bookkeeping
  after it; the rest of "own" is the server, the framework, the session, the records, the
  answer and the client's side of the connection);
* router CPU per turn (the router processes' user+system time over the turns they served, every
  worker's with ``--workers N`` on the Redis state: every session is opened before the first turn
  and finished after the last, outside that window), on
  the long sessions of each input mode and on a short-context pass (``--short-turns`` turns of ~1K
  tokens, full context); and beside it, on the long sessions, the time the router's threads spent
  runnable but waiting for a core, per turn (:func:`benchmarks.router.wait_seconds`): the part of
  the added latency that is this machine's contention (the clients and the stub share its
  cores), not the router's work;
* bytes stored per trajectory (the Redis list of its turn blocks) and served (the trainer's
  binary batch of it) against the bound ``1.2 x (context tokens x bytes of one varint id +
  generated tokens x their record bytes)``; a record's bytes are those of one generated token's
  records in a stored turn block of the stub's answer with a one-token input;
* state-store memory per 1,000 such finished, untaken sessions: the router's resident memory
  (memory state; read ``--heap-trim-interval`` and a second after the sessions, once the router
  has returned its free heap pages: :mod:`core.heap`; with 0, at once) and Redis ``used_memory``
  (Redis state), before and after the sessions;
* the trainer's take + decode time per trajectory (``POST /v1/batches/take`` of one trajectory,
  then :func:`trainer.batch.decode_batch`).

* the floor of the router's CPU per short turn, measured beside it: the libraries the router is
  built on doing the least a turn needs (:func:`serve_floor`: uvicorn with uvloop and httptools
  serving one FastAPI route whose body is validated as a list of ids, forwarded to the stub with
  aiohttp, its answer decoded with orjson and returned; no auth, records, state or metrics), and
  the router's figure as a ratio to it; and the added latency p50 of the short pass through the
  floor and through the router (each minus the same pass sent straight to the stub): what a
  turn's added latency cannot go below on this machine. The three short passes run one after the
  other, ``--rounds`` times (the median round's CPU is printed): a shared machine's speed drifts
  over minutes, so only figures measured side by side make a ratio;

* the streamed reply split (no engine, no HTTP; printed first): the router's CPU per token of a
  streamed chat reply (``stream: true``, :class:`router.chat.streaming.TextDeltas` with the chat
  model's renderer: the token's decoding and its reasoning/content deltas), at ``--stream-tokens``
  points of one reasoning reply (default 1K, 5K and 20K tokens in: the mean over the next 500
  tokens, least of 3 runs), and each as a ratio to the first: a token's cost must not grow with
  the reply's length (it did, quadratically in total, before the split resumed its scan); and
  the same at 1K and 5K ids into a reply of byte-level junk (ids of UTF-8 continuation bytes,
  which never complete a character): its cost must not grow with the run's length either;

* the same for the OpenAI chat endpoint (``POST {openai_base_url}/chat/completions``, the router
  started with a ``tiny`` checkpoint as its chat model): ``--chat-turns`` turns whose user
  messages (tool output, one token per character) grow the context to ``--chat-context`` tokens,
  each sending back the previous reply as the assistant message; its latency is set beside the
  same direct figures by context size (the raw API's, approximately the same token counts), and
  its CPU per turn includes each session's opening (one per ``--chat-turns`` turns).

Targets: added p50 <= 3 ms per turn at 128K context (a turn costs in proportion to what it
appends: the ``append`` mode; a ``full`` turn's body itself is the whole context, which the router
must decode as JSON); router CPU <= 1 ms per turn at short contexts. All processes share this
machine's cores: the figures depend on the machine and on what else runs (the load average is
printed).

The floor is what a router on these libraries cannot go below on this machine: the 1 ms target
holds only where the floor is well under it.

Run: ``.venv/bin/python benchmarks/agent.py [--sessions 256] [--turns 57] [--max-context 131072]
[--engine-s 1.0] [--state memory redis] [--input full append] [--short-turns 10] [--rounds 3]
[--workers 1] [--heap-trim-interval 5] [--stream-tokens 1000 5000 20000] [--out r.json]``
(``--out``: also write every figure as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.router import (  # noqa: E402
    N_OUT,
    SUPPORT,
    Conn,
    _event_loop_policy,
    build_request,
    cpu_seconds,
    pct,
    serve_stub,
    stub_generate_body,
    wait_seconds,
)
from core.jsonio import loads  # noqa: E402
from router.config import RouterConfig  # noqa: E402

VOCAB = 4096
VARINT_ID_BYTES = 2  # ids below 16384
BUCKETS = (8192, 32768, 65536, 98304, 1 << 62)
SAMPLING = b'"sampling_params":{"max_new_tokens":64,"top_k":32}'


OUT_IDS = [ord("a") + i % 26 for i in range(N_OUT)]  # text a chat renderer decodes and matches


def stub_body() -> bytes:
    """``benchmarks/router.py``'s stub answer with ASCII ids."""
    return stub_generate_body(OUT_IDS)


class Agent:
    """One session's growing context, kept as the JSON text of its ids (appended, never rebuilt)."""

    OUT = ",".join(str(t) for t in OUT_IDS).encode()

    def __init__(self, seed: int, turns: int, max_context: int) -> None:
        self.rng = random.Random(seed)
        self.sizes = [max(16, max_context * (t + 1) // turns) for t in range(turns)]
        self.ids = b""
        self.n = 0

    def next_body(self, turn: int, *, direct: bool, append: bool = False) -> bytes:
        """The body of turn ``turn``: the context so far, the last answer, new tool tokens (at
        least one); with ``append`` only the new tool tokens (the router stored the rest)."""
        if turn:
            self.ids += b"," + self.OUT
            self.n += N_OUT
        new = max(1, self.sizes[turn] - self.n)
        tool = ",".join(str(self.rng.randrange(1, VOCAB)) for _ in range(new)).encode()
        self.ids = tool if not self.ids else self.ids + b"," + tool
        self.n += new
        if append:
            return b'{"append_ids":[' + tool + b"]," + SAMPLING + b"}"
        extra = b',"return_logprob":true,"return_sampling_mask":true' if direct else b""
        return b'{"input_ids":[' + self.ids + b"]," + SAMPLING + extra + b"}"


def answer_seconds(answer: bytes) -> tuple[float, float]:
    """The engine leg and the dispatcher's time of a turn the router answered: its
    ``timings.engine_ms`` (from sending ``/generate`` to the engine's whole answer, as the router
    timed it) and ``timings.router_ms`` (the dispatcher's time besides that leg)."""
    timings = loads(answer)["timings"]
    return timings["engine_ms"] / 1000, timings["router_ms"] / 1000


def bucket(size: int) -> int:
    return next(b for b in BUCKETS if size <= b)


async def start_phase(i: int, spread_s: float) -> None:
    """Wait session ``i``'s start phase: a fixed random fraction of ``spread_s`` (the engine's time
    per turn), so the sessions' turns do not reach the router in lockstep (the stub answers after
    exactly ``--engine-s``); the direct and router passes share the phases."""
    await asyncio.sleep(random.Random(f"phase-{i}").random() * spread_s)


@dataclass(frozen=True)
class Pass:
    """One pass of :func:`run_agents`: latencies by context bucket, the session ids, and the
    router's CPU seconds and run-queue wait (:func:`benchmarks.router.wait_seconds`) over the turns
    alone (its sessions' opening and finishing excluded; None without a router pid)."""

    lat: dict[int, list[float]]
    sids: list[str]
    turn_cpu_s: float | None = None
    turn_wait_s: float | None = None


async def run_agents(
    port: int,
    auth: dict[str, str],
    sessions: int,
    turns: int,
    max_context: int,
    direct: bool,
    append: bool = False,
    spread_s: float = 0.0,
    own: dict[int, list[tuple[float, float]]] | None = None,
    pid: int | None = None,
) -> Pass:
    """Every agent's turns, concurrently (``append``: as appended tokens), each from its start
    phase (:func:`start_phase` over ``spread_s``), in three steps: every session is opened, every
    agent runs its turns, every session is finished. ``own`` (a router pass): each turn's latency
    less its engine leg, and its dispatcher's time (:func:`answer_seconds`), by context bucket.
    ``pid``: the router process whose CPU time over the turns step is measured."""
    lat: dict[int, list[float]] = {}
    conns = [await Conn.open(port) for _ in range(sessions)]
    sids: list[str] = []
    try:
        if not direct:
            sids = list(await asyncio.gather(*(_open_session(c, auth) for c in conns)))
        paths = [f"/v1/sessions/{sid}/turns" for sid in sids] or ["/generate"] * sessions

        async def one(i: int) -> None:
            agent = Agent(i, turns, max_context)
            await start_phase(i, spread_s)
            for t in range(turns):
                body = agent.next_body(t, direct=direct, append=append)
                t0 = time.perf_counter()
                status, data = await conns[i].send(build_request("POST", paths[i], body, auth))
                seconds = time.perf_counter() - t0
                lat.setdefault(bucket(agent.n), []).append(seconds)
                assert status == 200, data[:300]
                if own is not None:
                    engine, dispatch = answer_seconds(data)
                    own.setdefault(bucket(agent.n), []).append((seconds - engine, dispatch))

        cpu0, wait0 = (cpu_seconds(pid), wait_seconds(pid)) if pid else (0.0, 0.0)
        await asyncio.gather(*(one(i) for i in range(sessions)))
        turn_cpu = cpu_seconds(pid) - cpu0 if pid else None
        turn_wait = wait_seconds(pid) - wait0 if pid else None
        await asyncio.gather(*(_finish_session(c, sid, auth) for c, sid in zip(conns, sids, strict=False)))
    finally:
        for c in conns:
            c.close()
    return Pass(lat, sids, turn_cpu, turn_wait)


async def _open_session(conn: Conn, auth: dict[str, str]) -> str:
    status, data = await conn.send(build_request("POST", "/v1/sessions", b"{}", auth))
    assert status == 200, data
    return json.loads(data)["session_id"]


async def _finish_session(conn: Conn, sid: str, auth: dict[str, str]) -> None:
    request = build_request("POST", f"/v1/sessions/{sid}/finish", b'{"reward":1.0}', auth)
    status, data = await conn.send(request)
    assert status == 200, data


class ChatAgent:
    """One session over the OpenAI chat endpoint: the messages so far, kept as JSON text; each
    turn adds the last reply as the assistant message and a new user message of tool output."""

    def __init__(self, seed: int, turns: int, max_context: int) -> None:
        self.rng = random.Random(seed)
        self.sizes = [max(16, max_context * (t + 1) // turns) for t in range(turns)]
        self.messages = b""
        self.n = 0

    def next_body(self, turn: int, reply: str | None) -> bytes:
        if reply is not None:
            self.messages += b"," + json.dumps({"role": "assistant", "content": reply}).encode()
            self.n += N_OUT
        text = "".join(self.rng.choice("abcdefghij klmnop") for _ in range(self.sizes[turn] - self.n))
        user = json.dumps({"role": "user", "content": text}).encode()
        self.messages = user if not self.messages else self.messages + b"," + user
        self.n = self.sizes[turn]
        return b'{"model":"stub","max_tokens":64,"top_p":0.9,"messages":[' + self.messages + b"]}"


async def run_chat_agents(
    port: int, auth: dict[str, str], sessions: int, turns: int, max_context: int, spread_s: float = 0.0
) -> dict[int, list[float]]:
    """As :func:`run_agents` through ``POST {openai_base_url}/chat/completions``."""
    lat: dict[int, list[float]] = {}

    async def one(i: int) -> None:
        conn = await Conn.open(port)
        agent = ChatAgent(i, turns, max_context)
        try:
            status, data = await conn.send(build_request("POST", "/v1/sessions", b"{}", auth))
            assert status == 200, data
            sid = json.loads(data)["session_id"]
            path = f"/v1/sessions/{sid}/openai/v1/chat/completions"
            await start_phase(i, spread_s)
            reply = None
            for t in range(turns):
                request = build_request("POST", path, agent.next_body(t, reply), auth)
                t0 = time.perf_counter()
                status, data = await conn.send(request)
                lat.setdefault(bucket(agent.n), []).append(time.perf_counter() - t0)
                assert status == 200, data[:300]
                reply = json.loads(data)["choices"][0]["message"]["content"]
        finally:
            conn.close()

    await asyncio.gather(*(one(i) for i in range(sessions)))
    return lat


def record_bytes() -> float:
    """Bytes of one generated token's records in a stored turn block (stub answer, 1-id input)."""
    from router.engine_answer import parse_turn
    from router.records import encode_stored

    body = json.loads(stub_body())
    turn = parse_turn(body, index=0, group="g", replica="r", input_ids=[1], moved_from=None, timings={})
    blob, _ = encode_stored(turn)  # the router's default: float32 support log-probs
    return len(blob) / N_OUT


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def trajectory_bytes(redis_url: str | None, sids: list[str], n: int) -> list[int]:
    """Bytes of the stored turn blocks of the first ``n`` sessions (Redis state only)."""
    if redis_url is None:
        return []
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    try:
        return [sum(len(b) for b in await r.lrange(f"mf:s:{sid}:t", 0, -1)) for sid in sids[:n]]
    finally:
        await r.aclose()


async def redis_memory(redis_url: str | None) -> int:
    if redis_url is None:
        return 0
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    try:
        return int((await r.info("memory"))["used_memory"])
    finally:
        await r.aclose()


async def take_and_decode(url: str, key: str, n: int) -> tuple[list[float], list[float], list[int]]:
    """``n`` takes of one trajectory each: take seconds, decode seconds, bytes served."""
    from trainer.batch import decode_batch
    from trainer.client import RECORDS_MEDIA_TYPE, AsyncRolloutClient

    takes, decodes, sizes = [], [], []
    async with AsyncRolloutClient(url, key) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            answer = await client.router.request(
                "POST", "/v1/batches/take", {"size": 1}, accept=RECORDS_MEDIA_TYPE
            )
            content = answer.content
            t1 = time.perf_counter()
            batch = decode_batch(content)
            decodes.append(time.perf_counter() - t1)
            takes.append(t1 - t0)
            sizes.append(len(content))
            if batch.lease_id is not None:
                await client.ack(batch.lease_id)
    return takes, decodes, sizes


def streamed_split(chat_model: Path, points: list[int]) -> dict[str, float]:
    """Router CPU per streamed token (µs) at each of ``points`` tokens into one reasoning reply
    (module docstring), printed with its ratio to the first point's."""
    from router.chat.renderers import load_renderer

    renderer = load_renderer(chat_model)
    rng = random.Random(0)
    words = [
        "the",
        "tool",
        "output",
        "shows",
        "a",
        "failing",
        "test",
        "so",
        "next",
        "I",
        "read",
        "the",
        "file",
        "and",
        "check",
        "it",
    ]
    text, n = ["<think>\n"], 0
    while n < (max(points) + 600) * 6:
        text.append(" ".join(rng.choice(words) for _ in range(rng.randrange(4, 16))) + ".\n")
        n += len(text[-1])
    ids = renderer.encode("".join(text))
    out = _split_cost(renderer, ids, points)
    first = out[str(points[0])]
    print("streamed reply split: router CPU per token of a streamed reasoning reply")
    for point in points:
        print(
            f"  {point:>6} tokens in: {out[str(point)]:6.2f} us  ({out[str(point)] / first:.2f}x the first)"
        )
    return out


def _split_cost(renderer, ids: list[int], points) -> dict[str, float]:
    """Router CPU per streamed token (µs) at each of ``points`` ids into ``ids``: the mean over the
    next 500 ids fed one at a time to a :class:`TextDeltas` fed the ids before, least of 3 runs."""
    from router.chat.streaming import TextDeltas

    out: dict[str, float] = {}
    for point in points:
        best = float("inf")
        for _ in range(3):
            deltas = TextDeltas(renderer)
            deltas.feed(ids[:point])
            cpu = time.process_time()
            for tok in ids[point : point + 500]:
                deltas.feed([tok])
            best = min(best, (time.process_time() - cpu) / 500)
        out[str(point)] = round(best * 1e6, 2)
    return out


JUNK_POINTS = (1000, 5000)
"""Points of the streamed junk split, in ids."""


def streamed_junk(chat_model: Path) -> dict[str, float]:
    """Router CPU per streamed token (µs) at each of :data:`JUNK_POINTS` ids into a reply of
    byte-level junk: ids of UTF-8 continuation bytes, a run of which never completes a character
    (the mean over the next 500 ids, least of 3 runs)."""
    from router.chat.renderers import load_renderer

    renderer = load_renderer(chat_model)
    pool = [t for t in range(4096) if (b := renderer.token_bytes(t)) and all(0x80 <= x < 0xC0 for x in b)]
    rng = random.Random(0)
    ids = [rng.choice(pool) for _ in range(max(JUNK_POINTS) + 500)]
    out = _split_cost(renderer, ids, JUNK_POINTS)
    print("streamed junk split: router CPU per token of a streamed reply of ids that complete no character")
    for point in JUNK_POINTS:
        print(f"  {point:>6} ids in: {out[str(point)]:6.2f} us")
    return out


def _ms(x: float) -> str:
    return f"{x * 1000:8.2f}"


def report_latency(
    router: dict[int, list[float]],
    direct: dict[int, list[float]],
    own: dict[int, list[tuple[float, float]]] | None = None,
) -> list[dict]:
    """Print the latency table by context bucket; its rows (milliseconds). With ``own``
    (:func:`run_agents`), also the p50 of each turn's latency outside its engine leg ("own": the
    router's receiving, checks, records, state write and answer, and the client's side of the
    connection), the rest of the added p50 ("leg": added p50 - own p50, the engine leg's time
    over the direct request: the router's engine client and the body it sends), and the p50 of the
    dispatcher's part of "own" ("dispatch": :func:`answer_seconds`)."""
    head = "  context <=   turns   router p50/p99 ms   direct p50/p99 ms   added p50/p99 ms"
    print(head + ("   own p50  leg p50  dispatch p50" if own else ""))
    rows = []
    for b in sorted(router):
        r, d = router[b], direct.get(b, [])
        added = (pct(r, 0.5) - pct(d, 0.5), pct(r, 0.99) - pct(d, 0.99))
        label = "max" if b == BUCKETS[-1] else f"{b // 1024}K"
        split: tuple[float, ...] = ()
        if own:
            mine = pct([x for x, _ in own[b]], 0.5)
            split = (mine, added[0] - mine, pct([x for _, x in own[b]], 0.5))
        print(
            f"  {label:>9} {len(r):7d} {_ms(pct(r, 0.5))} {_ms(pct(r, 0.99))}   "
            f"{_ms(pct(d, 0.5))} {_ms(pct(d, 0.99))}   {_ms(added[0])} {_ms(added[1])}"
            + "".join(f" {_ms(x)}" for x in split)
        )
        ms = [round(x * 1000, 3) for x in (pct(r, 0.5), pct(r, 0.99), pct(d, 0.5), pct(d, 0.99), *added)]
        keys = ("router_p50_ms", "router_p99_ms", "direct_p50_ms", "direct_p99_ms")
        parts = ("own_p50_ms", "leg_p50_ms", "dispatch_p50_ms")
        rows.append(
            {"context_le": label, "turns": len(r), **dict(zip(keys, ms, strict=False))}
            | {"added_p50_ms": ms[4], "added_p99_ms": ms[5]}
            | {k: round(x * 1000, 3) for k, x in zip(parts, split, strict=False)}
        )
    return rows


class FloorTurn(BaseModel):
    """The floor's turn body: the ids validated as a list of ints, the sampling parameters as given."""

    input_ids: list[int]
    sampling_params: dict = {}


def serve_floor(port: int, stub_port: int) -> None:
    """The floor of the router's CPU per turn (the module's docstring): ``POST /v1/sessions``,
    ``.../turns`` (validated ``input_ids``, forwarded to the stub's ``/generate``, the answer decoded
    and returned as it came) and ``.../finish`` on uvicorn, the router's own server settings, through
    the router's engine connection pool (:func:`clients.engine.make_http_client`: aiohttp's default
    of 100 connections would queue the turns of more sessions than that)."""
    import aiohttp
    import orjson
    import uvicorn
    from fastapi import FastAPI, Response

    from clients.engine import make_http_client

    app = FastAPI()
    url = f"http://127.0.0.1:{stub_port}/generate"
    pool: list[aiohttp.ClientSession] = []

    @app.post("/v1/sessions")
    async def create() -> dict:
        return {"session_id": secrets.token_hex(8)}

    @app.post("/v1/sessions/{sid}/turns")
    async def turn(sid: str, body: FloorTurn) -> Response:
        if not pool:  # the router's pool settings (its connection limit above all)
            pool.append(make_http_client())
        payload = {
            "input_ids": body.input_ids,
            "sampling_params": body.sampling_params,
            "return_logprob": True,
        }
        headers = {"content-type": "application/json"}
        async with pool[0].post(url, data=orjson.dumps(payload), headers=headers) as r:
            answer = await r.read()
        orjson.loads(answer)
        return Response(answer, media_type="application/json")

    @app.post("/v1/sessions/{sid}/finish")
    async def finish(sid: str) -> dict:
        return {"session_id": sid}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")


def start_floor(stack: contextlib.ExitStack, stub_port: int) -> tuple[int, int]:
    """The floor (:func:`serve_floor`) in its own process; its port and pid."""
    from benchmarks.router import _wait, spawn
    from tests.support.procs import free_port

    port = free_port()
    argv = [sys.executable, __file__, "--serve-floor", str(port), "--stub-port", str(stub_port)]
    proc = stack.enter_context(spawn(argv))
    _wait(f"http://127.0.0.1:{port}/docs", proc)
    return port, proc.pid


def _all(lat: dict[int, list[float]]) -> list[float]:
    return [x for xs in lat.values() for x in xs]


async def measure_short(
    args: argparse.Namespace, router: tuple[int, int], auth: dict[str, str], floor: tuple[int, int]
) -> dict:
    """The short pass (``--short-turns`` turns to ~1K tokens) ``--rounds`` times, each round sent
    straight to the stub, through the floor and through the router, one after the other (the
    machine's speed drifts over minutes: a ratio holds only between passes run side by side). The
    median round's CPU per turn of each, and the added p50 of each over all rounds."""
    n = args.sessions * args.short_turns
    cpu: dict[str, list[float]] = {"floor": [], "router": []}
    lat: dict[str, list[float]] = {"direct": [], "floor": [], "router": []}
    targets = {"direct": (args.stub_port, None, {}), "floor": (*floor, {}), "router": (*router, auth)}
    for _ in range(args.rounds):
        for name, (port, pid, headers) in targets.items():
            done = await run_agents(
                port,
                headers,
                args.sessions,
                args.short_turns,
                1024,
                name == "direct",
                spread_s=args.engine_s,
                pid=pid,
            )
            lat[name] += _all(done.lat)
            if pid is not None:
                cpu[name].append(done.turn_cpu_s / n)
    floor_s, router_s = (pct(cpu[k], 0.5) for k in ("floor", "router"))
    added = {k: pct(lat[k], 0.5) - pct(lat["direct"], 0.5) for k in ("floor", "router")}
    print(
        f"  router CPU per turn (short pass, context <= 1K): {router_s * 1000:.2f} ms (target <= 1 ms); "
        f"{router_s / floor_s:.2f} x the floor's {floor_s * 1000:.2f} ms (median of {args.rounds} rounds)"
    )
    print(
        f"  added p50 on the short pass: {added['router'] * 1000:.2f} ms "
        f"(the floor's: {added['floor'] * 1000:.2f} ms)"
    )
    return {
        "short_cpu_ms_per_turn": round(router_s * 1000, 3),
        "floor_cpu_ms_per_turn": round(floor_s * 1000, 3),
        "short_cpu_vs_floor": round(router_s / floor_s, 3),
        "short_added_p50_ms": round(added["router"] * 1000, 3),
        "floor_short_added_p50_ms": round(added["floor"] * 1000, 3),
    }


def start_router(
    stack: contextlib.ExitStack,
    preset: Path,
    state: str,
    key: str,
    log: Path,
    chat_model: Path,
    workers: int = 1,
    heap_trim_s: float = RouterConfig.heap_trim_s or 0.0,
) -> tuple[int, int]:
    """A real ``mixfleet router`` (its chat model: ``chat_model``; ``workers`` processes); its port
    and pid (with workers, their supervisor's: :func:`cpu_seconds` counts the workers below it)."""
    from benchmarks.router import _wait, spawn
    from tests.support.procs import free_port, mixfleet_argv

    port = free_port()
    argv = mixfleet_argv("router", "--preset", str(preset), "--port", str(port), "--log-level", "warning")
    argv += [
        "--chat-model",
        str(chat_model),
        "--vocab-size",  # the stub's (its ids are drawn from it), not the chat model's
        str(VOCAB),
        "--workers",
        str(workers),
        "--heap-trim-interval",
        str(heap_trim_s),
    ]
    env = {"MIXFLEET_API_KEYS": json.dumps({key: ["rollout", "trainer", "admin"]})}
    proc = stack.enter_context(spawn([*argv, "--state", state], env=env, log=log))
    _wait(f"http://127.0.0.1:{port}/healthz", proc)
    time.sleep(1.5)  # the first health poll puts the stub in rotation
    return port, proc.pid


async def measure_state(
    args: argparse.Namespace,
    port: int,
    pid: int,
    key: str,
    redis_url: str | None,
    direct: dict[int, list[float]],
    floor: tuple[int, int],
) -> dict:
    """The long sessions of each input mode, then the short pass beside the ``floor`` (its port and
    pid), the chat pass and the trainer's takes, through one router; every figure printed, and
    returned."""
    auth = {"authorization": f"Bearer {key}"}
    out: dict = {}
    bound = 1.2 * ((args.max_context + N_OUT) * VARINT_ID_BYTES + args.turns * N_OUT * record_bytes())
    for mode in args.input:
        print(f"  {mode} context per turn ({'input_ids' if mode == 'full' else 'append_ids'}):")
        fresh = mode == args.input[0]  # the router's RSS says what the state holds only on its first pass
        out[mode] = await measure_long(
            args, port, pid, auth, redis_url, direct, mode == "append", bound, fresh
        )
    if args.short_turns:
        out |= await measure_short(args, (port, pid), auth, floor)
    if args.chat_turns:
        cpu0 = cpu_seconds(pid)
        chat = await run_chat_agents(
            port, auth, args.sessions, args.chat_turns, args.chat_context, args.engine_s
        )
        n_chat = args.sessions * args.chat_turns
        per_turn = (cpu_seconds(pid) - cpu0) / n_chat
        print(f"  OpenAI chat endpoint, {args.chat_turns} turns to {args.chat_context} tokens:")
        out["chat"] = {"latency": report_latency(chat, direct), "cpu_ms_per_turn": round(per_turn * 1000, 3)}
        print(f"  router CPU per chat turn: {per_turn * 1000:.2f} ms over {n_chat} turns")
    takes, decodes, sizes = await take_and_decode(f"http://127.0.0.1:{port}", key, min(8, args.sessions))
    served = sum(sizes) / len(sizes)
    print(
        f"  bytes served per trajectory (binary batch): {served / 1e6:.2f} MB "
        f"(bound {bound / 1e6:.2f} MB: {served / bound:.2f} x)"
    )
    print(
        f"  trainer take + decode per trajectory: {_ms(pct(takes, 0.5)).strip()} + "
        f"{_ms(pct(decodes, 0.5)).strip()} ms (p50 of {len(takes)})"
    )
    out["served_bytes_per_trajectory"] = served
    out["bound_bytes"] = bound
    out["take_ms"] = round(pct(takes, 0.5) * 1000, 3)
    out["decode_ms"] = round(pct(decodes, 0.5) * 1000, 3)
    return out


async def measure_long(
    args: argparse.Namespace,
    port: int,
    pid: int,
    auth: dict[str, str],
    redis_url: str | None,
    direct: dict[int, list[float]],
    append: bool,
    bound: float,
    fresh: bool,
) -> dict:
    """One pass of the long sessions (``append``: as appended tokens): latency, CPU, memory and
    bytes stored. Memory state's figure is the router's RSS growth, measured only when ``fresh``
    (its first pass: later ones reuse the memory the allocator kept from earlier ones)."""
    mem0 = await redis_memory(redis_url) if redis_url else rss_bytes(pid)
    own: dict[int, list[tuple[float, float]]] = {}
    done = await run_agents(
        port,
        auth,
        args.sessions,
        args.turns,
        args.max_context,
        direct=False,
        append=append,
        spread_s=args.engine_s,
        own=own,
        pid=pid,
    )
    cpu, sids = done.turn_cpu_s, done.sids
    if not redis_url and fresh:
        await asyncio.sleep(args.heap_trim_interval + 1.0 if args.heap_trim_interval else 0.0)
    mem = (await redis_memory(redis_url) if redis_url else rss_bytes(pid)) - mem0
    out: dict = {"latency": report_latency(done.lat, direct, own)}
    n_turns = args.sessions * args.turns
    wait = done.turn_wait_s or 0.0
    print(
        f"  router CPU per turn (long sessions): {cpu / n_turns * 1000:.2f} ms over {n_turns} turns; "
        f"waiting for a core (run queue): {wait / n_turns * 1000:.2f} ms"
    )
    out["cpu_ms_per_turn"] = round(cpu / n_turns * 1000, 3)
    out["run_queue_wait_ms_per_turn"] = round(wait / n_turns * 1000, 3)
    if redis_url or fresh:
        where = "Redis used_memory" if redis_url else "router RSS"
        per_1000 = mem / args.sessions * 1000
        print(f"  state memory per 1,000 finished sessions ({where}): {per_1000 / 2**30:.2f} GiB")
        out["state_bytes_per_1000_sessions"] = per_1000
    stored = await trajectory_bytes(redis_url, sids, 8)
    if stored:
        mean = sum(stored) / len(stored)
        mb, ratio = mean / 1e6, mean / bound
        print(f"  bytes stored per trajectory: {mb:.2f} MB (bound {bound / 1e6:.2f} MB: {ratio:.2f} x)")
        out["stored_bytes_per_trajectory"] = mean
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=57)
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--engine-s", type=float, default=1.0, help="the stub engine's time per turn")
    ap.add_argument("--short-turns", type=int, default=10, help="turns of the short pass (0: none)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the short pass beside the floor")
    ap.add_argument("--chat-turns", type=int, default=57, help="turns of the chat pass (0: none)")
    ap.add_argument("--chat-context", type=int, default=131072, help="context of the chat pass's last turn")
    ap.add_argument("--state", nargs="+", default=["memory", "redis"], choices=["memory", "redis"])
    ap.add_argument("--input", nargs="+", default=["full", "append"], choices=["full", "append"])
    ap.add_argument(
        "--workers", type=int, default=1, help="router processes of the Redis state (memory state: one)"
    )
    ap.add_argument(
        "--heap-trim-interval",
        type=float,
        default=RouterConfig.heap_trim_s or 0.0,
        help="the router's --heap-trim-interval (0: never)",
    )
    ap.add_argument(
        "--stream-tokens",
        type=int,
        nargs="*",
        default=[1000, 5000, 20000],
        help="points of the streamed reply split, in tokens (none: skip it)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write every figure here as JSON")
    ap.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-floor", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stub-port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name in ("sessions", "turns", "max_context", "rounds", "workers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("short_turns", "chat_turns"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be at least 0")
    if any(n < 1 for n in args.stream_tokens):
        ap.error("--stream-tokens must be at least 1 each")
    if args.serve_floor:
        serve_floor(args.serve_floor, args.stub_port)
        return 0
    _event_loop_policy()
    if args.serve_stub:
        asyncio.run(serve_stub(args.serve_stub, stub_body(), args.engine_s, VOCAB))
        return 0
    from benchmarks.router import _wait, spawn
    from tests.support.procs import free_port, mixfleet_argv, redis_server
    from tests.support.router import write_preset

    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    key = secrets.token_hex(16)
    chat_model = tmp / "chat-model"
    subprocess.run(mixfleet_argv("init-model", str(chat_model), "--preset", "tiny"), check=True)
    with contextlib.ExitStack() as stack:
        stub_port = free_port()
        argv = [sys.executable, __file__, "--serve-stub", str(stub_port), "--engine-s", str(args.engine_s)]
        stub = stack.enter_context(spawn(argv))
        _wait(f"http://127.0.0.1:{stub_port}/health", stub)
        groups = [
            {"name": "stub", "sessions_per_replica": 100_000, "replicas": [f"http://127.0.0.1:{stub_port}"]}
        ]
        preset = write_preset(tmp / "p.toml", groups)
        print(
            f"agent benchmark: {args.sessions} sessions x {args.turns} turns, context growing to "
            f"{args.max_context} tokens; stub engine {args.engine_s:g} s a turn, {N_OUT} tokens with "
            f"{SUPPORT}-id masks; {os.cpu_count()} cores shared by stub, router(s), Redis and client; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        report: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        report["load_average_start"] = os.getloadavg()
        if args.stream_tokens:
            report["stream_us_per_token"] = streamed_split(chat_model, args.stream_tokens)
            report["stream_junk_us_per_token"] = streamed_junk(chat_model)
        direct = asyncio.run(
            run_agents(
                stub_port, {}, args.sessions, args.turns, args.max_context, True, spread_s=args.engine_s
            )
        ).lat
        args.stub_port = stub_port
        floor = start_floor(stack, stub_port)
        for kind in args.state:
            redis_url = stack.enter_context(redis_server()) if kind == "redis" else None
            log = tmp / f"router-{kind}.log"
            workers = args.workers if redis_url else 1
            port, pid = start_router(
                stack, preset, redis_url or "memory", key, log, chat_model, workers, args.heap_trim_interval
            )
            print(f"\n{kind} state{f' ({workers} router processes)' if workers > 1 else ''}:")
            report[kind] = asyncio.run(measure_state(args, port, pid, key, redis_url, direct, floor))
        report["load_average_end"] = os.getloadavg()
        print(f"load average at the end: {report['load_average_end'][0]:.1f}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Soak and chaos: a fleet run for a chosen time under agents, a trainer and scheduled faults.

``.venv/bin/python benchmarks/soak.py --duration 3600 [--agents 24] [--chat-agents 8] [--turns 12]
[--out soak.json]``

The fleet is the production one on one machine, supervised the way Modal supervises it: a Redis
server (append-only file, fsync always), ``mixfleet router --workers 2 --state redis://``, and one
``mixfleet replica`` per group of the local preset (stage, the local CPU engine, the sidecar and its
reconciler; a replica whose engine or sidecar dies exits, and this script starts it again, as Modal
replaces a container). Each replica is registered through a small pass-through proxy of this script
(its ``--advertise-url``), which can answer 500s for a while: the replica that "answers 500s".

Load, at the study's shape scaled down: ``--agents`` concurrent multi-turn sessions, each of
``--turns`` turns, then a finish with a reward; a trainer takes batches of ``--batch``
trajectories, acknowledges them and publishes a new version after every batch. Two kinds of agent:

* token agents (``--agents`` less ``--chat-agents``) call the token API (``POST
  /v1/sessions/{id}/turns``) with the whole context as ids, appending ``--gen`` generated and
  ``--tool`` tool tokens a turn (contexts grow to ``prompt + turns x (gen + tool)`` tokens); a
  failed turn is resynced from the recorded trajectory;
* chat agents (``--chat-agents``, default a third of ``--agents``; ``--short``: 2) are what a
  harness does: the official ``openai`` client (``AsyncOpenAI``, ``max_retries=5``) on the
  session's ``openai_base_url``, one Chat Completions call a turn with the whole conversation
  (each reply sent back as returned, then a user message of about ``--tool`` characters, or a
  tool result per tool call), ``max_tokens`` ``--gen``; every other chat agent streams
  (``stream=True``). Each call carries an ``Idempotency-Key`` (``extra_headers``), kept on the
  client's own retries and on the agent's (same key, for up to :data:`CHAT_RETRY_S`), so a turn
  the router recorded before a failure is answered again rather than sampled twice. The router
  serves the chat APIs with the fleet's base policy as ``--chat-model``, as ``mixfleet up`` does.

Faults, one every ``--fault-every`` seconds, in this order, cycling: an engine SIGKILL, a sidecar
SIGKILL, a router worker SIGKILL (uvicorn starts another), a redis-server restart (same port and
append-only file), a publish whose conversion process is SIGKILLed while it converts, a slow
replica (its engine SIGSTOPped and SIGCONTed, half of every second, for ``--fault-s``), a replica
answering 500 to every request for ``--fault-s``.

Printed at the end (and written to ``--out`` as JSON): turns and trajectories served; trajectories
lost (finished by an agent, never delivered to the trainer), duplicated (acknowledged twice) and
incomplete (delivered with a different number of turns than the agent completed), chat sessions
included, and ``forks``: forked turns in the chat trajectories delivered (the router did not see a
request's history as an extension of the recorded turns) -- all four must be 0; per chat agent
(``chat``) its sessions, turns, forks, the errors that reached it past the client's retries and
the sessions it gave up; turns failed over and failed for the agent; versions published (each
publish's start, seconds and outcome; ``--short`` runs on until one succeeds after the last fault
recovered, for up to 2 min) and the versions every replica activated; router (all processes) and
redis memory at start, middle and end; and for each fault the fleet's added latency per turn (the
agent's wall time of the turn minus the engine's time of the attempt that answered,
``timings.engine_ms``: routing, failover, retries, recording, HTTP) p50 / p99 in the 30 s before
it, during it (until its recovery plus 10 s) and in the 30 s after (token turns: a chat reply has
no engine time; a chat turn's wall time overall is ``chat.turn_ms``); and ``turn_replays``: the
keyed retries the router answered with the turn recorded under their key (its
``mixfleet_router_turn_replays_total``: ``found``, nothing sampled; ``raced``, a sample discarded).

Acknowledged trajectories stay in the state store for the router's ``--retention`` (``--retention``
here, default 600 s; the router's own default is an hour), so its memory levels off once the run
is longer than that (``memory_series`` in the JSON has a sample every 30 s).

``--short`` (a few minutes: fewer agents and turns, one round of faults) is what the suite runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.errors import UserError  # noqa: E402
from launcher.children import Child, spawn, stop  # noqa: E402

# Every port the soak hands out lies below the kernel's ephemeral range (the suite's block of this
# pytest worker, or all of TEST_PORTS run alone): a port picked there is not taken by another
# process's outgoing connection in the seconds before its server binds it.
from tests.support.procs import descendants, free_port  # noqa: E402

RUN = "soak"
# A lease whose answer the trainer never got (a router worker killed mid-take) is redelivered after
# this; the drain at the end waits for it.
LEASE_TIMEOUT_S = 30
# A chat agent sends a failed turn again (same Idempotency-Key) for this long before it gives the
# session up: longer than a replica's restart under load (the slowest fault).
CHAT_RETRY_S = 120.0
GROUPS = ("cpu-bf16", "cpu-fp8", "cpu-nvfp4")
FAULTS = (
    "engine_kill",
    "sidecar_kill",
    "router_worker_kill",
    "redis_restart",
    "publish_kill",
    "slow",
    "errors",
)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float
    agents: int
    turns: int
    gen: int
    tool: int
    batch: int
    fault_every_s: float
    out: Path | None
    fault_s: float = 20.0  # how long a slow or failing replica stays so
    retention_s: float = 600.0  # the router's --retention: acknowledged trajectories kept this long
    seed: int = 0
    chat_agents: int = 0  # of the ``agents``, those that chat through the OpenAI API (the rest: tokens)


@dataclass
class FaultRecord:
    name: str
    at: float
    recovered_at: float | None = None
    detail: str = ""


@dataclass
class ChatCount:
    """What one chat agent saw: its finished sessions and turns, the errors that reached it (after
    the client's own retries), its sessions given up (a turn still failing after
    :data:`CHAT_RETRY_S`, or refused), and the forked turns of its trajectories the trainer got."""

    stream: bool
    sessions: int = 0
    turns: int = 0
    errors: Counter = field(default_factory=Counter)
    abandoned: int = 0
    forks: int = 0


@dataclass
class Tally:
    """What the agents and the trainer saw (the figures the run is judged by)."""

    turns: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, added ms, moved)
    turn_errors: Counter = field(default_factory=Counter)
    finished: dict[str, int] = field(default_factory=dict)  # session -> turns the agent completed
    delivered: Counter = field(default_factory=Counter)  # session -> times acknowledged
    delivered_turns: dict[str, int] = field(default_factory=dict)
    chat: list[ChatCount] = field(default_factory=list)  # one per chat agent
    chat_owner: dict[str, int] = field(default_factory=dict)  # chat session -> its agent's index
    chat_turn_ms: list[float] = field(default_factory=list)  # a chat turn's wall time at the agent
    forked: dict[str, int] = field(default_factory=dict)  # chat session -> forked turns delivered
    published: list[int] = field(default_factory=list)
    publish_errors: list[str] = field(default_factory=list)
    publish_s: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, seconds, ok)
    memory: list[dict[str, float]] = field(default_factory=list)


# ------------------------------------------------------------------------------ processes


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


class Redis:
    """A redis-server on a free port with an append-only file in ``dir``; :meth:`restart` keeps both."""

    def __init__(self, workdir: Path) -> None:
        self.dir, self.port = workdir, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while (
            subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout
            != b"PONG\n"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)

    def restart(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.start()

    def used_mb(self) -> float:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), "info", "memory"], capture_output=True, text=True
        )
        for line in out.stdout.splitlines():
            if line.startswith("used_memory:"):
                return int(line.split(":")[1]) / 2**20
        return float("nan")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


class Proxy:
    """A pass-through HTTP proxy in front of one sidecar (aiohttp); while ``failing`` it answers 500."""

    def __init__(self, target_port: int) -> None:
        self.port, self.target = free_port(), f"http://127.0.0.1:{target_port}"
        self.failing = False
        self._runner: Any = None
        self._http: Any = None

    async def start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _forward(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        if self.failing:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        try:
            async with self._http.request(
                request.method, self.target + request.path_qs, headers=headers, data=await request.read()
            ) as resp:
                body = await resp.read()
                keep = {k: v for k, v in resp.headers.items() if k.lower() == "content-type"}
                return web.Response(status=resp.status, body=body, headers=keep)
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": f"proxy: {exc}"}}, status=502)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()


@dataclass
class ReplicaProc:
    group: str
    public_port: int
    proxy: Proxy
    child: Child | None = None
    restarts: int = 0


class Fleet:
    """Redis, the router (2 workers) and one supervised replica per group, in ``workdir``."""

    def __init__(self, workdir: Path, retention_s: float) -> None:
        self.dir = workdir
        self.retention_s = retention_s
        self.redis = Redis(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key, self.replica_key = os.urandom(16).hex(), os.urandom(16).hex()
        self.router: Child | None = None
        self.replicas = [ReplicaProc(g, free_port(), Proxy(0)) for g in GROUPS]
        for r in self.replicas:
            r.proxy = Proxy(r.public_port)
        self.base = workdir / "base"
        self.logs = workdir / "logs"

    def start(self) -> None:
        from mixfleet.init_model import write_model
        from weight_sync.publish import bootstrap
        from weight_sync.store.local import LocalStore

        write_model(self.base, "tiny")
        bootstrap(LocalStore(self.dir / "store"), RUN, self.base, ["bf16", "fp8", "nvfp4"])
        self.redis.start()
        keys = json.dumps({self.key: ["rollout", "trainer", "admin"], self.replica_key: ["replica"]})
        env = {"MIXFLEET_API_KEYS": keys, "MIXFLEET_STORE": str(self.dir / "store"), "MIXFLEET_RUN": RUN}
        argv = ["router", "--preset", "local", "--port", str(self.port), "--workers", "2"]
        argv += [
            "--state",
            self.redis.url,
            "--heartbeat-timeout",
            "5",
            "--lease-timeout",
            str(LEASE_TIMEOUT_S),
            "--retention",
            str(self.retention_s),
            "--chat-model",  # the base policy's tokenizer and chat template, as `mixfleet up` gives it
            str(self.base),
        ]
        self.router = spawn("router", argv, self.logs / "router.log", env)
        for r in self.replicas:
            self.start_replica(r)

    def start_replica(self, r: ReplicaProc) -> None:
        argv = ["replica", "--preset", "local", "--group", r.group, "--store", str(self.dir / "store")]
        argv += [
            "--run",
            RUN,
            "--port",
            str(r.public_port),
            "--engine-port",
            str(free_port()),
            "--stage-dir",
            str(self.dir / "staging" / r.group),
        ]
        argv += ["--router", self.url, "--replica-id", f"soak-{r.group}"]
        argv += ["--advertise-url", f"http://127.0.0.1:{r.proxy.port}", "--log-dir", str(self.logs)]
        r.child = spawn(f"replica-{r.group}", argv, self.logs / f"replica-{r.group}.log",
                        {"MIXFLEET_API_KEY": self.replica_key})  # fmt: skip

    def supervise(self) -> None:
        """Start again every replica whose process exited (Modal replacing a container)."""
        for r in self.replicas:
            if r.child is not None and r.child.returncode() is not None:
                r.restarts += 1
                self.start_replica(r)

    def router_pids(self) -> list[int]:
        """The router's processes: its main process and its workers (not conversion processes)."""
        assert self.router is not None
        return [self.router.pid, *(p for p in descendants(self.router.pid) if _is_worker(p, self.router.pid))]

    def stop(self) -> None:
        stop([r.child for r in self.replicas if r.child is not None] + ([self.router] if self.router else []))
        self.redis.stop()


# ------------------------------------------------------------------------------ load


def _already_finished(exc: Exception) -> bool:
    """Whether a failed finish is the router's 409 for a session no longer open: a finish sent
    before it (an attempt whose answer was lost, retried by the client or by the agent) was stored,
    so the session is finished (``already finished``), or already taken and acknowledged by the
    trainer (``already consumed``); see ``finish_session`` in ``router/routes_sessions.py``."""
    from clients.router import RouterError

    return (
        isinstance(exc, RouterError)
        and exc.status == 409
        and any(f"is already {s}" in exc.detail for s in ("finished", "consumed"))
    )


async def _streamed(stream: Any) -> dict[str, Any]:
    """The assistant message a streamed reply (``chat.completion.chunk`` events) adds up to, as a
    harness sends it back: its content, its tool calls (each one's ``arguments`` joined over its
    chunks) and its reasoning when it has some; the same message as
    :func:`trainer.demo_agents.sent_back` of the reply without streaming."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        for c in delta.tool_calls or ():
            call = calls.setdefault(c.index, {"id": c.id, "type": "function"})
            call.setdefault("function", {"name": "", "arguments": ""})
            if c.function is not None:
                call["function"]["name"] += c.function.name or ""
                call["function"]["arguments"] += c.function.arguments or ""
    out: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    if any(reasoning):
        out["reasoning_content"] = "".join(reasoning)
    return out


class Load:
    """The agents and the trainer, on one event loop."""

    def __init__(self, fleet: Fleet, cfg: SoakConfig, tally: Tally) -> None:
        self.fleet, self.cfg, self.tally = fleet, cfg, tally
        self.stopping = asyncio.Event()
        self.agents_done = asyncio.Event()  # every agent ended its last session (finished or not)
        self.rng = random.Random(cfg.seed)
        self.publish_running = asyncio.Event()

    async def agents(self, client: Any) -> None:
        """``agents - chat_agents`` token agents and ``chat_agents`` chat agents, each running one
        session after another until :attr:`stopping`; the chat agents of odd index stream. The
        chat agents share one ``openai.AsyncOpenAI`` (the ``openai`` package is needed only with
        chat agents)."""
        chat = None
        if self.cfg.chat_agents:
            from trainer.demo_agents import chat_client

            chat = chat_client(self.fleet.url, self.fleet.key, timeout_s=60.0, retries=5)
        self.tally.chat = [ChatCount(stream=i % 2 == 1) for i in range(self.cfg.chat_agents)]

        async def one(index: int | None) -> None:
            while not self.stopping.is_set():
                if index is None:
                    await self.session(client)
                else:
                    await self.chat_session(client, chat, index)

        tokens = self.cfg.agents - self.cfg.chat_agents
        try:
            await asyncio.gather(*(one(None) for _ in range(tokens)), *map(one, range(self.cfg.chat_agents)))
        finally:
            if chat is not None:
                await chat.close()
        self.agents_done.set()

    async def session(self, client: Any) -> None:
        try:
            sid = (await client.create_session()).session_id
        except Exception as exc:  # the fleet may be mid-fault; try again shortly
            self.tally.turn_errors[f"create: {type(exc).__name__}"] += 1
            await asyncio.sleep(1.0)
            return
        context = [self.rng.randrange(3, 250) for _ in range(32)]
        done = 0
        params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": self.cfg.gen}
        while done < self.cfg.turns:
            t0 = time.monotonic()
            try:
                turn = await client.turn(sid, context, params)
            except Exception as exc:
                self.tally.turn_errors[type(exc).__name__] += 1
                done, context = await self.resync(client, sid, done, context)
                continue
            added_ms = (time.monotonic() - t0) * 1000 - turn["timings"].get("engine_ms", 0.0)
            self.tally.turns.append((t0, added_ms, turn.get("moved_from") is not None))
            context = (
                context + turn["output_ids"] + [self.rng.randrange(3, 250) for _ in range(self.cfg.tool)]
            )
            done += 1
        await self.finish(client, sid, done, self.tally.turn_errors)

    async def finish(self, client: Any, sid: str, done: int, errors: Counter) -> bool:
        """Finish ``sid`` after ``done`` turns with a random reward (up to 10 tries, each failure
        counted in ``errors``); whether it is finished (then :attr:`Tally.finished` has it)."""
        for _ in range(10):
            try:
                await client.finish(sid, reward=self.rng.random())
                self.tally.finished[sid] = done
                return True
            except Exception as exc:
                if _already_finished(exc):  # a retry of a finish the router had stored
                    self.tally.finished[sid] = done
                    return True
                errors[f"finish: {type(exc).__name__}"] += 1
                await asyncio.sleep(1.0)
        return False

    async def chat_session(self, client: Any, chat: Any, index: int) -> None:
        """One session of chat agent ``index``: ``turns`` Chat Completions calls through the
        official client on the session's ``openai_base_url``, each sending the whole conversation
        so far (every reply as returned, then a user message, or a tool result per tool call),
        streamed for a streaming agent; then the finish."""
        count = self.tally.chat[index]
        try:
            session = await client.create_session()
        except Exception as exc:  # the fleet may be mid-fault; try again shortly
            count.errors[f"create: {type(exc).__name__}"] += 1
            await asyncio.sleep(1.0)
            return
        if session.openai_base_url is None:
            raise RuntimeError("the router serves no OpenAI chat API (started without --chat-model)")
        self.tally.chat_owner[session.session_id] = index
        session_chat = chat.with_options(base_url=session.openai_base_url)
        messages: list[dict[str, Any]] = [{"role": "user", "content": self._words()}]
        for _ in range(self.cfg.turns):
            t0 = time.monotonic()
            reply = await self.chat_turn(session_chat, messages, count)
            if reply is None:
                count.abandoned += 1
                return
            self.tally.chat_turn_ms.append((time.monotonic() - t0) * 1000)
            count.turns += 1
            messages += [reply, *self._answers(reply)]
        if await self.finish(client, session.session_id, self.cfg.turns, count.errors):
            count.sessions += 1

    async def chat_turn(
        self, chat: Any, messages: list[dict[str, Any]], count: ChatCount
    ) -> dict[str, Any] | None:
        """The assistant message of one chat turn, as it goes back into the conversation; None
        when the session is given up. The call carries an ``Idempotency-Key``, which the client
        keeps on its own retries and this agent on its own (a failure that reached it: counted),
        so a turn the router recorded is answered again, never sampled twice. A refusal (a 4xx
        the client does not retry) or failures for :data:`CHAT_RETRY_S` give the session up."""
        import openai

        from trainer.demo_agents import sent_back

        kw = {"model": "mixfleet", "messages": messages, "max_tokens": self.cfg.gen, "temperature": 1.0}
        kw |= {"top_p": 0.95, "extra_headers": {"Idempotency-Key": uuid.uuid4().hex}}
        deadline = time.monotonic() + CHAT_RETRY_S
        while True:
            try:
                if count.stream:
                    async with await chat.chat.completions.create(stream=True, **kw) as stream:
                        return await _streamed(stream)
                return sent_back((await chat.chat.completions.create(**kw)).choices[0].message)
            except Exception as exc:
                count.errors[type(exc).__name__] += 1
                refused = isinstance(exc, openai.APIStatusError) and exc.status_code in range(400, 500)
                if (refused and exc.status_code not in (408, 409, 429)) or time.monotonic() > deadline:
                    return None
                await asyncio.sleep(1.0)

    def _words(self) -> str:
        """About ``tool`` characters of random words (the byte-level tokenizer: as many tokens)."""
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < self.cfg.tool:
            words.append("".join(self.rng.choices("abcdefghijklmnopqrstuvwxyz", k=self.rng.randrange(2, 9))))
        return " ".join(words)

    def _answers(self, reply: dict[str, Any]) -> list[dict[str, Any]]:
        """The messages a harness appends after ``reply``: a result per tool call, else the user's."""
        calls = reply.get("tool_calls") or []
        if calls:
            return [{"role": "tool", "tool_call_id": c["id"], "content": self._words()} for c in calls]
        return [{"role": "user", "content": self._words()}]

    async def resync(self, client: Any, sid: str, done: int, context: list[int]) -> tuple[int, list[int]]:
        """After a failed turn: adopt what the router recorded (a turn may have been stored); the
        trajectory is read until the router answers (a fault may be in progress), for up to 20 s."""
        for _ in range(40):
            await asyncio.sleep(0.5)
            try:
                turns = (await client.trajectory(sid))["turns"]
            except Exception:
                continue
            if len(turns) > done:
                context = []  # the last segment's tokens (a fork starts a new one)
                for t in turns:
                    context = (context if t.get("fork") is None else []) + t["append_ids"] + t["output_ids"]
                tool = [self.rng.randrange(3, 250) for _ in range(self.cfg.tool)]
                return len(turns), context + tool
            break
        return done, context

    async def trainer(self, client: Any) -> None:
        while not (self.agents_done.is_set() and self.drained()):
            try:
                batch = await client.take(self.cfg.batch, wait_s=1.0)
            except Exception as exc:
                self.tally.turn_errors[f"take: {type(exc).__name__}"] += 1
                await asyncio.sleep(1.0)
                continue
            if batch.lease_id is None:
                continue
            counts = Counter(t["session_id"] for t in batch.turns)
            forks = Counter(t["session_id"] for t in batch.turns if t.get("fork") is not None)
            try:
                await client.ack(batch.lease_id)
            except Exception as exc:  # not acknowledged: redelivered later, counted then
                self.tally.turn_errors[f"ack: {type(exc).__name__}"] += 1
                continue
            for t in batch.trajectories:
                self.tally.delivered[t["session_id"]] += 1
                self.tally.delivered_turns[t["session_id"]] = counts.get(t["session_id"], 0)
                self.note_forks(t["session_id"], forks.get(t["session_id"], 0))
            if not self.stopping.is_set():
                await self.publish(client)

    def note_forks(self, sid: str, forks: int) -> None:
        """A delivered chat trajectory's forked turns, on its agent's count (each session once: a
        redelivery is counted as a duplicate, not as more forks)."""
        index = self.tally.chat_owner.get(sid)
        if index is not None and sid not in self.tally.forked:
            self.tally.forked[sid] = forks
            self.tally.chat[index].forks += forks

    def published_since(self, t: float) -> bool:
        return any(ok and start >= t for start, _, ok in self.tally.publish_s)

    def drained(self) -> bool:
        return all(s in self.tally.delivered for s in self.tally.finished)

    async def publish(self, client: Any) -> None:
        self.publish_running.set()
        t0, ok = time.monotonic(), False
        try:
            job = await client.publish(str(self.fleet.base))
            job = await client.wait_job(job["job_id"], timeout_s=600.0)
            self.tally.published.append(job["version"])
            ok = True
        except Exception as exc:
            self.tally.publish_errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.publish_running.clear()
            self.tally.publish_s.append((t0, time.monotonic() - t0, ok))


# ------------------------------------------------------------------------------ faults


class Faults:
    """Injects :data:`FAULTS` in order, one every ``fault_every_s``; records when each recovered."""

    def __init__(self, fleet: Fleet, load: Load, client: Any, fault_s: float) -> None:
        self.fleet, self.load, self.client, self.fault_s = fleet, load, client, fault_s
        self.records: list[FaultRecord] = []
        self._group = 0

    def _replica(self) -> ReplicaProc:
        r = self.fleet.replicas[self._group % len(self.fleet.replicas)]
        self._group += 1
        return r

    def _pid(self, r: ReplicaProc, word: str) -> int | None:
        assert r.child is not None
        return next((p for p in descendants(r.child.pid) if f" {word} " in _cmdline(p)), None)

    async def run(self, every_s: float, rounds: int | None) -> None:
        i = 0
        while rounds is None or i < rounds * len(FAULTS):
            await asyncio.sleep(every_s)
            if self.load.stopping.is_set():
                return
            name = FAULTS[i % len(FAULTS)]
            rec = FaultRecord(name, time.monotonic())
            self.records.append(rec)
            rec.detail = await getattr(self, name)()
            await self.recovered(rec)
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {rec.detail}; recovered in "
                  f"{(rec.recovered_at or rec.at) - rec.at:.1f}s", flush=True)  # fmt: skip
            i += 1

    async def recovered(self, rec: FaultRecord, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                groups = (await self.client.groups())["groups"]
                if all(g.get("ready_replicas", 0) > 0 for g in groups) and len(groups) == len(GROUPS):
                    rec.recovered_at = time.monotonic()
                    return
            await asyncio.sleep(0.5)

    async def _kill(self, word: str) -> str:
        r = self._replica()
        pid = self._pid(r, word)
        if pid is None:
            return f"no {word} process of {r.group} found"
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(1.0)
        return f"{r.group} {word} pid {pid}"

    async def engine_kill(self) -> str:
        return await self._kill("engine")

    async def sidecar_kill(self) -> str:
        return await self._kill("sidecar")

    async def router_worker_kill(self) -> str:
        assert self.fleet.router is not None
        workers = [p for p in descendants(self.fleet.router.pid) if _is_worker(p, self.fleet.router.pid)]
        if not workers:
            return "no router worker found"
        os.kill(workers[0], signal.SIGKILL)
        await asyncio.sleep(2.0)
        return f"router worker pid {workers[0]} of {len(workers)}"

    async def redis_restart(self) -> str:
        await asyncio.to_thread(self.fleet.redis.restart)
        return f"redis-server restarted on port {self.fleet.redis.port}"

    async def publish_kill(self) -> str:
        assert self.fleet.router is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.load.publish_running.is_set():
                pool = [
                    p for p in descendants(self.fleet.router.pid) if _is_converter(p, self.fleet.router.pid)
                ]
                if pool:
                    for p in pool:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGKILL)
                    return f"{len(pool)} conversion processes killed during a publish"
            await asyncio.sleep(0.05)
        return "no conversion process seen during a publish"

    async def slow(self) -> str:
        r, seconds = self._replica(), self.fault_s
        pid = self._pid(r, "engine")
        if pid is None:
            return f"no engine of {r.group}"
        end = time.monotonic() + seconds
        with contextlib.suppress(ProcessLookupError):
            while time.monotonic() < end:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(0.5)
                os.kill(pid, signal.SIGCONT)
                await asyncio.sleep(0.5)
        return f"{r.group} engine stopped half of every second for {seconds:g}s"

    async def errors(self) -> str:
        r, seconds = self._replica(), self.fault_s
        r.proxy.failing = True
        await asyncio.sleep(seconds)
        r.proxy.failing = False
        return f"{r.group} answered 500 to everything for {seconds:g}s"


def _ppid(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return -1


def _is_worker(pid: int, router: int) -> bool:
    cmd = _cmdline(pid)
    return _ppid(pid) == router and "multiprocessing" in cmd and "resource_tracker" not in cmd


def _is_converter(pid: int, router: int) -> bool:
    cmd = _cmdline(pid)
    return _ppid(pid) != router and "multiprocessing" in cmd and "resource_tracker" not in cmd


# ------------------------------------------------------------------------------ report


def _pcts(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    values = sorted(values)
    p99 = values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]
    return {"n": len(values), "p50": round(statistics.median(values), 2), "p99": round(p99, 2)}


def fault_latency(tally: Tally, rec: FaultRecord) -> dict[str, Any]:
    """Router-added ms per turn started in the 30 s before the fault, during it (until it recovered
    plus 10 s) and in the 30 s after."""
    end = (rec.recovered_at or rec.at) + 10
    windows = {"before": (rec.at - 30, rec.at), "during": (rec.at, end), "after": (end, end + 30)}
    return {k: _pcts([ms for t, ms, _ in tally.turns if a <= t < b]) for k, (a, b) in windows.items()}


def summarize(
    tally: Tally, faults: list[FaultRecord], fleet: Fleet, status: dict[str, Any]
) -> dict[str, Any]:
    lost = [s for s in tally.finished if s not in tally.delivered]
    dup = [s for s, n in tally.delivered.items() if n > 1]
    incomplete = [
        s for s, n in tally.finished.items() if s in tally.delivered_turns and tally.delivered_turns[s] != n
    ]
    mem = tally.memory
    last_recovery = max((f.recovered_at or f.at for f in faults), default=0.0)
    return {
        "turns": len(tally.turns),
        "trajectories_finished": len(tally.finished),
        "trajectories_delivered": len(tally.delivered),
        "lost": len(lost),
        "duplicated": len(dup),
        "incomplete": len(incomplete),
        "lost_ids": lost[:10],
        "turns_moved": sum(1 for *_, moved in tally.turns if moved),
        "turn_errors": dict(tally.turn_errors),
        "versions_published": len(tally.published),
        "last_version": max(tally.published, default=0),
        "publish_errors": tally.publish_errors[:10],
        "publishes": [{"at": t, "seconds": round(d, 2), "ok": ok} for t, d, ok in tally.publish_s],
        "published_after_faults": sum(ok and t >= last_recovery for t, _, ok in tally.publish_s),
        "latest_version": status.get("latest_version"),
        "active_versions": {
            g["group"]: sorted({r["active_version"] for r in g["replicas"]}, key=str)
            for g in status.get("groups", [])
        },
        "replica_restarts": {r.group: r.restarts for r in fleet.replicas},
        "memory_series": mem,
        "memory": {k: mem[i] for k, i in (("start", 0), ("middle", len(mem) // 2), ("end", -1))}
        if mem
        else {},
        "added_ms_overall": _pcts([ms for _, ms, _ in tally.turns]),
        "faults": [{**asdict(f), "latency_ms": fault_latency(tally, f)} for f in faults],
        **chat_summary(tally),
    }


def chat_summary(tally: Tally) -> dict[str, Any]:
    """The chat agents' figures: ``forks`` (forked turns in the chat trajectories delivered; must
    be 0: the router saw every request's history as an extension of the recorded turns) and
    ``chat``: per agent its finished sessions, turns, forks, the errors that reached it and the
    sessions it gave up; the chat sessions finished and delivered, and a chat turn's wall time."""
    finished = [s for s in tally.finished if s in tally.chat_owner]
    return {
        "forks": sum(tally.forked.values()),
        "forked_ids": [s for s, n in tally.forked.items() if n][:10],
        "chat": {
            "agents": [{**asdict(c), "errors": dict(c.errors)} for c in tally.chat],
            "turns": sum(c.turns for c in tally.chat),
            "sessions_finished": len(finished),
            "sessions_delivered": sum(s in tally.delivered for s in finished),
            "errors": sum(sum(c.errors.values()) for c in tally.chat),
            "abandoned": sum(c.abandoned for c in tally.chat),
            "turn_ms": _pcts(tally.chat_turn_ms),
        },
    }


def _sample_memory(fleet: Fleet, tally: Tally, t0: float) -> None:
    tally.memory.append(
        {
            "t_s": round(time.monotonic() - t0),
            "router_mb": round(_rss_mb(fleet.router_pids()), 1),
            "redis_mb": round(fleet.redis.used_mb(), 2),
        }  # fmt: skip
    )


# ------------------------------------------------------------------------------ main


async def _wait_ready(client: Any, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            groups = (await client.groups())["groups"]
            if len(groups) == len(GROUPS) and all(g.get("ready_replicas", 0) > 0 for g in groups):
                return
        await asyncio.sleep(1.0)
    raise RuntimeError("the fleet did not become ready")


async def _settled_status(client: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    """The weights status once every live replica serves the latest version (the last publish's
    activation may still be under way when the trainer drains), or as it is after ``timeout_s``:
    a replica that never catches up is what the report then shows."""
    status = await client.weights_status()
    if status.get("latest_version") is not None:
        with contextlib.suppress(UserError):
            status = await client.router.wait_active(status["latest_version"], timeout_s)
    return status


async def soak(cfg: SoakConfig, fleet: Fleet, rounds: int | None) -> dict[str, Any]:
    from trainer.client import AsyncRolloutClient

    tally = Tally()
    async with AsyncRolloutClient(fleet.url, fleet.key, retries=8) as client:
        await _wait_ready(client)
        await asyncio.gather(*(r.proxy.start() for r in fleet.replicas))
        load = Load(fleet, cfg, tally)
        faults = Faults(fleet, load, client, cfg.fault_s)
        t0 = time.monotonic()

        async def clock() -> None:
            next_sample = 0.0
            while time.monotonic() - t0 < cfg.duration_s or (rounds is not None and not fault_task.done()):
                fleet.supervise()
                if time.monotonic() - t0 >= next_sample:
                    await asyncio.to_thread(_sample_memory, fleet, tally, t0)
                    next_sample += 30.0
                await asyncio.sleep(0.5)
            over = time.monotonic()  # a short run goes on until a publish after the faults succeeded
            while rounds is not None and not load.published_since(over) and time.monotonic() - over < 120:
                fleet.supervise()
                await asyncio.sleep(0.5)
            load.stopping.set()

        trainer = asyncio.create_task(load.trainer(client))
        fault_task = asyncio.create_task(faults.run(cfg.fault_every_s, rounds))
        await asyncio.gather(clock(), load.agents(client))
        fault_task.cancel()
        try:  # an undelivered lease comes back after LEASE_TIMEOUT_S
            async with asyncio.timeout(3 * LEASE_TIMEOUT_S + 60):
                await trainer
            drain_timed_out = False
        except TimeoutError:
            drain_timed_out = True
        await asyncio.to_thread(_sample_memory, fleet, tally, t0)
        status = await _settled_status(client)
        replays = await asyncio.to_thread(turn_replays, fleet.url)
        await asyncio.gather(*(r.proxy.close() for r in fleet.replicas))
    summary = summarize(tally, faults.records, fleet, status)
    return {**summary, "turn_replays": replays, "drain_timed_out": drain_timed_out}


def turn_replays(url: str) -> dict[str, float]:
    """The router's ``mixfleet_router_turn_replays_total`` by outcome (every worker's, a killed
    one's included): keyed retries answered with the turn recorded under their key."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "mixfleet_router_turn_replays_total"
    }


def print_report(report: dict[str, Any]) -> None:
    keys = ("turns", "trajectories_finished", "trajectories_delivered", "lost", "duplicated", "incomplete",
            "forks", "turns_moved", "versions_published", "published_after_faults", "last_version",
            "drain_timed_out")  # fmt: skip
    for k in keys:
        print(f"{k:>24}: {report[k]}")
    print(f"{'turn errors':>24}: {report['turn_errors']}")
    chat = report["chat"]
    print(f"{'chat':>24}: {chat['turns']} turns, {chat['sessions_finished']} sessions finished, "
          f"{chat['sessions_delivered']} delivered, {chat['errors']} errors at the agents, "
          f"{chat['abandoned']} given up; a turn's wall ms {chat['turn_ms']}")  # fmt: skip
    for i, a in enumerate(chat["agents"]):
        kind = "streaming" if a["stream"] else "non-streaming"
        print(f"{'chat agent ' + str(i):>24}: {kind}, {a['sessions']} sessions, {a['turns']} turns, "
              f"{a['forks']} forks, {a['abandoned']} given up, errors {a['errors']}")  # fmt: skip
    replays = report["turn_replays"]
    print(f"{'keyed retries answered':>24}: {replays.get('found', 0):.0f} from the record, "
          f"{replays.get('raced', 0):.0f} after a race (their sample discarded)")  # fmt: skip
    print(f"{'active versions':>24}: {report['active_versions']}")
    print(f"{'replica restarts':>24}: {report['replica_restarts']}")
    for k, m in report["memory"].items():
        print(f"{'memory ' + k:>24}: router {m['router_mb']} MB, redis {m['redis_mb']} MB (t={m['t_s']}s)")
    print(f"{'added ms per turn':>24}: {report['added_ms_overall']}")
    print("fault                  recovered_s  before p50/p99     during p50/p99     after p50/p99")
    for f in report["faults"]:
        rec = (f["recovered_at"] or f["at"]) - f["at"]
        cols = [f"{w.get('p50', '-')}/{w.get('p99', '-')} (n={w['n']})" for w in f["latency_ms"].values()]
        print(f"{f['name']:<22} {rec:>11.1f}  " + "  ".join(f"{c:<17}" for c in cols))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of load (default 3600)")
    ap.add_argument("--agents", type=int, default=24, help="concurrent sessions (default 24)")
    ap.add_argument(
        "--chat-agents",
        type=int,
        default=None,
        help="of the --agents, how many chat through the OpenAI API (default a third; --short: 2)",
    )
    ap.add_argument("--turns", type=int, default=12, help="turns per session (default 12)")
    ap.add_argument("--gen", type=int, default=24, help="generated tokens per turn (default 24)")
    ap.add_argument("--tool", type=int, default=96, help="tool tokens appended per turn (default 96)")
    ap.add_argument("--batch", type=int, default=8, help="trajectories per trainer batch (default 8)")
    ap.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults (default 120)")
    ap.add_argument(
        "--retention",
        type=float,
        default=600.0,
        help="the router's --retention (default 600 s): acknowledged trajectories stay that long, so the "
        "state store's memory levels off after it",
    )
    ap.add_argument("--fault-s", type=float, default=20.0, help="seconds a slow/failing replica lasts")
    ap.add_argument("--short", action="store_true", help="a few minutes, one round of faults (the suite's)")
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs)")
    args = ap.parse_args(argv)
    if args.short:
        # the load runs until the last fault recovered (each waits for the one before to recover)
        args.duration, args.agents, args.turns, args.fault_every, args.fault_s = 20.0, 6, 3, 4.0, 4.0
    if args.chat_agents is None:
        args.chat_agents = args.agents // 3
    if not 0 <= args.chat_agents <= args.agents:
        ap.error(f"--chat-agents must be between 0 and --agents ({args.agents}), got {args.chat_agents}")
    cfg = SoakConfig(
        args.duration,
        args.agents,
        args.turns,
        args.gen,
        args.tool,
        args.batch,
        args.fault_every,
        args.out,
        args.fault_s,
        args.retention,
        chat_agents=args.chat_agents,
    )
    work = Path(tempfile.mkdtemp(prefix="mixfleet-soak-"))
    fleet = Fleet(work, cfg.retention_s)
    try:
        fleet.start()
        report = asyncio.run(soak(cfg, fleet, 1 if args.short else None))
    finally:
        fleet.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work / 'logs'}")
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    ok = report["lost"] == report["duplicated"] == report["incomplete"] == report["forks"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Continuous batching over ``Model.forward`` on one scheduler thread.

The scheduler owns the model and every request's KV cache. One thread runs the loop:

1. apply the commands queued since the last step (new requests, aborts, pause / continue,
   weight swaps, flush) — so every state change, a weight swap included, happens *between* two
   forward steps and one step never mixes two weight versions;
2. unless paused, admit waiting requests (up to ``max_running``) and run one step: one
   ``Model.forward`` call over the pending tokens of every running request (a prefill chunk
   within ``prefill_budget`` tokens per step, or the one last-sampled token when decoding);
3. sample the next token for every request whose whole sequence is now in its cache, then
   finish the ones that hit a stop token or EOS (unless ``ignore_eos``), ``max_new_tokens`` or
   the context length, or that carry a ``to_finish`` (finished after their first token).

Requests therefore join and leave the running batch between decode steps. Results go to each
request's ``sink`` (called on the scheduler thread; it must not block) as :class:`PrefillEvent`
(input log-probs, once), :class:`TokenEvent` (one per output token, tagged with the weight
version that produced it) and exactly one final :class:`FinishEvent`.

Pause modes (SGLang's ``/pause_generation``, managers/scheduler.py 5817-5932): ``abort`` aborts
every request; ``retract`` moves running requests back to the waiting queue and drops their caches
(their prompt and output so far are recomputed on continue, under whatever weights are served
then); ``in_place`` freezes running requests with their caches. New requests queue while paused.
``continue`` resumes. A flush (:meth:`Scheduler.flush_cache`) is refused while requests run --
so after an ``in_place`` pause under load, and never after a ``retract`` one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from core.sglang_release import WAITING_ABORT
from engine.runtime.request import GenerateSpec, duplicate_rid
from engine.runtime.sampler import Draw, sample, scaled_logprobs, top_logprobs

log = logging.getLogger("mixfleet.engine.scheduler")

PauseMode = Literal["abort", "retract", "in_place"]


class ModelLike(Protocol):
    """The part of ``engine.model.model.Model`` the scheduler uses (and ``forward_routed``, only
    when the scheduler records routed experts)."""

    def new_sequence(self) -> Any: ...

    def forward(self, tokens: list[torch.Tensor], caches: list[Any]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class PrefillEvent:
    """Input log-probs of the prompt from ``logprob_start_len`` on: ``(logprob | None, token_id)``
    per prompt token (``None`` for token 0, which nothing predicts), and per position the top
    ``top_logprobs_num`` entries (``None`` for token 0)."""

    input_token_logprobs: tuple[tuple[float | None, int], ...]
    input_top_logprobs: tuple[tuple[tuple[float, int], ...] | None, ...]


@dataclass(frozen=True)
class TokenEvent:
    """One output token, its behavior record and the weight version of the step that drew it."""

    index: int
    draw: Draw
    weight_version: int
    retractions: int = 0  # times the request was retracted so far (SGLang's ``num_retractions``)
    # this token finishes the request: its FinishEvent follows at once, and SGLang streams the
    # two as one output (the finish is set before the output streamer runs,
    # managers/scheduler_components/batch_result_processor.py 363-369, 502)
    finishes: bool = False


@dataclass(frozen=True)
class FinishEvent:
    """The request is done; ``finish_reason`` is SGLang's JSON shape. ``routed_experts``: when the
    request asked for them and the scheduler records them, int32 ``[rows, layers, k]`` for the
    positions ``[routed_experts_start_len, seqlen - 1)`` that went through the model (SGLang's
    ``_maybe_collect_routed_experts``, managers/scheduler_components/batch_result_processor.py
    136-160: ``seqlen - 1 - start_len`` rows on a normal finish); else None."""

    finish_reason: dict[str, Any]
    completion_tokens: int
    weight_version: int
    routed_experts: torch.Tensor | None = None
    retractions: int = 0  # times the request was retracted (SGLang's ``num_retractions``)
    # the request was aborted before its output stream took it over (waiting, retracted, or mid
    # prefill): SGLang's scheduler echoes such an abort, which its tokenizer manager answers with
    # what it was sent so far (:meth:`Scheduler._do_abort`)
    echo: bool = False


Event = PrefillEvent | TokenEvent | FinishEvent
Sink = Callable[[Event], None]

# The commands SGLang's scheduler answers over its socket to the tokenizer manager (a weight
# update's and a flush's results, ``send_control_output``, managers/scheduler.py 2253-2289);
# a request, an abort, a pause and a continue get no reply of their own.
_ANSWERED = frozenset({"update", "flush"})


@dataclass(eq=False)
class _Request:
    spec: GenerateSpec
    sink: Sink
    arrival: float
    rng: random.Random
    output_ids: list[int] = field(default_factory=list)
    cache: Any = None
    prefill_done: bool = False
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[tuple[tuple[float, int], ...] | None] = field(default_factory=list)
    carry_logits: torch.Tensor | None = None  # last prefill row of the previous chunk
    routes: list[torch.Tensor] = field(default_factory=list)  # routed experts of positions 0 .. cache.length
    last_token_time: float | None = None
    finished: bool = False
    retractions: int = 0  # a retract pause's count (SGLang's Req.retraction_count)

    def seq_len(self) -> int:
        return len(self.spec.input_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.spec.input_ids)
        if end <= n:
            return list(self.spec.input_ids[start:end])
        head = list(self.spec.input_ids[start:n]) if start < n else []
        return head + self.output_ids[max(start - n, 0) : end - n]


@dataclass
class _Command:
    kind: str
    args: dict[str, Any]
    future: concurrent.futures.Future


class Scheduler:
    """Owns the model, the waiting queue and the running batch; see the module docstring.

    Public methods are thread-safe; those returning a ``Future`` complete on the scheduler thread
    once the command took effect (at a step boundary).
    """

    def __init__(
        self,
        model: ModelLike,
        *,
        weight_version: int,
        vocab_size: int,
        context_len: int,
        eos_token_ids: frozenset[int],
        metrics: Any = None,
        max_running: int = 64,
        prefill_budget: int = 2048,
        record_routes: bool = False,
    ) -> None:
        self.model = model
        # SGLang's --enable-return-routed-experts: without it a request's return_routed_experts
        # yields nothing (no capturer, state_capturer/routed_experts.py 50-51)
        self.record_routes = record_routes
        self.weight_version = weight_version
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.paused: PauseMode | None = None
        # Wall-clock time (time.time()) of the scheduler's last answer: an event sent to a
        # request's sink, or the reply to a weight update or a flush. SGLang's tokenizer manager
        # stamps every message it receives from the scheduler (``last_receive_tstamp``,
        # managers/tokenizer_manager.py 2465-2479), which /health_generate reads.
        self.last_output = 0.0
        self.steps = 0
        # Cumulative seconds, for /server_info: whole steps, inside Model.forward, in the sampler.
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.sample_seconds = 0.0
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._by_rid: dict[str, _Request] = {}
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ---------------------------------------------------------------- public, any thread

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request and end the loop."""
        self._stop.set()
        self._command("noop")
        self._thread.join(timeout)

    def submit(self, spec: GenerateSpec, sink: Sink) -> concurrent.futures.Future:
        """Queue a validated request; its events go to ``sink``. Fails if the rid is in use."""
        return self._command("submit", spec=spec, sink=sink, arrival=time.monotonic())

    def held(self, rids: list[str]) -> str | None:
        """The first of ``rids`` a request submitted and not yet finished holds, or None: what
        SGLang 0.5.23's ``_init_req_state`` refuses as "Duplicate request ID detected: <rid>"
        (managers/tokenizer_manager.py 3833-3837). Read from any thread (a dict lookup);
        :meth:`submit` checks it again, atomically, in the scheduler thread."""
        return next((rid for rid in rids if rid in self._by_rid), None)

    def abort(
        self, rid: str = "", abort_all: bool = False, message: str = "Aborted by request."
    ) -> concurrent.futures.Future:
        """Abort the requests whose rid starts with ``rid`` (or every request): :meth:`_do_abort`;
        the future holds how many were aborted."""
        return self._command("abort", rid=rid, abort_all=abort_all, message=message)

    def pause(self, mode: PauseMode) -> concurrent.futures.Future:
        return self._command("pause", mode=mode)

    def resume(self) -> concurrent.futures.Future:
        return self._command("resume")

    def update_weights(
        self, model: ModelLike | None, weight_version: int | None, flush: bool
    ) -> concurrent.futures.Future:
        """At one step boundary: serve ``model`` (fully loaded by the caller; None keeps the
        current one), stamp ``weight_version`` on every token from the next step on (None keeps
        it), then, if ``flush``, flush as :meth:`flush_cache` does. The future holds whether the
        flush happened (True when none was asked), as SGLang's scheduler does it: weights and
        version change even when the flush is refused (managers/scheduler_components/
        weight_updater.py 138-160)."""
        return self._command("update", model=model, weight_version=weight_version, flush=flush)

    def flush_cache(self, *, fully_idle: bool = False) -> concurrent.futures.Future:
        """SGLang's ``Scheduler.flush_cache`` (managers/scheduler.py 5518-5548): succeeds (True)
        only when no request is running and, unless generation is paused in ``retract`` or
        ``in_place`` mode (``is_fully_idle(ignore_waiting=self._engine_paused)``; an ``abort``
        pause never reaches SGLang's scheduler, tokenizer_manager.py 2267-2280), none is waiting.
        ``fully_idle``: the check of a flush sent with a timeout, which SGLang's flush wrapper
        makes with ``is_fully_idle()`` alone (scheduler.py 1340-1344; scheduler_components/
        flush_wrapper.py 33-37, 45-49): a waiting request refuses it even while paused.
        This engine has no prefix cache, so a flush drops nothing; the refusal is the contract."""
        return self._command("flush", fully_idle=fully_idle)

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread is running."""
        return self._thread.is_alive()

    def load(self) -> dict[str, int]:
        """A racy but consistent-enough snapshot for /server_info and heartbeats."""
        running = len(self._running)
        return {
            "num_running_reqs": 0 if self.paused else running,
            "num_paused_reqs": running if self.paused else 0,
            "num_queue_reqs": len(self._waiting),
        }

    # ---------------------------------------------------------------- scheduler thread

    def _command(self, kind: str, **args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set() and kind != "noop":
            fut.set_exception(RuntimeError("the engine is shutting down"))
            return fut
        self._commands.put(_Command(kind, args, fut))
        return fut

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._running or self._waiting) and self.paused is None
            if not busy:
                self._apply(self._commands.get())  # idle or paused: sleep until told something
            self._drain_commands()
            if self._stop.is_set():
                break
            if self.paused is None and (self._running or self._waiting):
                t0 = time.perf_counter()
                try:
                    self._step()
                except Exception as exc:  # a bug in a step must not kill the server
                    log.exception("engine step failed")
                    for req in list(self._running):
                        self._finish(req, {"type": "abort", "message": f"engine step failed: {exc}"})
                self.step_seconds += time.perf_counter() - t0
            self._publish_load()
        for req in list(self._running) + list(self._waiting):
            self._finish(req, {"type": "abort", "message": "The engine is shutting down."})
        self._drain_commands()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._apply(cmd)

    def _apply(self, cmd: _Command) -> None:
        """Run ``cmd`` and settle its future, unless its caller cancelled the future before the
        scheduler took it (an HTTP handler cancelled while it waited: a client gone mid-submit):
        then it is not run, as an executor runs no work whose future
        ``set_running_or_notify_cancel`` reports cancelled; a cancelled future takes no result."""
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            result = getattr(self, f"_do_{cmd.kind}")(**cmd.args)
        except Exception as exc:
            cmd.future.set_exception(exc)
        else:
            cmd.future.set_result(result)
        if cmd.kind in _ANSWERED:
            self.last_output = time.time()

    def _send(self, req: _Request, event: Event) -> None:
        """Give ``event`` to ``req``'s sink and stamp :attr:`last_output`."""
        self.last_output = time.time()
        req.sink(event)

    def _do_noop(self) -> None:
        return None

    def _do_submit(self, spec: GenerateSpec, sink: Sink, arrival: float) -> None:
        if self.held([spec.rid]) is not None:
            raise ValueError(duplicate_rid(spec.rid))
        seed = (
            spec.sampling_seed if spec.sampling_seed is not None else int.from_bytes(os.urandom(8), "little")
        )
        req = _Request(spec=spec, sink=sink, arrival=arrival, rng=random.Random(seed))
        self._by_rid[spec.rid] = req
        self._waiting.append(req)

    def _do_abort(self, rid: str, abort_all: bool, message: str) -> int:
        """End ``rid``'s request (or every one). As SGLang 0.5.23's ``Scheduler.abort_request``
        (managers/scheduler.py 5675-5812): a request still waiting (never run, or retracted) or
        mid prefill, a retracted one's recomputation included (SGLang's chunked request,
        ``process_pending_chunked_abort`` 3778-3827), is echoed to the tokenizer manager
        (``send_abort_output``) with no reason, which it answers
        :data:`~core.sglang_release.WAITING_ABORT` (tokenizer_manager.py 3577-3642); a
        decoding one (:meth:`_decoding`) finishes with ``message``. A ``rid`` takes every request
        whose rid starts with it (``req.rid.startswith(recv_req.rid)``, 5677, 5688, 5800; the
        tokenizer manager sends it only for a rid it holds exactly:
        :meth:`~engine.runtime.admission.Admission.abort`); an empty one takes none."""
        requests = self._by_rid.values()
        targets = [req for req in requests if abort_all or (rid and req.spec.rid.startswith(rid))]
        for req in targets:
            if self._decoding(req):
                self._finish(req, {"type": "abort", "message": message})
            else:
                self._finish(req, dict(WAITING_ABORT), echo=True)
        return len(targets)

    def _decoding(self, req: _Request) -> bool:
        """Whether ``req`` runs past its prefill: in the running batch, its cache holding every
        token but the last one sampled."""
        return req in self._running and req.cache is not None and req.cache.length >= req.seq_len() - 1

    def _do_pause(self, mode: PauseMode) -> int:
        affected = len(self._running)
        if mode == "abort":
            self._do_abort("", True, "Aborted by /pause_generation (mode abort).")
        elif mode == "retract":
            for req in reversed(self._running):
                req.retractions += 1
                req.cache = None
                req.routes.clear()  # recomputed with the cache
                if not req.prefill_done:  # its prompt is recomputed from the start
                    req.input_logprobs.clear()
                    req.input_top.clear()
                    req.carry_logits = None
                self._waiting.appendleft(req)
            if self.metrics is not None and self._running:
                self.metrics.add_retracted(len(self._running))
            self._running = []
        self.paused = mode
        return affected

    def _do_resume(self) -> None:
        self.paused = None

    def _do_update(self, model: ModelLike | None, weight_version: int | None, flush: bool) -> bool:
        old = self.weight_version
        if model is not None:
            self.model = model
        if weight_version is not None:
            self.weight_version = weight_version
        log.info("weights updated at step %d: version %s -> %s", self.steps, old, self.weight_version)
        return self._do_flush() if flush else True

    def _do_flush(self, fully_idle: bool = False) -> bool:
        ignore_waiting = not fully_idle and self.paused in ("retract", "in_place")
        return not self._running and (ignore_waiting or not self._waiting)

    def _publish_load(self) -> None:
        if self.metrics is None:
            return
        load = self.load()
        used = sum(r.cache.length for r in self._running if r.cache is not None)
        self.metrics.set_load(load["num_running_reqs"], load["num_queue_reqs"], load["num_paused_reqs"], used)

    def _finish(self, req: _Request, reason: dict[str, Any], echo: bool = False) -> None:
        if req.finished:
            return
        req.finished = True
        req.cache = None
        self._by_rid.pop(req.spec.rid, None)
        if req in self._running:
            self._running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(req)
        if self.metrics is not None:
            self.metrics.observe_finished(time.monotonic() - req.arrival, reason["type"] == "abort")
        self._send(
            req,
            FinishEvent(
                reason, len(req.output_ids), self.weight_version, self._routes_of(req), req.retractions, echo
            ),
        )

    def _routes_of(self, req: _Request) -> torch.Tensor | None:
        """The routed experts :class:`FinishEvent` carries for ``req`` (None unless recorded)."""
        if not (self.record_routes and req.spec.return_routed_experts):
            return None
        end = req.seq_len() - 1
        start = min(req.spec.routed_experts_start_len, max(end, 0))
        if not req.routes:
            return None
        return torch.cat(req.routes)[start:end].contiguous()

    def _step(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting.popleft()
            req.cache = self.model.new_sequence()
            self._running.append(req)
        budget = self.prefill_budget
        feed: list[tuple[_Request, int, int]] = []
        for req in self._running:
            have, total = req.cache.length, req.seq_len()
            pending = total - have
            if pending <= 0:
                continue
            if pending == 1 and req.prefill_done:
                feed.append((req, have, total))
                continue
            if budget <= 0 and feed:
                continue
            take = min(pending, max(budget, 1))
            budget -= take
            feed.append((req, have, have + take))
        if not feed:
            return
        model = self.model
        version = self.weight_version
        tokens = [torch.tensor(req.tokens(a, b), dtype=torch.long) for req, a, b in feed]
        t0 = time.perf_counter()
        caches = [req.cache for req, _, _ in feed]
        if self.record_routes and any(req.spec.return_routed_experts for req, _, _ in feed):
            logits, routes = model.forward_routed(tokens, caches)  # type: ignore[attr-defined]
            for (req, _, _), r in zip(feed, routes, strict=True):
                if req.spec.return_routed_experts:
                    req.routes.append(r)
        else:
            logits = model.forward(tokens, caches)
        self.forward_seconds += time.perf_counter() - t0
        self.steps += 1
        to_sample: list[tuple[_Request, torch.Tensor]] = []
        for (req, a, b), out in zip(feed, logits, strict=True):
            n_prompt = len(req.spec.input_ids)
            if not req.prefill_done:
                if req.spec.return_logprob:
                    self._collect_input_logprobs(req, a, b, out)
                    req.carry_logits = out[-1]
                if b >= n_prompt:
                    req.prefill_done = True
                    req.carry_logits = None
                    if self.metrics is not None:
                        self.metrics.add_prompt_tokens(n_prompt)
                    if req.spec.return_logprob:
                        self._send(req, PrefillEvent(tuple(req.input_logprobs), tuple(req.input_top)))
            if b == req.seq_len():
                if req.spec.to_finish is None and len(req.output_ids) >= req.spec.max_new_tokens:
                    self._finish(req, {"type": "length", "length": len(req.output_ids)})
                else:
                    to_sample.append((req, out[-1]))
        if to_sample:
            t0 = time.perf_counter()
            self._sample(to_sample, version)
            self.sample_seconds += time.perf_counter() - t0

    def _collect_input_logprobs(self, req: _Request, a: int, b: int, out: torch.Tensor) -> None:
        """Log-probs of prompt tokens ``j`` in ``[max(start, a), min(b, n))``: row ``j - 1 - a``."""
        n = len(req.spec.input_ids)
        start = req.spec.logprob_start_len
        lo, hi = max(start, a), min(b, n)
        if lo >= hi:
            return
        if lo == 0:
            req.input_logprobs.append((None, req.spec.input_ids[0]))
            req.input_top.append(None)
            lo = 1
        if lo >= hi:
            return
        # Token j is predicted by the logits of position j - 1; for j == a (the chunk's first
        # token) that row ended the previous chunk and was kept.
        rows = out[max(lo - 1 - a, 0) : hi - 1 - a]
        if lo == a:
            rows = torch.cat([req.carry_logits[None, :], rows])
        assert rows.shape[0] == hi - lo
        lps = scaled_logprobs(rows, [req.spec.settings] * rows.shape[0])
        ids = torch.tensor(req.spec.input_ids[lo:hi], dtype=torch.long)
        picked = lps.gather(1, ids[:, None])[:, 0].tolist()
        for j, lp in enumerate(picked):
            req.input_logprobs.append((lp, int(ids[j])))
            k = req.spec.top_logprobs_num
            req.input_top.append(top_logprobs(lps[j], k) if k > 0 else ())

    def _sample(self, rows: list[tuple[_Request, torch.Tensor]], version: int) -> None:
        logits = torch.stack([x for _, x in rows])
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        if not all(finite):
            for (req, _), ok in zip(rows, finite, strict=True):
                if not ok:
                    self._finish(req, {"type": "abort", "message": "The model produced non-finite logits."})
            rows = [row for row, ok in zip(rows, finite, strict=True) if ok]
            if not rows:
                return
            logits = torch.stack([x for _, x in rows])
        reqs = [r for r, _ in rows]
        draws = sample(
            logits,
            [r.spec.settings for r in reqs],
            [r.rng for r in reqs],
            want_support=[r.spec.return_sampling_mask for r in reqs],
            top_logprobs_num=[r.spec.top_logprobs_num for r in reqs],
        )
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.add_generated_tokens(len(draws), now)
        for req, draw in zip(reqs, draws, strict=True):
            req.output_ids.append(draw.token_id)
            if self.metrics is not None:
                if req.last_token_time is None:
                    self.metrics.observe_first_token(now - req.arrival)
                else:
                    self.metrics.observe_inter_token(now - req.last_token_time)
            req.last_token_time = now
            reason = self._finish_reason(req, draw.token_id)
            self._send(
                req, TokenEvent(len(req.output_ids) - 1, draw, version, req.retractions, reason is not None)
            )
            if reason is not None:
                self._finish(req, reason)

    def _finish_reason(self, req: _Request, token: int) -> dict[str, Any] | None:
        """SGLang 0.5.23's ``Req.update_finish_state`` order (managers/schedule_batch.py
        2007-2049): the request's ``to_finish`` first (the scheduler's abort of a request it took,
        :meth:`GenerateSpec.with_finish_abort`; 2011-2014); then a stop id or EOS, which beats the
        length cap when the last token allowed is one (2029-2035), and which ``ignore_eos`` turns
        off, the request's ``stop_token_ids`` included (``_check_token_based_finish``, 1856-1878);
        then length (2037-2042); then the context limit, which SGLang applies by capping
        ``max_new_tokens`` when it takes the request."""
        if req.spec.to_finish is not None:
            return req.spec.to_finish
        n_out = len(req.output_ids)
        if not req.spec.ignore_eos and (token in req.spec.stop_token_ids or token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if n_out >= req.spec.max_new_tokens:
            return {"type": "length", "length": n_out}
        if req.seq_len() >= self.context_len:
            return {"type": "length", "length": n_out}
        return None

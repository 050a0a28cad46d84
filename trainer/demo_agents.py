"""The demo's sampling side: agents that hold multi-turn chats with the fleet through each
session's OpenAI Chat Completions API (``{router}/v1/sessions/{id}/openai/v1``), with the official
``openai`` client, so every episode goes token-in-token-out through the router's chat rendering.

An agent draws a problem (:mod:`trainer.tasks`) and runs ``samples`` episodes of it concurrently,
one session each: it creates the session over the rollout API
(:class:`trainer.client.AsyncRolloutClient`), then calls ``chat.completions.create`` on the
session's ``openai_base_url`` with the messages so far, ``max_tokens`` (the task's),
``temperature``, ``top_p`` and a seed per turn. It sends each answer back unchanged (its content,
and its tool calls and reasoning when the reply has them), so the router finds the answer's
sampled ids and the next turn extends the recorded tokens instead of forking. After each inexact
answer the task's feedback is the next user message, up to ``max_turns`` answers; then the agent
finishes the session with the episode's reward and the metadata ``exact`` (of the last answer)
and ``turns``.

Every chat request carries a fresh ``Idempotency-Key`` header, which the client keeps on its own
retries of the call (408/409/429/5xx and connection errors, ``max_retries`` times), so a retried
turn is answered with the turn the router recorded rather than sampled again. The chat API takes
no ``min_version``: :func:`trainer.demo.run_demo` starts the agents only once every replica
serves the warm-started version, and a replica's version only moves forward.

Backpressure: at most ``config.outstanding`` sessions are open or finished and not yet taken (nor
held back) by the trainer; an agent starts its next problem only when there is room for all its
samples, so batches stay within a version or two of the trainer. The room of a session the router
holds back as too stale is given back as soon as the trainer sees it held back, while its take
still waits (:func:`trainer.demo._take`): with room for one batch only, the fresh sessions the
take waits for could not start otherwise.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai

from trainer.client import AsyncRolloutClient, RouterError
from trainer.demo_config import DemoConfig
from trainer.tasks import Problem, ReverseDigits

MODEL = "mixfleet"  # the chat APIs serve the session's group whatever the model name says
MAX_ERRORS = 20  # failed episodes (router refusals, unreachable router) before an agent gives up


def chat_client(router_url: str, api_key: str, *, timeout_s: float = 600.0, retries: int = 5) -> Any:
    """The agents' one ``openai.AsyncOpenAI`` (its connection pool); each session gets a copy
    with its own base URL (``with_options``, which shares the pool)."""
    return openai.AsyncOpenAI(
        base_url=router_url.rstrip("/") + "/v1", api_key=api_key, timeout=timeout_s, max_retries=retries
    )


def sent_back(message: Any) -> dict[str, Any]:
    """An assistant reply (``ChatCompletionMessage``) as the message that repeats it: its content,
    tool calls and reasoning as the router gave them, nothing else."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls
        ]
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def _chat_error(exc: openai.APIError, session_id: str) -> RouterError:
    status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
    return RouterError("POST", f"/v1/sessions/{session_id}/openai/v1/chat/completions", status, exc.message)


@dataclass
class Agents:
    """The agent tasks' shared state: clients, counters, the room of the backpressure (module
    docstring) and the errors met."""

    client: AsyncRolloutClient
    chat: Any  # openai.AsyncOpenAI (chat_client)
    task: ReverseDigits
    config: DemoConfig
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    sessions: int = 0
    outstanding: int = 0
    held_back: int = 0
    room: asyncio.Condition = field(default_factory=asyncio.Condition)
    errors: list[str] = field(default_factory=list)

    async def release(self, count: int) -> None:
        """``count`` sessions left the outstanding set (taken, held back, or failed)."""
        async with self.room:
            self.outstanding = max(0, self.outstanding - count)
            self.room.notify_all()

    async def note_held_back(self, held_back: int) -> None:
        """The router holds back ``held_back`` sessions in all (a take's answer, or the trainer
        queue's stats while a take waits): those it newly holds back leave the outstanding set,
        since no take with the demo's bound will hand them out."""
        await self.release(max(0, held_back - self.held_back))
        self.held_back = held_back

    async def episode(self, problem: Problem, prompt_key: str, seed: int) -> None:
        """One session: chat until an exact answer or ``max_turns`` answers, then finish it."""
        try:
            session = await self.client.create_session(
                metadata={"prompt": prompt_key, "digits": problem.digits}
            )
            if session.openai_base_url is None:
                raise RouterError("POST", "/v1/sessions", None, "the router serves no OpenAI chat API")
            chat = self.chat.with_options(base_url=session.openai_base_url)
            messages: list[dict[str, Any]] = problem.messages()
            scores = []
            for turn in range(self.task.max_turns):
                try:
                    reply = await chat.chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        max_tokens=self.task.max_new_tokens,
                        temperature=self.config.temperature,
                        top_p=self.config.top_p,
                        seed=(seed + turn) % 2**62,
                        extra_headers={"Idempotency-Key": uuid.uuid4().hex},
                    )
                except openai.APIError as exc:
                    raise _chat_error(exc, session.session_id) from None
                choice = reply.choices[0]
                answer = choice.message.content or ""
                scores.append(self.task.score(problem, answer, choice.finish_reason == "stop"))
                if scores[-1].exact or turn + 1 == self.task.max_turns:
                    break
                feedback = {"role": "user", "content": self.task.feedback(problem, answer)}
                messages += [sent_back(choice.message), feedback]
            await self.client.finish(
                session.session_id,
                self.task.reward(scores),
                {"exact": scores[-1].exact, "turns": len(scores)},
            )
        except BaseException:
            await self.release(1)
            raise
        self.sessions += 1

    async def agent(self, index: int) -> None:
        """Agent ``index`` until :attr:`stop`: a problem, ``samples`` episodes of it, and again."""
        rng = random.Random(self.config.seed * 1_000_003 + index)
        n = self.config.samples
        k = 0
        while not self.stop.is_set():
            async with self.room:
                await self.room.wait_for(lambda: self.outstanding + n <= max(n, self.config.outstanding))
                self.outstanding += n
            problem = self.task.sample(rng)
            key = f"a{index}-{k}"
            seeds = [rng.getrandbits(62) for _ in range(n)]
            try:
                await asyncio.gather(*(self.episode(problem, key, s) for s in seeds))
            except RouterError as exc:
                self.errors.append(str(exc))
                if len(self.errors) > MAX_ERRORS:
                    raise
                await asyncio.sleep(0.5)
            k += 1

"""The demo RL loop: warm-start a policy by supervised learning on a task, then learn it by
asynchronous RL from a sampler fleet behind a router, publishing every update.

:func:`run_demo` needs a router URL and key (scopes ``rollout``, ``trainer`` and ``admin``), the
fleet's base checkpoint directory and an output directory, all on the router's machine (the
router converts checkpoints it is given by absolute path). It talks to the router over HTTP only.

Before: every group of the fleet serves some version; the store's latest version is ``v0``.
What happens, in order:

1. **SFT** (:mod:`trainer.demo_sft`): ``sft_steps`` steps of teacher-forced cross-entropy on the
   answers of fresh problems of the multi-turn task (:mod:`trainer.tasks`), in the chat the
   agents will hold, rendered by the checkpoint's chat template; on the trainer
   (:class:`trainer.policy.Policy`).
2. The result is published as the router's next version (the number the router takes under
   its job lock, as ``mixfleet weights publish`` does by default: one more than any version the
   store holds, whoever published it; ``v0 + 1`` on a fleet nobody else publishes to); the loop
   waits until every replica of every group serves it (the samplers start from it), so no turn
   is served by an older version.
3. **RL**: ``agents`` asyncio tasks (:mod:`trainer.demo_agents`) each draw a problem and run
   ``samples`` episodes of it concurrently, one session each, chatting through the session's
   OpenAI Chat Completions API with the official ``openai`` client (answer, feedback, answer
   again, up to ``turns`` answers), and finish each session with the episode's reward.
   Meanwhile the trainer takes batches of ``prompts * samples`` finished trajectories (waiting
   for them, with the staleness bound ``max_version_age``), computes group-normalized
   advantages per prompt, its logits at the sampled positions (one forward per segment of the
   batch's sequence view, every token once) and :func:`trainer.corrections.policy_loss` with
   ``method`` over the loss mask, the generated tokens of every turn: an episode's advantage
   applies to all the tokens it generated, in every turn. It takes one optimizer step, saves
   the weights and publishes them as the next version. Sampling never stops: agents keep
   sampling while the trainer computes and while the fleet converts and activates; each update
   waits only for the previous version's activation before it publishes its own.
4. After ``updates`` updates (or ``time_limit_s`` of RL), the agents stop and the last version's
   activation is awaited.

After: ``<out>/demo.json`` (see :func:`run_demo`), ``<out>/episodes.jsonl`` (one line per
trained episode, :func:`episodes`), ``<out>/demo.png`` when matplotlib is installed, and the
published checkpoints ``<out>/checkpoints/pNNNN``, the N-th this run published (0: the warm
start; the version each became is in ``demo.json``'s ``activations``; the last ``keep`` of them,
older ones are removed once their publication is done).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.tasks import cancel_and_wait
from trainer.batch import Batch
from trainer.client import AsyncRolloutClient
from trainer.corrections import (
    DEFAULT_BAND,
    PPO_CLIP_EPS,
    Support,
    group_advantages,
    mismatch_by_group,
    policy_loss,
    sampled_logprobs,
)
from trainer.demo_agents import Agents, chat_client
from trainer.demo_config import DemoConfig
from trainer.demo_sft import ChatPrompts, supervised
from trainer.policy import Policy
from trainer.progress import Progress

# ---------------------------------------------------------------- one RL update


@dataclass
class UpdateStats:
    loss: float
    mean_reward: float
    exact: float
    trajectories: int
    turns_mean: float
    turns: dict[str, int]
    forks: int
    tokens: int
    prompt_groups: int
    version_age: dict[str, float]
    k3_kl: dict[str, float]
    k3_kl_fresh: dict[str, float]
    abs_logprob_diff_mean: dict[str, float]
    extreme_ratio_share: dict[str, float]
    tokens_by_group: dict[str, int]
    grad_norm: float
    support_mean: float
    singleton_share: float
    clipped_share: float


def version_ages(batch: Batch, trainer_version: int) -> np.ndarray:
    """Per token: ``trainer_version`` minus the token's version (-1 where unknown); the batch's
    own ages when its header carries the trainer version."""
    if batch.trainer_version is not None:
        return batch.version_ages
    return np.where(batch.versions >= 0, np.maximum(0, trainer_version - batch.versions), -1)


def episodes(batch: Batch) -> list[dict[str, Any]]:
    """Per trajectory of ``batch``: ``session``, ``prompt``, ``reward``, ``exact`` (its last answer
    was), ``turns`` (the turns the router recorded) and ``forks`` (its segments after the first:
    turns whose context did not extend the recorded one; 0 when the chat was token-in-token-out)."""
    n = len(batch.trajectories)
    segments = np.bincount(batch.segment_trajectory, minlength=n)
    owner = batch.segment_trajectory[np.array([int(t["segment"]) for t in batch.turns], dtype=np.int64)]
    turns = np.bincount(owner, minlength=n)
    out = []
    for i, t in enumerate(batch.trajectories):
        meta = t.get("metadata") or {}
        out.append(
            {
                "session": t.get("session_id"),
                "prompt": meta.get("prompt"),
                "reward": t.get("reward"),
                "exact": bool(meta.get("exact")),
                "turns": int(turns[i]),
                "forks": int(segments[i]) - 1,
            }
        )
    return out


def _episode_stats(eps: list[dict[str, Any]]) -> dict[str, Any]:
    """:class:`UpdateStats`' episode fields: share ending exact, turns (mean and count of episodes
    per number of turns) and forks."""
    counts: dict[str, int] = {}
    for e in sorted(eps, key=lambda e: e["turns"]):
        counts[str(e["turns"])] = counts.get(str(e["turns"]), 0) + 1
    return {
        "exact": float(np.mean([e["exact"] for e in eps])) if eps else 0.0,
        "turns_mean": float(np.mean([e["turns"] for e in eps])) if eps else 0.0,
        "turns": counts,
        "forks": int(sum(e["forks"] for e in eps)),
    }


def rl_step(
    policy: Policy, opt: torch.optim.Optimizer, batch: Batch, config: DemoConfig, trainer_version: int
) -> tuple[UpdateStats, np.ndarray]:
    """One optimizer step of ``config.method`` on ``batch``, taken while the trainer holds
    ``trainer_version``; returns its figures and, per token of the batch, the trainer's log-prob
    before the step renormalized over the token's recorded support (the distribution the
    sampler drew from; the whole vocabulary where the support is empty), the value the router's
    mismatch upload compares with the sampler's behavior log-prob. Mismatch is also measured
    here, full-vocabulary against the samplers' raw log-probs, over all tokens and over the
    fresh ones (version age 0: the samplers' precision alone). ``grad_norm`` is the gradient's
    norm before clipping; ``support_mean`` and ``singleton_share`` describe the recorded
    supports (a position whose support is one token gives no gradient under mask replay);
    ``clipped_share`` is the share of tokens whose term PPO's clip (``grpo``'s) holds constant:
    ``p / mu`` beyond ``1 + eps`` with a positive advantage or below ``1 - eps`` with a negative
    one, whatever ``config.method`` is. ``exact``, ``turns_mean``, ``turns`` and ``forks``
    describe the batch's episodes (:func:`episodes`)."""
    rewards = torch.tensor([float(t.get("reward") or 0.0) for t in batch.trajectories])
    keys = [str((t.get("metadata") or {}).get("prompt", i)) for i, t in enumerate(batch.trajectories)]
    codes = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    per_trajectory = group_advantages(rewards, torch.tensor([codes[k] for k in keys]))
    adv = per_trajectory[torch.from_numpy(batch.trajectory_index)]
    logits = policy.sampled_logits(batch, config.temperature, replay=True)  # R3 where routes were recorded
    tokens = torch.from_numpy(batch.token_ids)
    loss = policy_loss(
        logits,
        tokens,
        torch.from_numpy(batch.logprobs),
        torch.from_numpy(batch.support_ids),
        torch.from_numpy(batch.support_offsets),
        torch.from_numpy(batch.support_logprobs),
        adv,
        method=config.method,
        band=config.band or DEFAULT_BAND,
    )
    opt.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0))
    opt.step()
    with torch.no_grad():
        trainer_lp = torch.log_softmax(logits.detach(), dim=-1).gather(1, tokens[:, None])[:, 0]
        support = Support.build(
            torch.from_numpy(batch.support_ids),
            torch.from_numpy(batch.support_offsets),
            torch.from_numpy(batch.support_logprobs),
            *logits.shape,
        )
        replayed = sampled_logprobs(logits.detach(), tokens, support).numpy()
        ratio = torch.exp(trainer_lp - torch.from_numpy(batch.logprobs))
        clipped = ((adv > 0) & (ratio > 1 + PPO_CLIP_EPS)) | ((adv < 0) & (ratio < 1 - PPO_CLIP_EPS))
    sizes = np.diff(batch.support_offsets)
    return UpdateStats(
        loss=loss.item(),
        mean_reward=float(rewards.mean()) if rewards.numel() else 0.0,
        trajectories=len(batch.trajectories),
        tokens=len(batch),
        prompt_groups=len(codes),
        grad_norm=grad_norm,
        support_mean=float(sizes.mean()) if sizes.size else 0.0,
        singleton_share=float((sizes == 1).mean()) if sizes.size else 0.0,
        clipped_share=float(clipped.float().mean()) if clipped.numel() else 0.0,
        **_episode_stats(episodes(batch)),
        **_mismatch_stats(batch, trainer_lp, trainer_version),
    ), replayed


def _mismatch_stats(batch: Batch, trainer_lp: torch.Tensor, trainer_version: int) -> dict[str, Any]:
    """:class:`UpdateStats`' version-age and mismatch fields: the trainer's log-probs against the
    samplers' raw ones per group, over every token with a raw log-prob and over the fresh ones."""
    sampler_lp = torch.from_numpy(batch.raw_logprobs)
    known = ~torch.isnan(sampler_lp)
    all_ages = version_ages(batch, trainer_version)
    fresh = known & torch.from_numpy(all_ages == 0)

    def by_group(mask: torch.Tensor) -> dict[str, Any]:
        labels = [batch.groups[g] for g in batch.group_index[mask.numpy()]]
        return mismatch_by_group(trainer_lp[mask], sampler_lp[mask], labels) if labels else {}

    per_group, per_group_fresh = by_group(known), by_group(fresh)
    ages = all_ages[all_ages >= 0]
    return {
        "version_age": {
            "mean": float(ages.mean()) if ages.size else 0.0,
            "max": int(ages.max()) if ages.size else 0,
            "share_stale": float((ages > 0).mean()) if ages.size else 0.0,
        },
        "k3_kl": {g: m.k3_kl for g, m in per_group.items()},
        "k3_kl_fresh": {g: m.k3_kl for g, m in per_group_fresh.items()},
        "abs_logprob_diff_mean": {g: m.abs_logprob_diff_mean for g, m in per_group.items()},
        "extreme_ratio_share": {g: m.extreme_ratio_share for g, m in per_group.items()},
        "tokens_by_group": {g: m.tokens for g, m in per_group.items()},
    }


# ---------------------------------------------------------------- the asynchronous loop


class ActivationError(RuntimeError):
    """A published version was not served by every group in time; carries the replicas' errors."""

    def __init__(self, version: int, missing: list[str], errors: dict[str, str]) -> None:
        detail = "; ".join(f"{r}: {e}" for r, e in errors.items()) or "no replica reported an error"
        super().__init__(f"v{version} is not active in {', '.join(sorted(missing))} ({detail})")
        self.version = version
        self.missing = missing
        self.errors = errors


async def _activation(
    client: AsyncRolloutClient, version: int, job_id: str, timeout_s: float
) -> dict[str, Any]:
    """Wait for publish job ``job_id``, then until every replica of every group reports
    ``version`` or later; returns the seconds from the call until the job was done and until
    each group served it. Raises :class:`ActivationError` after ``timeout_s``."""
    start = time.monotonic()
    job = await client.wait_job(job_id, timeout_s=timeout_s)
    published_s = time.monotonic() - start
    activated: dict[str, float] = {}
    while True:
        status = await client.weights_status()
        errors: dict[str, str] = {}
        for g in status.get("groups", []):
            reps = g.get("replicas") or []
            behind = [r for r in reps if (r.get("active_version") or 0) < version]
            errors.update({r["replica_id"]: str(r["error"]) for r in behind if r.get("error")})
            if g["group"] not in activated and reps and not behind:
                activated[g["group"]] = time.monotonic() - start
        names = {g["group"] for g in status.get("groups", [])}
        if names and names <= set(activated):
            break
        if time.monotonic() - start > timeout_s:
            raise ActivationError(version, sorted(names - set(activated)), errors)
        await asyncio.sleep(0.1)
    return {
        "version": version,
        "job": job.get("job_id", job_id),
        "published_s": published_s,
        "activated_s": activated,
    }


class _Publisher:
    """Publishes checkpoints one version at a time; a version is published only after the
    previous one's activation was observed (or timed out)."""

    def __init__(
        self, client: AsyncRolloutClient, out: Path, config: DemoConfig, log: Callable[[str], None]
    ) -> None:
        self.client = client
        self.out = out
        self.config = config
        self.log = log
        self.pending: asyncio.Task | None = None
        self.records: list[dict[str, Any]] = []
        self.dirs: list[Path] = []
        self.saved = 0  # checkpoints saved: the next one's number

    async def publish(self, policy: Policy) -> int:
        """Save ``policy`` and, once the previous version's activation was observed, publish it
        as the router's next version; returns that version (the job's). Another weight job
        running (another publisher's) is waited for, up to ``config.job_wait_s`` seconds, with one
        line to the log; past that the publish's refusal is raised (a :class:`RouterError`, one
        line)."""
        path = (self.out / "checkpoints" / f"p{self.saved:04d}").resolve()
        self.saved += 1
        await asyncio.to_thread(policy.save, path)
        await self.settle()
        job = await self.client.publish(str(path), wait_s=self.config.job_wait_s, on_wait=self.log)
        version = int(job["version"])
        self.dirs.append(path)
        self.pending = asyncio.create_task(
            _activation(self.client, version, job["job_id"], self.config.activation_timeout_s)
        )
        return version

    async def settle(self) -> None:
        if self.pending is None:
            return
        self.records.append(await self.pending)
        self.pending = None
        while len(self.dirs) > self.config.keep:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)


async def run_demo(
    router_url: str,
    api_key: str,
    base: str | Path,
    out: str | Path,
    config: DemoConfig,
    *,
    show_progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the demo against the fleet behind ``router_url``; write and return ``demo.json``:

    ``config``; ``task``; ``groups`` (the fleet's); ``sft`` (``loss`` per step, ``wall_s``);
    ``first_version``; ``updates``: one entry per update with ``update``, ``version`` (the
    version it published), ``trained_on_version``, ``mean_reward``, ``exact`` (share of episodes
    whose last answer was exact), ``turns_mean`` and ``turns`` (episodes per number of turns),
    ``forks`` (expected 0), ``loss``, ``trajectories``, ``tokens``, ``prompt_groups``,
    ``version_age`` (mean, max, share of stale tokens), per group ``k3_kl`` (``k3_kl_fresh``:
    over the tokens of age 0), ``abs_logprob_diff_mean``, ``extreme_ratio_share`` and
    ``tokens_by_group`` (trainer log-probs before the step against the samplers' raw
    log-probs), ``wall_s`` (since RL started), ``step_s``, ``grad_norm``, ``support_mean``,
    ``singleton_share`` and ``clipped_share`` (see :func:`rl_step`); ``mismatch_uploads``: per
    update the router's answer to the upload of the trainer's log-probs (its figures per group
    and version); ``activations``: per published version the seconds until its job was done and
    until each group served it; ``summary`` (:func:`summarize`). Each trained episode is also a
    line of ``<out>/episodes.jsonl``: its ``update`` and :func:`episodes`' fields.

    Raises :class:`trainer.policy.CheckpointError` when ``base`` is not a chat model.
    """
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.trainer_threads)
    rng = random.Random(config.seed)
    task = config.task()
    prompts = ChatPrompts(base)
    policy = Policy.load(base)
    record: dict[str, Any] = {
        "config": asdict(config),
        "task": {"name": "reverse-digits-chat", **asdict(task)},
        "router": router_url,
    }
    (out / "episodes.jsonl").write_text("")
    started = time.monotonic()
    chat = chat_client(router_url, api_key)
    try:
        async with AsyncRolloutClient(router_url, api_key) as client:
            status = await client.weights_status()
            groups = status.get("groups", [])
            record["groups"] = [{"group": g["group"], "format": g["format"]} for g in groups]
            version = int(status.get("latest_version") or 0)
            names = ", ".join(f"{g['group']} ({g['format']})" for g in record["groups"])
            log(f"fleet: {names}; latest v{version}")

            record["sft"] = await asyncio.to_thread(
                supervised, policy, prompts, task, config, rng, show_progress
            )
            publisher = _Publisher(client, out, config, log)
            log("publishing the warm-started policy as the next version ...")
            version = await publisher.publish(policy)
            record["first_version"] = version
            await publisher.settle()
            log(f"v{version} active in every group: {publisher.records[-1]['activated_s']}")

            agents = Agents(client, chat, task, config)
            updates, uploads = await _rl_updates(
                client, policy, config, version, publisher, agents, out, show_progress, log
            )
            await publisher.settle()
    finally:
        await chat.close()
    record["updates"] = updates
    record["mismatch_uploads"] = uploads
    record["activations"] = publisher.records
    record["sessions"] = agents.sessions
    record["agent_errors"] = agents.errors[:20]
    record["summary"] = summarize(record, time.monotonic() - started)
    (out / "demo.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


async def _rl_updates(
    client: AsyncRolloutClient,
    policy: Policy,
    config: DemoConfig,
    version: int,
    publisher: _Publisher,
    agents: Agents,
    out: Path,
    show_progress: bool,
    log: Callable[[str], None],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The asynchronous RL updates from ``version`` on, while ``config.agents`` agents sample: take
    a batch, step, upload the trainer's log-probs, acknowledge, publish the next version; each
    batch's episodes are appended to ``out/episodes.jsonl``. Returns the updates' records and the
    router's answers to the uploads."""
    workers = [asyncio.create_task(agents.agent(i)) for i in range(config.agents)]
    opt = torch.optim.AdamW(policy.model.parameters(), lr=config.lr, weight_decay=0.0)
    updates: list[dict[str, Any]] = []
    uploads: list[dict[str, Any]] = []
    rl_start = time.monotonic()
    bar = Progress(config.updates, f"rl {config.method}", show_progress)
    try:
        for u in range(1, config.updates + 1):
            if time.monotonic() - rl_start > config.time_limit_s:
                log(f"time limit reached after {u - 1} updates")
                break
            taken = await _take(client, config, version, workers, agents)
            batch = taken.batch
            t0 = time.monotonic()
            stats, trainer_lp = await asyncio.to_thread(rl_step, policy, opt, batch, config, version)
            step_s = time.monotonic() - t0
            if batch.lease_id is not None:
                routes = policy.route_mismatch()  # None unless the batch recorded routes
                uploads.append(await client.upload_trainer_logprobs(batch.lease_id, trainer_lp, routes))
                await client.ack(batch.lease_id)
            with (out / "episodes.jsonl").open("a") as f:
                f.writelines(json.dumps({"update": u, **e}) + "\n" for e in episodes(batch))
            trained_on = version
            version = await publisher.publish(policy)
            updates.append(
                {
                    "update": u,
                    "version": version,
                    "trained_on_version": trained_on,
                    **asdict(stats),
                    "held_back": batch.held_back,
                    "take_wait_s": taken.wait_s,
                    "empty_takes": taken.empty,
                    "wall_s": time.monotonic() - rl_start,
                    "step_s": step_s,
                }
            )
            bar.update(reward=stats.mean_reward, exact=stats.exact, age=stats.version_age["mean"])
    finally:
        bar.close()
        agents.stop.set()
        await cancel_and_wait(workers)
    return updates, uploads


TAKE_WAIT_S = 60.0  # the longest a take may wait (router.schemas.TakeRequest.wait_s)
POLL_S = 1.0  # while a take waits: how often the agents' failures and the held-back count are read


@dataclass(frozen=True)
class Taken:
    """A batch and what getting it took: ``wait_s`` from the first take to the batch, and the
    takes before it that answered no trajectory (``empty``)."""

    batch: Batch
    wait_s: float
    empty: int


async def _take(
    client: AsyncRolloutClient, config: DemoConfig, version: int, workers: list, agents: Agents
) -> Taken:
    """The next batch: up to ``config.batch_size`` trajectories within the staleness bound (the
    router waits for a full one up to :data:`TAKE_WAIT_S`); raises what an agent task died of.
    Every answer, an empty one too, releases the agents' room of the sessions it took. While a
    take waits, every :data:`POLL_S` the agents' failures are checked and, with a staleness bound,
    the room of the sessions the router newly holds back (:meth:`Agents.note_held_back`, from the
    queue's stats) is given back at once, so that the agents can sample the fresh sessions the
    take waits for."""
    t0 = time.monotonic()
    empty = 0
    while True:
        take = asyncio.ensure_future(
            client.take(
                config.batch_size,
                max_version_age=config.max_version_age,
                wait_s=TAKE_WAIT_S,
                trainer_version=version,
            )
        )
        try:
            while not (await asyncio.wait({take}, timeout=POLL_S))[0]:
                _raise_failed(workers)
                if config.max_version_age is not None:
                    await agents.note_held_back((await client.queue_stats())["held_back"])
        finally:
            await cancel_and_wait([take])
        batch = take.result()
        await agents.release(len(batch.trajectories))
        await agents.note_held_back(batch.held_back)
        if batch.trajectories:
            return Taken(batch, time.monotonic() - t0, empty)
        empty += 1
        _raise_failed(workers)


def _raise_failed(workers: list) -> None:
    """Raise what an agent task died of, if one did."""
    for w in workers:
        if w.done() and not w.cancelled() and w.exception() is not None:
            raise w.exception()


def summarize(record: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """First and last fifths of the reward curve, and totals: tokens, trained ``episodes``, their
    ``forks`` (expected 0), mean turns per episode and episodes per number of turns."""
    ups = record.get("updates") or []
    turns: dict[str, int] = {}
    for u in ups:
        for n, count in u["turns"].items():
            turns[n] = turns.get(n, 0) + count
    episodes = sum(turns.values())
    rewards = np.array([u["mean_reward"] for u in ups], dtype=np.float64)
    exact = np.array([u["exact"] for u in ups], dtype=np.float64)
    k = max(1, len(ups) // 5)
    return {
        "updates": len(ups),
        "wall_s": wall_s,
        "rl_wall_s": ups[-1]["wall_s"] if ups else 0.0,
        "sft_first_loss": (record["sft"]["loss"] or [None])[0],
        "sft_last_loss": (record["sft"]["loss"] or [None])[-1],
        "reward_first": float(rewards[:k].mean()) if ups else None,
        "reward_last": float(rewards[-k:].mean()) if ups else None,
        "exact_first": float(exact[:k].mean()) if ups else None,
        "exact_last": float(exact[-k:].mean()) if ups else None,
        "tokens": int(sum(u["tokens"] for u in ups)),
        "episodes": episodes,
        "forks": int(sum(u["forks"] for u in ups)),
        "turns_mean": sum(int(n) * c for n, c in turns.items()) / episodes if episodes else None,
        "turns": dict(sorted(turns.items(), key=lambda kv: int(kv[0]))),
    }

"""The demo's supervised warm start: teacher-forced cross-entropy on the answers of fresh problems
of :mod:`trainer.tasks`, in the chat the agents hold with the fleet.

Contexts are rendered by the checkpoint's own tokenizer and chat template through
``transformers`` (:class:`ChatPrompts`: ``apply_chat_template`` with the generation prompt),
the template and tokenizer the router renders the agents' chats with, so the warm start trains
on the ids the samplers are given (``tests/trainer/test_demo_sft.py`` compares the two). An
example's target is the answer's ids and ``<|im_end|>``, the token a Qwen3-style template closes
an assistant turn with (the router ends a sampled turn on it).

With ``max_turns`` > 1 every other example is a second attempt: its context holds a wrong first
answer (the target with one to all of its digits changed) and the task's feedback on it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.demo_config import DemoConfig
from trainer.policy import CheckpointError, Policy
from trainer.progress import Progress
from trainer.tasks import Problem, ReverseDigits

END_OF_TURN = "<|im_end|>"

Example = tuple[list[int], list[int]]
"""(context ids ending with the generation prompt, target ids ending with the end of turn)."""


class ChatPrompts:
    """A checkpoint's chat rendering on the trainer's side. CheckpointError when the checkpoint
    has no chat template or no ``<|im_end|>`` token."""

    def __init__(self, checkpoint: str | Path) -> None:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        except Exception as exc:  # a broken config or tokenizer file: transformers raises many kinds
            raise CheckpointError(
                f"{checkpoint}: cannot load the tokenizer: {type(exc).__name__}: {exc}"
            ) from None
        if not self.tokenizer.chat_template:
            raise CheckpointError(
                f"{checkpoint} has no chat template: the demo's agents chat through the router's chat "
                "API (every `mixfleet init-model` preset writes one; recreate an older base)"
            )
        end = self.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if end is None or end == self.tokenizer.unk_token_id:
            raise CheckpointError(f"{checkpoint}: the tokenizer has no {END_OF_TURN} token")
        self.end_id = int(end)

    def context(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The ids of ``messages`` followed by the generation prompt (the next turn's input)."""
        out = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return [int(i) for i in out["input_ids"]]

    def answer(self, text: str) -> list[int]:
        """The ids of an assistant answer ``text`` and the end of its turn."""
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.end_id]


def _wrong(problem: Problem, rng: random.Random) -> str:
    """The target with one to all of its digits changed."""
    out = list(problem.answer)
    for i in rng.sample(range(len(out)), rng.randint(1, len(out))):
        out[i] = rng.choice([d for d in "0123456789" if d != out[i]])
    return "".join(out)


def example(prompts: ChatPrompts, task: ReverseDigits, rng: random.Random, second: bool) -> Example:
    """A fresh problem's example: its first turn, or (``second``) a second attempt after a wrong
    first answer and its feedback."""
    problem = task.sample(rng)
    messages = problem.messages()
    if second:
        wrong = _wrong(problem, rng)
        messages += [
            {"role": "assistant", "content": wrong},
            {"role": "user", "content": task.feedback(problem, wrong)},
        ]
    return prompts.context(messages), prompts.answer(problem.answer)


def sft_loss(policy: Policy, examples: Sequence[Example]) -> torch.Tensor:
    """Mean cross-entropy of the target tokens (end of turn included) given each context."""
    logits = policy.forward([list(c) + list(t) for c, t in examples])
    rows, cols, targets = [], [], []
    for i, (context, target) in enumerate(examples):
        for j, tok in enumerate(target):
            rows.append(i)
            cols.append(len(context) - 1 + j)
            targets.append(tok)
    picked = logits[torch.tensor(rows), torch.tensor(cols)]
    return torch.nn.functional.cross_entropy(picked, torch.tensor(targets))


def supervised(
    policy: Policy,
    prompts: ChatPrompts,
    task: ReverseDigits,
    config: DemoConfig,
    rng: random.Random,
    show: bool,
) -> dict[str, Any]:
    """The SFT phase; returns its record (losses per step, batch size, share of second attempts,
    wall time)."""
    opt = torch.optim.AdamW(policy.model.parameters(), lr=config.sft_lr, weight_decay=0.0)
    losses: list[float] = []
    start = time.monotonic()
    bar = Progress(config.sft_steps, "sft", show)
    multi = task.max_turns > 1
    for _ in range(config.sft_steps):
        batch = [example(prompts, task, rng, multi and i % 2 == 1) for i in range(config.sft_batch)]
        loss = sft_loss(policy, batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(loss=losses[-1])
    bar.close()
    return {
        "steps": config.sft_steps,
        "batch": config.sft_batch,
        "second_attempts": (config.sft_batch // 2 if multi else 0) / config.sft_batch,
        "loss": losses,
        "wall_s": time.monotonic() - start,
    }

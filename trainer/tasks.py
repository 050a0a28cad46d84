"""A learnable multi-turn chat task for the demo RL loop: reverse a short string of digits, with
feedback between attempts.

An episode is a chat (OpenAI message dicts, :meth:`Problem.messages`): the user message is the
digits (``"4071"``); the assistant answers with them reversed (``"1704"``), ending its turn. An
answer that is not exact gets feedback as a new user message (:meth:`ReverseDigits.feedback`):
the target's positions, each holding the answer's digit where it is right and ``_`` where it is
not (``"17_4"`` for ``"1744"``); the assistant then answers again, up to ``max_turns`` answers in
all. The task sees text only: the token ids are the chat model's (rendered by the router for the
agents, by the trainer's tokenizer for the supervised warm start).

Score of one answer (:meth:`ReverseDigits.score`): 1.0 for an exact answer (the reversed digits,
nothing else, and the turn ended on the model's end token rather than the token limit).
Otherwise, with ``partial_credit`` on (the default), ``0.5`` times the share of the target's
positions that hold the right digit (comparing the answer with the target character by
character; an answer of the wrong length loses the positions it misses or adds: the share's
denominator is the longer of the two), so a model that gets most digits right earns more than one
that gets none. With ``partial_credit`` off, every inexact answer scores 0.

Reward of an episode (:meth:`ReverseDigits.reward`): the mean score of its answers, so 1.0 only
for an exact first answer, and an exact second answer after a wrong first one earns less than
that but more than staying wrong.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One prompt: its digits and the answer they call for."""

    digits: str

    @property
    def answer(self) -> str:
        return self.digits[::-1]

    def messages(self) -> list[dict[str, str]]:
        """The episode's first messages: one user message, the digits."""
        return [{"role": "user", "content": self.digits}]


@dataclass(frozen=True)
class Score:
    reward: float
    exact: bool


@dataclass(frozen=True)
class ReverseDigits:
    """Problems of ``min_len`` to ``max_len`` digits, drawn from a seeded generator; episodes of at
    most ``max_turns`` answers."""

    min_len: int = 3
    max_len: int = 4
    partial_credit: bool = True
    max_turns: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len} .. {self.max_len}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")

    @property
    def max_new_tokens(self) -> int:
        """Enough new tokens for the longest answer and its end token (one token per digit: every
        chat model the demo runs on has single-token digits)."""
        return self.max_len + 1

    def problem(self, digits: str) -> Problem:
        if not digits.isdigit():
            raise ValueError(f"digits must be decimal digits, got {digits!r}")
        return Problem(digits)

    def sample(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_len, self.max_len)
        return self.problem("".join(rng.choice("0123456789") for _ in range(n)))

    def score(self, problem: Problem, answer: str, stopped: bool) -> Score:
        """The score of ``answer`` (an assistant message's content, whitespace around it ignored);
        ``stopped``: the turn ended on the model's end token (finish reason ``stop``)."""
        target = problem.answer
        out = answer.strip()
        if stopped and out == target:
            return Score(1.0, True)
        if not self.partial_credit:
            return Score(0.0, False)
        hits = sum(a == b for a, b in zip(out, target, strict=False))
        return Score(0.5 * hits / max(len(out), len(target)), False)

    def feedback(self, problem: Problem, answer: str) -> str:
        """The user's reply to an inexact ``answer``: per position of the target, the answer's
        character where it is right, else ``_``."""
        out = answer.strip()
        return "".join(c if i < len(out) and out[i] == c else "_" for i, c in enumerate(problem.answer))

    def reward(self, scores: Sequence[Score]) -> float:
        """The episode's reward: the mean score of its answers (at least one)."""
        if not scores:
            raise ValueError("an episode has at least one answer")
        return sum(s.reward for s in scores) / len(scores)

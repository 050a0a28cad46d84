"""A learnable task for the demo RL loop: reverse a short string of digits.

A prompt is ``<|bos|>`` followed by the bytes of ``"<digits>>"`` (for example ``"4071>"``); the
answer is the digits reversed followed by ``<|eos|>`` (``"1704"``, then end). Token ids are the
byte-level ones of the base policy written by ``mixfleet init-model`` (a byte is its own id; the
special tokens follow at 256 and 257), so the task needs no tokenizer.

Reward (:meth:`ReverseDigits.score`): 1.0 for an exact answer (the reversed digits, then the
end token). Otherwise, with ``partial_credit`` on (the default), ``0.5`` times
the share of the answer's positions that hold the right digit (comparing the output, cut at the
end token, position by position with the target; an output of the wrong length loses the
positions it misses or adds: the share's denominator is the longer of the two), so a model that
gets most digits right earns more than one that gets none. With ``partial_credit`` off, every
inexact answer earns 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

BOS_ID = 256
EOS_ID = 257
SEPARATOR = ord(">")


@dataclass(frozen=True)
class Problem:
    """One prompt: its digits, the token ids the model is given and the ids it must answer."""

    digits: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]


@dataclass(frozen=True)
class Score:
    reward: float
    exact: bool


@dataclass(frozen=True)
class ReverseDigits:
    """Problems of ``min_len`` to ``max_len`` digits, drawn from a seeded generator."""

    min_len: int = 3
    max_len: int = 4
    partial_credit: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len} .. {self.max_len}")

    @property
    def max_new_tokens(self) -> int:
        """Enough new tokens for the longest answer and its end token."""
        return self.max_len + 1

    def problem(self, digits: str) -> Problem:
        if not digits.isdigit():
            raise ValueError(f"digits must be decimal digits, got {digits!r}")
        prompt = (BOS_ID, *digits.encode(), SEPARATOR)
        answer = (*digits[::-1].encode(), EOS_ID)
        return Problem(digits, prompt, answer)

    def sample(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_len, self.max_len)
        return self.problem("".join(rng.choice("0123456789") for _ in range(n)))

    def score(self, problem: Problem, output_ids: list[int]) -> Score:
        """The reward of ``output_ids`` (a turn's sampled ids) for ``problem``."""
        target = list(problem.answer_ids[:-1])
        out = list(output_ids)
        finished = EOS_ID in out
        if finished:
            out = out[: out.index(EOS_ID)]
        if finished and out == target:
            return Score(1.0, True)
        if not self.partial_credit:
            return Score(0.0, False)
        hits = sum(a == b for a, b in zip(out, target, strict=False))
        return Score(0.5 * hits / max(len(out), len(target)), False)

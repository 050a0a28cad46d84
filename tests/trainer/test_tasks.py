"""The demo's multi-turn task: scores of answers, the feedback between attempts, an episode's
reward."""

from __future__ import annotations

import random

import pytest

from trainer.tasks import ReverseDigits, Score

TASK = ReverseDigits(3, 4)


def test_an_exact_answer_scores_one_only_when_the_turn_ended() -> None:
    p = TASK.problem("4071")
    assert p.answer == "1704" and p.messages() == [{"role": "user", "content": "4071"}]
    assert TASK.score(p, "1704", stopped=True) == Score(1.0, True)
    assert TASK.score(p, " 1704\n", stopped=True) == Score(1.0, True)
    assert TASK.score(p, "1704", stopped=False) == Score(0.5, False)  # cut by the token limit


def test_partial_credit_counts_positions_against_the_longer() -> None:
    p = TASK.problem("4071")
    assert TASK.score(p, "1744", True) == Score(0.5 * 3 / 4, False)
    assert TASK.score(p, "17", True) == Score(0.5 * 2 / 4, False)
    assert TASK.score(p, "170412", True) == Score(0.5 * 4 / 6, False)
    assert TASK.score(p, "", True) == Score(0.0, False)
    assert ReverseDigits(partial_credit=False).score(p, "1744", True) == Score(0.0, False)


def test_feedback_marks_the_right_positions() -> None:
    p = TASK.problem("4071")
    assert TASK.feedback(p, "1744") == "17_4"
    assert TASK.feedback(p, "9") == "____"
    assert TASK.feedback(p, "170499") == "1704"


def test_the_reward_is_the_mean_score_of_the_answers() -> None:
    assert TASK.reward([Score(1.0, True)]) == 1.0
    assert TASK.reward([Score(0.25, False), Score(1.0, True)]) == 0.625
    with pytest.raises(ValueError, match="at least one"):
        TASK.reward([])


def test_problems_are_seeded_and_bounds_checked() -> None:
    a = [TASK.sample(random.Random(3)).digits for _ in range(5)]
    assert a == [TASK.sample(random.Random(3)).digits for _ in range(5)]
    assert all(3 <= len(d) <= 4 and d.isdigit() for d in a)
    with pytest.raises(ValueError, match="max_turns"):
        ReverseDigits(max_turns=0)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        ReverseDigits(5, 3)

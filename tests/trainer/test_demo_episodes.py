"""The demo trainer on multi-turn trajectories: the policy computes each segment of a batch once
and gives every sampled token the logits a forward of its own turn (its whole input, then its
output) gives; :func:`trainer.demo.episodes` counts each trajectory's turns and forks from the
batch's segments."""

from __future__ import annotations

import pytest
import torch

from router.records import encode_batch, encode_turn
from router.turn_data import TurnData
from trainer.batch import decode_batch
from trainer.demo import episodes
from trainer.policy import Policy


def _turn(i: int, append: list[int], out: list[int], **kw) -> bytes:
    n = len(out)
    return encode_turn(
        TurnData(
            turn=i,
            group="g",
            replica="r",
            append_ids=append,
            output_ids=out,
            logprobs=[-1.0] * n,
            raw_logprobs=[-1.0] * n,
            support_ids=[[]] * n,
            support_logprobs=[[]] * n,
            **kw,
        )
    )


@pytest.fixture(scope="module")
def batch():
    chat = [_turn(0, [5, 17, 42], [99, 3]), _turn(1, [250, 7, 8], [11, 12, 13], context=5)]
    forked = [
        _turn(0, [1, 2, 3], [4]),
        _turn(1, [1, 2, 9, 9], [8, 7], fork={"stored": 4, "common": 2}),
        _turn(2, [6], [5], context=6),
    ]
    single = [_turn(0, [30, 31], [32, 33])]
    meta = {"prompt": "p", "exact": True}
    return decode_batch(
        encode_batch(
            "L",
            0,
            [
                ({"session_id": "a", "reward": 1.0, "metadata": meta}, chat),
                ({"session_id": "b", "reward": 0.5, "metadata": {"prompt": "p"}}, forked),
                ({"session_id": "c", "reward": 0.0, "metadata": {"prompt": "q"}}, single),
            ],
        )
    )


def test_each_token_gets_its_own_turns_logits(batch, tiny_dir) -> None:
    torch.manual_seed(0)
    policy = Policy.load(tiny_dir)
    assert len(batch.sequence_offsets) - 1 == 4  # a, b's two segments, c: each computed once
    with torch.no_grad():
        got = policy.sampled_logits(batch, temperature=2.0)
        want = []
        for turn in batch.turns:
            lo, hi = int(turn["token_start"]), int(turn["token_end"])
            context = [int(x) for x in turn["input_ids"]]
            logits = policy.forward([context + batch.token_ids[lo:hi].tolist()])[0]
            want.append(logits[len(context) - 1 : len(context) - 1 + hi - lo] / 2.0)
    assert got.shape == (len(batch), policy.model.config.vocab_size)
    torch.testing.assert_close(got, torch.cat(want), atol=2e-2, rtol=2e-2)


def test_episodes_count_turns_and_forks(batch) -> None:
    assert episodes(batch) == [
        {"session": "a", "prompt": "p", "reward": 1.0, "exact": True, "turns": 2, "forks": 0},
        {"session": "b", "prompt": "p", "reward": 0.5, "exact": False, "turns": 3, "forks": 1},
        {"session": "c", "prompt": "q", "reward": 0.0, "exact": False, "turns": 1, "forks": 0},
    ]

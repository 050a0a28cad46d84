"""Routing replay (R3) in the trainer kit's BF16 forward: recorded experts replace the trainer's own
top-k exactly, gate weights come from the trainer's router logits (gradients reach the router),
and the forward changes only through routing: replaying the trainer's own routes changes nothing,
and routes changed from position m on leave every earlier position's logits untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from router.records import encode_batch, encode_turn
from router.turn_data import ROUTES_SECTION, RoutedExperts, TurnData
from trainer.batch import decode_batch
from trainer.policy import NO_ROUTES, Policy

SEQ = [5, 17, 42, 99, 3, 250, 7, 11, 12, 13, 200, 2]


@pytest.fixture(scope="module")
def policy(tiny_dir) -> Policy:
    torch.manual_seed(0)
    return Policy.load(tiny_dir)


class Used:
    """The experts every MoE layer's experts actually ran with, per forward: [B, L, layers, k]."""

    def __init__(self, policy: Policy) -> None:
        self.by_layer: dict[int, torch.Tensor] = {}
        self.handles = [
            layer.mlp.experts.register_forward_pre_hook(self._hook(i))
            for i, layer in enumerate(policy.model.model.layers)
        ]

    def _hook(self, i: int):
        def hook(_module, args):
            self.by_layer[i] = args[1].detach().clone()

        return hook

    def routes(self, batch: int, width: int) -> np.ndarray:
        layers = [self.by_layer[i] for i in sorted(self.by_layer)]
        return torch.stack(layers, dim=1).reshape(batch, width, len(layers), -1).numpy()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _own_routes(policy: Policy, seqs: list[list[int]]) -> np.ndarray:
    used = Used(policy)
    try:
        with torch.no_grad():
            policy.forward(seqs)
        return used.routes(len(seqs), max(map(len, seqs)))
    finally:
        used.close()


def _sampler_routes(tiny_dir, seq: list[int]) -> np.ndarray:
    """The local engine's routes of ``seq`` (what a sampler records): [len(seq), layers, k]."""
    from engine.model.model import load_model

    model = load_model(str(tiny_dir))
    _, routes = model.forward_routed([torch.tensor(seq)], [model.new_sequence()])
    return routes[0].numpy()


def test_replaying_the_trainers_own_routes_changes_nothing(policy: Policy) -> None:
    own = _own_routes(policy, [SEQ])[0]
    with torch.no_grad():
        plain = policy.forward([SEQ])
        replayed = policy.forward([SEQ], [own[:-1]])
    assert torch.equal(plain, replayed)
    assert policy.last_route_differ[0, :-1].tolist() == [0] * (len(SEQ) - 1)
    assert policy.last_route_differ[0, -1] == NO_ROUTES


def test_replay_runs_the_recorded_experts_and_changes_only_from_where_routing_changed(policy: Policy) -> None:
    own = _own_routes(policy, [SEQ])[0]
    experts = policy.model.config.num_experts
    m = 6
    recorded = own[:-1].copy()
    recorded[m:] = (recorded[m:] + 1) % experts  # other experts from position m on (still distinct)
    used = Used(policy)
    try:
        with torch.no_grad():
            plain = policy.forward([SEQ])
            replayed = policy.forward([SEQ], [recorded])
        got = used.routes(1, len(SEQ))[0]
    finally:
        used.close()
    np.testing.assert_array_equal(got[:-1], recorded)  # exactly the recorded experts, in order
    # An unrecorded position is routed by the model itself: k distinct experts, and in layer 0 (whose
    # router reads only the attention over embeddings, which the changed routes cannot reach) the
    # plain forward's own top-k. Deeper layers read hidden states the replayed experts changed.
    assert all(len(set(row)) == len(row) for row in got[-1].tolist())
    np.testing.assert_array_equal(got[-1][0], own[-1][0])
    assert torch.equal(replayed[0, :m], plain[0, :m])  # causal: nothing before the change moved
    assert not torch.allclose(replayed[0, m:], plain[0, m:])
    assert policy.last_route_differ[0, :m].tolist() == [0] * m
    assert policy.last_route_differ[0, m:-1].tolist() == [1] * (len(SEQ) - 1 - m)


def test_replayed_gate_weights_are_the_trainers_and_carry_gradients(policy: Policy) -> None:
    own = _own_routes(policy, [SEQ])[0]
    recorded = (own[:-1] + 3) % policy.model.config.num_experts
    policy.model.zero_grad()
    logits = policy.forward([SEQ], [recorded])
    torch.log_softmax(logits[0, :-1], -1).gather(1, torch.tensor(SEQ[1:])[:, None]).sum().backward()
    for layer in policy.model.model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0
    policy.model.zero_grad()


def _batch_with_routes(seq: list[int], n_out: int, routes: np.ndarray):
    flat = routes.reshape(-1).astype(np.int32)
    rows, width = routes.shape[0], routes.shape[1] * routes.shape[2]
    turn = TurnData(
        turn=0,
        group="g",
        replica="r",
        append_ids=seq[:-n_out],
        output_ids=seq[-n_out:],
        logprobs=[-1.0] * n_out,
        raw_logprobs=[-1.0] * n_out,
        support_ids=[[]] * n_out,
        support_logprobs=[[]] * n_out,
        sections={ROUTES_SECTION: RoutedExperts(0, rows, width, flat.astype("<i4").tobytes()).to_section()},
    )
    data = encode_batch("L", 0, [({"session_id": "s"}, [encode_turn(turn)])])
    return decode_batch(data)


def test_a_batch_replays_the_samplers_routes_exactly(policy: Policy, tiny_dir) -> None:
    sampler = _sampler_routes(tiny_dir, SEQ)[:-1]  # SGLang's rows: positions [0, seqlen - 1)
    n_out = 5
    batch = _batch_with_routes(SEQ, n_out, sampler)
    used = Used(policy)
    try:
        with torch.no_grad():
            logits = policy.sampled_logits(batch, replay=True)
        got = used.routes(1, len(SEQ))[0]
    finally:
        used.close()
    np.testing.assert_array_equal(got[:-1], sampler)
    assert logits.shape == (n_out, policy.model.config.vocab_size)
    own = _own_routes(policy, [SEQ])[0][:-1]
    same = (np.sort(own, -1) == np.sort(sampler, -1)).all(axis=(-1, -2))
    want = (~same[len(SEQ) - n_out - 1 :]).astype(np.uint8)  # the positions that predicted each token
    np.testing.assert_array_equal(policy.route_mismatch(), want)
    with torch.no_grad():
        policy.sampled_logits(batch, replay=False)
    np.testing.assert_array_equal(policy.route_mismatch(), want)  # measured with or without replay

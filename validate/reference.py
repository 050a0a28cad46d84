"""The trainer's BF16 forward that levels 4 and 5 compare a group with.

``transformers``' ``Qwen3MoeForCausalLM`` (the trainer's model class, ``trainer.policy``) loaded
from the BF16 checkpoint of the group's active version, computed in float32 (the BF16 weights are
exact in float32): an implementation independent of the fleet's engine. Per sequence it gives
the log-probabilities of every next token and, per MoE layer, the top-k expert ids its router
chose for every token (``output_router_logits``; the top-k of the router's softmax is the top-k of
its logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Forward:
    """One sequence: ``logp`` ``[L - 1, V]`` (float64: position ``i`` predicts token ``i + 1``) and
    ``routes`` ``{layer: [L, k] int64}`` (the MoE layers' top-k expert ids, sorted per token)."""

    logp: torch.Tensor
    routes: dict[int, torch.Tensor]


class Reference:
    def __init__(self, checkpoint: Path) -> None:
        from transformers import Qwen3MoeForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = Qwen3MoeForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        c = self.model.config
        self.top_k = int(c.num_experts_per_tok)
        sparse = [
            i
            for i in range(c.num_hidden_layers)
            if i not in (c.mlp_only_layers or []) and (i + 1) % c.decoder_sparse_step == 0
        ]
        self.moe_layers = sparse if c.num_experts else []

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> Forward:
        out = self.model(torch.tensor([ids]), output_router_logits=bool(self.moe_layers))
        logp = torch.log_softmax(out.logits[0, :-1].double(), dim=-1)
        routes = {}
        for layer, logits in zip(self.moe_layers, out.router_logits or (), strict=False):
            top = torch.topk(logits.reshape(len(ids), -1).float(), self.top_k, dim=-1).indices
            routes[layer] = torch.sort(top, dim=-1).values
        return Forward(logp, routes)

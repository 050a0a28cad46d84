"""The demo's trainer-side policy: a ``transformers`` ``Qwen3MoeForCausalLM`` loaded from an HF
BF16 checkpoint, trained with float32 master weights and BF16 autocast compute, saved back as an
HF BF16 checkpoint.

Contract:

* :meth:`Policy.load` reads ``config.json`` and ``*.safetensors`` of a directory (the base policy
  ``mixfleet init-model`` writes, or one :meth:`Policy.save` wrote).
* :meth:`Policy.save` writes ``config.json`` and ``model.safetensors`` with the checkpoint's own
  tensor names (``save_pretrained`` maps the library's fused expert tensors back to the per-expert
  HF names) in BF16, plus the base's tokenizer files, so the fleet's converter and loaders take it
  as they take the base.
* :meth:`Policy.sampled_logits` gives the logits at exactly the positions a batch sampled, in the
  batch's token order, so :func:`trainer.corrections.policy_loss` applies to them unchanged.
* Routing replay (R3, as slime/Miles' ``RoutingReplay``: ``probs = scores.gather(1,
  top_indices)`` with the rollout's indices): with ``replay``, every position whose routed
  experts the batch recorded (:meth:`trainer.batch.Batch.segment_routes`) uses the sampler's experts in
  every MoE layer instead of the trainer's own top-k; their gate weights are recomputed from the
  trainer's own router logits (softmax over all experts, gathered at the recorded ids,
  renormalized when ``norm_topk_prob``, exactly as ``Qwen3MoeTopKRouter`` weighs its own top-k),
  so gradients still reach the router. Positions without a record (padding, a turn's last token)
  keep the trainer's routing. Replay goes through ``register_forward_hook`` on each router
  (a public torch API), which replaces the router's output; nothing else changes, so replaying
  the trainer's own routes gives exactly the forward without replay.
* :meth:`Policy.route_mismatch` says, per sampled token, whether the trainer's own top-k (as a
  set, per MoE layer) differs from the recorded experts at the position that predicted it.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.batch import Batch

COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
NO_ROUTES = 2  # route_mismatch: the position has no recorded routes


class _Replay:
    """The forward hooks of one forward pass: per MoE layer (its index in ``model.layers``) the
    recorded experts ``[B * L, k]`` (-1: not recorded), and, filled by the pass, per layer whether
    the trainer's own top-k set differs from them ``[B * L]`` (False where not recorded)."""

    def __init__(self, recorded: torch.Tensor, replay: bool) -> None:
        self.recorded = recorded  # [B, L, layers, k] int64
        self.replay = replay
        self.differ = torch.zeros(recorded.shape[:2], dtype=torch.bool)

    def hook(self, layer: int, norm_topk_prob: bool):
        def forward_hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
            logits, scores, own = output
            want = self.recorded[:, :, layer].reshape(-1, own.shape[-1])
            known = want[:, 0] >= 0
            same = (own.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1)
            self.differ |= (known & ~same).view(self.differ.shape)
            if not self.replay or not bool(known.any()):
                return output
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            idx = torch.where(known[:, None], want, own)
            top = probs.gather(1, idx)
            if norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        return forward_hook


class CheckpointError(ValueError):
    """A directory is not a checkpoint the policy can load."""


@dataclass
class Policy:
    model: torch.nn.Module
    source: Path
    pad_id: int
    last_route_differ: np.ndarray | None = None
    _sampled_differ: np.ndarray | None = None

    @classmethod
    def load(cls, checkpoint: str | Path) -> Policy:
        from transformers import Qwen3MoeForCausalLM
        from transformers.utils import logging as hf_logging

        path = Path(checkpoint)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} holds no config.json (not an HF checkpoint)")
        hf_logging.disable_progress_bar()
        try:
            model = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        except Exception as exc:  # a broken config or shard: transformers raises many kinds
            raise CheckpointError(
                f"{path}: cannot load the checkpoint: {type(exc).__name__}: {exc}"
            ) from None
        model.train()
        pad = model.config.pad_token_id
        return cls(model, path, 0 if pad is None else int(pad))

    def _moe_routers(self) -> list[tuple[int, torch.nn.Module]]:
        """(layer index, router module) of every MoE layer."""
        layers = self.model.model.layers
        return [(i, layer.mlp.gate) for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate")]

    def forward(
        self, sequences: list[list[int]], routes: list[np.ndarray | None] | None = None, replay: bool = True
    ) -> torch.Tensor:
        """Logits [B, L, V] (float32) of right-padded ``sequences``, computed under BF16 autocast.

        ``routes`` (one per sequence, None: none recorded): int ``[rows, layers, k]`` for its
        positions ``[0, rows)``, a row of -1 where none was recorded; with ``replay`` they replace
        the trainer's top-k there (module docstring). Either way :attr:`last_route_differ` is then
        ``[B, L]`` uint8: 1 where the trainer's own top-k differs from the recorded experts in some
        MoE layer, 0 where it is the same, :data:`NO_ROUTES` where nothing was recorded."""
        width = max(len(s) for s in sequences)
        if routes is None:
            self.last_route_differ = None
            return self._forward(sequences, width)
        cfg = self.model.config
        recorded = torch.full((len(sequences), width, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1)
        for i, r in enumerate(routes):
            if r is not None:
                if r.shape[1:] != recorded.shape[2:] or r.shape[0] > width:
                    raise ValueError(f"routes of sequence {i} have shape {r.shape}, not [<= {width}, "
                                     f"{cfg.num_hidden_layers}, {cfg.num_experts_per_tok}]")  # fmt: skip
                recorded[i, : r.shape[0]] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        state = _Replay(recorded, replay)
        handles = [
            m.register_forward_hook(state.hook(i, bool(cfg.norm_topk_prob))) for i, m in self._moe_routers()
        ]
        try:
            logits = self._forward(sequences, width)
        finally:
            for h in handles:
                h.remove()
        differ = state.differ.to(torch.uint8)
        differ[recorded[:, :, 0, 0] < 0] = NO_ROUTES
        self.last_route_differ = differ.numpy()
        return logits

    def _forward(self, sequences: list[list[int]], width: int) -> torch.Tensor:
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(sequences), width), dtype=torch.int64)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
            mask[i, : len(s)] = 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.model(input_ids=ids, attention_mask=mask, use_cache=False)
        return out.logits.float()

    def sampled_logits(self, batch: Batch, temperature: float = 1.0, replay: bool = False) -> torch.Tensor:
        """[T, V]: for every sampled token of ``batch`` (in its order), the logits (divided by
        ``temperature``) of the position that predicted it. Each segment of the batch is one
        sequence (:attr:`Batch.sequence_ids`, every token once: a multi-turn trajectory's turns
        are computed together, each turn's context being the segment's tokens before it), and a
        sampled token's logits are those at its position in its segment minus one. ``replay``:
        the segments' recorded routed experts replace the trainer's routing (module docstring);
        recorded routes are compared with the trainer's own either way (:meth:`route_mismatch`)."""
        offsets = batch.sequence_offsets
        ids = batch.sequence_ids
        sequences = [ids[offsets[s] : offsets[s + 1]].tolist() for s in range(offsets.size - 1)]
        k = int(self.model.config.num_experts_per_tok)
        routes = [batch.segment_routes(s, k) for s in range(len(sequences))]
        recorded = any(r is not None for r in routes)
        logits = self.forward(sequences, routes if recorded else None, replay=replay)
        segment = np.searchsorted(offsets, batch.token_positions, side="right") - 1
        r = torch.from_numpy(segment)
        c = torch.from_numpy(batch.token_positions - offsets[segment] - 1)
        self._sampled_differ = None if self.last_route_differ is None else self.last_route_differ[r, c]
        return logits[r, c] / temperature

    def route_mismatch(self) -> np.ndarray | None:
        """Per sampled token of the last :meth:`sampled_logits` batch (its order): 1 where the
        trainer's own experts differ from the recorded ones at the position that predicted the
        token, 0 where they agree, :data:`NO_ROUTES` where none were recorded; None when the
        batch recorded no routes."""
        return self._sampled_differ

    def save(self, out: str | Path) -> Path:
        """Write the current weights as an HF BF16 checkpoint into ``out`` (created)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        snapshot = copy.deepcopy(self.model).to(torch.bfloat16)
        snapshot.config.dtype = torch.bfloat16
        snapshot.save_pretrained(str(out), safe_serialization=True)
        for name in COPIED_FILES:
            if (self.source / name).is_file():
                shutil.copyfile(self.source / name, out / name)
        return out

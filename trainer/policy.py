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
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.batch import Batch

COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


class CheckpointError(ValueError):
    """A directory is not a checkpoint the policy can load."""


@dataclass
class Policy:
    model: torch.nn.Module
    source: Path
    pad_id: int

    @classmethod
    def load(cls, checkpoint: str | Path) -> Policy:
        from transformers import Qwen3MoeForCausalLM
        from transformers.utils import logging as hf_logging

        path = Path(checkpoint)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} holds no config.json (not an HF checkpoint)")
        hf_logging.disable_progress_bar()
        model = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model.train()
        pad = model.config.pad_token_id
        return cls(model, path, 0 if pad is None else int(pad))

    def forward(self, sequences: list[list[int]]) -> torch.Tensor:
        """Logits [B, L, V] (float32) of right-padded ``sequences``, computed under BF16 autocast."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(sequences), width), dtype=torch.int64)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
            mask[i, : len(s)] = 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.model(input_ids=ids, attention_mask=mask, use_cache=False)
        return out.logits.float()

    def sampled_logits(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """[T, V]: for every sampled token of ``batch`` (in its order), the logits (divided by
        ``temperature``) of the position that predicted it. Each trajectory's turns are
        concatenated into one sequence (turn k's input is the whole context up to it)."""
        sequences: list[list[int]] = []
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        for turn in batch.turns:
            start, end = int(turn["token_start"]), int(turn["token_end"])
            context = [int(x) for x in turn["input_ids"]]
            output = batch.token_ids[start:end].tolist()
            rows.append(np.full(end - start, len(sequences), dtype=np.int64))
            cols.append(len(context) - 1 + np.arange(end - start, dtype=np.int64))
            sequences.append(context + output)
        logits = self.forward(sequences)
        r = torch.from_numpy(np.concatenate(rows))
        c = torch.from_numpy(np.concatenate(cols))
        return logits[r, c] / temperature

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

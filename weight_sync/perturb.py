"""Known synthetic perturbations of a BF16 checkpoint, for proving that an update activated.

``swap_output_rows(src, dst, t, s)`` swaps rows ``t`` and ``s`` of the output projection. Every
weight format keeps ``lm_head`` in BF16 and a row swap only permutes the logits, so the softmax
normalizer is unchanged and the effect is exact and known before publishing, for every group
whatever its precision: at any position ``logp_after(t) == logp_before(s)``,
``logp_after(s) == logp_before(t)``, and every other token's log-prob is unchanged. With a tied
embedding the embedding rows swap too, which changes nothing for sequences in which neither
token occurs before the scored position.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from safetensors.torch import load_file, save_file

from core.errors import UserError
from weight_sync.publish import link_tree
from weight_sync.safetensors_io import read_header


def swap_output_rows(src: Path, dst: Path, t: int, s: int) -> str:
    """Write into ``dst`` the checkpoint ``src`` with rows ``t`` and ``s`` of the output projection
    swapped (``lm_head.weight``, or ``model.embed_tokens.weight`` when the embedding is tied);
    returns the tensor's name. Other files are hard-linked; ``manifest.json`` is left out."""
    shard, tensor_name, meta = check_swap_rows(sorted(Path(src).glob("*.safetensors")), t, s)
    link_tree(src, dst, skip=("manifest.json", shard.name))
    tensors = load_file(shard)
    w = tensors[tensor_name].clone()
    w[[t, s]] = w[[s, t]]
    tensors[tensor_name] = w
    save_file(tensors, str(dst / shard.name), metadata=meta)
    return tensor_name


def check_swap_rows(shards: Sequence[Path], t: int, s: int) -> tuple[Path, str, dict[str, str] | None]:
    """The one of ``shards`` (a checkpoint's safetensors files) holding its output projection, the
    tensor's name and the shard's metadata, from the headers alone; ``UserError`` when there is
    none or ``t`` and ``s`` are not two different rows of it."""
    headers = {f: read_header(f) for f in shards}
    target = next(
        (
            (f, name)
            for name in ("lm_head.weight", "model.embed_tokens.weight")
            for f in headers
            if name in headers[f][0]
        ),
        None,
    )
    if target is None:
        where = shards[0].parent if shards else "the checkpoint"
        raise UserError(f"{where} has neither lm_head.weight nor model.embed_tokens.weight")
    shard, tensor_name = target
    entries, meta = headers[shard]
    rows = entries[tensor_name].shape[0]
    if not (0 <= t < rows and 0 <= s < rows) or t == s:
        raise UserError(f"swap_rows must be two different token ids in [0, {rows}), got {t}, {s}")
    return shard, tensor_name, meta or None

"""Synthetic HF ``Qwen3MoeForCausalLM`` BF16 checkpoints for weight_sync tests and benchmarks.

``write_checkpoint(dir, spec)`` writes ``config.json``, BF16 ``*.safetensors`` shards (written
with the real ``safetensors`` library), ``model.safetensors.index.json``, a small
``tokenizer.json`` and ``generation_config.json``. Values are seeded (the same spec gives the
same bytes), roughly N(0, scale) with a few planted outliers per tensor, so block and group
maxima differ across the tensor.

Shard assignment: with ``straddle=True`` (and 2+ shards) fusion groups are deliberately split
across shards -- ``layers.{last}.self_attn.k_proj`` and one expert's ``up_proj`` go to a different
shard than their q_proj / gate_proj partners -- so a converter must read across shards.
With ``shard_bytes`` set, tensors fill shards in order up to that size instead (benchmarks).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class MoESpec:
    """Shapes of a small Qwen3-MoE model (defaults: tiny, fp8 edge blocks, a dense layer)."""

    hidden_size: int = 160  # not a multiple of 128: fp8 edge blocks
    intermediate_size: int = 224  # dense MLP layers
    moe_intermediate_size: int = 96
    num_hidden_layers: int = 3
    num_experts: int = 4
    num_experts_per_tok: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 40
    vocab_size: int = 300
    mlp_only_layers: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    shards: int = 2
    shard_bytes: int | None = None
    straddle: bool = True
    seed: int = 0
    scale: float = 0.05
    extra: dict = field(default_factory=dict)

    def config(self) -> dict:
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "mlp_only_layers": list(self.mlp_only_layers),
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 4096,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        cfg.update(self.extra)
        return cfg

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor name and shape, in a natural (layer) order."""
        h, d = self.hidden_size, self.head_dim
        yield "model.embed_tokens.weight", (self.vocab_size, h)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", (h,)
            yield f"{p}.self_attn.q_proj.weight", (self.num_attention_heads * d, h)
            yield f"{p}.self_attn.k_proj.weight", (self.num_key_value_heads * d, h)
            yield f"{p}.self_attn.v_proj.weight", (self.num_key_value_heads * d, h)
            yield f"{p}.self_attn.o_proj.weight", (h, self.num_attention_heads * d)
            yield f"{p}.self_attn.q_norm.weight", (d,)
            yield f"{p}.self_attn.k_norm.weight", (d,)
            yield f"{p}.post_attention_layernorm.weight", (h,)
            if i in self.mlp_only_layers:
                inter = self.intermediate_size
                yield f"{p}.mlp.gate_proj.weight", (inter, h)
                yield f"{p}.mlp.up_proj.weight", (inter, h)
                yield f"{p}.mlp.down_proj.weight", (h, inter)
            else:
                inter = self.moe_intermediate_size
                yield f"{p}.mlp.gate.weight", (self.num_experts, h)
                for e in range(self.num_experts):
                    yield f"{p}.mlp.experts.{e}.gate_proj.weight", (inter, h)
                    yield f"{p}.mlp.experts.{e}.up_proj.weight", (inter, h)
                    yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, inter)
        yield "model.norm.weight", (h,)
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (self.vocab_size, h)

    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.tensor_shapes())


def make_tensor(name: str, shape: tuple[int, ...], seed: int, scale: float) -> torch.Tensor:
    """The deterministic BF16 value of one tensor."""
    g = torch.Generator().manual_seed((hash_name(name) ^ seed) & 0x7FFFFFFF)
    if len(shape) == 1:  # norms: around 1
        return (1.0 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    t = torch.randn(shape, generator=g) * scale
    n = t.numel()
    flat = t.view(-1)
    idx = torch.randint(0, n, (max(1, n // 997),), generator=g)
    flat[idx] *= torch.empty(idx.numel()).uniform_(5.0, 40.0, generator=g)
    return t.to(torch.bfloat16)


def hash_name(name: str) -> int:
    h = 1469598103934665603
    for b in name.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _assign_shards(spec: MoESpec, names: list[tuple[str, tuple[int, ...]]]) -> list[list[str]]:
    if spec.shard_bytes is not None:
        out: list[list[str]] = [[]]
        size = 0
        for name, shape in names:
            nbytes = math.prod(shape) * 2
            if out[-1] and size + nbytes > spec.shard_bytes:
                out.append([])
                size = 0
            out[-1].append(name)
            size += nbytes
        return out
    n = max(1, spec.shards)
    per = math.ceil(len(names) / n)
    out = [[name for name, _ in names[i * per : (i + 1) * per]] for i in range(n)]
    if spec.straddle and n >= 2:
        last = spec.num_hidden_layers - 1
        moved = [f"model.layers.{last}.self_attn.k_proj.weight"]
        moe_layers = [i for i in range(spec.num_hidden_layers) if i not in spec.mlp_only_layers]
        if moe_layers:
            moved.append(f"model.layers.{moe_layers[0]}.mlp.experts.1.up_proj.weight")
        for m in moved:
            src = next(i for i, s in enumerate(out) if m in s)
            out[src].remove(m)
            out[(src + 1) % n].append(m)
    return [s for s in out if s]


def write_checkpoint(directory: Path, spec: MoESpec | None = None) -> MoESpec:
    """Write the checkpoint of ``spec`` into ``directory`` (created); returns the spec."""
    spec = spec or MoESpec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(spec.config(), indent=2) + "\n")
    names = list(spec.tensor_shapes())
    shapes = dict(names)
    shards = _assign_shards(spec, names)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: make_tensor(n, shapes[n], spec.seed, spec.scale) for n in shard}
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * 2
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (directory / "generation_config.json").write_text(json.dumps(gen) + "\n")
    vocab = {f"<{i}>": i for i in range(spec.vocab_size)}
    tok = {"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<0>"}}
    (directory / "tokenizer.json").write_text(json.dumps(tok) + "\n")
    return spec


def load_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (for checks on small models)."""
    from safetensors import safe_open

    out = {}
    for p in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[k] = f.get_tensor(k)
    return out


def write_sparse_checkpoint(directory: Path, spec: MoESpec) -> MoESpec:
    """Write ``spec``'s checkpoint as real safetensors files whose data sections are holes (sparse
    files: every tensor reads as zeros and takes no disk), for models too big to write: the
    header, ``config.json`` and the index are those of the real model. One shard per
    ``spec.shard_bytes`` of tensors (default: one shard)."""
    from weight_sync.safetensors_io import OutTensor, encode_header

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(spec.config(), indent=2) + "\n")
    names = list(spec.tensor_shapes())
    shapes = dict(names)
    shards = _assign_shards(spec, names) if spec.shard_bytes is not None else [[n for n, _ in names]]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = [OutTensor(n, "BF16", shapes[n]) for n in shard]
        header = encode_header(tensors, {"format": "pt"})
        with open(directory / fname, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(t.nbytes for t in tensors))
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": spec.numel() * 2}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return spec

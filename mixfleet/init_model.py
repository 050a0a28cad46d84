"""Write a deterministic BF16 Qwen3-MoE base policy (HF checkpoint + byte-level tokenizer).

``mixfleet init-model DIR [--preset tiny|small] [--seed S]`` writes ``config.json``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template:
every preset is a chat model) and the weights (``model.safetensors``, or shards plus
``model.safetensors.index.json`` for ``small``). The same preset and seed give the same bytes on
every run.

The writer, its presets and its initialisation are :mod:`weight_sync.base_model` (shared with the
conversion pool's warm-up, which must not import this command); this module is the command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core.errors import UserError
from weight_sync.base_model import DEFAULT_SEED, PRESETS, Preset, write_model


def param_count(preset: str | Preset) -> int:
    """Number of parameters of a preset (embeddings and LM head included)."""
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    h, d, L = spec.hidden_size, spec.head_dim, spec.num_hidden_layers
    attn = h * d * (2 * spec.num_attention_heads + 2 * spec.num_key_value_heads) + 2 * d + 2 * h
    moe = spec.num_experts * 3 * h * spec.moe_intermediate_size + spec.num_experts * h
    dense = 3 * h * spec.intermediate_size
    mlp = sum(dense if i in spec.mlp_only_layers else moe for i in range(L))
    return L * attn + mlp + 2 * spec.vocab_size * h + h


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size (default tiny)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    out: Path = args.dir
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    if (out / "config.json").exists():
        raise UserError(f"{out} already holds a model (config.json exists); choose an empty directory")
    try:
        write_model(out, args.preset, args.seed)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc}") from None
    print(f"wrote {args.preset} Qwen3-MoE base policy ({param_count(args.preset):,} parameters) to {out}")
    return 0

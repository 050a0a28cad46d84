"""The deterministic BF16 Qwen3-MoE base policy: an HF checkpoint (``config.json``,
``generation_config.json``, the weights as ``model.safetensors`` or shards plus
``model.safetensors.index.json``) with its byte-level tokenizer (``tokenizer.json``,
``tokenizer_config.json``); the same preset and seed give the same bytes on every run.

Two users share this one writer: ``mixfleet init-model`` (:mod:`mixfleet.init_model`, the command)
and the conversion pool's warm-up (``weight_sync.publish._warm_job``), which converts a one-layer
model into every format in each worker (nvfp4's calibration reads the tokenizer too). It lives in
weight_sync, the lower of the two packages, so that the warm-up imports nothing of the command
layer.

Every preset is a chat model: after the byte tokens (ids 0-255) and :data:`SPECIAL_TOKENS`
(256-258) come the chat tokens :data:`CHAT_TOKENS` (ids 259-266; :data:`VOCAB_SIZE` counts all of
them and is ``config.json``'s ``vocab_size``), ``tokenizer_config.json`` carries
:data:`CHAT_TEMPLATE`, a Qwen3-style template, as its ``chat_template``, and ``<|im_end|>``
(:data:`IM_END_ID`) is an end-of-sequence id beside ``<|eos|>``. The chat APIs render with these
(:mod:`router.chat.renderers.local`). The tokenizer is built from the engine's byte-level alphabet
(``engine.model.tokenizer.bytes_to_unicode``), imported inside :func:`tokenizer_dict` only: the
same lazy weight_sync -> engine arrow as nvfp4's calibration (``weight_sync.convert``).

Initialisation (chosen so that the random policy is not uniform and every layer matters):
embeddings N(0, 1); q/k/v, router, experts' and MLP gate/up N(0, 1/fan_in); o_proj and down
projections N(0, 1/(fan_in * 2 * layers)); norm weights 1 + N(0, 0.1^2); LM head with std
3/sqrt(hidden), so next-token logits have a spread of about 3 nats and the model behaves like a
peaked, context-dependent bigram model (entropy a few nats), which makes sampling tests
meaningful.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
CHAT_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
ADDED_TOKENS = SPECIAL_TOKENS + CHAT_TOKENS
"""The added tokens in id order from 256."""
VOCAB_SIZE = 256 + len(ADDED_TOKENS)
"""Every preset's vocabulary: the byte tokens, the special tokens and the chat tokens."""
IM_START_ID = 256 + ADDED_TOKENS.index("<|im_start|>")
IM_END_ID = 256 + ADDED_TOKENS.index("<|im_end|>")
EOS_IDS = (EOS_ID, IM_END_ID)
"""``config.json``'s ``eos_token_id``: ``<|eos|>`` and ``<|im_end|>``."""
DEFAULT_SEED = 1234

# Qwen3's chat template (Qwen/Qwen3 tokenizer_config.json) in its parts the local model uses: a
# system prompt with the tool signatures, <think> reasoning, <tool_call> JSON calls and
# <tool_response> results.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- else %}{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{%- set reasoning_content = message.reasoning_content %}{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{\\"name\\": \\"\' }}{{- tool_call.name }}{{- \'\\", \\"arguments\\": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    """Shape of a generated model. ``shards``: number of safetensors files (1 = no index)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    max_position_embeddings: int
    shards: int
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        """:data:`VOCAB_SIZE`, the same for every preset."""
        return VOCAB_SIZE


# Every dim divides NVFP4 groups of 16 and MXFP4 blocks of 32. FP8: tiny's k/v (N = 2 x 32 = 64)
# are not a multiple of 128, so SGLang refuses its qkv_proj as block FP8 and `mixfleet convert`
# keeps it BF16 (weight_sync/formats/fp8_layout.py); small's every merged shard fits.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        intermediate_size=512,
        max_position_embeddings=2048,
        shards=1,
    ),
    "small": Preset(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=384,
        intermediate_size=1536,
        max_position_embeddings=4096,
        shards=2,
    ),
}


def config_dict(preset: Preset) -> dict[str, Any]:
    """The ``config.json`` of a preset: every field transformers' ``Qwen3MoeConfig`` (v4 and v5
    spellings) and SGLang's Qwen3-MoE loader read."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "max_window_layers": preset.num_hidden_layers,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(preset.mlp_only_layers),
        "moe_intermediate_size": preset.moe_intermediate_size,
        "num_experts": preset.num_experts,
        "num_experts_per_tok": preset.num_experts_per_tok,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": BOS_ID,
        "eos_token_id": list(EOS_IDS),
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
    }


def init_tensors(preset: Preset, seed: int) -> dict[str, Any]:
    """HF-named BF16 tensors of a freshly initialised model (deterministic in ``seed``)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p = preset
    layers = p.num_hidden_layers
    h, d = p.hidden_size, p.head_dim

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * std).to(torch.bfloat16)

    def linear(n: int, k: int, residual: bool = False) -> torch.Tensor:
        var = 1.0 / k / (2 * layers if residual else 1)
        return normal((n, k), var**0.5)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + torch.randn((n,), generator=g) * 0.1).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((p.vocab_size, h), 1.0)}
    for i in range(layers):
        q = f"model.layers.{i}."
        t[q + "input_layernorm.weight"] = norm(h)
        t[q + "self_attn.q_proj.weight"] = linear(p.num_attention_heads * d, h)
        t[q + "self_attn.k_proj.weight"] = linear(p.num_key_value_heads * d, h)
        t[q + "self_attn.v_proj.weight"] = linear(p.num_key_value_heads * d, h)
        t[q + "self_attn.o_proj.weight"] = linear(h, p.num_attention_heads * d, residual=True)
        t[q + "self_attn.q_norm.weight"] = norm(d)
        t[q + "self_attn.k_norm.weight"] = norm(d)
        t[q + "post_attention_layernorm.weight"] = norm(h)
        if i not in p.mlp_only_layers and p.num_experts > 0:
            t[q + "mlp.gate.weight"] = linear(p.num_experts, h)
            for e in range(p.num_experts):
                x = f"{q}mlp.experts.{e}."
                t[x + "gate_proj.weight"] = linear(p.moe_intermediate_size, h)
                t[x + "up_proj.weight"] = linear(p.moe_intermediate_size, h)
                t[x + "down_proj.weight"] = linear(h, p.moe_intermediate_size, residual=True)
        else:
            t[q + "mlp.gate_proj.weight"] = linear(p.intermediate_size, h)
            t[q + "mlp.up_proj.weight"] = linear(p.intermediate_size, h)
            t[q + "mlp.down_proj.weight"] = linear(h, p.intermediate_size, residual=True)
    t["model.norm.weight"] = norm(h)
    t["lm_head.weight"] = normal((p.vocab_size, h), 3.0 / h**0.5)
    return t


def tokenizer_dict() -> dict[str, Any]:
    """``tokenizer.json``: byte-level BPE with no merges (token id == byte value) + the
    :data:`ADDED_TOKENS` (ids from 256; the chat tokens not special, as Qwen3's ``<think>``, but
    ``<|im_start|>`` and ``<|im_end|>``), spelled exactly as the ``tokenizers`` library serialises it."""
    from engine.model.tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 256 + i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": s in SPECIAL_TOKENS or s in CHAT_TOKENS[:2],
            }
            for i, s in enumerate(ADDED_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {b2u[b]: b for b in range(256)},
            "merges": [],
        },
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model(out: str | Path, preset: str | Preset = "tiny", seed: int = DEFAULT_SEED) -> Path:
    """Write the model into directory ``out`` (created; must not already hold a config.json).

    After: ``out`` is a complete HF ``Qwen3MoeForCausalLM`` BF16 checkpoint with its tokenizer,
    byte-identical for the same ``preset`` and ``seed``. Returns ``out``.
    """
    import torch
    from safetensors.torch import save_file

    spec = PRESETS[preset] if isinstance(preset, str) else preset
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_dict(spec)
    tensors = init_tensors(spec, seed)
    names = list(tensors)
    shards = max(1, spec.shards)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        # Split by cumulative size into `shards` files, keeping the (deterministic) name order.
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        files: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
        acc = 0
        for name in names:
            t = tensors[name]
            files[min(shards - 1, acc * shards // total)][name] = t
            acc += t.numel() * t.element_size()
        weight_map: dict[str, str] = {}
        for i, part in enumerate(files):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": BOS_ID,
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": PAD_ID,
            "do_sample": True,
            "temperature": 1.0,
            "top_p": 1.0,
        },
    )
    write_tokenizer(out)
    return out


def write_tokenizer(out: str | Path) -> Path:
    """Write only the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``), the same for
    every preset, into the existing directory ``out``: the bytes :func:`write_model` writes."""
    out = Path(out)
    _write_json(out / "tokenizer.json", tokenizer_dict())
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    return out

"""The model's shape, read from an HF ``config.json`` of a ``Qwen3MoeForCausalLM`` checkpoint.

Pure Python (no torch), so the server can validate a directory cheaply. Every problem with a
directory (missing, no ``config.json``, another architecture, a field we cannot run) is a
``ValueError`` whose message names the problem; the server turns it into a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Qwen3-MoE ``config.json`` that determine the forward pass.

    Invariants (checked by ``__post_init__``): positive sizes, ``num_attention_heads`` a multiple
    of ``num_key_value_heads``, ``1 <= num_experts_per_tok <= num_experts`` when there are experts.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError("config.json: num_experts_per_tok must be in [1, num_experts]")
        if self.decoder_sparse_step <= 0:
            raise ValueError("config.json: decoder_sparse_step must be positive")
        if self.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias:
            raise ValueError("config.json: attention_bias=true is not supported")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a sparse MoE block (else a dense SwiGLU MLP), as HF decides."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids (``eos_token_id`` may be an int, a list, or absent)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(int(t) for t in self.eos_token_id)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises ``ValueError`` naming what is wrong."""
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ValueError(
                f"config.json: architecture {archs!r} is not supported; this engine runs {ARCHITECTURE}"
            )
        if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config.json: model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
        rope_theta, rope_type = _rope(cfg)
        if rope_type not in (None, "default"):
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only default RoPE)")
        if cfg.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            num_experts = int(cfg.get("num_experts", 0) or 0)
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
                num_experts=num_experts,
                num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(int(i) for i in (cfg.get("mlp_only_layers") or ())),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                hidden_act=str(cfg.get("hidden_act", "silu")),
                attention_bias=bool(cfg.get("attention_bias", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                pad_token_id=cfg.get("pad_token_id"),
                raw=dict(cfg),
            )
        except KeyError as exc:
            raise ValueError(f"config.json: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if str(exc).startswith("config.json"):
                raise
            raise ValueError(f"config.json: malformed field: {exc}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``; raises ``ValueError`` if the directory or file is missing or bad."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{cfg_path}: not readable JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path}: not a JSON object")
        return cls.from_dict(cfg)


def _rope(cfg: dict[str, Any]) -> tuple[float, str | None]:
    """(theta, rope type) from either transformers-v4 (``rope_theta``/``rope_scaling``) or v5
    (``rope_parameters``) spelling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), params.get("rope_type")
    scaling = cfg.get("rope_scaling")
    rope_type = None
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type"))
    return float(cfg.get("rope_theta", 10000.0)), rope_type

"""Chat renderers, one per model family (:mod:`router.chat.renderers.base` is the port):
``local`` (the local engine's model) and ``qwen3``. :func:`load_renderer` picks one for a
checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from router.chat.renderers.base import Message, Renderer, RenderError, Reply, Tool, ToolCall
from router.chat.renderers.local import LocalRenderer
from router.chat.renderers.qwen3 import Qwen3Renderer

FAMILIES: dict[str, type[Qwen3Renderer]] = {"local": LocalRenderer, "qwen3": Qwen3Renderer}
"""Renderer per family name; the names are :data:`router.config.CHAT_FAMILIES`."""

__all__ = ["FAMILIES", "Message", "RenderError", "Renderer", "Reply", "Tool", "ToolCall", "load_renderer"]


def load_renderer(model_dir: str | Path, family: str | None = None) -> Renderer:
    """The renderer of the checkpoint in ``model_dir`` (its ``tokenizer.json`` and chat template).
    ``family`` None: ``local`` when the tokenizer has init-model's ``<|eos|>``, else ``qwen3``.
    ValueError naming the problem (unknown family, no template, a stop token missing)."""
    if family is None:
        text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8", errors="replace")
        family = "local" if '"<|eos|>"' in text else "qwen3"
    if family not in FAMILIES:
        raise ValueError(f"unknown chat model family {family!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[family].load(model_dir)

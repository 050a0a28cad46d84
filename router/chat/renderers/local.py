"""The local CPU engine's model family (every ``mixfleet init-model`` preset): a byte-level
tokenizer with Qwen3's chat tokens and a Qwen3-style chat template
(:data:`weight_sync.base_model.CHAT_TEMPLATE`), read from the model directory like any checkpoint's;
an assistant turn ends with ``<|im_end|>`` or ``<|eos|>``. Replies parse as Qwen3's."""

from __future__ import annotations

from router.chat.renderers.qwen3 import Qwen3Renderer


class LocalRenderer(Qwen3Renderer):
    family = "local"
    STOP_TEXTS = ("<|im_end|>", "<|eos|>")

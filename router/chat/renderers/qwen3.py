"""The Qwen3 family (the study's model): the checkpoint's own ``tokenizer.json`` and chat template;
assistant turns end with ``<|im_end|>`` (or ``<|endoftext|>``), reasoning is ``<think>...</think>``
before the answer, tool calls are Hermes-style ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` blocks after it (SGLang 0.5.23 parses the same blocks:
``function_call/qwen25_detector.py``; its reasoning parser splits at ``</think>``:
``parser/reasoning_parser.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from router.chat.renderers.base import Reply, ToolCall, call_id
from router.chat.renderers.template import TemplateRenderer

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")


def parse_reply(text: str, output_ids: Sequence[int], stopped: bool) -> Reply:
    """Reasoning, content and tool calls of a Qwen3-style reply ``text`` (stop token removed).
    A ``<tool_call>`` block that is not a JSON object with a string ``name`` leaves the whole
    answer as content (no calls), as SGLang's detector does."""
    reasoning = None
    if "</think>" in text:
        before, text = text.split("</think>", 1)
        reasoning = before.split("<think>")[-1].strip("\n")
        text = text.lstrip("\n")
    calls: list[ToolCall] = []
    first = text.find("<tool_call>")
    if first >= 0:
        for i, m in enumerate(_CALL.finditer(text)):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                calls = []
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls = []
                break
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(ToolCall(call_id(output_ids, i), obj["name"], json.dumps(args, ensure_ascii=False)))
    content = text[:first].strip() if calls else text.strip()
    return Reply(content=content, reasoning=reasoning, tool_calls=tuple(calls), stopped=stopped)


class Qwen3Renderer(TemplateRenderer):
    family = "qwen3"
    STOP_TEXTS: tuple[str, ...] = STOP_TEXTS
    markup = ("<think>", "</think>", "<tool_call>")

    @classmethod
    def load(cls, model_dir: str | Path) -> Qwen3Renderer:
        """From a checkpoint directory (``tokenizer.json`` and its chat template)."""
        return cls.from_dir(model_dir, cls.STOP_TEXTS)  # type: ignore[return-value]

    def parse(self, output_ids: Sequence[int]) -> Reply:
        ids = list(output_ids)
        stopped = bool(ids) and ids[-1] in self.stop_ids
        if stopped:
            ids = ids[:-1]
        return parse_reply(self.decode(ids), output_ids, stopped)

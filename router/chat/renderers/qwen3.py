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
from typing import Any

from router.chat.renderers.base import Message, Reply, ToolCall, call_id
from router.chat.renderers.template import TemplateRenderer

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")


def parse_reply(text: str, output_ids: Sequence[int], stopped: bool, opens: bool = False) -> Reply:
    """Reasoning, content and tool calls of a Qwen3-style reply ``text`` (stop token removed).
    The reasoning is the text between the first ``<think>`` and the first ``</think>`` (with
    ``opens``, a generation prompt that opened the reasoning, all the text before that
    ``</think>`` when no ``<think>`` comes first; without, such a reply has no reasoning, as
    SGLang's parser reads one unless it forces reasoning);
    text sampled before that ``<think>`` is content, followed by the text after the
    ``</think>``: a streamed reply shows it as content before any markup comes
    (:mod:`router.chat.streaming`), and both must give the same content. (SGLang 0.5.23's
    one-shot reasoning parser, ``srt/parser/reasoning_parser.py``
    ``BaseReasoningFormatDetector.detect_and_parse``, folds such text into the reasoning while
    its streaming parser emits it as normal text.) A ``<tool_call>`` block that is not a JSON
    object with a string ``name`` leaves the whole answer as content (no calls), as SGLang's
    detector does."""
    reasoning = None
    before, end, after = text.partition("</think>")
    if end and (opens or "<think>" in before):
        pre, _, inside = before.partition("<think>") if "<think>" in before else ("", "", before)
        reasoning = inside.strip("\n")
        text = pre + after.lstrip("\n")
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
    """``opens_reasoning``: the template's generation prompt leaves a ``<think>`` open (Qwen3's
    thinking-only templates end it with ``<think>\n``): the reply is reasoning up to ``</think>``."""

    family = "qwen3"
    STOP_TEXTS: tuple[str, ...] = STOP_TEXTS
    markup = ("<think>", "</think>", "<tool_call>")
    reasoning_end = "</think>"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        probe = [Message("user", "?")]
        prompt = self.render_text(probe, (), gp=True)[len(self.render_text(probe, (), gp=False)) :]
        self.opens_reasoning = prompt.rfind("<think>") > prompt.rfind("</think>")

    @classmethod
    def load(cls, model_dir: str | Path) -> Qwen3Renderer:
        """From a checkpoint directory (``tokenizer.json`` and its chat template)."""
        return cls.from_dir(model_dir, cls.STOP_TEXTS)  # type: ignore[return-value]

    def parse(self, output_ids: Sequence[int]) -> Reply:
        ids = list(output_ids)
        stopped = bool(ids) and ids[-1] in self.stop_ids
        if stopped:
            ids = ids[:-1]
        return parse_reply(self.decode(ids), output_ids, stopped, self.opens_reasoning)

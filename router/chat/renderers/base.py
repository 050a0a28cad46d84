"""The renderer port: how one model family turns chat messages into token ids and sampled token
ids back into an assistant message.

A conversation's context is built in segments (:mod:`router.chat.conversation`)::

    head(first messages, tools) + out_1 + close(out_1) + body(messages after 1) + out_2 + ...

where ``out_i`` are the ids sampled for assistant turn ``i``, kept exactly. ``head`` and ``body``
end with the generation prompt. Exact extension: the context of the next turn always starts with
the context of the previous turn followed by the ids sampled in it (tested per family in
``tests/chat/test_renderers.py``).

Every renderer raises :class:`RenderError` (the chat routes answer 400 with its message) for what
it cannot represent exactly.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


class RenderError(ValueError):
    """A request the renderer cannot represent exactly; the message names the part."""


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> Any:
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


@dataclass(frozen=True)
class Tool:
    """A function the model may call (JSON-schema ``parameters``)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def template_dict(self) -> dict[str, Any]:
        """The OpenAI shape chat templates expect (``{"type": "function", "function": {...}}``)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class Message:
    """One chat message, the same for both APIs. ``reasoning`` None: not given (an assistant
    message sent back without its reasoning still matches the turn that sampled it)."""

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as HF chat templates read it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.parsed_arguments()},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class Reply:
    """An assistant turn parsed from its sampled ids. ``stopped``: it ended on a stop token;
    ``text_first``: its content begins with text known to be text before its reasoning
    (Anthropic's blocks are then text, thinking: the order sampled,
    :mod:`router.chat.anthropic_routes`)."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    stopped: bool
    text_first: bool = False

    def matches(self, message: Message) -> bool:
        """Whether ``message`` (sent back by a harness) is this reply: same content and calls
        (names and arguments; ids are not compared), same reasoning when the message has one."""
        if message.role != "assistant" or message.content.strip() != self.content.strip():
            return False
        if message.reasoning is not None and message.reasoning.strip() != (self.reasoning or "").strip():
            return False
        if len(message.tool_calls) != len(self.tool_calls):
            return False
        return all(
            a.name == b.name and a.parsed_arguments() == b.parsed_arguments()
            for a, b in zip(message.tool_calls, self.tool_calls, strict=True)
        )


def call_id(output_ids: Sequence[int], index: int) -> str:
    """The id of tool call ``index`` of a turn: the same every time its ids are parsed."""
    digest = hashlib.sha256(f"{index}:{','.join(map(str, output_ids))}".encode()).hexdigest()
    return f"call_{digest[:24]}"


class Shown(abc.ABC):
    """What a reply shows while it is sampled (:mod:`router.chat.streaming`), fed its text
    (decoded, stop ids left out) as it grows: the reasoning (None: not known to have any) and the
    content that :meth:`Renderer.parse` of every reply whose text starts with the text fed so far
    starts them with. A part longer than it ever was before starts with what it was (the
    reasoning never gets shorter), so a reader takes each part's growth alone; feeding a piece
    costs time in proportion to the piece (amortized), not to the text fed before."""

    @abc.abstractmethod
    def feed(self, text: str) -> None:
        """Append ``text``, the next decoded text of the reply."""

    @property
    @abc.abstractmethod
    def reasoning_size(self) -> int | None:
        """The length of the reasoning (None: not known to have any)."""

    @property
    @abc.abstractmethod
    def content_size(self) -> int:
        """The length of the content."""

    @abc.abstractmethod
    def reasoning(self, start: int) -> str:
        """The reasoning from index ``start`` on."""

    @abc.abstractmethod
    def content(self, start: int) -> str:
        """The content from index ``start`` on."""


class Renderer(abc.ABC):
    """One model family's chat rendering (module docstring). ``stop_ids``: the ids that end an
    assistant turn (sent as the engine's ``stop_token_ids``)."""

    family: str
    stop_ids: tuple[int, ...]
    opens_reasoning: bool = False
    """Whether the generation prompt itself opens the reasoning (a reply starts inside it)."""
    form: str = ""
    """Which form of the template the renderer renders: ``""`` its default, ``"no-thinking"``
    (:meth:`without_thinking`). A chat note is only resumed in the form it was written in
    (:func:`router.chat.conversation.digests`)."""

    @abc.abstractmethod
    def head(self, messages: Sequence[Message], tools: Sequence[Tool]) -> list[int]:
        """The first messages (up to the first assistant turn) and the tools, with the generation
        prompt."""

    @abc.abstractmethod
    def body(self, messages: Sequence[Message]) -> list[int]:
        """Messages that follow an assistant turn (closed), with the generation prompt."""

    @abc.abstractmethod
    def close(self, output_ids: Sequence[int]) -> list[int]:
        """What follows the sampled ids of an assistant turn before the next message."""

    @abc.abstractmethod
    def assistant(
        self, before: Sequence[Message], message: Message, after: Sequence[Message], tools: Sequence[Tool]
    ) -> list[int]:
        """An assistant message no turn of this conversation sampled (a harness edit), rendered
        from its text as the template renders it between ``before`` and ``after``, from the
        generation prompt of ``before`` on, closed."""

    @abc.abstractmethod
    def parse(self, output_ids: Sequence[int]) -> Reply:
        """The assistant message of sampled ids."""

    @abc.abstractmethod
    def shown(self) -> Shown:
        """A :class:`Shown` of a reply about to be sampled, fed nothing yet."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens kept."""

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: those of a token that ends inside a UTF-8 character
        too, which :meth:`decode` of it alone cannot show (OpenAI's log-prob ``bytes``)."""

    @abc.abstractmethod
    def stop_token(self, text: str) -> int:
        """The id of a stop sequence; RenderError unless ``text`` is exactly one token."""

    def without_thinking(self) -> Renderer:
        """This renderer with the template's no-thinking form (a generation prompt after which the
        model answers without reasoning); RenderError naming it when the family has none."""
        raise RenderError(
            f"thinking cannot be disabled: the {self.family} renderer has no no-thinking form of its template"
        )

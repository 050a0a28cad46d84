"""The token context of a chat request, derived from the session's stored trajectory.

Nothing but the trajectory is kept per conversation: any router worker builds the same context.
The messages are rendered segment by segment (:mod:`router.chat.renderers.base`); at each
assistant message the context built so far is looked up among the session's recorded turns (as
the engine saw them, :class:`Sampled`: a turn stores only what it appends, so its whole input is
rebuilt from its segment, :func:`router.segments.engine_inputs`): a turn whose ``input_ids``
equal it and whose sampled ids parse to that message
(:meth:`~router.chat.renderers.base.Reply.matches`) supplies its sampled ``output_ids``, exactly
as sampled, reasoning included. An assistant message no turn matches (the harness edited or
invented it) is rendered from its text by the chat template.

The request's ``input_ids`` are always the full context. It ``extends`` the session when it
starts with the last recorded turn's ``input_ids + output_ids``; otherwise the history was changed
and the turn store records a fork (it compares the full ``input_ids`` itself, and stores only
the tokens a turn that extends its segment appends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.chat.renderers.base import Message, Renderer, RenderError, Tool
from router.segments import engine_inputs
from router.turn_data import TurnData


@dataclass(frozen=True)
class Sampled:
    """A recorded turn as its engine saw it: its whole input and its sampled ids."""

    input_ids: Sequence[int]
    output_ids: Sequence[int]


def sampled_turns(turns: Sequence[TurnData]) -> list[Sampled]:
    """The session's recorded turns (in order) with their whole inputs; ValueError as
    :func:`router.segments.engine_inputs`."""
    return [Sampled(ids, t.output_ids) for ids, t in zip(engine_inputs(turns), turns, strict=True)]


@dataclass(frozen=True)
class Context:
    """``input_ids`` of the next turn; ``extends``: it continues the last recorded turn (always
    True for the first turn); ``kept``: assistant messages given as their sampled ids."""

    input_ids: list[int]
    extends: bool
    kept: int


def check_messages(messages: Sequence[Message]) -> None:
    """RenderError unless the messages can start a turn: at least one, not ending with an
    assistant message (a prefilled answer), a system message only first."""
    if not messages:
        raise RenderError("messages: at least one message is required")
    if messages[-1].role == "assistant":
        raise RenderError(
            "messages: the last message is an assistant message; prefilling an answer is not supported"
        )
    for i, m in enumerate(messages[1:], 1):
        if m.role == "system":
            raise RenderError(f"messages[{i}]: a system message is only rendered as the first message")


def build_context(
    renderer: Renderer, messages: Sequence[Message], tools: Sequence[Tool], turns: Sequence[Sampled]
) -> Context:
    """The next turn's context for ``messages`` given the session's recorded ``turns`` (module
    docstring). Raises RenderError for what the renderer cannot represent."""
    check_messages(messages)
    by_context: dict[tuple[int, ...], list[Sampled]] = {}
    for t in turns:
        by_context.setdefault(tuple(t.input_ids), []).append(t)
    ids: list[int] = []
    start, kept, after = 0, 0, False
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        seg = messages[start:i]
        ids += renderer.body(seg) if after else renderer.head(seg, tools)
        sampled = next(
            (t for t in by_context.get(tuple(ids), ()) if renderer.parse(t.output_ids).matches(m)), None
        )
        if sampled is not None:
            ids += list(sampled.output_ids) + renderer.close(sampled.output_ids)
            kept += 1
        else:
            ids += renderer.assistant(messages[:i], m, messages[i + 1 :], tools)
        start, after = i + 1, True
    tail = messages[start:]
    ids += renderer.body(tail) if after else renderer.head(tail, tools)
    extends = True
    if turns:
        last = turns[-1]
        n_in, n_out = len(last.input_ids), len(last.output_ids)
        extends = ids[:n_in] == list(last.input_ids) and ids[n_in : n_in + n_out] == list(last.output_ids)
    return Context(ids, extends, kept)

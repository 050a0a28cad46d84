"""The token context of a chat request, rendered from where the session's recorded turns leave it.

The messages are rendered segment by segment (:mod:`router.chat.renderers.base`); at each
assistant message the context built so far is looked up among the recorded turns it may be
(:class:`Sampled`, each with its whole input as the engine saw it): a turn whose input equals it
and whose reply (its sampled ids less a stop sequence that ended it, :func:`reply_ids`) parses to
that message (:meth:`~router.chat.renderers.base.Reply.matches`) supplies its sampled
``output_ids``, exactly as sampled, reasoning included. An assistant message no turn matches (the
harness edited or invented it) is rendered from its text by the chat template.

Where rendering starts (:class:`Known`), so that a turn costs what it appends, not its context:

* :func:`resume`: the session's chat note (:class:`Note`, kept in the state store beside the
  session's context, :meth:`router.state.base.StateStore.put_chat_note`) says how many messages
  its last turn rendered and a digest of them (with the renderer family and the tools,
  :func:`digests`). When the note is about the session's last turn and the request starts with
  exactly those messages followed by an assistant message, the last turn's input is the stored
  context without its last ``output`` ids (the context of an open session is its segment: the
  last turn's whole input and its sampled ids, :mod:`router.segments`), so only the messages
  after it are rendered, the assistant message being matched against that one turn.
* :func:`from_trajectory`: otherwise (no note, the note is about an earlier turn because a token
  turn or a concurrent turn came after it, or the messages it covers changed: the history was
  edited), every message is rendered, matched against every recorded turn, rebuilt from the
  trajectory (a turn stores only what it appends, :func:`router.segments.engine_inputs`).

Both give the same context for the same messages; the first reads only the session's context.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import xxhash

from core.jsonio import dumps
from router.chat.renderers.base import Message, Renderer, RenderError, Tool
from router.segments import Stored, as_ids, engine_inputs, stored_ids
from router.state.base import ChatState
from router.turn_data import TurnData


@dataclass(frozen=True)
class Sampled:
    """A recorded turn as its engine saw it: its whole input (a list, or a uint32 array), its
    sampled ids and the stop id that ended it (``matched``, as the engine reports it; None: none)."""

    input_ids: Sequence[int] | np.ndarray
    output_ids: Sequence[int]
    matched: int | None = None


def matched_stop(finish_reason: Mapping[str, Any] | None) -> int | None:
    """The stop id a turn's finish reason says ended it (None: no stop id did)."""
    matched = (finish_reason or {}).get("matched")
    return matched if isinstance(matched, int) and not isinstance(matched, bool) else None


def reply_ids(renderer: Renderer, output_ids: Sequence[int], matched: int | None) -> Sequence[int]:
    """The ids a turn's reply is parsed from: ``output_ids`` without its last id when that is the
    stop id that ended it (``matched``) and not one of the renderer's own stop ids (which
    :meth:`~router.chat.renderers.base.Renderer.parse` removes): a stop sequence is no part of the
    reply's text, as both APIs answer and SGLang trims it (sglang 0.5.23
    ``srt/managers/detokenizer_manager.py`` 194-224, ``trim_matched_stop``)."""
    if matched is not None and output_ids and output_ids[-1] == matched and matched not in renderer.stop_ids:
        return output_ids[:-1]
    return output_ids


@dataclass(frozen=True)
class Known:
    """Where rendering starts: ``ids``, the context of the first ``messages`` messages (ending with
    the generation prompt; empty when ``messages`` is 0; a list or a uint32 array), and the
    recorded ``turns`` an assistant message from there on may be."""

    ids: Sequence[int] | np.ndarray = ()
    messages: int = 0
    turns: Sequence[Sampled] = ()


@dataclass(frozen=True)
class Note:
    """The chat note of a session's turn (its bytes: :meth:`encode`): the ``messages`` rendered
    into its input, their :func:`digests` entry, the number of ids it sampled (``output``) and the
    stop id that ended it (``matched``, :func:`matched_stop`)."""

    messages: int
    digest: str
    output: int
    matched: int | None = None

    def encode(self) -> bytes:
        return json.dumps([self.messages, self.digest, self.output, self.matched]).encode()

    @classmethod
    def decode(cls, data: bytes) -> Note | None:
        """The note of ``data`` (one without ``matched`` has None); None when it is not one (it is
        then not used)."""
        try:
            messages, digest, output, *rest = json.loads(data)
            matched = rest[0] if rest else None
            return cls(int(messages), str(digest), int(output), None if matched is None else int(matched))
        except (ValueError, TypeError):
            return None


def digests(family: str, tools: Sequence[Tool], messages: Sequence[Message]) -> list[str]:
    """Entry ``k``: a digest of the renderer ``family`` (with its form, ``qwen3/no-thinking``: a
    turn in one form is not resumed by a request in the other, which renders the conversation whole,
    as :func:`from_trajectory` renders it), the ``tools`` and ``messages[:k]`` (every
    field of each, as orjson writes the dataclass: a message is all strings), for ``k`` in
    ``0 .. len(messages)``.

    xxh3-128, not a cryptographic hash: a harness resends its whole conversation every turn, so the
    chain covers up to a few hundred kilobytes a turn and is hashed at memory speed; 128 bits make
    an accidental match of another history negligible, and a request can only match its own
    session's history (a note written with another digest matches nothing: that turn renders
    whole, to the same context)."""
    h = xxhash.xxh3_128()
    h.update(json.dumps([family, [astuple(t) for t in tools]], sort_keys=True).encode())
    out = [h.hexdigest()]
    for m in messages:
        data = dumps(m)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        out.append(h.hexdigest())
    return out


def sampled_turns(turns: Sequence[TurnData]) -> list[Sampled]:
    """The session's recorded turns (in order) with their whole inputs; ValueError as
    :func:`router.segments.engine_inputs`."""
    return [
        Sampled(ids, t.output_ids, matched_stop(t.finish_reason))
        for ids, t in zip(engine_inputs(turns), turns, strict=True)
    ]


def from_trajectory(turns: Sequence[TurnData]) -> Known:
    """Rendering from the first message, matched against every recorded turn."""
    return Known(turns=sampled_turns(turns))


def resume(
    state: ChatState, context: Stored, messages: Sequence[Message], prefix_digests: Sequence[str]
) -> Known | None:
    """Rendering from the session's last turn (module docstring), or None when its note does not
    allow it. ``context``: the session's stored context (``state``'s, or the one the caller holds);
    ``prefix_digests``: :func:`digests` of the request."""
    note = Note.decode(state.note) if state.note_turn == state.session.n_turns - 1 else None
    if note is None or not 0 < note.messages < len(messages) or messages[note.messages].role != "assistant":
        return None
    ids = stored_ids(context)  # no copy, no Python list of the context
    if prefix_digests[note.messages] != note.digest or note.output >= len(ids):
        return None
    cut = len(ids) - note.output
    prefix = ids[:cut]
    return Known(prefix, note.messages, (Sampled(prefix, ids[cut:].tolist(), note.matched),))


@dataclass(frozen=True)
class Context:
    """``input_ids`` of the next turn (a uint32 array); ``kept``: assistant messages given as their
    sampled ids."""

    input_ids: np.ndarray
    kept: int


def check_messages(messages: Sequence[Message]) -> None:
    """RenderError unless the messages can start a turn: at least one, not ending with an
    assistant message (a prefilled answer), every assistant message after a message of another
    role (the template renders an assistant turn as the answer to what precedes it). A system
    message may stand anywhere (a harness's reminder mid-conversation): the template renders it
    where it stands, and one that cannot is a RenderError of the template's own."""
    if not messages:
        raise RenderError("messages: at least one message is required")
    if messages[-1].role == "assistant":
        raise RenderError(
            "messages: the last message is an assistant message; prefilling an answer is not supported"
        )
    for i, m in enumerate(messages):
        if m.role == "assistant" and (i == 0 or messages[i - 1].role == "assistant"):
            where = "the first message" if i == 0 else "right after another assistant message"
            raise RenderError(
                f"messages[{i}]: an assistant message is {where}; the chat template renders an "
                "assistant message only after a user, system or tool message"
            )


MAX_TEXT_ASSISTANT = 128
"""The most assistant messages one request may have rendered from their text (no recorded turn
sampled them): each is rendered against the whole conversation (the template may render an
assistant message by where it stands), so their cost grows with their number times the
conversation's length."""


def build_context(
    renderer: Renderer, messages: Sequence[Message], tools: Sequence[Tool], known: Known
) -> Context:
    """The next turn's context for ``messages``, rendered from ``known`` on (module docstring).
    Raises RenderError for what the renderer cannot represent and for more than
    :data:`MAX_TEXT_ASSISTANT` assistant messages to render from their text; ValueError when
    ``known`` starts after some messages but not at an assistant message."""
    check_messages(messages)
    if known.messages and messages[known.messages].role != "assistant":
        raise ValueError(f"rendering resumes at messages[{known.messages}], not an assistant message")
    by_length: dict[int, list[Sampled]] = {}
    for t in known.turns:
        by_length.setdefault(len(t.input_ids), []).append(t)
    base = as_ids(known.ids)  # the known context stays one array; only rendered ids are a list
    ids: list[int] = []
    start, kept, after, prompted = known.messages, 0, False, known.messages > 0
    from_text = 0
    for i in range(start, len(messages)):
        m = messages[i]
        if m.role != "assistant":
            continue
        if not prompted:
            seg = messages[start:i]
            ids += renderer.body(seg) if after else renderer.head(seg, tools)
        sampled = next(
            (
                t
                for t in by_length.get(len(base) + len(ids), ())
                if _is_context(t.input_ids, base, ids)
                and renderer.parse(reply_ids(renderer, t.output_ids, t.matched)).matches(m)
            ),
            None,
        )
        if sampled is not None:
            ids += list(sampled.output_ids) + renderer.close(sampled.output_ids)
            kept += 1
        else:
            from_text += 1
            if from_text > MAX_TEXT_ASSISTANT:
                raise RenderError(
                    f"messages[{i}]: more than {MAX_TEXT_ASSISTANT} assistant messages that no turn of "
                    "this session sampled; each is rendered from its text against the whole conversation"
                )
            ids += renderer.assistant(messages[:i], m, messages[i + 1 :], tools)
        start, after, prompted = i + 1, True, False
    tail = messages[start:]
    ids += renderer.body(tail) if after else renderer.head(tail, tools)
    return Context(np.concatenate((base, as_ids(ids))) if len(base) else as_ids(ids), kept)


def _is_context(input_ids: Sequence[int] | np.ndarray, base: np.ndarray, ids: list[int]) -> bool:
    """Whether ``input_ids`` (as long as the two) is ``base`` followed by ``ids``."""
    n = len(base)
    if input_ids is base:  # the resumed turn's own input: no comparison of the context
        return not ids
    return (n == 0 or bool(np.array_equal(input_ids[:n], base))) and list(input_ids[n:]) == ids

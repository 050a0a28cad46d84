"""Renderers per model family: the exact-extension property (every next context starts with the
previous context and the ids sampled in it), agreement with the family's chat template, kept
reasoning, edits detected, parsing, and what cannot be represented. The Qwen3 family is tested with
a Qwen3-style template string and a byte-level BPE tokenizer built here (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from engine.model.tokenizer import Tokenizer as EngineTokenizer
from router.chat.conversation import (
    MAX_TEXT_ASSISTANT,
    Known,
    Note,
    Sampled,
    build_context,
    digests,
    reply_ids,
    resume,
    sampled_turns,
)
from router.chat.renderers import Message, RenderError, Tool, ToolCall, load_renderer
from router.segments import pack
from router.state.base import ChatState, SessionInfo
from router.turn_data import TurnData
from weight_sync.base_model import IM_END_ID, PRESETS, VOCAB_SIZE, write_tokenizer

# Qwen3's chat template (Qwen/Qwen3-8B tokenizer_config.json), in its usual multi-line spelling.
QWEN3_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text(encoding="utf-8")

CORPUS = [
    "The weather in Paris is sunny and 20 degrees. Let me check the weather for you.",
    'get_weather {"city": "Paris"} {"temp": 20} It is 20 degrees in Paris. Thanks! You are welcome.',
    "You may call one or more functions to assist with the user query. function signatures",
] * 20


def _qwen3_dir(root: Path) -> Path:
    """A Qwen3-style checkpoint's tokenizer files: byte-level BPE with merges, Qwen3's added tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in (
                "<think>",
                "</think>",
                "<tool_call>",
                "</tool_call>",
                "<tool_response>",
                "</tool_response>",
            )
        ]
    )
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_TEMPLATE}))
    return root


@pytest.fixture(scope="module", params=["local", "qwen3"])
def renderer(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "local":
        write_tokenizer(root)
    else:
        _qwen3_dir(root)
    r = load_renderer(root)
    assert r.family == request.param
    return r


TOOLS = (
    Tool(
        "get_weather", "The weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}}
    ),
)
SAMPLED = [
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<think>\nI have it.\n</think>\n\nIt is 20 degrees in Paris.",
    "<think>\n\n</think>\n\nYou are welcome.",
]


def _sample(renderer, text: str, stop: bool = True) -> list[int]:
    return renderer.encode(text) + ([renderer.stop_ids[0]] if stop else [])


def _turn(i: int, input_ids: list[int], output_ids: list[int]) -> Sampled:
    return Sampled(input_ids, output_ids)


def _conversation(renderer):
    """Three turns of a tool-using conversation: (messages, turns) after each, the harness sending
    back each reply as the API returned it (without its reasoning)."""
    messages = [Message("system", "Be brief."), Message("user", "Weather in Paris?")]
    follow = [[Message("tool", '{"temp": 20}', tool_call_id="call_1")], [Message("user", "Thanks!")]]
    turns: list[Sampled] = []
    steps = []
    for i, text in enumerate(SAMPLED):
        ctx = build_context(renderer, messages, TOOLS, Known(turns=turns))
        steps.append((list(messages), ctx))
        out = _sample(renderer, text)
        turns.append(_turn(i, ctx.input_ids.tolist(), out))
        reply = renderer.parse(out)
        messages.append(Message("assistant", reply.content, tool_calls=reply.tool_calls))
        if i < len(follow):
            messages += follow[i]
    return steps, turns


def test_exact_extension(renderer):
    steps, turns = _conversation(renderer)
    for i, (_, ctx) in enumerate(steps):
        assert ctx.kept == i
        if i:
            prev = turns[i - 1]
            assert ctx.input_ids[: len(prev.input_ids) + len(prev.output_ids)].tolist() == [
                *prev.input_ids,
                *prev.output_ids,
            ]


def test_agrees_with_the_chat_template(renderer):
    """Within the tool loop (after the last user message) the template keeps the reasoning too:
    the segment-wise context is the whole template render, tokenized as one string."""
    steps, _ = _conversation(renderer)
    messages, ctx = steps[1]
    with_reasoning = [
        Message("assistant", m.content, reasoning="The user wants the weather.", tool_calls=m.tool_calls)
        if m.role == "assistant"
        else m
        for m in messages
    ]
    text = renderer.render_text(with_reasoning, TOOLS, gp=True)
    assert ctx.input_ids.tolist() == renderer.encode(text)
    messages, ctx = steps[0]
    assert ctx.input_ids.tolist() == renderer.encode(renderer.render_text(messages, TOOLS, gp=True))


def test_a_later_system_message_is_rendered_where_it_stands(renderer):
    """System messages after the first (a developer message, a harness's reminder after a tool
    result) are rendered where they stand, as the family's template renders the whole
    conversation, and the next context still extends the sampled turn (they were refused)."""
    messages = [
        Message("system", "Be brief."),
        Message("system", "Use metric units."),
        Message("user", "Weather?"),
    ]
    first = build_context(renderer, messages, TOOLS, Known())
    assert first.input_ids.tolist() == renderer.encode(renderer.render_text(messages, TOOLS, gp=True))
    out = _sample(renderer, SAMPLED[0])
    reply = renderer.parse(out)
    messages += [
        Message("assistant", reply.content, tool_calls=reply.tool_calls),
        Message("tool", '{"temp": 20}', tool_call_id="call_1"),
        Message("system", "Answer in one sentence."),
    ]
    second = build_context(renderer, messages, TOOLS, Known(turns=[Sampled(first.input_ids.tolist(), out)]))
    assert second.kept == 1
    assert second.input_ids[: len(first.input_ids) + len(out)].tolist() == [*first.input_ids.tolist(), *out]
    kept = [  # within the tool loop the template keeps the sampled reasoning (as the test above)
        Message("assistant", m.content, reasoning="The user wants the weather.", tool_calls=m.tool_calls)
        if m.role == "assistant"
        else m
        for m in messages
    ]
    assert second.input_ids.tolist() == renderer.encode(renderer.render_text(kept, TOOLS, gp=True))


def test_sampled_reasoning_is_kept(renderer):
    """After a new user message the template would drop earlier reasoning; the context keeps the
    sampled ids verbatim."""
    steps, turns = _conversation(renderer)
    _, last = steps[2]
    for t in turns[:2]:
        n = len(t.output_ids)
        at = len(t.input_ids)
        assert last.input_ids[at : at + n].tolist() == list(t.output_ids)
    assert "The user wants the weather." in renderer.decode(last.input_ids.tolist())


def test_a_reply_less_the_stop_sequence_that_ended_it_is_kept(renderer):
    """A turn that a stop sequence ended (``matched``, not a stop token of the renderer) replies
    without it; that reply sent back is the turn's ids, the stop sequence's included."""
    user = [Message("user", "Count")]
    head = build_context(renderer, user, (), Known()).input_ids.tolist()
    out = renderer.encode("one, two!")
    stop = out[-1]
    sampled = Sampled(head, out, matched=stop)
    assert renderer.parse(reply_ids(renderer, out, stop)).content == "one, two"
    messages = [*user, Message("assistant", "one, two"), Message("user", "More")]
    ctx = build_context(renderer, messages, (), Known(turns=[sampled]))
    assert ctx.kept == 1 and ctx.input_ids.tolist()[: len(head) + len(out)] == head + out
    unmatched = build_context(renderer, messages, (), Known(turns=[Sampled(head, out)]))
    assert unmatched.kept == 0  # without the stop, the reply is "one, two!": an edit
    assert reply_ids(renderer, [*out, renderer.stop_ids[0]], renderer.stop_ids[0])[-1] == renderer.stop_ids[0]


def test_the_no_thinking_form(renderer, tmp_path):
    """``without_thinking``: the generation prompt with Qwen3's empty think block
    (``enable_thinking`` false), one conversation extending exactly in it, an edited assistant
    message rendered after that prompt as the template writes the message; a template without
    such a form is refused by name."""
    plain = renderer.without_thinking()
    assert plain is renderer.without_thinking() and plain.without_thinking() is plain
    user = [Message("user", "Hi")]
    head = build_context(plain, user, (), Known()).input_ids.tolist()
    assert plain.decode(head) == renderer.decode(renderer.head(user, ())) + "<think>\n\n</think>\n\n"
    out = _sample(plain, "Hello there.")
    messages = [*user, Message("assistant", "Hello there."), Message("user", "More")]
    ctx = build_context(plain, messages, (), Known(turns=[Sampled(head, out)]))
    assert ctx.kept == 1 and ctx.input_ids.tolist()[: len(head) + len(out)] == head + out
    edited = [*user, Message("assistant", "Edited."), Message("user", "More")]
    text = plain.decode(build_context(plain, edited, (), Known()).input_ids.tolist())
    assert text == plain.decode(head) + "Edited.<|im_end|>\n" + plain.decode(plain.body(edited[2:]))
    template = QWEN3_TEMPLATE.replace("enable_thinking is defined and enable_thinking is false", "false")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "tokenizer.json").write_bytes(
        _qwen3_dir(tmp_path / "q").joinpath("tokenizer.json").read_bytes()
    )
    with pytest.raises(RenderError, match="the chat template has no no-thinking form"):
        load_renderer(tmp_path, "qwen3").without_thinking()


def test_edited_history_does_not_extend(renderer):
    steps, turns = _conversation(renderer)
    messages = list(steps[2][0])
    i = max(j for j, m in enumerate(messages) if m.role == "assistant")
    messages[i] = Message("assistant", "It is 25 degrees in Paris.")
    ids = build_context(renderer, messages, TOOLS, Known(turns=turns)).input_ids.tolist()
    ctx = build_context(renderer, messages, TOOLS, Known(turns=turns))
    last = turns[1]
    assert ctx.kept == 1 and ids[: len(last.input_ids)] == last.input_ids
    assert ids[: len(last.input_ids) + len(last.output_ids)] != [*last.input_ids, *last.output_ids]
    first = turns[0]
    prefix = [*first.input_ids, *first.output_ids]
    assert ids[: len(prefix)] == prefix
    assert "It is 25 degrees in Paris.<|im_end|>" in renderer.decode(ids)
    other_tools = build_context(renderer, steps[2][0], (), Known(turns=turns))
    assert other_tools.kept == 0
    assert other_tools.input_ids[: len(first.input_ids)].tolist() != first.input_ids


def _resume(state: ChatState, messages, chain):
    """:func:`resume` from the context the store read with ``state``."""
    return resume(state, state.context, messages, chain)


def _state(renderer, messages, turn: int, sampled: Sampled, note_turn: int | None = None) -> ChatState:
    """The chat state the store holds after turn ``turn`` (rendered from ``messages``) was noted."""
    note = Note(len(messages), digests(renderer.family, TOOLS, messages)[-1], len(sampled.output_ids))
    info = SessionInfo("s", "g", None, "open", 0.0, n_turns=turn + 1)
    context = pack([*sampled.input_ids, *sampled.output_ids])
    return ChatState(info, context, turn if note_turn is None else note_turn, note.encode())


def test_resuming_from_the_last_turn_renders_the_same_context(renderer):
    """From the note of the last turn only the messages after it are rendered; the context is the
    one rendered from every message and recorded turn, the reply matched as sampled, an edited
    reply rendered from its text."""
    steps, turns = _conversation(renderer)
    for i in (1, 2):
        messages, full = steps[i]
        state = _state(renderer, steps[i - 1][0], i - 1, turns[i - 1])
        known = _resume(state, messages, digests(renderer.family, TOOLS, messages))
        assert known is not None and known.messages == len(steps[i - 1][0])
        ctx = build_context(renderer, messages, TOOLS, known)
        assert ctx.input_ids.tolist() == full.input_ids.tolist() and ctx.kept == 1
    messages = list(steps[2][0])
    at = len(steps[1][0])
    messages[at] = Message("assistant", "It is 25 degrees in Paris.")
    chain = digests(renderer.family, TOOLS, messages)
    known = _resume(_state(renderer, steps[1][0], 1, turns[1]), messages, chain)
    assert known is not None
    edited = build_context(renderer, messages, TOOLS, known)
    assert edited.kept == 0
    assert (
        edited.input_ids.tolist()
        == build_context(renderer, messages, TOOLS, Known(turns=turns)).input_ids.tolist()
    )
    # not resumed: the note is about an earlier turn, or a message before the last reply changed
    assert _resume(_state(renderer, steps[1][0], 2, turns[1], note_turn=1), steps[2][0], chain) is None
    changed = [Message("system", "Be briefer."), *steps[2][0][1:]]
    state = _state(renderer, steps[1][0], 1, turns[1])
    assert _resume(state, changed, digests(renderer.family, TOOLS, changed)) is None
    assert _resume(state, steps[2][0], digests(renderer.family, (), steps[2][0])) is None


def test_parse(renderer):
    reply = renderer.parse(_sample(renderer, SAMPLED[0]))
    assert (
        reply.stopped
        and reply.content == "Let me check."
        and reply.reasoning == "The user wants the weather."
    )
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert reply.tool_calls[0].id == renderer.parse(_sample(renderer, SAMPLED[0])).tool_calls[0].id
    broken = renderer.parse(_sample(renderer, "Sure.\n<tool_call>\n{not json}\n</tool_call>"))
    assert broken.tool_calls == () and broken.content.startswith("Sure.\n<tool_call>")
    cut = _sample(renderer, "It is 20", stop=False)
    assert not renderer.parse(cut).stopped
    assert renderer.decode(renderer.close(cut)) == "<|im_end|>\n"
    assert renderer.decode(renderer.close(_sample(renderer, "It is 20"))) == "\n"


def test_token_bytes_rebuild_the_text(renderer):
    """Each token's bytes, those of a token that ends inside a UTF-8 character included (decoded
    alone it is a replacement character), join into the text's UTF-8."""
    text = "Grüße 😀 ✓ <think>x</think><|im_end|>"
    ids = renderer.encode(text)
    assert b"".join(renderer.token_bytes(i) for i in ids) == text.encode()
    assert any(renderer.decode([i]) == "\ufffd" for i in ids)  # the text splits a character
    assert renderer.token_bytes(renderer.stop_ids[0]) == renderer.STOP_TEXTS[0].encode()


def test_tool_results_render_back(renderer):
    steps, _ = _conversation(renderer)
    text = renderer.decode(steps[1][1].input_ids)
    assert text.endswith(
        '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )
    assert '"name": "get_weather"' in renderer.decode(steps[0][1].input_ids)


def test_refusals(renderer):
    assert renderer.stop_token("<|im_end|>") == renderer.stop_ids[0]
    with pytest.raises(RenderError, match="stop sequence 'never mind' is"):
        renderer.stop_token("never mind")
    with pytest.raises(RenderError, match="last message is an assistant message"):
        build_context(renderer, [Message("user", "a"), Message("assistant", "b")], (), Known())
    with pytest.raises(RenderError, match="at least one message"):
        build_context(renderer, [], (), Known())
    a, b = Message("user", "a"), Message("assistant", "b")
    with pytest.raises(RenderError, match=r"messages\[0\]: an assistant message is the first message"):
        build_context(renderer, [b, a], (), Known())
    with pytest.raises(RenderError, match=r"messages\[2\]: an assistant message is right after another"):
        build_context(renderer, [a, b, b, a], (), Known())
    edited = [m for _ in range(MAX_TEXT_ASSISTANT) for m in (Message("user", "a"), Message("assistant", "b"))]
    assert build_context(renderer, [*edited, Message("user", "a")], (), Known()).kept == 0
    more = [*edited, Message("user", "a"), Message("assistant", "b"), Message("user", "a")]
    with pytest.raises(
        RenderError, match=rf"messages\[{len(edited) + 1}\]: more than {MAX_TEXT_ASSISTANT} assistant"
    ):
        build_context(renderer, more, (), Known())
    call = ToolCall("c", "f", "{}")
    assert (
        build_context(
            renderer,
            [Message("user", "a"), Message("assistant", "", tool_calls=(call,)), Message("tool", "r")],
            (),
            Known(),
        ).kept
        == 0
    )


def test_local_tokenizer_files(tmp_path):
    """Every preset's tokenizer: the chat tokens after the special tokens, the same bytes every
    time, read the same by the engine's tokenizer and by the tokenizers library."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_tokenizer(a)
    write_tokenizer(b)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert PRESETS["tiny"].vocab_size == PRESETS["small"].vocab_size == VOCAB_SIZE == 256 + 3 + 8
    text = "<|im_start|>user\nHé<|im_end|>\n<think>x</think><tool_call>"
    lib = tokenizers.Tokenizer.from_file(str(a / "tokenizer.json"))
    engine = EngineTokenizer.from_dir(a)
    assert lib.encode(text, add_special_tokens=False).ids == engine.encode(text)
    assert engine.vocab_size == VOCAB_SIZE and engine.encode("<|im_end|>") == [IM_END_ID] == [260]


def test_stored_append_only_turns_give_each_turns_whole_input() -> None:
    """A turn stores only what it appends; the chat context sees each turn's whole input, a fork
    starting a new segment."""

    def stored(i: int, context: int, append: list[int], out: list[int], fork=None) -> TurnData:
        n = len(out)
        return TurnData(
            i, "g", "r", append, out, [0.0] * n, [0.0] * n, [[]] * n, [[]] * n, context=context, fork=fork
        )

    turns = [
        stored(0, 0, [1, 2], [3]),
        stored(1, 3, [4], [5, 6]),
        stored(2, 0, [1, 9], [7], fork={"stored": 6, "common": 1}),
        stored(3, 3, [8], [10]),
    ]
    got = [(list(t.input_ids), list(t.output_ids)) for t in sampled_turns(turns)]
    assert got == [([1, 2], [3]), ([1, 2, 3, 4], [5, 6]), ([1, 9], [7]), ([1, 9, 7, 8], [10])]
    with pytest.raises(ValueError, match="context 2 but its segment holds 3"):
        sampled_turns([turns[0], stored(1, 2, [4], [5])])

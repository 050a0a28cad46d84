"""The demo's warm start renders its contexts with the checkpoint's chat template through
``transformers``: exactly the ids the router's renderer gives the agents' chats, first turn and
second attempt alike; a checkpoint without a chat template is refused by name."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from router.chat.renderers import Message, load_renderer
from trainer.demo_sft import ChatPrompts, example
from trainer.policy import CheckpointError
from trainer.tasks import ReverseDigits


@pytest.fixture(scope="module")
def prompts(tiny_dir) -> ChatPrompts:
    return ChatPrompts(tiny_dir)


def test_contexts_are_the_routers(prompts: ChatPrompts, tiny_dir) -> None:
    renderer = load_renderer(tiny_dir)
    task = ReverseDigits()
    p = task.problem("4071")
    first = prompts.context(p.messages())
    assert first == renderer.head([Message("user", "4071")], ())
    sampled = prompts.answer("1744")  # as the engine would sample it: the answer, then <|im_end|>
    assert sampled[-1] in renderer.stop_ids
    second = [*p.messages(), {"role": "assistant", "content": "1744"}, {"role": "user", "content": "17_4"}]
    routed = first + sampled + renderer.close(sampled) + renderer.body([Message("user", "17_4")])
    assert prompts.context(second) == routed


def test_examples_target_the_answer_and_the_end_of_turn(prompts: ChatPrompts) -> None:
    task = ReverseDigits()
    rng = random.Random(0)
    context, target = example(prompts, task, random.Random(0), second=False)
    p = task.sample(rng)
    assert context == prompts.context(p.messages())
    assert target == [*map(ord, p.answer), prompts.end_id]
    context2, target2 = example(prompts, task, random.Random(0), second=True)
    assert target2 == target and context2[: len(context)] == context and len(context2) > len(context)


def test_a_checkpoint_without_a_chat_template_is_refused(tiny_dir, tmp_path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has no chat template"):
        ChatPrompts(tmp_path)

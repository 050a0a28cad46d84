"""Live fixtures of the chat tests: the ``tiny`` model (a chat model, as every preset), a real
engine behind the scripted stand-in (:mod:`tests.support.scripted`) and a real router whose chat
model is that checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from router.chat.renderers import load_renderer
from router.chat.renderers.template import read_chat_template
from tests.support.engines import engine_process
from tests.support.models import make_model_dir
from tests.support.router import router_process, write_preset
from tests.support.scripted import scripted_engine


@pytest.fixture(scope="session")
def chat_model(model_root):
    return make_model_dir(model_root, "tiny", "bf16")


@pytest.fixture(scope="module")
def renderer(chat_model):
    return load_renderer(chat_model)


@pytest.fixture(scope="module")
def engine(chat_model):
    with engine_process(chat_model) as url, scripted_engine(url) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def router(engine, chat_model, tmp_path_factory):
    preset = write_preset(
        tmp_path_factory.mktemp("chat") / "preset.toml",
        [{"name": "cpu", "replicas": [engine.url], "sessions_per_replica": 8}],
    )
    with router_process(preset, extra_args=("--chat-model", str(chat_model))) as handle:
        yield handle


@pytest.fixture
def session(router):
    """A fresh session: its create answer (ids and both base URLs)."""
    r = httpx.post(router.url + "/v1/sessions", headers=router.headers, timeout=30)
    r.raise_for_status()
    return r.json()


def trajectory(router, session_id: str) -> list[dict]:
    """The session's stored turns, each with ``input_ids``: the engine's whole input, rebuilt from
    its segment (a turn stores its ``append_ids`` after ``context`` tokens; a fork starts anew)."""
    r = httpx.get(f"{router.url}/v1/sessions/{session_id}/trajectory", headers=router.headers, timeout=30)
    r.raise_for_status()
    turns = r.json()["turns"]
    segment: list[int] = []
    for t in turns:
        if t["fork"] is not None:
            segment = []
        assert t["context"] == len(segment)
        t["input_ids"] = segment + t["append_ids"]
        segment = t["input_ids"] + t["output_ids"]
    return turns


def reasoning_opened(model_dir: Path, out: Path) -> Path:
    """``out``: the tokenizer of ``model_dir`` with its chat template changed so that the generation
    prompt opens ``<think>`` (Qwen3 thinking-2507 style: it ends with ``<think>\\n``, the reply
    starts inside the reasoning); a chat model directory for ``--chat-model``."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    opening = "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}{%- if false %}"
    template = read_chat_template(model_dir).replace(
        "{%- if add_generation_prompt %}", "{%- if add_generation_prompt %}" + opening
    )
    assert template != read_chat_template(model_dir), "the template has no generation prompt to open"
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out

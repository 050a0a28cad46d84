"""Where the router's chat model comes from: ``mixfleet router --chat-model DIR [--chat-family F]``
(a directory it cannot render with is one line at start, nothing served), the configuration
(no chat model: the chat routes answer 503 in each API's error shape), and the Modal deploy's
``MIXFLEET_CHAT_MODEL`` (a directory on the weights Volume, passed to the router's arguments)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.errors import UserError
from fleet.specs import FleetSpec, GroupSpec
from mixfleet.router import default_args, router_app
from router.chat.renderers import FAMILIES
from router.config import CHAT_FAMILIES, RouterConfig
from tests.support.procs import mixfleet_argv
from tests.support.router import write_preset
from weight_sync.base_model import write_tokenizer


def test_the_configurations_families_are_the_renderers() -> None:
    assert tuple(FAMILIES) == CHAT_FAMILIES
    with pytest.raises(ValueError, match="chat_family must be one of local, qwen3"):
        RouterConfig(fleet=_fleet(), auth_disabled=True, chat_family="llama")


def _fleet() -> FleetSpec:
    return FleetSpec(
        name="t", groups=[GroupSpec(name="cpu", accelerator="cpu", replicas=["http://127.0.0.1:9"])]
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--chat-model", "{empty}"), "--chat-model {empty}: cannot render chat with it"),
        (("--chat-model", "{model}", "--chat-family", "llama"), "--chat-family must be auto or one of local"),
        (("--chat-family", "qwen3", "--chat-model", "{model}"), "cannot render chat with it"),
    ],
)
def test_router_refuses_a_chat_model_it_cannot_use(tmp_path: Path, flags, message: str) -> None:
    """An empty directory (no tokenizer), an unknown family, a family the tokenizer lacks the stop
    tokens of: exit 2 and one line naming the flag."""
    empty, model = tmp_path / "empty", tmp_path / "model"
    empty.mkdir()
    model.mkdir()
    write_tokenizer(model)
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu", "replicas": ["http://127.0.0.1:9"]}])
    names = {"empty": str(empty), "model": str(model)}
    argv = mixfleet_argv("router", "--preset", str(preset), "--insecure-no-auth", "--port", "9")
    r = subprocess.run(
        [*argv, *(f.format(**names) for f in flags)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and message.format(**names) in r.stderr, r.stderr


def test_without_a_chat_model_the_chat_routes_answer_503(tmp_path: Path) -> None:
    config = RouterConfig(fleet=_fleet(), auth_disabled=True)
    with TestClient(router_app(config)) as client:
        sid = client.post("/v1/sessions", json={"group": "cpu"}).json()["session_id"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = client.post(f"/v1/sessions/{sid}/openai/v1/chat/completions", json=body)
        assert r.status_code == 503 and "--chat-model" in r.json()["error"]["message"]
        r = client.post(f"/v1/sessions/{sid}/anthropic/v1/messages", json=body)
        assert r.status_code == 503 and r.json()["type"] == "error"


def test_modal_deploy_passes_its_chat_model_and_vocabulary_to_the_router(monkeypatch) -> None:
    """``MIXFLEET_CHAT_MODEL`` at deploy: shipped to the router container and its ``--chat-model``;
    one outside the Volume is refused before anything is deployed. So is ``MIXFLEET_VOCAB_SIZE``
    (``mixfleet deploy --checkpoint``'s vocabulary), the router's ``--vocab-size``."""
    monkeypatch.setenv("MIXFLEET_PRESET", "homogeneous")
    monkeypatch.delenv("MIXFLEET_FLEET_JSON", raising=False)
    monkeypatch.delenv("MIXFLEET_VOCAB_SIZE", raising=False)
    monkeypatch.setenv("MIXFLEET_REDIS_URL", "redis://127.0.0.1:1/0")
    for path, ok in (("/weights/main/bf16/chat", True), ("/tmp/model", False)):
        monkeypatch.setenv("MIXFLEET_CHAT_MODEL", path)
        sys.modules.pop("deploy.modal_app", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not ok:
                with pytest.raises(UserError, match="must be a directory on the weights Volume"):
                    importlib.import_module("deploy.modal_app")
                continue
            module = importlib.import_module("deploy.modal_app")
        assert module.ROUTER_ENV["MIXFLEET_CHAT_MODEL"] == path
        assert "MIXFLEET_CHAT_MODEL" not in module.ENV  # the GPU servers' environment
        args = module.router_args()
        assert args["chat_model"] == path and set(args) == set(default_args(preset="x")) | {"fleet_json"}
        assert json.loads(args["fleet_json"])["name"] == "homogeneous"
        assert args["vocab_size"] is None  # no --checkpoint: the router reads the chat model's
    monkeypatch.setenv("MIXFLEET_CHAT_MODEL", "/weights/main/bf16/chat")
    for value, ok in (("151936", True), ("-3", False), ("many", False)):
        monkeypatch.setenv("MIXFLEET_VOCAB_SIZE", value)
        sys.modules.pop("deploy.modal_app", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not ok:
                with pytest.raises(
                    UserError, match=f"MIXFLEET_VOCAB_SIZE must be a positive integer, got '{value}'"
                ):
                    importlib.import_module("deploy.modal_app")
                continue
            module = importlib.import_module("deploy.modal_app")
        assert module.ROUTER_ENV["MIXFLEET_VOCAB_SIZE"] == value and "MIXFLEET_VOCAB_SIZE" not in module.ENV
        assert module.router_args()["vocab_size"] == int(value)
    sys.modules.pop("deploy.modal_app", None)

"""An input id outside the served checkpoint's vocabulary is refused by the router, before anything
reaches an engine: SGLang 0.5.23 checks a prompt's ids against the vocabulary nowhere before its
embedding gathers them (its tokenizer manager checks only ``token_ids_logprob``'s,
managers/tokenizer_manager.py 1513-1531; layers/vocab_parallel_embedding.py 515-521 asserts the range
only under ``SGLANG_ENABLE_ASYNC_ASSERT``, off by default, environ.py 515), so the local engine's own
refusal must not be what a test sees.

Real parts: a local engine process, a recording proxy in front of it (what the router forwarded),
and router processes: one given the chat model (the vocabulary size is its ``config.json``'s, the
default), one given ``--vocab-size`` (it takes precedence).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.procs import mixfleet_argv
from tests.support.recorder import recording_proxy
from tests.support.router import router_process, write_preset

ONE = {"max_new_tokens": 1}


@pytest.fixture(scope="module")
def proxied(engine_url, tiny_bf16, tmp_path_factory):
    """(a router whose one group's replica is a recording proxy of the engine, the proxy, the
    engine's vocabulary size); the router is given the engine's checkpoint as its chat model."""
    d = tmp_path_factory.mktemp("vocab")
    vocab = json.loads((Path(tiny_bf16) / "config.json").read_text())["vocab_size"]
    with recording_proxy(engine_url) as rec:
        preset = write_preset(d / "p.toml", [{"name": "cpu-a", "replicas": [rec.url]}])
        with router_process(preset, extra_args=("--chat-model", str(tiny_bf16))) as router:
            yield router, rec, vocab


def _forwarded_ids(rec) -> list:
    """The ``input_ids`` of every ``/generate`` the router sent (turns, ``/generate``, scores)."""
    return [json.loads(body).get("input_ids") for body, _ in rec.exchanges("/generate")]


def test_out_of_vocabulary_ids_are_refused_before_any_engine_sees_them(proxied) -> None:
    router, rec, vocab = proxied
    outside = f"is outside the vocabulary (size {vocab})"
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        turns, v = f"/v1/sessions/{sid}/turns", vocab
        refused = [
            (turns, {"input_ids": [1, v], "sampling_params": ONE}, f"input_ids[1] = {v}"),
            ("/generate", {"input_ids": [3, 2, v + 7], "sampling_params": ONE}, f"input_ids[2] = {v + 7}"),
            (
                "/generate",
                {"input_ids": [1, v], "sampling_params": ONE, "stream": True},
                f"input_ids[1] = {v}",
            ),
            ("/generate", {"input_ids": [[1], [2, v]], "sampling_params": ONE}, f"input_ids[1][1] = {v}"),
            ("/v1/score", {"input_ids": [[1, 2], [3, 4, v]]}, f"input_ids[1][2] = {v}"),  # every replica's
        ]
        for path, body, where in refused:
            r = c.post(path, json=body)
            assert r.status_code == 422 and r.json() == {"detail": f"{where} {outside}"}, (path, r.text)
        assert _forwarded_ids(rec) == []  # nothing reached the engine

        ok = c.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, vocab - 1], "sampling_params": ONE})
        assert ok.status_code == 200, ok.text  # the last id of the vocabulary is in it
        r = c.post(f"/v1/sessions/{sid}/turns", json={"append_ids": [5, vocab], "sampling_params": ONE})
        assert r.status_code == 422 and r.json() == {"detail": f"append_ids[1] = {vocab} {outside}"}, r.text
        context = [1, vocab - 1, *ok.json()["output_ids"], 5, vocab]  # the stored context, extended
        r = c.post(f"/v1/sessions/{sid}/turns", json={"input_ids": context, "sampling_params": ONE})
        where = f"input_ids[{len(context) - 1}] = {vocab}"
        assert r.status_code == 422 and r.json() == {"detail": f"{where} {outside}"}, r.text
        assert c.post("/generate", json={"input_ids": [vocab - 1], "sampling_params": ONE}).status_code == 200
        assert c.post("/v1/score", json={"input_ids": [[1, vocab - 1]]}).status_code == 200
        assert _forwarded_ids(rec) == [[1, vocab - 1], [vocab - 1], [[1, vocab - 1]]]
        assert c.get(f"/v1/sessions/{sid}").json()["turns"] == 1  # the refused turns stored nothing


def test_the_vocabulary_flag_takes_precedence_and_is_checked(engine_url, tiny_bf16, tmp_path: Path) -> None:
    """``--vocab-size N`` over the chat model's; a size below 1 is one line and exit 2."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    flags = ("--chat-model", str(tiny_bf16), "--vocab-size", "10")
    with router_process(preset, extra_args=flags) as router:
        r = httpx.post(
            f"{router.url}/generate",
            json={"input_ids": [9, 10], "sampling_params": ONE},
            headers=router.headers,
        )
        assert r.status_code == 422 and r.json() == {
            "detail": "input_ids[1] = 10 is outside the vocabulary (size 10)"
        }
    argv = mixfleet_argv("router", "--preset", str(preset), "--insecure-no-auth", "--vocab-size", "0")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().endswith("--vocab-size must be >= 1, got 0"), r.stderr

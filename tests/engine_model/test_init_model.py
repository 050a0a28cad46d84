"""``mixfleet init-model``: deterministic bytes, a real HF checkpoint and tokenizer, sharding for small."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch

from engine.model.tokenizer import Tokenizer
from mixfleet.init_model import PRESETS, param_count, write_model
from tests.support.models import make_model_dir
from tests.support.procs import REPO, mixfleet_argv
from weight_sync.base_model import VOCAB_SIZE


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _init(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        mixfleet_argv("init-model", str(out), *extra), cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_tiny_is_byte_identical_across_processes(tmp_path: Path, tiny_dir: Path) -> None:
    # tiny_dir was written in this process (write_model); the CLI writes in a fresh one.
    r = _init(tmp_path / "a", "--preset", "tiny")
    assert r.returncode == 0, r.stderr
    assert f"{param_count('tiny'):,} parameters" in r.stdout
    assert _digests(tmp_path / "a") == _digests(tiny_dir)
    assert set(_digests(tiny_dir)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    other_seed = write_model(tmp_path / "c", "tiny", seed=5)
    assert _digests(other_seed)["model.safetensors"] != _digests(tiny_dir)["model.safetensors"]


def test_small_is_sharded_deterministic_and_sized(tmp_path: Path, model_root: Path) -> None:
    small = make_model_dir(model_root, "small", "bf16")
    again = write_model(tmp_path / "s", "small")
    assert _digests(again) == _digests(small)
    index = json.loads((small / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((small / s).is_file() for s in shards)
    n = param_count("small")
    assert 50e6 <= n <= 100e6
    from safetensors import safe_open

    total = 0
    for s in shards:
        with safe_open(str(small / s), framework="pt") as f:
            total += sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    assert total == n


def _prod(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def test_refuses_a_directory_that_holds_a_model(tiny_dir: Path) -> None:
    r = _init(tiny_dir)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "already holds a model" in r.stderr


def test_config_is_a_transformers_qwen3_moe_config(tiny_dir: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert type(cfg).__name__ == "Qwen3MoeConfig"
    p = PRESETS["tiny"]
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (
        p.hidden_size,
        p.num_experts,
        p.num_experts_per_tok,
        VOCAB_SIZE,
    )


def test_random_policy_is_not_degenerate(tiny_model) -> None:
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(tiny_model.forward([ids], [tiny_model.new_sequence()])[0], -1)
    entropy = -(logp.exp() * logp).sum(-1)
    # Far from uniform (log VOCAB_SIZE = 5.59) and far from deterministic; and it depends on the context.
    assert 1.0 < entropy.mean() < 4.5
    assert logp.exp().max(-1).values.mean() > 0.15
    assert (logp.argmax(-1)[1:] != logp.argmax(-1)[:-1]).any()


TEXTS = [
    "Hello, world!",
    "wörld ✓ 漢字 🙂",
    "<|bos|>a<|eos|>b<|pad|>",
    "",
    "  spaces\n\ttabs  ",
    "<|im_start|>assistant\n<think>x</think><tool_call>{}</tool_call><|im_end|>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encodes_and_decodes_as_sglangs_fast_tokenizer(tiny_dir: Path, text: str) -> None:
    """The engine's ids of a ``text`` input are those SGLang 0.5.23's tokenizer manager gets by
    calling the fast tokenizer on it (managers/tokenizer_manager.py 1064-1069), and its text of
    ids what the detokenizer's ``batch_decode`` gives (managers/detokenizer_manager.py 270-300),
    with and without ``skip_special_tokens``: an added token that is not special (``<think>``,
    ``<tool_call>``) stays text when special tokens are skipped."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    ours = Tokenizer.from_dir(tiny_dir)
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.batch_decode([ids], skip_special_tokens=False)[0] == text
    assert ours.decode(ids, skip_special_tokens=True) == hf.batch_decode([ids], skip_special_tokens=True)[0]


def test_tokenizer_json_is_what_the_library_writes(tiny_dir: Path) -> None:
    import tokenizers

    spec = json.loads((tiny_dir / "tokenizer.json").read_text())
    assert json.loads(tokenizers.Tokenizer.from_str(json.dumps(spec)).to_str()) == spec
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.eos_token_id == 257 and tok.bos_token_id == 256 and tok.pad_token_id == 258
    assert tok.encode("hi<|eos|>", add_special_tokens=False) == [104, 105, 257]


def test_tokenizer_bytes_and_errors(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.encode("A") == [65]
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut UTF-8 sequence decodes with a replacement char
    assert tok.decode([300, 65]) == "A"  # an id beyond the vocabulary decodes to nothing, as the library's
    with pytest.raises(ValueError, match="no readable tokenizer"):
        Tokenizer.from_dir(tiny_dir / "missing")

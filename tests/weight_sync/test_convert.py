"""Converter, in-process: every format's output (see conversion_checks), independence from chunking
and threading, idempotency, refusal to overwrite a different conversion, atomic DST."""

from __future__ import annotations

import pytest

from core.errors import UserError
from core.formats import FORMATS
from tests.support.checkpoints import MoESpec, load_all, write_checkpoint
from tests.weight_sync.conversion_checks import check_conversion
from weight_sync.convert import convert_checkpoint, source_checksum


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "src"
    write_checkpoint(d, MoESpec())
    return d


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_is_independent_of_chunking_and_threads(ckpt, tmp_path, fmt) -> None:
    """Tiny chunks (many tasks per tensor, several fp8 row blocks) on 2 threads give the same
    bytes as one task per tensor on 1 thread; and the output is what the format promises."""
    a = convert_checkpoint(ckpt, tmp_path / "a", fmt, workers=1, chunk_elems=1 << 30)
    b = convert_checkpoint(ckpt, tmp_path / "b", fmt, workers=2, chunk_elems=2000)
    assert a.files == b.files and a.tensor_count == b.tensor_count
    check_conversion(ckpt, tmp_path / "b", fmt)


def test_idempotent_and_refuses_other_content(ckpt, tmp_path) -> None:
    dst = tmp_path / "out"
    first = convert_checkpoint(ckpt, dst, "bf16")
    assert convert_checkpoint(ckpt, dst, "bf16") == first  # same content: verified, returned
    with pytest.raises(UserError, match="already holds a different conversion"):
        convert_checkpoint(ckpt, dst, "fp8")
    other = tmp_path / "other"
    write_checkpoint(other, MoESpec(seed=1))
    assert source_checksum(other) != source_checksum(ckpt)
    with pytest.raises(UserError, match="already holds a different conversion"):
        convert_checkpoint(other, dst, "bf16")
    # A damaged earlier conversion is not silently accepted as "the same".
    shard = sorted(dst.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=shard.name):
        convert_checkpoint(ckpt, dst, "bf16")


def test_empty_dst_is_filled_and_nothing_else_is_left(ckpt, tmp_path) -> None:
    dst = tmp_path / "staging"
    dst.mkdir()
    convert_checkpoint(ckpt, dst, "bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staging"]  # no temporary beside it
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="refusing to overwrite"):
        convert_checkpoint(ckpt, foreign, "bf16")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_source_checksum_follows_content_not_location(ckpt, tmp_path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert source_checksum(copy) == source_checksum(ckpt)
    (copy / "tokenizer.json").write_text("{}")
    assert source_checksum(copy) != source_checksum(ckpt)


def test_transformers_loads_the_bf16_output(ckpt, tmp_path) -> None:
    """An independent reader of our safetensors writer and index: HF transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    convert_checkpoint(ckpt, tmp_path / "bf16", "bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    src = load_all(ckpt)
    layer = model.model.layers[0]
    assert torch.equal(model.model.embed_tokens.weight, src["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, src["lm_head.weight"])
    assert torch.equal(layer.self_attn.k_proj.weight, src["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(model.model.norm.weight, src["model.norm.weight"])


def test_nvfp4_input_scales_are_calibrated_on_the_policy_text(tmp_path) -> None:
    """On the ``init-model`` policy (byte-level tokenizer: the calibration text is ~1,700 tokens),
    every ``input_scale`` is amax/(6*448) of an independent transformers calibration, and the
    scales differ by site (not a placeholder)."""
    from tests.support.models import make_model_dir

    src = make_model_dir(tmp_path, "tiny", "bf16")
    dst = tmp_path / "nvfp4"
    convert_checkpoint(src, dst, "nvfp4")
    check_conversion(src, dst, "nvfp4")
    scales = {n: t.item() for n, t in load_all(dst).items() if n.endswith(".input_scale")}
    assert len(set(scales.values())) == 8  # 2 layers x (qkv, o_proj, experts' gate/up, experts' down)
    assert all(1e-4 < v < 1e-2 for v in scales.values())


def test_nvfp4_without_a_tokenizer_is_refused(ckpt, tmp_path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    (src / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="calibration failed: .*tokenizer"):
        convert_checkpoint(src, tmp_path / "out", "nvfp4")
    assert not (tmp_path / "out").exists()
    convert_checkpoint(src, tmp_path / "fp8", "fp8")  # the other formats need no calibration

"""The engine's checkpoint reader (engine.model.loader): its own safetensors parsing matches the
safetensors library byte for byte, refuses malformed files naming them, and a loaded model does
not depend on the files it was loaded from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.model.loader import TensorSource
from engine.model.model import load_model
from tests.support.models import FORMATS, make_model_dir


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tensor_matches_the_safetensors_library(model_root: Path, fmt: str) -> None:
    path = make_model_dir(model_root, "tiny", fmt)
    reference: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        reference.update(load_file(file))
    src = TensorSource(path)
    assert sorted(src._entries) == sorted(reference)  # noqa: SLF001 - the set of names read
    dtypes = set()
    for name, ref in reference.items():
        got = src.get(name)
        dtypes.add(ref.dtype)
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name
    assert torch.bfloat16 in dtypes


def _shard(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[0]


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[:-1])


def _header_too_long(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[:8] = (len(data)).to_bytes(8, "little")
    f.write_bytes(bytes(data))


def _garbage_header(f: Path) -> None:
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 : 8 + n] = b"{" * n
    f.write_bytes(bytes(data))


def _overlap(f: Path) -> None:
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = header[names[0]], header[names[1]]
    size = a["data_offsets"][1] - a["data_offsets"][0]
    if b["data_offsets"][1] - b["data_offsets"][0] == size:
        b["data_offsets"] = list(a["data_offsets"])  # two tensors on the same bytes
    else:
        a["data_offsets"][1] += 1
    raw = json.dumps(header, separators=(",", ":")).encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _tiny(f: Path) -> None:
    f.write_bytes(b"\x01\x02")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "data section"),
        (_header_too_long, "header length"),
        (_garbage_header, "not valid JSON"),
        (_overlap, "overlaps another|bytes for shape"),
        (_tiny, "only 2 bytes"),
    ],
)
def test_malformed_files_are_refused_by_name(model_root: Path, tmp_path: Path, damage, message) -> None:
    path = shutil.copytree(make_model_dir(model_root, "tiny", "fp8"), tmp_path / "m")
    shard = _shard(path)
    damage(shard)
    with pytest.raises(ValueError, match=message) as info:
        load_model(path)
    assert shard.name in str(info.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_loaded_model_does_not_read_its_files_again(model_root: Path, tmp_path: Path, fmt: str) -> None:
    """The files are mapped while loading; afterwards they may be overwritten in place (same
    inode) or removed without changing what the model computes."""
    path = shutil.copytree(make_model_dir(model_root, "tiny", fmt), tmp_path / "m")
    model = load_model(path)
    ids = torch.arange(1, 33)

    def logits() -> torch.Tensor:
        return model.forward([ids], [model.new_sequence()])[0]

    before = logits()
    for shard in path.glob("*.safetensors"):
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.write(b"\x00" * size)
    assert torch.equal(logits(), before)
    shutil.rmtree(path)
    assert torch.equal(logits(), before)

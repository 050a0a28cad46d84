"""Streaming safetensors I/O: mapped views equal copies and survive page release; the layout
writer accepts pieces in any order from several threads and refuses incomplete or mistyped data;
files it writes read back with the safetensors library."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from weight_sync.safetensors_io import LayoutWriter, OutTensor, TensorReader, read_header


def _source(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "c": torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),
    }
    path = tmp_path / "src.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_views_equal_copies_and_survive_release(tmp_path) -> None:
    path, tensors = _source(tmp_path)
    entries, _ = read_header(path)
    with TensorReader() as r:
        a = r.view_rows(entries["a"], 10, 250)
        assert torch.equal(a, tensors["a"][10:250])
        assert torch.equal(a, r.read_rows(entries["a"], 10, 250))
        assert torch.equal(r.view_rows(entries["b"]), tensors["b"])
        assert r.file_array(path).tobytes() == path.read_bytes()
        bits = r.bits_rows(entries["a"], 10, 250)
        assert bits.dtype == np.uint16 and torch.equal(
            torch.from_numpy(bits.copy()).view(torch.bfloat16), a.reshape(-1)
        )
        r.release(path)  # pages handed back: the views read them again from the page cache
        assert torch.equal(a, tensors["a"][10:250])
        r.release(path, entries["c"].start + 1, 100)  # inside one page: nothing to release
        assert torch.equal(r.view_rows(entries["c"]), tensors["c"])


def _layout():
    outs = [
        OutTensor("x", "BF16", (40, 33)),
        OutTensor("y", "F32", (3, 5)),
        OutTensor("z", "U8", (0,)),
        OutTensor("s", "F32", ()),
    ]
    g = torch.Generator().manual_seed(1)
    data = {
        "x": torch.randn(40, 33, generator=g).to(torch.bfloat16),
        "y": torch.randn(3, 5, generator=g),
        "z": torch.zeros(0, dtype=torch.uint8),
        "s": torch.tensor(2.5),
    }
    return outs, data


def test_pieces_in_any_order_from_threads_read_back(tmp_path) -> None:
    outs, data = _layout()
    w = LayoutWriter(tmp_path / "out.safetensors", outs, {"format": "pt"})
    pieces = [(0, r * 33 * 2, data["x"][r : r + 4]) for r in range(0, 40, 4)]
    pieces += [(1, r * 5 * 4, data["y"][r]) for r in range(3)] + [(3, 0, data["s"])]
    random.Random(2).shuffle(pieces)
    threads = [
        threading.Thread(target=lambda chunk=pieces[i::3]: [w.write_at(*p) for p in chunk]) for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    back = load_file(str(tmp_path / "out.safetensors"))
    assert back.keys() == data.keys()
    assert all(torch.equal(back[k], v) for k, v in data.items())
    assert (tmp_path / "out.safetensors").stat().st_size == w.size


def test_incomplete_or_mistyped_pieces_are_refused(tmp_path) -> None:
    outs, data = _layout()
    w = LayoutWriter(tmp_path / "a.safetensors", outs)
    with pytest.raises(RuntimeError, match="expected BF16"):
        w.write_at(0, 0, data["x"].float())
    with pytest.raises(RuntimeError, match="expected BF16"):  # arrays: bit patterns of the item size
        w.write_at(0, 0, data["x"].float().numpy())
    other = LayoutWriter(tmp_path / "b.safetensors", outs)
    assert other.write_at(0, 0, data["x"][:1].view(torch.int16).numpy()).size == 66  # bf16 bits as int16
    other.abort()
    with pytest.raises(RuntimeError, match="overflow x"):
        w.write_at(0, 2, data["x"])
    w.write_at(0, 0, data["x"])
    w.write_at(1, 0, data["y"])
    with pytest.raises(RuntimeError, match="s got 0 bytes, expected 4"):
        w.close()
    with pytest.raises(FileExistsError):
        LayoutWriter(tmp_path / "a.safetensors", outs)

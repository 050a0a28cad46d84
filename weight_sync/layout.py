"""A run's versions keep one tensor layout: what a publish checks before converting anything.

A replica activates a version by loading its files into the model its engine already serves.
SGLang 0.5.23's ``update_weights_from_disk`` reads no ``config.json`` (it keeps the served
``model_config`` and only points it at the new path: model_executor/model_runner_components/
weight_updater.py 193-203) and loads tensors by name into the existing parameters, so a version
whose tensors differ from the served ones is never refused cleanly:

- a tensor the model has no parameter for is skipped, and a parameter the checkpoint lacks keeps
  its old value (the Qwen3-MoE loader: ``if name not in params_dict: continue``,
  models/qwen3_moe.py 1224-1225, 1266-1267, or a warning, 1276): the engine serves a mix of two
  versions under the new number;
- a tensor of another shape fails the load (``default_weight_loader``'s size assertion,
  model_loader/weight_utils.py 1582-1585), and the "rollback" re-reads the new path (set at
  weight_updater.py 193 before the load, re-read at 236-237 outside any ``try``), fails again and
  ends the server (managers/scheduler.py 6366-6373 sends SIGQUIT; managers/tokenizer_manager.py
  4072-4081 kills the process tree); every replica of the group does the same, and a replica
  started afterwards stages the pointer's version and cannot load it either.

So :func:`check_layout` refuses, before anything is converted, a checkpoint whose conversion in
some format would not hold exactly the tensors (names, dtypes, shapes) of that format's current
version: :func:`weight_sync.convert.converted_tensors` gives the conversion's outputs from the
headers alone, and the current version's files (deltas resolved) give theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from core.errors import UserError
from weight_sync.convert import converted_tensors, load_source
from weight_sync.delta import version_shards
from weight_sync.safetensors_io import read_header
from weight_sync.store.base import VersionStore
from weight_sync.types import FormatRef, VersionRef

Layout = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (safetensors dtype, shape)."""


class LayoutMismatch(UserError):
    """``ckpt_dir`` would convert, in ``format``, to other tensors than ``version`` holds;
    ``difference`` names the first tensor that differs."""

    def __init__(self, ckpt_dir: Path, run_id: str, fmt: str, version: int, difference: str) -> None:
        super().__init__(
            f"checkpoint {ckpt_dir} does not fit run {run_id!r}: in {fmt}, {difference} (version "
            f"{version}, the current one); an engine loads a version into the model it serves, so "
            "every version of a run has the same tensors (names, dtypes, shapes)"
        )
        self.ckpt_dir, self.run_id, self.format, self.version = ckpt_dir, run_id, fmt, version
        self.difference = difference


def check_layout(store: VersionStore, run_id: str, ckpt_dir: Path, formats: Iterable[str]) -> None:
    """Raise :class:`LayoutMismatch` unless ``ckpt_dir`` (a BF16 checkpoint) converts, in every
    one of ``formats`` that has a current version, to exactly that version's tensors; formats
    without a pointer yet accept any layout. ``UserError`` where the checkpoint cannot be read."""
    source = None
    for fmt in formats:
        current = store.read_pointer(FormatRef(run_id, fmt))
        if current is None:
            continue
        source = source or load_source(ckpt_dir)
        new = {t.name: (t.dtype, tuple(t.shape)) for t in converted_tensors(source, fmt)}
        difference = first_difference(new, version_layout(store, VersionRef(run_id, fmt, current)))
        if difference is not None:
            raise LayoutMismatch(ckpt_dir, run_id, fmt, current, difference)


def version_layout(store: VersionStore, ref: VersionRef) -> Layout:
    """Every tensor of version ``ref`` (its full content, deltas resolved), from the headers of its
    ``*.safetensors`` files."""
    layout: Layout = {}
    for shard in version_shards(store, ref):
        entries, _ = read_header(shard)
        layout.update({name: (e.dtype, tuple(e.shape)) for name, e in entries.items()})
    return layout


def first_difference(new: Layout, current: Layout) -> str | None:
    """The first tensor (by name) in which ``new`` differs from ``current``, said in words; None
    when they are equal."""
    for name in sorted(new.keys() | current.keys()):
        if name not in current:
            return f"tensor {name!r} is not in the current version"
        if name not in new:
            return f"tensor {name!r} of the current version is missing"
        if new[name] != current[name]:
            (dtype, shape), (was, was_shape) = new[name], current[name]
            return f"tensor {name!r} is {dtype} {list(shape)}, the current version's {was} {list(was_shape)}"
    return None

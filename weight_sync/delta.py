"""Delta versions: a trainer hands over only the tensors that changed since a base version.

The manifest's ``kind == "delta"`` with ``base_version`` B (see :mod:`weight_sync.manifest`) says:
this directory holds only the files whose bytes differ from B's full content (same relative
paths, same format); every other file comes from B (itself possibly a delta: chains resolve to
the newest layer). A replica stages a delta by materializing the layers into one directory
(:mod:`weight_sync.stage`), so an engine (SGLang or ours) always loads one complete checkpoint
in which every tensor appears exactly once.

Publishing a delta (:func:`weight_sync.publish.publish_delta`) takes a directory of
``*.safetensors`` holding the changed BF16 tensors only, under their HF names, and:

1. :func:`merge_source` writes the full BF16 checkpoint of the new version: B's bf16 content
   with those tensors replaced (shards without a changed tensor are hard-linked, the others
   rewritten; one shard in memory at a time). The run must keep a bf16 copy of B.
2. Each format is converted from it exactly as a full publish would (so a delta's content is
   byte for byte what a full publish of the merged checkpoint gives), then
   :func:`reduce_to_delta` drops every converted file whose size and digest equal B's and
   rewrites the manifest as ``kind="delta"``. A quantized shard changes when any tensor in it
   changes, including one fused with a changed tensor (NVFP4 q/k/v and gate/up share a scale).

What it saves: store space and bytes to verify or copy (files equal to the base's are neither
written again nor, staging in place, hashed again); not conversion time (each format converts
the whole merged checkpoint once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from core.errors import UserError
from weight_sync.manifest import MANIFEST_NAME, ChecksumError, FileEntry, Manifest, count_tensors
from weight_sync.safetensors_io import TensorEntry, TensorReader, read_header
from weight_sync.store.base import VersionStore
from weight_sync.types import VersionRef

MAX_CHAIN = 1000


def version_files(store: VersionStore, ref: VersionRef) -> dict[str, tuple[Path, FileEntry]]:
    """Every file of version ``ref``'s full content (deltas resolved, newest layer winning):
    relative path -> (directory holding it, its manifest entry). A chain without a base or with a
    cycle raises ``ChecksumError`` naming the manifest that breaks it."""
    chain: list[tuple[VersionRef, Manifest]] = [(ref, store.read_manifest(ref))]
    while chain[-1][1].kind == "delta":
        base = chain[-1][1].base_version
        if base is None or len(chain) > MAX_CHAIN or any(r.version == base for r, _ in chain):
            raise ChecksumError(
                Path(store.version_dir(chain[-1][0])) / MANIFEST_NAME,
                "delta chain has no base or is cyclic",
            )
        base_ref = ref.with_version(base)
        chain.append((base_ref, store.read_manifest(base_ref)))
    files: dict[str, tuple[Path, FileEntry]] = {}
    for r, m in reversed(chain):
        src = Path(store.version_dir(r))
        for rel, entry in m.files.items():
            files[rel] = (src, entry)
    return files


def version_shards(store: VersionStore, ref: VersionRef) -> list[Path]:
    """The ``*.safetensors`` files of version ``ref``'s full content (deltas resolved), by path."""
    return [
        d / rel for rel, (d, _) in sorted(version_files(store, ref).items()) if rel.endswith(".safetensors")
    ]


def link_version(store: VersionStore, ref: VersionRef, out: Path) -> None:
    """Hard-link (or copy, across filesystems) every file of version ``ref``'s full content but its
    manifest into the directory ``out``: the checkpoint a delta version stands for."""
    for rel, (src, _) in sorted(version_files(store, ref).items()):
        if rel != MANIFEST_NAME:
            dst = Path(out) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(src / rel, dst)


def scratch_dir(store: VersionStore) -> Path:
    """A new directory on the store's own disk for a checkpoint built from its versions (a volume
    store's container disk, ``scratch``; else beside the store), so hard links reach its files."""
    own_disk = getattr(store, "scratch", None) or getattr(store, "root", None)
    if own_disk is not None:
        Path(own_disk).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=own_disk))


@contextlib.contextmanager
def whole_content(store: VersionStore, ref: VersionRef) -> Iterator[Path]:
    """A directory holding version ``ref``'s whole content while the block runs: its own
    directory for a full version; for a delta, whose directory holds only what changed, its
    layers hard-linked (:func:`link_version`) into a :func:`scratch_dir`, removed after."""
    if store.read_manifest(ref).kind != "delta":
        yield Path(store.version_dir(ref))
        return
    tmp = scratch_dir(store)
    try:
        link_version(store, ref, tmp / "content")
        yield tmp / "content"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_finite(entries: list[TensorEntry]) -> None:
    """``UserError`` naming the delta's file and tensor when one of ``entries`` holds NaN or Inf
    (the converter's own check, :func:`weight_sync.convert.finite_bf16`, which would otherwise
    name the merged temporary copy; the delta's tensors are BF16, as the base's)."""
    from weight_sync.convert import finite_bf16

    with TensorReader() as reader:
        for e in entries:
            finite_bf16(reader.bits_rows(e), e)


def _header(path: Path) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """``name -> (dtype, shape)`` and the metadata of a safetensors file (``SafetensorsError``,
    a ``UserError``, naming the file when it is malformed)."""
    entries, metadata = read_header(path)
    return {name: (e.dtype, list(e.shape)) for name, e in entries.items()}, metadata


def merge_source(store: VersionStore, run_id: str, base_version: int, delta_dir: Path, out: Path) -> int:
    """Write into the empty directory ``out`` the full BF16 checkpoint: ``base_version``'s bf16
    content with the tensors of ``delta_dir``'s ``*.safetensors`` replaced. Returns how many
    tensors were replaced.

    Refuses (``UserError``, before writing anything) a delta without tensors, a tensor named twice,
    a tensor the base does not have, one whose dtype or shape differs from the base's, or one
    holding NaN or Inf (each naming the delta's file and tensor).
    """
    from safetensors.torch import load_file, save_file

    delta_dir = Path(delta_dir)
    if not delta_dir.is_dir():
        raise UserError(f"delta directory {delta_dir} does not exist")
    base_ref = VersionRef(run_id, "bf16", base_version)
    if base_version not in store.versions(base_ref.stream):
        raise UserError(
            f"run {run_id!r} keeps no bf16 copy of version {base_version} to apply a delta to "
            "(publish the bf16 format too, or publish a full checkpoint)"
        )
    delta: dict[str, tuple[Path, str, list[int]]] = {}
    entries: list[TensorEntry] = []
    for file in sorted(delta_dir.glob("*.safetensors")):
        for name, e in read_header(file)[0].items():
            if name in delta:
                raise UserError(f"delta tensor {name!r} is in both {delta[name][0].name} and {file.name}")
            delta[name] = (file, e.dtype, list(e.shape))
            entries.append(e)
    if not delta:
        raise UserError(f"delta directory {delta_dir} has no tensors (*.safetensors)")
    base = version_files(store, base_ref)
    where: dict[str, str] = {}  # tensor -> base shard holding it
    headers: dict[str, tuple[dict[str, tuple[str, list[int]]], dict[str, str]]] = {}
    for rel, (src, _) in sorted(base.items()):
        if rel.endswith(".safetensors"):
            headers[rel] = _header(src / rel)
            for name in headers[rel][0]:
                where[name] = rel
    unknown = sorted(n for n in delta if n not in where)
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise UserError(f"delta tensors not in version {base_version}: {', '.join(unknown[:5])}{more}")
    for name, (file, dtype, shape) in sorted(delta.items()):
        b_dtype, b_shape = headers[where[name]][0][name]
        if (dtype, shape) != (b_dtype, b_shape):
            raise UserError(
                f"delta tensor {name!r} in {file.name} is {dtype} {shape}; version {base_version} has "
                f"{b_dtype} {b_shape}"
            )
    _check_finite(entries)
    changed = {where[n] for n in delta}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    loaded: dict[Path, dict] = {}
    for rel, (src, _) in sorted(base.items()):
        if rel == MANIFEST_NAME:
            continue
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel not in changed:
            _link_or_copy(src / rel, dst)
            continue
        tensors = load_file(src / rel)
        for name in tensors:
            if name in delta:
                file = delta[name][0]
                if file not in loaded:
                    loaded.clear()  # one delta file in memory at a time
                    loaded[file] = load_file(file)
                tensors[name] = loaded[file][name]
        save_file(tensors, str(dst), metadata=headers[rel][1] or {"format": "pt"})
    return len(delta)


def reduce_to_delta(store: VersionStore, base: VersionRef, staged: Path) -> Manifest | None:
    """Turn the converted full version in ``staged`` into a delta over ``base``: delete the
    files whose manifest entry (size and digest) equals the base's and rewrite ``manifest.json``
    (``kind="delta"``). Returns the new manifest, or None (``staged`` untouched) when the base has a
    file the new version lacks, which a delta cannot express (publish that format in full)."""
    staged = Path(staged)
    full = Manifest.read(staged)
    base_files = version_files(store, base)
    if any(rel not in full.files for rel in base_files if rel != MANIFEST_NAME):
        return None
    keep = {rel: e for rel, e in full.files.items() if rel not in base_files or base_files[rel][1] != e}
    for rel in full.files:
        if rel not in keep:
            (staged / rel).unlink()
    manifest = dataclasses.replace(
        full,
        kind="delta",
        base_version=base.version,
        files=keep,
        tensor_count=sum(count_tensors(staged / rel) for rel in keep if rel.endswith(".safetensors")),
        total_bytes=sum(e.bytes for e in keep.values()),
    )
    manifest.write(staged, fsync=False)
    return manifest


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)

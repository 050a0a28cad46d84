"""Pruning a run's version store: read what is committed, apply :mod:`weight_sync.retention`'s
rule, delete the rest through the store port (``VersionStore.delete``).

Contracts:

- :func:`plan_prune` reads only; its :class:`PrunePlan` names each version to delete and the
  bytes deleting it frees: the files whose every hard link is in the versions deleted (a
  rollback's hard-linked files are freed only with the last version linking them).
- :func:`apply_prune` deletes the plan's versions, newest first within a format (a delta goes
  before a base it resolves through, which retention only lets go with it), and returns what it
  deleted. Whoever calls it keeps publishes out meanwhile: the router holds its job lock
  (:meth:`router.publishing.PublishService.prune`); ``mixfleet weights prune --store`` says so.
- ``keep`` below 1 is a ``UserError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from core.formats import FORMATS
from weight_sync.retention import Layer, StreamView, retained
from weight_sync.store.base import VersionStore
from weight_sync.types import FormatRef, VersionRef


@dataclass(frozen=True)
class PrunePlan:
    """What a prune of ``run_id`` keeps and deletes (per format, ascending) and the bytes it frees."""

    run_id: str
    keep: int
    kept: dict[str, tuple[int, ...]]
    delete: dict[str, tuple[int, ...]]
    bytes_freed: int

    @property
    def refs(self) -> list[VersionRef]:
        return [VersionRef(self.run_id, f, v) for f, vs in self.delete.items() for v in vs]

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "keep": self.keep,
            "kept": {f: list(v) for f, v in self.kept.items()},
            "deleted": {f: list(v) for f, v in self.delete.items()},
            "bytes_freed": self.bytes_freed,
        }


def check_keep(keep: int) -> int:
    """``keep`` when it is at least 1, else a ``UserError`` naming it."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise UserError(f"keep must be a whole number of versions, at least 1 (got {keep!r})")
    return keep


def streams_of(store: VersionStore, run_id: str) -> dict[str, StreamView]:
    """Every format of ``run_id`` with a committed version or a pointer, as retention sees it."""
    out = {}
    for fmt in FORMATS:
        stream = FormatRef(run_id, fmt)
        pointer = store.read_pointer(stream)
        versions = store.versions(stream)
        if pointer is None and not versions:
            continue
        layers = {}
        for v in versions:
            m = store.read_manifest(stream.at(v))
            layers[v] = Layer(m.kind, m.base_version)
        out[fmt] = StreamView(layers, pointer)
    return out


def plan_prune(
    store: VersionStore,
    run_id: str,
    keep: int,
    *,
    protect: Iterable[int] = (),
    serving_from: int | None = None,
) -> PrunePlan:
    """What pruning ``run_id`` to ``keep`` versions would delete, keeping besides what retention
    always keeps the ``protect`` versions and every version from ``serving_from`` upward (the
    lowest version a replica serves: what replicas may still serve or stage). Reads the store,
    changes nothing."""
    keep = check_keep(keep)
    streams = streams_of(store, run_id)
    protect = set(protect)
    if serving_from is not None:
        protect |= {v for s in streams.values() for v in s.versions if v >= serving_from}
    kept = retained(streams, keep, protect=protect)
    delete = {f: tuple(sorted(set(s.versions) - kept[f])) for f, s in streams.items()}
    plan_refs = [VersionRef(run_id, f, v) for f, vs in delete.items() for v in vs]
    return PrunePlan(
        run_id=run_id,
        keep=keep,
        kept={f: tuple(sorted(v)) for f, v in kept.items()},
        delete={f: v for f, v in delete.items() if v},
        bytes_freed=bytes_freed(store, plan_refs),
    )


def bytes_freed(store: VersionStore, refs: Iterable[VersionRef]) -> int:
    """Bytes that deleting every version of ``refs`` frees: the sizes of their distinct files
    (inodes) whose every link lies in those versions."""
    seen: dict[tuple[int, int], list] = {}
    for ref in refs:
        for dirpath, _dirs, files in os.walk(Path(store.version_dir(ref))):
            for name in files:
                st = os.stat(Path(dirpath) / name)
                entry = seen.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])
                entry[0] += 1
    return sum(size for links, nlink, size in seen.values() if links >= nlink)


def apply_prune(store: VersionStore, plan: PrunePlan) -> list[VersionRef]:
    """Delete the plan's versions (newest first per format); returns those deleted, in order."""
    done = []
    for fmt, versions in plan.delete.items():
        for v in sorted(versions, reverse=True):
            ref = VersionRef(plan.run_id, fmt, v)
            store.delete(ref)
            done.append(ref)
    return done

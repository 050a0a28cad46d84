"""Which committed weight versions a run keeps: the pure rule behind pruning (no I/O).

Given, per format, the committed versions (each a :class:`Layer`: full or a delta over a base)
and the pointer, the number ``keep`` and versions to ``protect``, :func:`retained` returns per
format the versions that must stay; every other committed version may be deleted
(:mod:`weight_sync.prune` does it). A format keeps:

1. its pointer's version (what its replicas serve, stage and restart on);
2. every version above its pointer (a publish in progress, or a barrier publish whose other
   formats failed: :func:`weight_sync.publish.publish_checkpoint` may still advance it);
3. the run's newest ``keep`` versions (the highest ``keep`` numbers committed in any format,
   so a rollback target among them is whole in every format);
4. the ``protect`` versions it has (a replica's active version: what it serves, and what
   ``mixfleet validate`` reads for its group);
5. in ``bf16`` also every version 1-4 keeps in any other format: ``mixfleet validate`` compares
   a group's version with ``<run>/bf16/vN`` of the same N (``validate/target.py``), a
   ``--delta-of N`` publish merges into bf16's N (``weight_sync/delta.py`` ``merge_source``)
   and a perturbation or a new group's bootstrap converts from bf16's copy of the latest
   (``router/publishing.py`` ``perturb``, ``weight_sync/publish.py`` ``bootstrap``);
6. every base that a version it keeps resolves through (a delta's ``base_version``,
   transitively, within the same format: ``weight_sync.delta.version_files``).

A base a chain names but the format does not have is not invented (the chain is already broken,
:func:`weight_sync.delta.version_files` names it); a cycle ends the walk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

REFERENCE_FORMAT = "bf16"


@dataclass(frozen=True)
class Layer:
    """What retention needs of a committed version's manifest: its kind and base."""

    kind: str = "full"
    base_version: int | None = None


@dataclass(frozen=True)
class StreamView:
    """One format of a run: its committed versions (number -> :class:`Layer`) and its pointer."""

    versions: Mapping[int, Layer] = field(default_factory=dict)
    pointer: int | None = None


def retained(
    streams: Mapping[str, StreamView], keep: int, *, protect: Iterable[int] = ()
) -> dict[str, frozenset[int]]:
    """Per format of ``streams``, the committed versions to keep (the module docstring's rule).

    ``keep`` must be at least 1 (``ValueError`` otherwise; the commands refuse it earlier)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    protect = frozenset(protect)
    every = sorted({v for s in streams.values() for v in s.versions})
    newest = frozenset(every[-keep:])
    roots: dict[str, set[int]] = {}
    for fmt, s in streams.items():
        wanted = set(newest | protect)
        if s.pointer is not None:
            wanted.add(s.pointer)
            wanted.update(v for v in s.versions if v > s.pointer)
        roots[fmt] = wanted & s.versions.keys()
    if REFERENCE_FORMAT in streams:
        others = set().union(*roots.values())
        roots[REFERENCE_FORMAT] |= others & streams[REFERENCE_FORMAT].versions.keys()
    return {fmt: frozenset(_with_bases(streams[fmt].versions, r)) for fmt, r in roots.items()}


def _with_bases(versions: Mapping[int, Layer], roots: Iterable[int]) -> set[int]:
    """``roots`` and every committed base their delta chains resolve through."""
    out: set[int] = set()
    for v in roots:
        while v in versions and v not in out:
            out.add(v)
            layer = versions[v]
            if layer.kind != "delta" or layer.base_version is None:
                break
            v = layer.base_version
    return out


def to_delete(
    streams: Mapping[str, StreamView], keep: int, *, protect: Iterable[int] = ()
) -> dict[str, list[int]]:
    """Per format, the committed versions :func:`retained` does not keep, ascending."""
    kept = retained(streams, keep, protect=protect)
    return {fmt: sorted(set(s.versions) - kept[fmt]) for fmt, s in streams.items()}

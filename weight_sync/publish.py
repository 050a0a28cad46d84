"""Publish a BF16 checkpoint as version N of a run, converted once per weight format.

docs/architecture.md, "2. A weight version". The protocol, per call:

1. Plan: the formats to publish (each once, however many replicas serve it), refusing a version
   that is not newer than every format's pointer (pointers never move backwards) and a checkpoint
   whose tensors would differ from a format's current version (:mod:`weight_sync.layout`: an
   engine loads a version into the model it serves).
2. Convert: each format not already committed as N is converted from the checkpoint into a
   private staging directory of the store, the formats in parallel worker processes (the
   conversion is CPU-bound; ``workers`` processes share the cores, longest conversion first).
   The checkpoint may live anywhere the publisher can read, including the store's own
   filesystem (a trainer that wrote its checkpoint onto the volume hands over the path; nothing
   is uploaded or copied first).
3. Commit: ``store.commit`` makes each staged directory the immutable ``v{N:06d}`` (files and
   manifest fsynced first).
4. Advance: the pointers move to N. In **barrier** mode (default) no pointer moves until every
   format of N is committed, so no group can activate N while another cannot. In
   **per-format** mode each pointer moves as soon as its own format is committed.

Holds after any failure or kill, at any step: every pointer still names a committed, complete
version (the store's guarantee) and, in barrier mode, no pointer names N unless all formats of
N are committed. Staging directories of a killed publisher are private to the store and never
read. Publishing N again afterwards succeeds: formats already committed as N from the same
source are kept (the store refuses to replace a committed version with other bytes), the
others are converted again.

A **rollback** to M publishes a new number N whose content is M's, per format (files are
hard-linked where the filesystem allows, else copied): pointers still only move forward, and
replicas activate N like any other version.

Deltas: a manifest has ``kind`` ("full" | "delta") and ``base_version``. A delta version holds
only the files whose bytes differ from ``base_version``'s (same relative paths, same format)
plus its own manifest; every file not listed comes from the base. A replica stages a delta by
materializing base and delta layers into one directory (:mod:`weight_sync.stage`), so the
activation protocol is the same for both kinds. :func:`publish_delta` publishes a trainer's
delta checkpoint (only the changed tensors) this way; :mod:`weight_sync.delta` says how and
what it saves.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Literal

from core.errors import UserError
from core.formats import FORMATS
from core.process import process_alive
from weight_sync.manifest import Manifest
from weight_sync.store.base import VersionStore
from weight_sync.types import FormatRef, VersionRef

Mode = Literal["barrier", "per_format"]
MODES: tuple[str, ...] = ("barrier", "per_format")
MANIFEST_NAME = "manifest.json"

# Relative conversion cost, used only to start the slowest conversions first.
_COST = {"nvfp4": 3, "mxfp4": 3, "fp8": 2, "bf16": 1}


@dataclass(frozen=True)
class FormatResult:
    """What publishing one format of one version did, with its timings in seconds."""

    format: str
    version: int
    reused: bool  # already committed as this version from the same source: not converted again
    convert_s: float  # conversion inside its worker (0 when reused or copied)
    commit_s: float
    advance_s: float
    total_bytes: int
    tensor_count: int
    kind: str = "full"  # the committed manifest's kind ("delta": only files that differ from its base)


@dataclass(frozen=True)
class PublishResult:
    """A completed publication: every format's pointer names ``version``."""

    run_id: str
    version: int
    mode: str
    content_of: int | None  # for a rollback: the version whose content this one carries
    formats: tuple[FormatResult, ...]
    convert_wall_s: float  # first conversion start -> last conversion end (parallel)
    commit_wall_s: float
    advance_wall_s: float
    total_s: float

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "mode": self.mode,
            "content_of": self.content_of,
            "convert_wall_s": self.convert_wall_s,
            "commit_wall_s": self.commit_wall_s,
            "advance_wall_s": self.advance_wall_s,
            "total_s": self.total_s,
            "formats": [vars(f) | {} for f in self.formats],
        }


@dataclass
class _Pending:
    fmt: str
    staged: Path | None = None
    future: Future | None = None
    convert_s: float = 0.0
    reused: bool = False
    manifest: Manifest | None = None
    commit_s: float = 0.0
    advance_s: float = 0.0
    done: list[str] = field(default_factory=list)


Event = Callable[[str, dict], None]
"""``on_event(kind, info)``: the publisher's progress (see :func:`publish_checkpoint`)."""


def no_events(_kind: str, _info: dict) -> None:
    """An :data:`Event` callback that ignores every event (the default where nobody watches)."""
    return None


def check_formats(formats: Iterable[str]) -> tuple[str, ...]:
    """The distinct formats in first-seen order; raises ``UserError`` on an unknown one."""
    out = tuple(dict.fromkeys(formats))
    if not out:
        raise UserError("no weight formats to publish")
    unknown = [f for f in out if f not in FORMATS]
    if unknown:
        raise UserError(f"unknown weight format(s) {', '.join(unknown)} (known: {', '.join(FORMATS)})")
    return out


def latest_version(store: VersionStore, run_id: str, formats: Iterable[str]) -> int | None:
    """The highest pointer over ``formats`` (None when none was ever published)."""
    ptrs = [p for p in (store.read_pointer(FormatRef(run_id, f)) for f in formats) if p is not None]
    return max(ptrs) if ptrs else None


def next_version(store: VersionStore, run_id: str, formats: Iterable[str]) -> int:
    """One more than every pointer and every committed version of ``formats`` (1 for a new run)."""
    top = 0
    for f in formats:
        top = max(
            top, store.read_pointer(FormatRef(run_id, f)) or 0, *store.versions(FormatRef(run_id, f)), 0
        )
    return top + 1


def check_checkpoint(ckpt_dir: Path, *, delta: bool = False, where: str = "") -> Path:
    """``ckpt_dir`` resolved, or ``UserError`` naming what keeps it from being published: it does
    not exist, it is not a directory, it has no ``config.json`` (a full checkpoint; a trainer's
    ``delta`` holds only changed tensors) or no ``*.safetensors`` file. ``where`` ends the
    missing-path messages (the router says " on the router's filesystem")."""
    ckpt_dir = Path(ckpt_dir).expanduser()
    what = "delta directory" if delta else "checkpoint directory"
    try:
        if not ckpt_dir.exists():
            raise UserError(f"{what} {ckpt_dir} does not exist{where}")
        if not ckpt_dir.is_dir():
            raise UserError(f"{what} {ckpt_dir} is not a directory{where}")
        if not delta and not (ckpt_dir / "config.json").is_file():
            raise UserError(f"checkpoint directory {ckpt_dir} has no config.json (HF checkpoints need one)")
        if not any(ckpt_dir.glob("*.safetensors")):
            raise UserError(f"{what} {ckpt_dir} has no *.safetensors files")
        return ckpt_dir.resolve()
    except OSError as exc:  # a name too long, a directory it may not read, ...
        raise UserError(f"cannot read {what} {str(ckpt_dir)[:200]}{where}: {exc.strerror or exc}") from None


class VersionMissing(UserError):
    """``version`` of ``run_id`` is not committed in format ``fmt`` (a rollback's target)."""

    def __init__(self, run_id: str, version: int, fmt: str) -> None:
        super().__init__(
            f"cannot roll back run {run_id!r} to version {version}: no {fmt} version {version} "
            "(never published, or pruned from the store)"
        )
        self.run_id, self.version, self.format = run_id, version, fmt


def check_rollback_target(store: VersionStore, run_id: str, to_version: int, formats: Iterable[str]) -> None:
    """:class:`VersionMissing` unless ``to_version`` is committed in every one of ``formats`` (the
    content a rollback publishes again); its checksums are verified by :func:`rollback` itself."""
    for f in formats:
        if to_version not in store.versions(FormatRef(run_id, f)):
            raise VersionMissing(run_id, to_version, f)


def _begin(store: VersionStore, run_id: str, version: int, formats: Sequence[str]) -> None:
    """What every publication does first: refuse a version older than a pointer, and remove the
    staging directories a killed publisher left an hour or more ago (``clean_staging``)."""
    for f in formats:
        ptr = store.read_pointer(VersionRef(run_id, f, version).stream)  # validates the reference
        if ptr is not None and ptr > version:
            raise UserError(
                f"version {version} is older than run {run_id!r}'s current {f} version {ptr} "
                "(pointers never move backwards; publish a newer number or roll back with a new one)"
            )
    for f in formats:
        store.clean_staging(FormatRef(run_id, f))


# ---------------------------------------------------------------------------------------------
# Worker side (runs in a spawned process: top-level, picklable, imports inside)


def _init_worker(threads: int, started: SimpleQueue) -> None:
    import signal

    import torch

    started.put(os.getpid())  # the parent stops its workers by these pids (_shutdown)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the group: the parent stops its workers

    torch.set_num_threads(max(1, threads))


def _convert_job(src: str, dst: str, fmt: str, threads: int) -> float:
    """Convert ``src`` into ``dst`` in format ``fmt``; returns the seconds it took."""
    from weight_sync.convert import convert_checkpoint

    t0 = time.perf_counter()
    convert_checkpoint(Path(src), Path(dst), fmt, workers=threads, fsync=True)  # durable here, in parallel
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------


def _committed_from(store: VersionStore, ref: VersionRef) -> Manifest | None:
    if ref.version not in store.versions(ref.stream):
        return None
    return store.read_manifest(ref)


def publish_checkpoint(
    store: VersionStore,
    run_id: str,
    version: int,
    ckpt_dir: Path,
    formats: Iterable[str],
    *,
    mode: Mode = "barrier",
    workers: int | None = None,
    conversion_pool: ConversionPool | None = None,
    on_event: Event = no_events,
    delta_of: int | None = None,
) -> PublishResult:
    """Convert ``ckpt_dir`` once per format and publish it as ``version`` of ``run_id``.

    ``workers``: conversion processes started for this call (default: one per format, each
    with ``cores // processes`` torch threads); ``0`` converts in this process, one format at a
    time (no process start-up; for small models). ``conversion_pool``: a long-lived pool to use
    instead (a service that publishes repeatedly pays the worker start-up once).

    Before: ``ckpt_dir`` is an HF BF16 checkpoint; ``version`` is not older than any of the
    formats' pointers. After (on return): every format in ``formats`` has ``version``
    committed and its pointer names it. Raises ``UserError`` for bad input (no pointer has
    moved then, in either mode), :class:`~weight_sync.layout.LayoutMismatch` among it.
    ``on_event(kind, info)`` reports progress: ``convert_start``, ``converted``, ``committed``,
    ``advanced`` with ``{"format": ...}``.

    ``delta_of``: commit each format as a delta over that (committed, older) version: only the
    converted files that differ from its content (a format whose base has files the new version
    lacks is committed in full). ``ckpt_dir`` is still the full checkpoint; see
    :func:`publish_delta` for a trainer's delta of changed tensors.
    """
    from weight_sync.layout import check_layout

    formats = check_formats(formats)
    if mode not in MODES:
        raise UserError(f"unknown publish mode {mode!r} (known: {', '.join(MODES)})")
    ckpt_dir = check_checkpoint(ckpt_dir)
    _begin(store, run_id, version, formats)
    if delta_of is not None:
        check_delta_base(store, run_id, version, delta_of, formats, need_bf16=False)
    check_layout(store, run_id, ckpt_dir, formats)
    t_start = time.perf_counter()
    pending = _plan(store, run_id, version, ckpt_dir, formats)
    job = _Publication(store, run_id, version, mode, on_event, delta_of)
    t_conv0 = time.perf_counter()
    t_conv_end = _convert_and_commit(job, ckpt_dir, pending, workers, conversion_pool) or t_conv0
    t_adv0 = time.perf_counter()
    if mode == "barrier":
        for p in pending.values():
            _advance(store, run_id, version, p, on_event)
    t_end = time.perf_counter()
    return PublishResult(
        run_id=run_id,
        version=version,
        mode=mode,
        content_of=None,
        formats=tuple(_format_result(p, version) for p in pending.values()),
        convert_wall_s=t_conv_end - t_conv0,
        commit_wall_s=sum(p.commit_s for p in pending.values()),
        advance_wall_s=(t_end - t_adv0) if mode == "barrier" else sum(p.advance_s for p in pending.values()),
        total_s=t_end - t_start,
    )


@dataclass(frozen=True)
class _Publication:
    """What every step of one :func:`publish_checkpoint` call shares."""

    store: VersionStore
    run_id: str
    version: int
    mode: str
    on_event: Event
    delta_of: int | None


def _plan(
    store: VersionStore, run_id: str, version: int, ckpt_dir: Path, formats: Sequence[str]
) -> dict[str, _Pending]:
    """One pending entry per format: ``reused`` (with its manifest) when the format already has
    ``version`` committed from the same source; ``UserError`` when it has it from another."""
    pending = {f: _Pending(f) for f in formats}
    src_sum: str | None = None
    for f in formats:
        existing = _committed_from(store, VersionRef(run_id, f, version))
        if existing is None:
            continue
        if src_sum is None:
            src_sum = _converter_source_checksum(ckpt_dir)
        if existing.source_checksum != src_sum:
            raise UserError(
                f"version {version} of run {run_id!r} is already committed for {f} from another "
                "checkpoint (versions are immutable; publish a new number)"
            )
        pending[f].reused, pending[f].manifest = True, existing  # same content, either kind
    return pending


def _convert_and_commit(
    job: _Publication,
    ckpt_dir: Path,
    pending: dict[str, _Pending],
    workers: int | None,
    conversion_pool: ConversionPool | None,
) -> float | None:
    """Convert and commit every format not reused (in per-format mode advancing each pointer as
    soon as its format is committed, reused ones first); returns when the last conversion ended
    (None when none ran).
    The call's own pool is shut down on return; after a failure its workers, or those of the
    kept ``conversion_pool``, are stopped and the staged directories not committed are removed."""
    to_convert = [p for p in pending.values() if not p.reused]
    pool: Executor | None = None
    ok = False
    try:
        if to_convert:
            pool, threads = _executor(workers, conversion_pool, len(to_convert))
            for p in sorted(to_convert, key=lambda p: -_COST.get(p.fmt, 1)):
                p.staged = Path(job.store.staging_dir(VersionRef(job.run_id, p.fmt, job.version)))
                job.on_event("convert_start", {"format": p.fmt})
                p.future = pool.submit(_convert_job, str(ckpt_dir), str(p.staged), p.fmt, threads)
        if job.mode == "per_format":  # formats that need no conversion advance at once
            for p in pending.values():
                if p.reused:
                    _advance(job.store, job.run_id, job.version, p, job.on_event)
        t_end = _finish_conversions(job, ckpt_dir, to_convert)
        ok = True
        return t_end
    finally:
        if isinstance(pool, ProcessPoolExecutor):
            _shutdown(pool, terminate=not ok)
        elif pool is not None and conversion_pool is None:
            pool.shutdown(wait=ok, cancel_futures=True)
        elif not ok and conversion_pool is not None:
            conversion_pool.reset()  # stop conversions still running for this failed publish
        if not ok:  # a committed one was renamed away: what is left are partial conversions
            for p in to_convert:
                if p.staged is not None:
                    shutil.rmtree(p.staged, ignore_errors=True)


def _executor(workers: int | None, conversion_pool: ConversionPool | None, jobs: int) -> tuple[Executor, int]:
    """The executor of ``jobs`` conversions and the torch threads each gets: the kept pool's, one
    thread in this process (``workers == 0``: small models, tests), or a pool for this call."""
    if conversion_pool is not None:
        return conversion_pool, conversion_pool.threads
    if workers == 0:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert"), os.cpu_count() or 1
    n_workers = _worker_count(workers, jobs)
    threads = max(1, (os.cpu_count() or 1) // n_workers)
    return _process_pool(n_workers, threads), threads


def _finish_conversions(job: _Publication, ckpt_dir: Path, to_convert: list[_Pending]) -> float | None:
    """As each submitted conversion ends: reduce it to a delta (``job.delta_of``), commit it and,
    in per-format mode, advance its pointer. Returns when the last conversion ended (None when
    there was none); a conversion's error is a ``UserError`` naming the format."""
    t_end: float | None = None
    futures = {p.future: p for p in to_convert}
    for done in _as_completed(list(futures)):
        p = futures[done]
        try:
            p.convert_s = done.result()
        except UserError:
            raise
        except Exception as exc:  # the converter's own errors are user-facing messages
            raise UserError(f"converting {ckpt_dir} to {p.fmt} failed: {exc}") from exc
        t_end = time.perf_counter()
        job.on_event("converted", {"format": p.fmt, "seconds": p.convert_s})
        if job.delta_of is not None:
            from weight_sync.delta import reduce_to_delta

            reduce_to_delta(job.store, VersionRef(job.run_id, p.fmt, job.delta_of), p.staged)
        _commit(job.store, job.run_id, job.version, p, job.on_event)
        if job.mode == "per_format":
            _advance(job.store, job.run_id, job.version, p, job.on_event)
    return t_end


def _format_result(p: _Pending, version: int) -> FormatResult:
    return FormatResult(
        format=p.fmt,
        version=version,
        reused=p.reused,
        convert_s=p.convert_s,
        commit_s=p.commit_s,
        advance_s=p.advance_s,
        total_bytes=p.manifest.total_bytes if p.manifest else 0,
        tensor_count=p.manifest.tensor_count if p.manifest else 0,
        kind=p.manifest.kind if p.manifest else "full",
    )


def publish_delta(
    store: VersionStore,
    run_id: str,
    version: int,
    delta_dir: Path,
    base_version: int,
    formats: Iterable[str],
    **kwargs,
) -> PublishResult:
    """Publish a trainer's delta checkpoint as ``version``: ``delta_dir`` holds ``*.safetensors``
    with only the BF16 tensors that changed since ``base_version`` (HF names, the base's dtypes
    and shapes).

    Before: ``base_version`` is committed in every format and in bf16 (the content the delta
    applies to). After: as :func:`publish_checkpoint` (same ``kwargs``), every format's version
    ``version`` being a delta over ``base_version`` whose staged content is byte for byte what a
    full publish of the merged checkpoint gives (:mod:`weight_sync.delta`). Bad input (a tensor
    the base lacks, another shape or dtype, NaN or Inf, no bf16 copy of the base) raises
    ``UserError``, naming the delta's file where it is one tensor's fault, before anything is
    converted or any pointer moves.
    """
    import tempfile

    from weight_sync.delta import merge_source

    formats = check_formats(formats)
    _begin(store, run_id, version, formats)
    check_delta_base(store, run_id, version, base_version, formats)
    root = getattr(store, "root", None)
    tmp = Path(tempfile.mkdtemp(prefix=".delta-source-", dir=root))
    try:
        merge_source(store, run_id, base_version, Path(delta_dir), tmp)
        return publish_checkpoint(store, run_id, version, tmp, formats, delta_of=base_version, **kwargs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_delta_base(
    store: VersionStore,
    run_id: str,
    version: int,
    base: int,
    formats: Sequence[str],
    *,
    need_bf16: bool = True,
) -> None:
    """``UserError`` unless ``base`` is older than ``version`` and committed in every format (and,
    with ``need_bf16``, as bf16: the content a trainer's delta applies to)."""
    if base >= version:
        raise UserError(f"a delta's base must be an older version: base {base}, version {version}")
    needed = list(dict.fromkeys([*formats, *(["bf16"] if need_bf16 else [])]))
    missing = [f for f in needed if base not in store.versions(FormatRef(run_id, f))]
    if missing:
        raise UserError(
            f"cannot publish a delta over version {base} of run {run_id!r}: it has no "
            f"{', '.join(missing)} version {base}"
            + (" (a delta applies to the base's bf16 copy)" if "bf16" in missing else "")
        )


def bootstrap(
    store: VersionStore,
    run_id: str,
    base_ckpt: Path,
    formats: Iterable[str],
    *,
    workers: int | None = None,
    on_event: Event = no_events,
) -> dict[str, int]:
    """Make every format of ``formats`` have a pointer, for a fleet that starts (``mixfleet up``).

    A run with no pointer at all gets ``base_ckpt`` published as version 0. A format added to a
    run that already serves version L (a new group) gets L's content converted from the run's
    bf16 copy of L (or ``base_ckpt`` when the run keeps no bf16 copy and L is 0), committed as
    L for that format only. Returns each format's pointer (the version its engines start at).
    Idempotent.
    """
    formats = check_formats(formats)
    latest = latest_version(store, run_id, formats)
    if latest is None:
        publish_checkpoint(store, run_id, 0, base_ckpt, formats, workers=workers, on_event=on_event)
    else:
        missing = [f for f in formats if store.read_pointer(FormatRef(run_id, f)) is None]
        if missing:
            from weight_sync.delta import whole_content

            source = VersionRef(run_id, "bf16", latest)
            if latest in store.versions(source.stream):
                with whole_content(store, source) as content:  # a delta's is linked whole
                    publish_checkpoint(
                        store, run_id, latest, content, missing, workers=workers, on_event=on_event
                    )
            elif latest == 0:
                publish_checkpoint(
                    store, run_id, 0, Path(base_ckpt), missing, workers=workers, on_event=on_event
                )
            else:
                raise UserError(
                    f"run {run_id!r} serves version {latest} but keeps no bf16 copy of it to convert "
                    f"for {', '.join(missing)}; publish a new version for every format"
                )
    return {f: store.read_pointer(FormatRef(run_id, f)) for f in formats}  # type: ignore[misc]


def rollback(
    store: VersionStore,
    run_id: str,
    to_version: int,
    formats: Iterable[str],
    *,
    version: int | None = None,
    on_event: Event = no_events,
) -> PublishResult:
    """Publish a new version whose content, per format, is ``to_version``'s (barrier mode).

    Before: ``to_version`` is committed and verifies in every format. After: every format's
    pointer names the new number (``version``, default :func:`next_version`), whose files
    equal ``to_version``'s. Raises ``UserError`` when ``to_version`` is missing or corrupt in
    some format (then no pointer moved).
    """
    formats = check_formats(formats)
    new = next_version(store, run_id, formats) if version is None else version
    _begin(store, run_id, new, formats)
    t_start = time.perf_counter()
    pending = {f: _Pending(f) for f in formats}
    check_rollback_target(store, run_id, to_version, formats)
    for f in formats:
        try:
            store.verify(VersionRef(run_id, f, to_version))
        except Exception as exc:
            raise UserError(f"cannot roll back to version {to_version}: {f} copy is corrupt: {exc}") from exc
    for f in formats:
        p = pending[f]
        target, source = VersionRef(run_id, f, new), VersionRef(run_id, f, to_version)
        if new in store.versions(target.stream):
            existing = store.read_manifest(target)
            if existing.files != store.read_manifest(source).files:
                raise UserError(f"version {new} of run {run_id!r} already exists for {f} with other content")
            p.reused, p.manifest = True, existing
            continue
        p.staged = Path(store.staging_dir(target))
        link_tree(Path(store.version_dir(source)), p.staged, skip=(MANIFEST_NAME,))
        _restamp_manifest(Path(store.version_dir(source)), p.staged, new)
        _commit(store, run_id, new, p, on_event)
    t_adv0 = time.perf_counter()
    for p in pending.values():
        _advance(store, run_id, new, p, on_event)
    t_end = time.perf_counter()
    return PublishResult(
        run_id=run_id,
        version=new,
        mode="barrier",
        content_of=to_version,
        formats=tuple(
            FormatResult(
                p.fmt,
                new,
                p.reused,
                0.0,
                p.commit_s,
                p.advance_s,
                p.manifest.total_bytes if p.manifest else 0,
                p.manifest.tensor_count if p.manifest else 0,
            )
            for p in pending.values()
        ),
        convert_wall_s=0.0,
        commit_wall_s=sum(p.commit_s for p in pending.values()),
        advance_wall_s=t_end - t_adv0,
        total_s=t_end - t_start,
    )


# ---------------------------------------------------------------------------------------------


def link_tree(src: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> None:
    """Hard-link (or copy, across filesystems) every regular file of ``src`` into ``dst``."""
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_dir() or rel.as_posix() in skip:
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(p, dst / rel)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _restamp_manifest(src_dir: Path, staged: Path, version: int) -> None:
    Manifest.read(src_dir).with_version(version).write(staged, fsync=False)


def _commit(store: VersionStore, run_id: str, version: int, p: _Pending, on_event: Event) -> None:
    t0 = time.perf_counter()
    try:
        p.manifest = store.commit(VersionRef(run_id, p.fmt, version), p.staged)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"committing {p.fmt} version {version} failed: {exc}") from exc
    p.commit_s = time.perf_counter() - t0
    on_event("committed", {"format": p.fmt, "seconds": p.commit_s})


def _advance(store: VersionStore, run_id: str, version: int, p: _Pending, on_event: Event) -> None:
    t0 = time.perf_counter()
    ref = VersionRef(run_id, p.fmt, version)
    if store.read_pointer(ref.stream) != version:
        try:
            store.advance(ref)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"moving the {p.fmt} pointer to version {version} failed: {exc}") from exc
    p.advance_s = time.perf_counter() - t0
    on_event("advanced", {"format": p.fmt})


class ConversionPool(Executor):
    """Worker processes kept across publications (a publishing service owns one).

    ``workers`` processes with ``cores // workers`` torch threads each. ``warm()`` starts them
    (imports torch and the converter) ahead of the first publication. ``submit`` runs a call in
    them; a pool found broken when a call is submitted (its idle workers were killed from outside:
    the OOM killer, an operator) is replaced by new workers once: a pool one of whose workers is no
    longer a live child of this process, or that the executor already marked broken (it marks it
    only after its manager thread saw the death, which can come after the next submit). Thread-safe.
    """

    def __init__(self, workers: int | None = None) -> None:
        cores = os.cpu_count() or 1
        self.workers = max(1, workers if workers is not None else cores)
        self.threads = max(1, cores // self.workers)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_formats(cls, formats: int) -> ConversionPool:
        """A pool of one worker per core and at least one per format, so that no format of a
        publish waits for another's worker (conversions are partly disk-bound: bf16's is almost
        all writes and fsync, which overlap the quantized formats' compute)."""
        return cls(max(os.cpu_count() or 1, formats))

    def executor(self) -> ProcessPoolExecutor:
        """The pool, started if there is none; a pool that lost a worker is replaced first."""
        with self._lock:
            lost = self._pool if self._pool is not None and not _workers_alive(self._pool) else None
            if lost is not None or self._pool is None:
                self._pool = _process_pool(self.workers, self.threads)
            pool = self._pool
        self._stop(lost)
        return pool

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        pool = self.executor()
        try:
            return pool.submit(fn, *args, **kwargs)
        except BrokenProcessPool:  # a worker died; any call it ran has already failed with this
            self._replace(pool)
            return self.executor().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """:meth:`close` (``cancel_futures``: running calls are killed); it always joins."""
        self.close(terminate=cancel_futures)

    def warm(self) -> set[int]:
        """Start every worker and import the converter in it; returns, when they are ready, the
        process ids of the workers that were warmed (every one, unless some kept failing to
        start)."""
        warmed: set[int] = set()
        for _ in range(4):  # a worker may take two warm jobs while another starts: go again
            warmed.update(f.result() for f in [self.submit(_warm_job) for _ in range(self.workers)])
            if len(warmed) >= self.workers:
                break
        return warmed

    def reset(self) -> None:
        """Stop the workers (a failed publication's conversions); the next use starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        self._stop(pool)

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
        self._stop(broken)

    @staticmethod
    def _stop(pool: ProcessPoolExecutor | None) -> None:
        if pool is not None:
            _shutdown(pool, terminate=True)

    def close(self, *, terminate: bool = False) -> None:
        """Stop the workers and join them (after this no worker process, queue or semaphore of
        the pool is left): running conversions finish first, or with ``terminate`` are killed
        at once (a publication never depends on a conversion that did not return)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            _shutdown(pool, terminate=terminate, wait=True)


def _warm_job() -> int:
    """Convert a tiny model (the base policy's layout, :mod:`weight_sync.base_model`, one
    layer) into every format in this worker, so that the first real conversion finds torch, the
    converter, numba's compiled quantizer kernels (each loaded per process, for the very array
    types the converter passes) and nvfp4's calibration forward (the engine's kernels) ready."""
    import tempfile

    import torch

    from weight_sync.base_model import Preset, write_model
    from weight_sync.convert import convert_checkpoint

    tiny = Preset(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=128,
                  intermediate_size=128, max_position_embeddings=512, shards=1)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="mixfleet-warm-") as tmp:
        src = write_model(Path(tmp) / "src", tiny)
        for fmt in FORMATS:
            convert_checkpoint(src, Path(tmp) / fmt, fmt, workers=torch.get_num_threads())
    return os.getpid()


@dataclass
class _Started:
    """The pids a pool's workers put on ``queue`` as they started (:func:`_init_worker`)."""

    queue: SimpleQueue
    pids: set[int] = field(default_factory=set)

    def drain(self) -> set[int]:
        while not self.queue.empty():
            self.pids.add(self.queue.get())
        return self.pids


_STARTED: weakref.WeakKeyDictionary[ProcessPoolExecutor, _Started] = weakref.WeakKeyDictionary()


def _workers_alive(pool: ProcessPoolExecutor) -> bool:
    """Whether every worker ``pool`` started is still a live child of this process
    (``multiprocessing.active_children`` reaps the dead ones) and still exists: a child that the
    executor's manager thread has just reaped stays listed by ``active_children`` (its ``waitpid``
    fails, which ``multiprocessing`` reads as still running) until that thread records its exit."""
    started = _STARTED.get(pool)
    if started is None:
        return True
    live = {proc.pid for proc in multiprocessing.active_children()}
    return all(pid in live and process_alive(pid) for pid in started.drain())


def _process_pool(workers: int, threads: int) -> ProcessPoolExecutor:
    context = multiprocessing.get_context("spawn")
    started = context.SimpleQueue()  # each worker puts its pid as it starts
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(threads, started)
    )
    _STARTED[pool] = _Started(started)
    return pool


def _worker_count(workers: int | None, jobs: int) -> int:
    """One process per format to convert (``workers`` caps it): formats never queue behind one
    another, even on fewer cores, since conversions are partly disk-bound."""
    return max(1, jobs if workers is None else min(jobs, workers))


def _as_completed(futures: list[Future]):
    from concurrent.futures import as_completed

    return as_completed(futures)


def _shutdown(pool: ProcessPoolExecutor, *, terminate: bool, wait: bool | None = None) -> None:
    """Shut ``pool`` down (``wait``: join its workers; default: unless ``terminate``); with
    ``terminate`` its workers still running (a conversion, after a failure elsewhere) are stopped
    first: the live children of this process whose pids its workers reported as they started."""
    started = _STARTED.pop(pool, None)
    pids = set() if started is None else started.drain()
    if terminate:
        for proc in multiprocessing.active_children():
            if proc.pid in pids:
                with contextlib.suppress(OSError):
                    proc.terminate()
    pool.shutdown(wait=not terminate if wait is None else wait, cancel_futures=True)
    if started is not None:
        started.queue.close()


def _converter_source_checksum(ckpt_dir: Path) -> str:
    """The content checksum the converter records in manifests for ``ckpt_dir``."""
    from weight_sync.convert import source_checksum

    return source_checksum(ckpt_dir)

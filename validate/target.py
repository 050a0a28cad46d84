"""What ``mixfleet validate`` checks a group against: the group as the live fleet describes it.

A :class:`GroupTarget` joins, for one group, the router's weight status (``GET /v1/weights``:
format, desired version, replicas and their active versions), the preset's fields the router
publishes with its ledger (``GET /v1/ledger``: accelerator, KV-cache dtype), each replica's
sidecar status (``/v1/status``, ``clients.sidecar``: the engine URL) and the version store on
this machine: the directory of the group's active version and the trainer's BF16 weights of that version
(``<store>/<run>/bf16/vN``, which a run keeps whenever it serves or publishes bf16, or the
``--checkpoint`` override).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import UserError
from validate import engine_calls
from weight_sync.store.local import LocalStore
from weight_sync.types import VersionRef


@dataclass(frozen=True)
class ReplicaTarget:
    replica_id: str
    url: str
    active_version: int | None
    engine_url: str | None


@dataclass(frozen=True)
class GroupTarget:
    name: str
    format: str
    accelerator: str | None
    kv_cache_dtype: str | None
    run_id: str
    version: int | None
    replicas: tuple[ReplicaTarget, ...]
    version_dir: Path | None
    bf16_dir: Path | None
    staleness: int | None


def discover(
    client: Any,
    store_root: Path | None,
    groups: list[str] | None,
    checkpoint: Path | None,
    scratch: Path | None = None,
) -> list[GroupTarget]:
    """The chosen groups (default: all) of the fleet behind ``client`` (``clients.router.WeightsClient``).

    Raises ``UserError`` naming an unknown group, a ``store_root`` that is not a directory, or
    when nothing is published.
    """
    if store_root is not None and not Path(store_root).is_dir():
        raise UserError(f"--store {store_root}: not a directory (the fleet's version store is needed here)")
    status = client.status()
    if status.get("latest_version") is None:
        raise UserError("nothing is published yet: publish a version before validating")
    ledger = client.call("GET", "/v1/ledger")  # the preset's fields, as the router serves them
    specs = {g["name"]: g for g in ledger.get("groups", [])}
    names = [g["group"] for g in status["groups"]]
    unknown = sorted(set(groups or []) - set(names))
    if unknown:
        raise UserError(f"unknown group(s) {', '.join(unknown)} (the fleet has {', '.join(names)})")
    store = LocalStore(store_root) if store_root is not None else None
    run_id = status["run_id"]
    out = []
    for g in status["groups"]:
        if groups and g["group"] not in groups:
            continue
        reps = tuple(_replica(r) for r in g["replicas"] if r.get("fresh", True))
        versions = {r.active_version for r in reps}
        version = versions.pop() if len(versions) == 1 else g.get("desired_version")
        spec = specs.get(g["group"], {})
        out.append(
            GroupTarget(
                name=g["group"],
                format=g["format"],
                accelerator=spec.get("accelerator"),
                kv_cache_dtype=spec.get("kv_cache_dtype"),
                run_id=run_id,
                version=version,
                replicas=reps,
                version_dir=version_content(store, run_id, g["format"], version, scratch),
                bf16_dir=checkpoint
                if checkpoint is not None
                else version_content(store, run_id, "bf16", version, scratch),
                staleness=status.get("max_version_lag"),
            )
        )
    return out


def version_content(
    store: LocalStore | None, run_id: str, fmt: str, version: int | None, scratch: Path | None
) -> Path | None:
    """The directory holding ``fmt`` version ``version``'s whole content and its manifest (None
    when the store has no such version, or without a ``scratch`` for a delta version):
    :func:`weight_sync.stage.loadable_dir`, a delta staged under ``scratch``."""
    if store is None or version is None:
        return None
    ref = VersionRef(run_id, fmt, version)
    d = Path(store.version_dir(ref))
    if not d.is_dir():
        return None
    if store.read_manifest(ref).kind != "delta":
        return d
    from weight_sync.stage import loadable_dir

    return None if scratch is None else loadable_dir(store, ref, scratch / fmt)


def _replica(r: dict[str, Any]) -> ReplicaTarget:
    status = engine_calls.sidecar_status(r["url"]) or {}  # no answer: level 3 runs without the engine
    return ReplicaTarget(r["replica_id"], r["url"], r.get("active_version"), status.get("engine_url"))

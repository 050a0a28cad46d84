"""Level 1, precision contract: what the group is supposed to compute, stated and checked for consistency.

Read from the preset (as the router serves it: format, accelerator, KV-cache dtype) and from the
active version's ``manifest.json`` and ``config.json``: the weight format, its scale groups, the
exceptions (modules kept in higher precision, with the converter's reasons), the KV-cache dtype
and the allowed staleness (the router's ``--max-version-lag``, which ``GET /v1/weights`` serves;
unbounded without one). Fails on an
inconsistency (the manifest or the checkpoint declaring another format or version than the group
serves, scale groups other than the format's); names, as a note, a format the group's
accelerator does not run natively.
"""

from __future__ import annotations

import json
from typing import Any

from validate.level import LevelResult
from validate.target import GroupTarget
from weight_sync.formats import fp8, mxfp4, nvfp4
from weight_sync.manifest import Manifest, ManifestError

# Scale groups per format (weight_sync.formats): fp8 128x128 blocks, NVFP4 16 elements with an
# E4M3 scale and a float32 global scale, MXFP4 32 elements with an E8M0 scale.
SCALE_GROUPS = {"bf16": None, "fp8": [fp8.BLOCK, fp8.BLOCK], "nvfp4": nvfp4.GROUP, "mxfp4": mxfp4.BLOCK}

# Accelerators with tensor-core support for each format (NVIDIA's architecture pages: FP8 from
# Hopper/Ada, NVFP4 and MXFP4 from Blackwell). Anything else runs the format emulated.
NATIVE = {
    "bf16": None,  # every accelerator
    "fp8": ("H100", "H200", "H20", "L4", "L40S", "B200", "B300", "GB200"),
    "nvfp4": ("B200", "B300", "GB200"),
    "mxfp4": ("B200", "B300", "GB200"),
}


def _declared(cfg: dict[str, Any]) -> tuple[str, Any, list[str]]:
    """(format, scale groups, exception list) as ``config.json``'s ``quantization_config`` declares them."""
    qc = cfg.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8", qc.get("weight_block_size"), list(qc.get("ignored_layers", []))
    if method.startswith("modelopt") or str(qc.get("quant_algo", "")).upper() == "NVFP4":
        return "nvfp4", qc.get("group_size"), list(qc.get("exclude_modules", []))
    if method == "mxfp4":
        return "mxfp4", mxfp4.BLOCK, list(qc.get("modules_to_not_convert", []))
    return ("bf16", None, []) if not qc else (method or "unknown", None, [])


def native(fmt: str, accelerator: str | None) -> bool:
    kinds = NATIVE.get(fmt)
    if kinds is None:
        return True
    acc = (accelerator or "").upper().rstrip("!").split(":")[0].split("-")[0]
    return acc in kinds


def check(target: GroupTarget) -> LevelResult:
    """Level 1 for ``target``."""
    failures, notes = [], []
    if target.version is None:
        return LevelResult(1, False, "no replica serves a version", ("no replica serves a version",))
    versions = {r.active_version for r in target.replicas}
    if len(versions) > 1:
        failures.append(f"replicas serve different versions {sorted(versions, key=str)}")
    if target.version_dir is None:
        return LevelResult(
            1,
            False,
            f"version {target.version} not found in the store",
            (f"{target.format} version {target.version} not found in the store (--store)",),
        )
    try:
        manifest = Manifest.read(target.version_dir)
    except ManifestError as exc:
        return LevelResult(1, False, str(exc), (str(exc),))
    cfg = json.loads((target.version_dir / "config.json").read_text())
    declared, groups, exceptions = _declared(cfg)
    if manifest.format != target.format:
        failures.append(f"manifest format {manifest.format} != the group's {target.format}")
    if manifest.version != target.version:
        failures.append(f"manifest version {manifest.version} != the served version {target.version}")
    if declared != target.format:
        failures.append(f"config.json declares {declared}, the group serves {target.format}")
    elif groups != SCALE_GROUPS[target.format]:
        failures.append(f"scale groups {groups} != {target.format}'s {SCALE_GROUPS[target.format]}")
    if not native(target.format, target.accelerator):
        notes.append(
            f"{target.format} does not run natively on {target.accelerator or 'an unknown accelerator'}"
            + (" (the local CPU engine emulates it in float32)" if target.accelerator == "cpu" else "")
        )
    if target.staleness is None:
        notes.append(
            "allowed staleness: unbounded (the router runs without --max-version-lag: a lagging "
            "replica keeps receiving turns)"
        )
    contract = {
        "format": target.format,
        "accelerator": target.accelerator,
        "native": native(target.format, target.accelerator),
        "scale_groups": SCALE_GROUPS.get(target.format),
        "exceptions": exceptions,
        "unquantized_reasons": dict(manifest.unquantized),
        "kv_cache_dtype": target.kv_cache_dtype,
        "allowed_staleness": target.staleness,
        "version": target.version,
        "manifest": {
            "format": manifest.format,
            "version": manifest.version,
            "kind": manifest.kind,
            "tensors": manifest.tensor_count,
            "bytes": manifest.total_bytes,
        },
    }
    summary = (
        f"{target.format} (scale groups {SCALE_GROUPS.get(target.format)}), {len(exceptions)} modules kept "
        f"BF16, KV cache {target.kv_cache_dtype}, v{target.version}"
    )
    return LevelResult.checked(1, summary, failures, tuple(notes), details=contract)

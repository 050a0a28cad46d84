"""Level 2, quantizer and converter: the group's published version against the trainer's BF16 weights.

Two comparisons, tensor by tensor:

- representation: the BF16 checkpoint converted again here with the fleet's own converter
  (``weight_sync.convert.convert_checkpoint``, byte-exact and deterministic) must equal the
  published directory: the same tensor names, dtypes and shapes, the same packed codes and the
  same scale bytes, and the same ``quantization_config``. A difference names the tensor and what
  it holds (packed codes, scales, a BF16 copy);
- reconstruction: every quantized linear of the published version, dequantized with the
  formats' own dequantizers (``engine.model.loader.LinearWeight.weight``), is within the
  format's relative error bound of the BF16 weight (``validate.thresholds``):
  ``||dequant(W_q) - W|| / ||W||`` per tensor (Frobenius norms, float64).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from validate.level import LevelResult
from validate.target import GroupTarget
from validate.thresholds import bounds

_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale_2", ".weight_scale", ".weight_scales", ".input_scale")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open handles are not mappings
                out[k] = h.get_tensor(k)
    return out


def _what(name: str, t: torch.Tensor) -> str:
    if name.endswith(_SCALE_SUFFIXES):
        return "scales"
    if t.dtype in (torch.uint8, torch.float8_e4m3fn):
        return "packed codes"
    return "BF16 copy"


def _quant_config(directory: Path) -> Any:
    cfg = json.loads((directory / "config.json").read_text())
    return cfg.get("quantization_config")


def compare_representation(published: Path, reference: Path) -> tuple[list[str], dict[str, Any]]:
    """Failures (one line each) and counts comparing ``published`` with the re-conversion ``reference``."""
    pub, ref = _tensors(published), _tensors(reference)
    failures = []
    for name in sorted(set(ref) - set(pub)):
        failures.append(f"tensor {name} is missing from the published version")
    for name in sorted(set(pub) - set(ref)):
        failures.append(f"tensor {name} is in the published version but the converter does not write it")
    differ: dict[str, int] = {}
    for name in sorted(set(pub) & set(ref)):
        a, b = pub[name], ref[name]
        what = _what(name, b)
        if a.dtype != b.dtype or a.shape != b.shape:
            failures.append(
                f"tensor {name} ({what}): {a.dtype} {list(a.shape)} published, "
                f"{b.dtype} {list(b.shape)} expected"
            )
            continue
        if a.numel() and not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            n = int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())
            failures.append(f"tensor {name} ({what}): {n} bytes differ from the converter's output")
            differ[what] = differ.get(what, 0) + 1
    if _quant_config(published) != _quant_config(reference):
        failures.append("config.json quantization_config differs from the converter's")
    return failures, {"tensors": len(pub), "differing": differ}


def reconstruction_errors(published: Path, bf16: Path) -> dict[str, float]:
    """Per quantized linear of ``published``: ``||dequant - W|| / ||W||`` against ``bf16``."""
    from engine.model.loader import TensorSource, load_linear

    src = TensorSource(published)
    out = {}
    for name, w in _tensors(bf16).items():
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or w.dim() != 2 or not _quantized(src, prefix):
            continue
        try:
            dq = load_linear(src, prefix, (int(w.shape[0]), int(w.shape[1]))).weight.double()
        except ValueError:
            out[prefix] = float("inf")  # the representation comparison names why
            continue
        ref = w.double()
        out[prefix] = float(torch.linalg.norm(dq - ref) / max(float(torch.linalg.norm(ref)), 1e-30))
    return out


def _quantized(src: Any, prefix: str) -> bool:
    return any(prefix + s in src for s in _SCALE_SUFFIXES) or prefix + ".weight_blocks" in src


def check(target: GroupTarget) -> LevelResult:
    """Level 2 for ``target`` (its version directory and BF16 weights must be known)."""
    if target.version_dir is None or target.bf16_dir is None:
        missing = (
            "the group's version directory"
            if target.version_dir is None
            else f"the BF16 weights of version {target.version} (the store keeps no "
            f"{target.run_id}/bf16/v{target.version}: pass --checkpoint)"
        )
        return LevelResult(2, False, f"cannot run: {missing} not found", (f"{missing} not found",))
    from weight_sync.convert import convert_checkpoint

    failures = []
    with tempfile.TemporaryDirectory(prefix="mixfleet-validate-") as tmp:
        ref = Path(tmp) / "reference"
        convert_checkpoint(target.bf16_dir, ref, target.format, workers=1)
        rep_failures, counts = compare_representation(target.version_dir, ref)
    failures += rep_failures
    errors = reconstruction_errors(target.version_dir, target.bf16_dir)
    bound = bounds(target.format).weight_rel_err
    over = {k: v for k, v in errors.items() if not v <= bound}
    for k, v in sorted(over.items(), key=lambda kv: -kv[1]):
        failures.append(f"{k}: reconstructed weight relative error {v:.3g} > {bound:.3g}")
    worst = max(errors.items(), key=lambda kv: kv[1]) if errors else (None, 0.0)
    summary = (
        f"{counts['tensors']} tensors, {len(errors)} quantized linears; worst relative error "
        f"{worst[1]:.3g} ({worst[0]}) vs bound {bound:.3g}"
        if errors
        else f"{counts['tensors']} tensors, no quantized linear (BF16 copies compared byte for byte)"
    )
    return LevelResult.checked(
        2,
        summary,
        failures,
        details={
            "tensors": counts["tensors"],
            "differing": counts["differing"],
            "bound": bound,
            "worst": {"linear": worst[0], "rel_err": worst[1]},
        },
        plot={"rel_err": errors, "bound": bound},
    )

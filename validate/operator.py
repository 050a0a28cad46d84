"""Level 3, one operator: BF16 vs the QDQ reference vs the group's engine, on a sample of linears.

The sample: per decoder layer its ``o_proj``, and for an MoE layer the ``gate_proj`` and
``down_proj`` of its first and last expert (a dense layer: its MLP's). The input is a fixed
random ``[8, K]`` matrix (seeded, unit variance).

- BF16: ``x @ W.T`` with the trainer's BF16 weight (float64).
- QDQ reference, written here from the formats' definitions: the published weight dequantized
  (``weight_sync.formats``), the input quantized and dequantized as the format's group computes
  it (fp8 W8A8: per token per 128 channels, e4m3 with scale ``amax / 448``; nvfp4 W4A4: per 16
  channels with the checkpoint's static ``input_scale``, E4M3 block scales and E2M1 codes;
  mxfp4 W4A16 and bf16: the input as is), then the product in float64.
- The engine: the local engine's ``POST /debug/operator`` runs the same linear of the files it
  serves with its own kernels. SGLang has no such route (docs/sglang-contract.md), so on an
  SGLang group the level compares the QDQ reference with BF16 only and says so.

QDQ vs BF16 separates quantization error (bounded per format) from engine vs QDQ: kernel,
layout or accumulation error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from validate import engine_calls
from validate.level import LevelResult
from validate.target import GroupTarget
from validate.thresholds import bounds

ROWS = 8
SEED = 1234


def sample_names(config: dict) -> list[str]:
    """The linears level 3 runs, from ``config.json``."""
    names = []
    experts = int(config.get("num_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        names.append(p + "self_attn.o_proj")
        if experts and i not in dense_only and (i + 1) % step == 0:
            for e in sorted({0, experts - 1}):
                names += [f"{p}mlp.experts.{e}.gate_proj", f"{p}mlp.experts.{e}.down_proj"]
        else:
            names += [p + "mlp.gate_proj", p + "mlp.down_proj"]
    return names


def qdq_fp8_activations(x: torch.Tensor) -> torch.Tensor:
    """Per token per 128 channels: e4m3 with scale ``max(amax, 1e-10) / 448`` (SGLang's
    ``per_token_group_quant_fp8``), dequantized."""
    m, k = x.shape
    out = torch.empty_like(x)
    for a in range(0, k, 128):
        blk = x[:, a : a + 128]
        s = blk.abs().amax(dim=1, keepdim=True).clamp_min(1e-10) / 448.0
        out[:, a : a + 128] = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return out


def qdq_nvfp4_activations(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """Per 16 channels with the static ``input_scale`` (FlashInfer's ``ref_fp4_quant``, see
    ``engine.model.act_nvfp4``'s docstring), dequantized: ``E2M1(q) * sf8 * input_scale``."""
    from weight_sync.formats import fp4

    gs = np.float32(1.0) / np.float32(input_scale)
    m, k = x.shape
    blocks = x.float().reshape(m, k // 16, 16)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    sf = (float(gs) * (amax * np.float32(1.0 / 6.0))).clamp(max=448.0)
    sf8 = sf.to(torch.float8_e4m3fn).float()
    inv = torch.where(sf8 > 0, 1.0 / (sf8 * np.float32(1.0 / gs)), torch.zeros_like(sf8))
    q = (blocks * inv).clamp(-6.0, 6.0)
    codes = fp4.encode(q, negative_zero_sign=False)
    return (fp4.decode(codes) * sf8 * np.float32(input_scale)).reshape(m, k)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.linalg.norm(a.double() - b.double()) / max(float(torch.linalg.norm(b.double())), 1e-30)
    )


def run_one(
    published: Path, bf16: Path, name: str, x: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(stored format, BF16 output, QDQ reference output) of linear ``name`` on ``x``."""
    from engine.model.loader import TensorSource

    w_ref = TensorSource(bf16).get(name + ".weight").double()
    lw = _published_linear(published, name, tuple(w_ref.shape))
    xq = x
    if lw.fmt == "fp8":
        xq = qdq_fp8_activations(x)
    elif lw.fmt == "nvfp4":
        xq = qdq_nvfp4_activations(x, float(lw.tensors[3]))
    return lw.fmt, x.double() @ w_ref.T, xq.double() @ lw.weight.double().T


def _published_linear(published: Path, name: str, shape: tuple[int, ...]):
    from engine.model.loader import TensorSource, load_linear

    return load_linear(TensorSource(published), name, (int(shape[0]), int(shape[1])))


def check(target: GroupTarget) -> LevelResult:
    """Level 3 for ``target``."""
    import json

    assert target.version_dir is not None and target.bf16_dir is not None  # level 1 and 2 passed
    b = bounds(target.format)
    config = json.loads((target.bf16_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(SEED)
    rows, failures, notes = [], [], []
    engines = [r for r in target.replicas if r.engine_url]
    for name in sample_names(config):
        x = torch.randn(ROWS, _shape(target.bf16_dir, name)[1], generator=gen, dtype=torch.float32)
        fmt, bf, qdq = run_one(target.version_dir, target.bf16_dir, name, x)
        row = {"linear": name, "stored": fmt, "qdq_vs_bf16": _rel(qdq, bf)}
        if fmt != "bf16" and row["qdq_vs_bf16"] > b.qdq_rel_err:
            failures.append(
                f"{name}: QDQ reference vs BF16 relative error {row['qdq_vs_bf16']:.3g} "
                f"> {b.qdq_rel_err:.3g} (quantization)"
            )
        for r in engines:
            out = engine_calls.operator(r.engine_url, name, x)
            if out is None:
                continue
            err = _rel(out, qdq)
            row.setdefault("engine_vs_qdq", {})[r.replica_id] = err
            if err > b.kernel_rel_err:
                failures.append(
                    f"{r.replica_id}: {name}: engine vs QDQ reference relative error {err:.3g} "
                    f"> {b.kernel_rel_err:.3g} (kernel, layout or accumulation)"
                )
        rows.append(row)
    if not any("engine_vs_qdq" in r for r in rows):
        notes.append(
            "no engine of the group serves /debug/operator (SGLang has none): QDQ reference vs BF16 only"
        )
    worst_q = max((r["qdq_vs_bf16"] for r in rows), default=0.0)
    worst_k = max((e for r in rows for e in r.get("engine_vs_qdq", {}).values()), default=None)
    summary = f"{len(rows)} linears: QDQ vs BF16 up to {worst_q:.3g} (bound {b.qdq_rel_err:.3g})" + (
        f", engine vs QDQ up to {worst_k:.2g} (bound {b.kernel_rel_err:.2g})" if worst_k is not None else ""
    )
    return LevelResult.checked(
        3,
        summary,
        failures,
        tuple(notes),
        details={
            "linears": rows,
            "bounds": {"qdq_rel_err": b.qdq_rel_err, "kernel_rel_err": b.kernel_rel_err},
        },
        plot={"linears": rows},
    )


def _shape(bf16: Path, name: str) -> tuple[int, ...]:
    from engine.model.loader import TensorSource

    return tuple(TensorSource(bf16).get(name + ".weight").shape)

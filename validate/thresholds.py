"""The one table of ``mixfleet validate``'s pass/fail bounds, per weight format, with their reasons.

Every level reads its bounds here (``bounds(fmt)``); nothing else in ``validate/`` holds a
threshold. The figures each bound is set against are recorded in docs/validate.md (the ``tiny``
preset) and in the commit that set them.
"""

from __future__ import annotations

from dataclasses import dataclass

from validate.live_update import TOLERANCE as LIVE_UPDATE_TOLERANCE


@dataclass(frozen=True)
class Bounds:
    """Pass/fail bounds of one format (see ``RATIONALE`` for each field's reason)."""

    weight_rel_err: float  # level 2: ||dequant(W_q) - W|| / ||W|| per linear
    qdq_rel_err: float  # level 3: QDQ reference output vs BF16 output, relative (Frobenius)
    kernel_rel_err: float  # level 3: engine output vs QDQ reference output, relative
    kl_k3_mean: float  # level 4: mean per-token k3 KL(group || BF16) over scored tokens
    dlogp_mean: float  # level 4: mean |log p_group - log p_bf16| in every position bucket
    support_min: float  # level 4: share of group-sampled tokens inside BF16's top-p nucleus
    route_agree_min: float  # level 5: per MoE layer, share of tokens with the same top-k expert set
    context_dlogp: float  # level 5: mean |d log p| per token, decode-time log-probs vs prefill scores
    live_update: float  # level 6: as ``weights verify`` (validate.live_update.TOLERANCE)


RATIONALE = {
    "weight_rel_err": "about 1.4x the RMS rounding error of the element code with its scale "
    "(E4M3: 3 mantissa bits, ~2.7%; NVFP4 E2M1 with E4M3 scales per 16, ~9.6%; MXFP4 E2M1 with "
    "power-of-two scales per 32, ~11.7%, measured on normal weights): a wrong scale or code "
    "moves a whole block by a factor, far outside it",
    "qdq_rel_err": "weight and activation quantization together (W8A8, W4A4, W4A16) on a random "
    "input: the weight error plus the activation error, with margin",
    "kernel_rel_err": "the engine and the QDQ reference compute the same products in another "
    "order (float32 accumulation, NVFP4's scale applied to the product): float32 rounding "
    "(~1.5e-7 measured in every format), plus, for quantized activations, a code rounded the "
    "other way at a tie",
    "kl_k3_mean": "about 4x the KL a format's own quantization causes on the tiny model (bf16 "
    "~1e-12, fp8 ~0.02, mxfp4 ~0.03, nvfp4 W4A4 ~0.2 with its static input scales): a wrong "
    "expert or layer raises it far more",
    "dlogp_mean": "about 2-3x the mean |d log p| of the format's own quantization (bf16 ~1e-6, "
    "fp8 ~0.1, mxfp4 ~0.16, nvfp4 ~0.55)",
    "support_min": "sampled tokens near the nucleus' edge may fall outside BF16's nucleus when "
    "probabilities move by quantization; a wrong model misses it far more often",
    "route_agree_min": "near-ties of the router's top-k flip under quantization for a few tokens; "
    "a layer whose input is wrong flips many",
    "context_dlogp": "decode and prefill are different computations (attention over one new row "
    "against the cache vs over the whole sequence; SGLang 0.5.23 fixes its split sizes and turns on "
    "batch-invariant ops only with --enable-deterministic-inference: "
    "layers/attention/flashinfer_backend.py 433-451, model_executor/model_runner.py 842-846), so "
    "their float32 results differ in the last bits; a quantized activation (FP8's per-token scale, "
    "NVFP4's E2M1 codes) or a near-tie top-k turns some of those into a different value, which then "
    "reaches every later token through the cache. Measured on the small model (960 tokens): mean "
    "5e-7 (bf16), 0.011 (fp8, KV fp8), 0.022 (nvfp4) per token, with single tokens up to 0.3. "
    "Bound: a tenth of level 4's dlogp_mean (request state may add at most a tenth of the "
    "mismatch the format is allowed); a cache that holds wrong keys or values moves every token "
    "by the model's whole scale",
    "live_update": "as weights verify: the perturbation's effect is exact up to kernel blocking",
}

_TABLE = {
    "bf16": Bounds(1e-6, 1e-5, 1e-5, 1e-4, 1e-3, 0.95, 0.97, 1e-4, LIVE_UPDATE_TOLERANCE["bf16"]),
    "fp8": Bounds(0.04, 0.08, 1e-3, 0.08, 0.3, 0.90, 0.90, 0.03, LIVE_UPDATE_TOLERANCE["fp8"]),
    "nvfp4": Bounds(0.13, 0.25, 1e-3, 0.6, 1.2, 0.80, 0.75, 0.12, LIVE_UPDATE_TOLERANCE["nvfp4"]),
    "mxfp4": Bounds(0.16, 0.25, 1e-5, 0.12, 0.5, 0.85, 0.80, 0.05, LIVE_UPDATE_TOLERANCE["mxfp4"]),
}


def bounds(fmt: str) -> Bounds:
    """The bounds of weight format ``fmt``; ``KeyError`` for a format the table lacks."""
    return _TABLE[fmt]


def table() -> dict[str, dict[str, float]]:
    """The whole table, JSON-able (the report prints it)."""
    return {fmt: b.__dict__.copy() for fmt, b in _TABLE.items()}

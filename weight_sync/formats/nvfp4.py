"""NVFP4 weights as NVIDIA ModelOpt exports them and SGLang's ``modelopt_fp4`` loads them.

Two-level scaling (ModelOpt ``NVFP4QTensor``): a per-tensor ``weight_scale_2`` and one
``float8_e4m3fn`` scale per 16 consecutive elements along K, E2M1 codes packed two per byte.

- ``weight_scale_2 = amax(|W|).float() / (6 * 448)`` (float32). Projections that SGLang fuses
  (q/k/v; gate/up of one MLP or expert) share one, from their joint amax: ``global_scale``.
- per group: ``s = amax_g.float() / (6 * weight_scale_2)``; ``s = 1.0`` where ``s == 0`` (an all-zero
  group, or one so small against the tensor's amax that the quotient underflows);
  ``s = clamp(s, min=2**-9)`` (smallest e4m3 subnormal, so no scale underflows to 0);
  ``weight_scale = s.to(float8_e4m3fn)`` (round to nearest even).
- codes: ``q = x.float() / (weight_scale.float() * weight_scale_2)`` then E2M1 round to nearest
  even, saturating at 6; sign bit iff ``q < 0`` (``-0.0`` gives 0x0). Low nibble = even index.
- ``input_scale`` (the activations' static global scale: SGLang 0.5.23 runs this format W4A4)
  = ``amax / (6 * 448)`` of the activations calibrated at that linear's input (ModelOpt's
  ``NVFP4QTensor.get_activation_scaling_factor``), see ``input_scale`` and the decision below;
  ``quantize`` of a weight alone returns 1.0 there (SGLang's fill value for a missing scale).

Activations: decision (read against the ``sglang 0.5.23`` wheel; paths relative to ``sglang/srt``).
The fleet starts SGLang with ``--quantization modelopt_fp4`` and no MoE or FP4-GEMM backend flag
(``images/sglang.py``). On B200/B300 (SM100 family) that runs:

- dense linears W4A4 with the checkpoint's static ``input_scale``: ``ModelOptFp4LinearMethod``
  picks ``quant_mode = "w4a4"`` unless ``SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16`` is set with the
  cutedsl GEMM backend (``layers/quantization/modelopt_quant.py`` 1785-1794, backend ``auto`` =
  ``flashinfer_cutedsl`` on SM100: ``layers/quantization/fp4_utils.py`` 149-160), and ``apply``
  always quantizes with ``fp4_quantize(x, 1 / input_scale.max())`` (1886-1914, 2094-2107): the
  per-token setting is not consulted for linears at all;
- MoE experts with ``flashinfer_trtllm`` (the Qwen3-MoE override on SM100,
  ``arg_groups/model_overrides/qwen3_moe.py`` 41, 78-90), also W4A4 with static scales
  ``w13_input_scale.max()`` / ``w2_input_scale.max()`` (``modelopt_quant.py`` 2768-2770;
  ``layers/moe/moe_runner/flashinfer_trtllm.py`` 1371-1400, 1506-1508, 587-610).

So the scales are calibrated in the conversion (option a; ``engine.model.calibrate``: a fixed
text in the checkpoint's tokenizer through the BF16 model, ModelOpt's max calibration). Rejected:
(b) dynamic per-token scales (``SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION``, an environment
variable, ``modelopt_quant.py`` 1514-1521): honoured only by the MoE runners
``flashinfer_trtllm(_routed)`` and cutedsl v2 (1477-1489, ``flashinfer_trtllm.py`` 1476-1504),
never by the dense linears, which would still need calibrated scales; (c) W4A16
(``quant_algo: W4A16_NVFP4``, 1673-1701): linears become Marlin W4A16
(``ModelOptNvFp4A16LinearMethod``, 2186-2308), but with ``--quantization modelopt_fp4`` the
Qwen3-MoE override still selects ``flashinfer_trtllm`` for the experts, whose NVFP4 MoE method
never reads ``is_w4a16`` and runs them W4A4 with the 1.0 fill (2633-2648); it would need
``--moe-runner-backend marlin`` (or cutedsl with the W4A16 variable), and W4A16 keeps only
NVFP4's memory saving, not its FP4 tensor-core speed, so it is not what a production NVFP4 group
runs. W4A4 with calibrated static scales is, and its activation rounding is the mismatch the
fleet measures.

Every division above is an IEEE float32 division: what ModelOpt computes on CPU. (On a GPU,
torch turns ``tensor / python_float`` into a multiplication by the float32 reciprocal, so
ModelOpt's ``weight_scale_2`` there is ``amax * (1/2688)``, which differs in the last bit for
about one tensor in five.) Beyond ModelOpt: a tensor that is all zeros gets
``weight_scale_2 = 0``, scales 1.0 and zero codes (ModelOpt divides 0 by 0 there).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from weight_sync.formats import _common

GROUP = 16
FP8_MAX = 448.0
E2M1_MAX = 6.0
SCALE_MIN = 2.0**-9


_DIVISOR = np.float32(E2M1_MAX * FP8_MAX)  # 2688, exact in float32


def _scale_2_of(amax_bits: int) -> np.float32:
    """``amax / (6 * 448)`` as one IEEE float32 division, for the float32 bit pattern of amax."""
    return np.float32(_common.f32_of_bits(amax_bits)) / _DIVISOR


def _joint_amax_bits(ws: tuple[torch.Tensor, ...], where: str) -> int:
    """The float32 bit pattern of the exact ``max |x|`` over every element of ``ws`` (NaN/Inf raise)."""
    top = 0
    for w in ws:
        w = _common.check_weight(w, where)
        bits = _common.abs_max_bits(w)
        _common.raise_if_nonfinite(bits, w, where)
        top = max(top, bits)
    return top


def global_scale(*ws: torch.Tensor) -> torch.Tensor:
    """``weight_scale_2`` shared by ``ws``: their joint ``amax(|W|)`` / (6 * 448), float32 0-dim.

    Pass every tensor that SGLang fuses into one projection. NaN/Inf or non-float inputs raise
    ``ValueError``; no tensors at all raise ``ValueError``.
    """
    if not ws:
        raise ValueError("nvfp4.global_scale: needs at least one tensor")
    return torch.tensor(_scale_2_of(_joint_amax_bits(ws, "nvfp4.global_scale")), dtype=torch.float32)


def _as_scale_2(value: object) -> np.float32:
    """A given ``weight_scale_2`` as a float32; ``ValueError`` unless finite, >= 0 and float32-exact."""
    where = "nvfp4.quantize"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"{where}: weight_scale_2 must be a one-element float tensor, got {_common.describe(value)}"
            )
        exact = float(value.detach().reshape(()).item())  # exact: float64 holds every float dtype's values
    elif isinstance(value, int | float) and not isinstance(value, bool):
        exact = float(value)
    else:
        raise ValueError(f"{where}: weight_scale_2 must be a tensor or a number, got {type(value).__name__}")
    if not (math.isfinite(exact) and 0 <= exact <= _F32_MAX) or float(np.float32(exact)) != exact:
        raise ValueError(f"{where}: weight_scale_2={exact!r} is not a finite non-negative float32")
    return np.float32(exact)


_F32_MAX = float(np.finfo(np.float32).max)


def _check_covers(ws2: np.float32, amax_bits: int, what: str) -> None:
    """``ValueError`` unless ``ws2 >= amax / (6 * 448)``, i.e. no group scale exceeds 448."""
    needed = _scale_2_of(amax_bits)
    if ws2 < needed:
        raise ValueError(
            f"nvfp4.quantize: weight_scale_2={float(ws2)!r} is smaller than amax/(6*448)={float(needed)!r} "
            f"of the tensor of {what}; compute it with nvfp4.global_scale over every tensor sharing it"
        )


def quantize(
    w: torch.Tensor,
    weight_scale_2: torch.Tensor | float | None = None,
    *,
    out: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """NVFP4 tensors of ``w`` (``[..., K]``, K a multiple of 16; bf16, f16 or f32).

    Returns ``weight`` uint8 ``[..., K/2]``, ``weight_scale`` float8_e4m3fn ``[..., K/16]``,
    ``weight_scale_2`` float32 0-dim and ``input_scale`` float32 0-dim (1.0: a weight alone has no
    activation range; the converter writes the calibrated one), bit-exact to the
    rules in the module docstring; ``weight`` and ``weight_scale`` are written into ``out``'s
    tensors of those names when given. ``weight_scale_2`` defaults to ``global_scale(w)``; a
    given one must be at least that (it comes from ``global_scale`` over a set containing ``w``).
    Bad shapes, dtypes, a mismatched ``out``, NaN/Inf or a too-small ``weight_scale_2`` raise
    ``ValueError``.
    """
    where = "nvfp4.quantize"
    w = _common.check_weight(w, where)
    _common.check_groups(w, GROUP, where)
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    res = _common.outputs(
        out,
        where,
        {
            "weight": ((*lead, k // 2), torch.uint8),
            "weight_scale": ((*lead, k // GROUP), torch.float8_e4m3fn),
        },
    )
    ws2 = (
        _scale_2_of(_joint_amax_bits((w,), where)) if weight_scale_2 is None else _as_scale_2(weight_scale_2)
    )
    quantize_bits(
        _common.bits(w),
        ws2,
        _common.as_array(res["weight"]),
        _common.as_array(res["weight_scale"]),
        what=_common.describe(w),
    )
    return {
        "weight": res["weight"],
        "weight_scale": res["weight_scale"],
        "weight_scale_2": torch.scalar_tensor(float(ws2), dtype=torch.float32),
        "input_scale": torch.scalar_tensor(1.0, dtype=torch.float32),
    }


def quantize_bits(
    x: np.ndarray,
    weight_scale_2: np.float32,
    packed: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    *,
    what: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``quantize`` on bits with a given ``weight_scale_2`` (float32, finite, >= 0): the
    array-level path (no torch), for callers that hold the weights' bits already (the converter).

    ``x``: flat float bit patterns (``uint16`` bfloat16 or ``uint32`` float32, see
    ``_common.bits``), a multiple of 16 of them. Returns ``packed`` (uint8 ``[len/2]``) and
    ``scales`` (uint8 ``[len/16]``: the float8_e4m3fn bytes), written into the arrays given or
    fresh ones. NaN/Inf, or a ``weight_scale_2`` below this tensor's amax / (6 * 448), raise
    ``ValueError`` naming the tensor as ``what``.
    """
    what = what or f"{x.size} values"
    ws2 = np.float32(weight_scale_2)
    packed = np.empty(x.size // 2, dtype=np.uint8) if packed is None else packed
    scales = np.empty(x.size // GROUP, dtype=np.uint8) if scales is None else scales
    if ws2 == 0:  # only for an all-zero tensor: scales 1.0, every code +0
        top = _common.abs_max_bits_of(x)
        scales.fill(_E4M3_ONE)
        packed.fill(0)
    else:
        six_ws2 = np.float32(E2M1_MAX) * ws2  # one float32 product, as ModelOpt
        kernel = _common.kernels().nvfp4_groups
        step = max(1, _common.CHUNK_ELEMENTS // GROUP)  # groups per task

        def task(g0: int, g1: int) -> int:
            return kernel(x[g0 * GROUP : g1 * GROUP], six_ws2, ws2, packed[g0 * 8 : g1 * 8], scales[g0:g1])

        top = int(max(_common.WORKERS.run_ranges(x.size // GROUP, step, task), default=0))
    _common.check_finite(top, "nvfp4.quantize", what)
    _check_covers(ws2, top, what)
    return packed, scales


_E4M3_ONE = 0x38  # float8_e4m3fn byte of 1.0


def input_scale(amax: float) -> np.float32:
    """The ``input_scale`` of activations whose calibrated ``max |x|`` is ``amax``: ``amax / (6 * 448)``
    as one IEEE float32 division of ``float32(amax)`` (ModelOpt's rule, as ``weight_scale_2``);
    1.0 where ``amax`` is 0 (any scale quantizes zeros exactly; ModelOpt refuses a zero scale).
    ``ValueError`` unless ``amax`` is finite and >= 0."""
    a = np.float32(amax)
    if not (np.isfinite(a) and a >= 0):
        raise ValueError(f"nvfp4.input_scale: activation amax {amax!r} is not a finite non-negative float32")
    return np.float32(1.0) if a == 0 else np.float32(a / _DIVISOR)


def check_layout(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, where: str
) -> None:
    """``ValueError`` (its message starting with ``where``) unless ``weight`` is uint8 ``[..., K/2]``
    with K a multiple of 16, ``weight_scale`` float8_e4m3fn ``[..., K/16]`` and ``weight_scale_2``
    one float."""
    if weight.dtype != torch.uint8 or weight.dim() < 1:
        raise ValueError(f"{where}: weight must be uint8 [..., K/2], got {_common.describe(weight)}")
    k = weight.shape[-1] * 2
    expected = [*weight.shape[:-1], k // GROUP]
    if k % GROUP or weight_scale.dtype != torch.float8_e4m3fn or list(weight_scale.shape) != expected:
        raise ValueError(
            f"{where}: weight_scale {_common.describe(weight_scale)} does not match weight "
            f"{_common.describe(weight)} (expected float8_e4m3fn {expected}, K a multiple of {GROUP})"
        )
    if (
        not isinstance(weight_scale_2, torch.Tensor)
        or not weight_scale_2.is_floating_point()
        or weight_scale_2.numel() != 1
    ):
        got = _common.describe(weight_scale_2) if isinstance(weight_scale_2, torch.Tensor) else "not a tensor"
        raise ValueError(f"{where}: weight_scale_2 must be one float (a one-element tensor), got {got}")


def dequantize(d: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 ``[..., K]`` from ``quantize``'s tensors: ``E2M1(code) * (scale.float() * weight_scale_2)``.

    The per-group factor is one float32 product, then one float32 product per element (ModelOpt's
    order). ``input_scale`` is ignored. Wrong dtypes or shapes raise ``ValueError``.
    """
    from weight_sync.formats.fp4 import decode_packed

    where = "nvfp4.dequantize"
    weight, scale, ws2 = _common.tensors(d, ("weight", "weight_scale", "weight_scale_2"), where)
    check_layout(weight, scale, ws2, where)
    k = weight.shape[-1] * 2
    factor = scale.float() * ws2.reshape(()).float()
    values = decode_packed(weight.contiguous()).view(*weight.shape[:-1], k // GROUP, GROUP)
    return values.mul_(factor.unsqueeze(-1)).view(*weight.shape[:-1], k)

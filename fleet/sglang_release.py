"""The SGLang release the fleet speaks, as pure protocol values: what the engine client, the local
engine and the image pin (:mod:`images.sglang`, which re-exports these) must agree on.

Every value was read from the released ``sglang 0.5.23`` wheel (``python/sglang/srt/...``); the
comment beside each names the file and lines. Nothing here imports modal or any engine.

Sampling masks (``return_sampling_mask``): the scheduler refuses a request unless its normalized
``top_k`` is 1 or ``1 < top_k <= --sampling-mask-max-tokens`` (managers/scheduler.py 3160-3182,
after sampling/sampling_params.py 245-250 turned temperature 0 into ``top_k = 1`` and ``top_k =
-1`` into :data:`TOP_K_ALL`). A turn that filters by ``top_p`` only is therefore sent with
``top_k = --sampling-mask-max-tokens`` (:func:`bound_top_k`): its support is the top-p nucleus cut
to that many tokens, which the turn's record states (``sampling.top_k_bound``). The pytorch
sampling backend the fleet runs zeroes every rank ``>= top_k`` (layers/sampler.py 823-826), so a
support never exceeds ``top_k`` and the bound itself cannot overflow the mask (a realized support
beyond the limit aborts the request with a 400: scheduler_components/batch_result_processor.py
1329-1339).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SGLANG_VERSION = "0.5.23"

# arg_groups/fields/exec_.py 182-188 ExecFeatures.sampling_mask_max_tokens (--sampling-mask-max-tokens).
SAMPLING_MASK_MAX_TOKENS_DEFAULT = 4096
# sampling/sampling_params.py 42-43: below this temperature a request is greedy; top_k -1 becomes
# TOP_K_ALL ("whole vocabulary").
SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30

# managers/io_struct.py 239-245 GenerateReqInput.sampling_logprobs_mode; managers/schedule_batch.py
# SamplingLogprobsMode = Literal["selected", "support"]. "selected": output_token_sampling_logprobs
# holds mu per token; "support": per token the log-probs of the whole support, aligned with
# output_token_sampling_mask (sampling/sampling_mask.py 37-51 SamplingMaskChunk.to_lists).
# Setting it without return_sampling_mask is refused (managers/tokenizer_manager.py 1431-1435).
SAMPLING_LOGPROBS_MODES = ("selected", "support")
SAMPLING_LOGPROBS_MODE = "support"  # what the engine client asks for

# managers/io_struct.py PauseGenerationReqInput.mode: Literal["abort", "retract", "in_place"] =
# "abort"; the fleet always sends in_place (requests keep their KV cache and resume).
PAUSE_MODES = ("abort", "retract", "in_place")
PAUSE_MODE = "in_place"

# meta_info keys of a /generate answer (managers/tokenizer_manager.py 2507-2566; the spans from
# utils/weight_versions.py 90-107 add_weight_versions_to_meta_info: [{"version": str, "start",
# "end"}], end exclusive, over output indices, and weight_version = the last span's version).
META_SAMPLING_MASK = "output_token_sampling_mask"
META_SAMPLING_LOGPROBS = "output_token_sampling_logprobs"
META_WEIGHT_VERSION = "weight_version"
META_WEIGHT_VERSIONS = "weight_versions"

# managers/schedule_batch.py 279-345 BaseFinishReason.to_json: {"type": "stop", "matched": token id,
# ids or string}, {"type": "length", "length": n}, {"type": "abort", "message", "status_code",
# "err_type"} (an abort echoed by the tokenizer manager, 3596-3601, carries only type and message).
FINISH_TYPES = ("stop", "length", "abort")


def mask_top_k_error(top_k: int, max_tokens: int = SAMPLING_MASK_MAX_TOKENS_DEFAULT) -> str | None:
    """SGLang's refusal of a sampling-mask request with normalized ``top_k`` (None: accepted), in
    its words (managers/scheduler.py 3172-3181)."""
    if top_k != 1 and not (1 < top_k <= max_tokens):
        return (
            "return_sampling_mask requires top_k=1 for greedy sampling "
            f"or finite 1 < top_k <= {max_tokens}; got top_k={top_k}. Lower top_k or increase "
            "--sampling-mask-max-tokens."
        )
    return None


def normalized_top_k(params: Mapping[str, Any]) -> int:
    """The ``top_k`` SGLang samples with for ``params`` (sampling_params.py 207-250): 1 when greedy
    (temperature below :data:`SAMPLING_EPS`), :data:`TOP_K_ALL` for a missing or -1 ``top_k``."""
    temperature = params.get("temperature")
    if temperature is not None and 0 <= temperature < SAMPLING_EPS:
        return 1
    top_k = params.get("top_k")
    return TOP_K_ALL if top_k is None or top_k == -1 else top_k


def bound_top_k(
    params: Mapping[str, Any], max_tokens: int = SAMPLING_MASK_MAX_TOKENS_DEFAULT
) -> tuple[dict[str, Any], int | None]:
    """``params`` as sent with a sampling mask, and the bound applied (None: sent as given).

    A request that samples (not greedy) with no finite ``top_k`` (missing, -1 or at least
    :data:`TOP_K_ALL`) gets ``top_k = max_tokens``; any other request, a finite ``top_k`` beyond
    ``max_tokens`` included (SGLang refuses it, naming the limit), is sent as given. After:
    ``normalized_top_k`` of the result is below :data:`TOP_K_ALL`. ValueError if ``max_tokens < 2``.
    """
    if max_tokens < 2:
        raise ValueError(f"sampling_mask_max_tokens must be >= 2, got {max_tokens}")
    out = dict(params)
    if normalized_top_k(params) < TOP_K_ALL:
        return out, None
    out["top_k"] = max_tokens
    return out, max_tokens

"""The SGLang release the fleet speaks -- the one pin of its number (:data:`SGLANG_VERSION`) -- as pure
protocol values: what the engine client, the local engine and the image (:mod:`images.sglang`,
which builds the release's image and command line on these) must agree on.

Every value was read from the released ``sglang 0.5.23`` wheel (``python/sglang/srt/...``); the
comment beside each names the file and lines. Nothing here imports modal or any engine.

Sampling masks (``return_sampling_mask``): the scheduler refuses a request unless its normalized
``top_k`` is 1 or ``1 < top_k <= --sampling-mask-max-tokens`` (managers/scheduler.py 3160-3182,
after sampling/sampling_params.py 245-250 turned temperature 0 into ``top_k = 1`` and ``top_k =
-1`` into :data:`TOP_K_ALL`). :func:`sampling_request` decides, per turn, what the engine client
asks (the one decision):

* greedy (temperature below :data:`SAMPLING_EPS`, or ``top_k = 1``): a mask; SGLang answers the
  one-token support with mu = 0 (layers/sampler.py 506-537).
* a finite ``top_k``: a mask, sent as given (beyond the limit SGLang refuses it, naming the limit).
* no finite ``top_k`` but ``top_p < 1`` or ``min_p > 0``: a mask with ``top_k =
  --sampling-mask-max-tokens`` (:func:`bound_top_k`): its support is the top-p / min-p candidate
  set cut to that many tokens, which the turn's record states (``sampling.top_k_bound``). The mask
  includes min-p filtering (pytorch backend: layers/sampler.py 830-836 zeroes ranks below
  ``min_p * max p`` before the capture; flashinfer: 407-434). The pytorch sampling backend the
  fleet runs zeroes every rank ``>= top_k`` (layers/sampler.py 823-826), so a support never exceeds
  ``top_k`` and the bound itself cannot overflow the mask (a realized support beyond the limit
  aborts the request with a 400: scheduler_components/batch_result_processor.py 1329-1339).
* no filter at all (:func:`whole_vocabulary`: sampling, no finite ``top_k``, ``top_p = 1``,
  ``min_p = 0``): no mask and no ``sampling_logprobs_mode`` (which SGLang refuses without a mask,
  managers/tokenizer_manager.py 1431-1435); sent unchanged, so it is sampled from the whole
  vocabulary as asked. Its support is the whole vocabulary (an empty record row) and mu is
  ``output_token_logprobs``: SGLang samples such a row from ``probs = softmax(logits / T)``
  (layers/sampler.py 225-229 ``simple_sampling_case``, 275 ``logits.div_(temperatures)``, 293-299,
  ``sampling_from_probs_torch`` 978-1004) and returns ``log(probs)`` of the same tensor (307-316,
  324-330; the top-k/top-p path of a batch it shares with filtered rows sorts a copy, 821, and
  with its ``top_k = TOP_K_ALL``, ``top_p = 1`` drops nothing beyond float32 rounding of the
  cumulative mass). That holds with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset, its default
  (environ.py 1508); set, the values are before temperature (layers/sampler.py 231-237,
  319-323), so a replica must not set it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.formats import FORMATS

SGLANG_VERSION = "0.5.23"

# arg_groups/fields/exec_.py 182-188 ExecFeatures.sampling_mask_max_tokens (--sampling-mask-max-tokens).
SAMPLING_MASK_MAX_TOKENS_DEFAULT = 4096
# sampling/sampling_params.py 42-43: below this temperature a request is greedy; top_k -1 becomes
# TOP_K_ALL ("whole vocabulary"). 207-210: a missing temperature is 1.0, top_p 1.0, top_k -1,
# min_p 0.0.
SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30

# managers/schedule_batch.py 163 INIT_INCREMENTAL_DETOKENIZATION_OFFSET: the detokenizer decodes an
# output after up to this many of the prompt's last ids (init_incremental_detokenize, 1788-1806).
DETOKENIZE_CONTEXT_IDS = 5
# environ.py 688 SGLANG_FORCE_STREAM_INTERVAL (default 50): an unstreamed request's output goes
# to the detokenizer every this many tokens before its finish
# (scheduler_components/output_streamer.py 49, 474-476).
FORCE_STREAM_INTERVAL = 50

# managers/io_struct.py 239-245 GenerateReqInput.sampling_logprobs_mode; managers/schedule_batch.py
# SamplingLogprobsMode = Literal["selected", "support"]. "selected": output_token_sampling_logprobs
# holds mu per token; "support": per token the log-probs of the whole support, aligned with
# output_token_sampling_mask (sampling/sampling_mask.py 37-51 SamplingMaskChunk.to_lists).
# Setting it without return_sampling_mask is refused (managers/tokenizer_manager.py 1431-1435).
SAMPLING_LOGPROBS_MODES = ("selected", "support")
SAMPLING_LOGPROBS_MODE = "support"  # what the engine client asks for

# managers/io_struct.py 1927-1946 PauseGenerationReqInput.mode: Literal["abort", "retract",
# "in_place"] = "abort". The fleet activates with "retract" (replica.activation): running requests go
# back to the waiting queue with their KV freed (managers/scheduler.py 5817-5932) and are
# re-prefilled, prompt and output so far, under the new weights on continue; so the running batch
# is empty and the flush that update_weights_from_disk runs by default succeeds while paused
# (scheduler.py 5518-5548: is_fully_idle(ignore_waiting=self._engine_paused)). "in_place" keeps the
# running batch, so that flush is refused under load (the io_struct docstring says so).
PAUSE_MODES = ("abort", "retract", "in_place")
PAUSE_MODE = "retract"

# managers/scheduler_components/weight_updater.py 120-133 flush_cache_after_weight_update: the
# message of an update refused only because its flush was (answered 400 by entrypoints/http_server.py
# 1299-1325). The weights WERE swapped and the scheduler recorded the new version (weight_updater.py
# 138-160, scheduler.py 5636-5655), but the tokenizer manager keeps /model_info on the old version
# (tokenizer_manager.py 2316-2322: only ``if success``). Several workers join their messages with
# " | " (tokenizer_manager.py 2386-2394), so a client looks for it inside the message.
UPDATE_NOT_FLUSHED_MESSAGE = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
UPDATE_NOT_FLUSHED_PREFIX = "Weights were updated, but the cache was not flushed"
# entrypoints/http_server.py 1025-1041 /flush_cache: 200 with this text when flushed, else 400 with
# the scheduler's message or "Flush cache failed.\n" (managers/scheduler_components/flush_wrapper.py
# 22-36: an immediate refusal carries no message).
FLUSH_OK_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_REFUSED_TEXT = "Flush cache failed.\n"
# managers/scheduler_components/flush_wrapper.py 22-60: a flush with ``?timeout=`` > 0 that finds
# the scheduler not fully idle (is_fully_idle() without ignore_waiting: waiting requests count even
# while paused) is deferred, and answered this, 400, when its timeout passes first (51-60). While
# one is deferred the scheduler answers any other flush "Another flush_cache is already in
# progress." (23-27), which HTTP does not reach with one tokenizer worker (the default,
# arg_groups/fields/serving.py 50-53): its tokenizer manager sends one flush at a time, a second
# waiting for the first's answer (tokenizer_control_mixin.py 130, 186-197; communicator.py 41-57).
FLUSH_TIMEOUT_MESSAGE = "Timed out waiting for idle state."

# meta_info keys of a /generate answer (managers/tokenizer_manager.py 2507-2566; the spans from
# utils/weight_versions.py 90-107 add_weight_versions_to_meta_info: [{"version": str, "start",
# "end"}], end exclusive, over output indices, and weight_version = the last span's version).
META_SAMPLING_MASK = "output_token_sampling_mask"
META_SAMPLING_LOGPROBS = "output_token_sampling_logprobs"
META_WEIGHT_VERSION = "weight_version"
META_WEIGHT_VERSIONS = "weight_versions"

# --- routed experts (R3) ---------------------------------------------------------------------------
# Request fields (managers/io_struct.py 263-268 GenerateReqInput): return_routed_experts (bool) and
# routed_experts_start_len (absolute start position; the answer covers positions
# [routed_experts_start_len, seqlen - 1), seqlen = prompt + output tokens; must be in [0, prompt
# tokens], else the request is aborted with the scheduler's message, managers/scheduler.py
# 3300-3319). The server flag --enable-return-routed-experts (arg_groups/fields/exec_.py 158-160)
# creates the capturer; without it a request that asks gets no key at all (no capturer,
# state_capturer/routed_experts.py 50-51; batch_result_processor.py 150-152 returns; the tokenizer
# manager adds the key only for a non-None value, managers/tokenizer_manager.py 2602-2609).
# Answer: meta_info["routed_experts"] = base64 of the raw bytes of an int32 tensor
# [seqlen - 1 - start, num_hidden_layers, num_experts_per_tok] (C order, the host's little-endian
# int32: managers/detokenizer_manager.py 432-448 ``b64encode(item.numpy().tobytes())``; host buffer
# dtype int32, state_capturer/base.py 63-70; rows from batch_result_processor.py 136-160,
# state_capturer/base.py 173-187; decoded by state_capturer/routed_experts.py 166-174
# ``np.frombuffer(b64decode(...), dtype=np.int32)``, the shape left to the caller). Collected on finish
# only (non-streaming and the last stream chunk).
META_ROUTED_EXPERTS = "routed_experts"
ENABLE_RETURN_ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
ROUTED_EXPERTS_DTYPE = "int32"


def routed_experts_start_error(start_len: int, prompt_tokens: int) -> str | None:
    """SGLang's refusal of a ``routed_experts_start_len`` (managers/scheduler.py 3300-3313), or None."""
    if start_len < 0:
        return (
            f"recv_req.routed_experts_start_len={start_len} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start_len > prompt_tokens:
        return (
            f"recv_req.routed_experts_start_len={start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller routed_experts_start_len."
        )
    return None


WAITING_ABORT = {"type": "abort", "message": "Abort in waiting queue"}
"""The finish reason of a request SGLang 0.5.23's scheduler aborts outside its output stream (in
its waiting queue, a retracted request included, or mid chunked prefill: managers/scheduler.py
5686-5706, 3778-3827; ``send_abort_output`` 2272-2279) for an abort that names no reason, as the
tokenizer manager's own aborts (``/abort_request``, a pause in mode ``abort``, an update with
``abort_all_requests``) never do (``abort_request``, managers/tokenizer_manager.py 2240-2253):
``_handle_abort_req`` answers it with a short ``meta_info`` (3577-3642)."""


ABORT_BAD_REQUEST = "BadRequestError"
"""The ``err_type`` of ``Req.set_finish_with_abort``'s default 400 (managers/schedule_batch.py
2221-2238): the logprob and routed-experts starts' aborts (managers/scheduler.py 3275-3279,
3300-3319)."""


def scheduler_abort(message: str, err_type: str | None = ABORT_BAD_REQUEST) -> dict[str, Any]:
    """The finish reason of a request SGLang 0.5.23's scheduler aborts with a 400 when it takes it
    (``FINISH_ABORT.to_json``, managers/schedule_batch.py 332-345): ``set_finish_with_abort``'s
    carries ``err_type`` :data:`ABORT_BAD_REQUEST`; the sampling-mask rule's
    (``_reject_sampling_mask_request``, managers/scheduler.py 3513-3518, through
    ``prepare_abort``, disaggregation/utils.py 1926-1930) none. Unstreamed the tokenizer manager
    raises it as a ``ValueError``, a 400 ``{"error": {"message"}}``; streamed it yields the output
    that carries it as one event, then ``[DONE]``, inside the HTTP 200 stream
    (managers/tokenizer_manager.py 1891-1922, 2041-2048; entrypoints/http_server.py 951-975):
    the mask's with nothing generated, ``set_finish_with_abort``'s with the one id its stub
    prefill of ``[0]`` drew and ``prompt_tokens`` 1 (schedule_batch.py 2011-2014, 2233-2236;
    scheduler_components/batch_result_processor.py 363-369)."""
    return {"type": "abort", "message": message, "status_code": 400, "err_type": err_type}


def abort_status(finish_reason: Any) -> int | None:
    """The HTTP status an abort ``finish_reason`` carries, as SGLang's tokenizer manager reads it
    (``_handle_abort_finish_reason``, managers/tokenizer_manager.py 1891-1922: an abort whose
    ``status_code`` is in [400, 600), which unstreamed is answered with that status and streamed
    is the last event's finish reason), or None (no abort, or one without such a status: answered
    200 unstreamed too)."""
    if not isinstance(finish_reason, dict) or finish_reason.get("type") != "abort":
        return None
    status = finish_reason.get("status_code")
    return status if type(status) is int and 400 <= status < 600 else None


def max_req_len(context_len: int) -> int:
    """SGLang 0.5.23's scheduler's ``max_req_len``: ``min(context_len - 1, kv_capacity - 1)``
    (managers/tp_worker.py 568-571), ``context_len - 1`` where the KV pool holds a whole context
    (the local engine's). Its ``max_req_input_len`` is 5 below (572); a request's generation is
    capped at ``max_req_len - input_len - 1`` (managers/scheduler.py 2693-2716)."""
    return context_len - 1


def input_length_error(prompt_tokens: int, context_len: int) -> str | None:
    """SGLang's abort of a prompt of ``prompt_tokens`` tokens not shorter than its scheduler's
    ``max_req_input_len`` (:func:`max_req_len` less 5: a prompt within 6 tokens of the context),
    or None (``validate_input_length``, managers/utils.py 259-289, called by
    ``_handle_generate_request`` after the sampling-mask rule and before the logprob start,
    managers/scheduler.py 3243-3253: ``set_finish_with_abort``, a 400; without
    ``--allow-auto-truncate``, which the fleet does not set). The tokenizer manager refused a
    prompt of ``context_len`` tokens or more before (tokenizer_manager.py 1336-1351)."""
    limit = max_req_len(context_len) - 5
    if prompt_tokens >= limit:
        return (
            f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({limit} tokens). "
            f"Use a shorter input or enable --allow-auto-truncate."
        )
    return None


def logprob_start_error(start_len: int, prompt_tokens: int) -> str | None:
    """SGLang's abort of a ``logprob_start_len`` past the input (managers/scheduler.py 3275-3279:
    ``set_finish_with_abort``, a 400), or None. It judges the start the request keeps: a request
    without ``return_logprob`` keeps -1 whatever it sent (3256-3258), and -1 with it the input's
    length (3260-3264); so only a start above the input's length is aborted, and one equal to it is
    served with no input log-probs (``input_token_logprobs: []``: none computed,
    managers/schedule_batch.py 2419-2435; scheduler_components/logprob_result_processor.py
    336-346, 377-395)."""
    if start_len > prompt_tokens:
        return (
            f"req.logprob_start_len={start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller logprob_start_len."
        )
    return None


def encode_routed_experts(ids: Any) -> str:
    """base64 of an int32 array's raw little-endian bytes (anything with ``tobytes`` of int32 values,
    or a flat sequence of ints)."""
    import array
    import base64
    import sys

    if hasattr(ids, "tobytes"):
        raw = ids.tobytes()
    else:
        arr = array.array("i", ids)
        if sys.byteorder != "little":
            arr.byteswap()
        raw = arr.tobytes()
    return base64.b64encode(raw).decode("ascii")


def decode_routed_experts(text: str) -> list[int]:
    """The flat int32 values of a ``routed_experts`` string (stdlib; ValueError if not base64 of a
    whole number of int32s)."""
    import array
    import base64
    import binascii
    import sys

    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"routed_experts is not base64: {exc}") from None
    if len(raw) % 4:
        raise ValueError(f"routed_experts holds {len(raw)} bytes, not a whole number of int32 values")
    arr = array.array("i")
    arr.frombytes(raw)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


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


def whole_vocabulary(params: Mapping[str, Any]) -> bool:
    """True when SGLang samples ``params`` from the whole vocabulary: not greedy, no finite
    ``top_k`` (missing, -1 or :data:`TOP_K_ALL`), ``top_p`` 1 and ``min_p`` 0 (missing values take
    SGLang's defaults, sampling/sampling_params.py 207-210; the batch's ``need_top_p_sampling`` /
    ``need_min_p_sampling`` test ``top_p != 1.0`` and ``min_p > 0``, sampling_batch_info.py 295-297)."""
    top_p = params.get("top_p")
    min_p = params.get("min_p")
    return (
        normalized_top_k(params) >= TOP_K_ALL
        and (top_p is None or top_p >= 1.0)
        and (min_p is None or min_p <= 0.0)
    )


@dataclass(frozen=True)
class SamplingRequest:
    """What the engine client sends for a turn's sampling: ``params`` (the ``sampling_params``),
    ``mask`` (whether ``return_sampling_mask`` and ``sampling_logprobs_mode`` are asked) and
    ``top_k_bound`` (the ``top_k`` set because the turn had no finite one; None: sent as given)."""

    params: dict[str, Any]
    mask: bool
    top_k_bound: int | None = None

    @property
    def statement(self) -> dict[str, Any] | None:
        """What the turn's record states about it (``TurnData.sampling``): ``{"sampling_mask":
        false}`` when no mask was asked (every support is the whole vocabulary, mu is
        ``output_token_logprobs``), ``{"top_k_bound": n}`` when ``top_k`` was bounded, else None."""
        if not self.mask:
            return {"sampling_mask": False}
        return None if self.top_k_bound is None else {"top_k_bound": self.top_k_bound}


def sampling_request(
    params: Mapping[str, Any], max_tokens: int = SAMPLING_MASK_MAX_TOKENS_DEFAULT
) -> SamplingRequest:
    """The one decision of how a turn's ``params`` are sent (see the module docstring): no mask
    for a :func:`whole_vocabulary` turn (``params`` unchanged), else a mask with ``params`` as
    :func:`bound_top_k` sends them. ValueError if ``max_tokens < 2``."""
    if max_tokens < 2:
        raise ValueError(f"sampling_mask_max_tokens must be >= 2, got {max_tokens}")
    if whole_vocabulary(params):
        return SamplingRequest(dict(params), mask=False)
    sent, bound = bound_top_k(params, max_tokens)
    return SamplingRequest(sent, mask=True, top_k_bound=bound)


# SGLANG_RETURN_ORIGINAL_LOGPROB (declared EnvBool(False), environ.py 1508) is read once, at import,
# by layers/sampler.py 82 with get_bool_env_var (utils/common.py 1424-1440: "true"/"1" -> True,
# anything else False, so "false" -> False): set, output_token_logprobs would be log-probs before temperature
# (layers/sampler.py 231-237, 319-323), not the distribution a token was drawn from, and an
# unfiltered turn's mu (which is output_token_logprobs) would be wrong whenever T != 1. Every engine
# the fleet starts gets these values, whatever the environment it inherits.
ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}
# --- /update_weights_from_disk per weight format ---------------------------------------------------
# The fleet's weight formats and what an in-place reload of each needs (managers/io_struct.py
# 1970-1993 UpdateWeightFromDiskReqInput; the scheduler hands model_path, load_format and
# recapture_cuda_graph to model_executor/model_runner_components/weight_updater.py 174-260).
#
# - load_format is never sent: the tokenizer manager fills a missing one with the server's own
#   (tokenizer_manager.py 2295-2296), the one the checkpoint was started with ("auto": safetensors
#   with the checkpoint's quantization_config). The reload path accepts only a DefaultModelLoader
#   (weight_updater.py 199-203); ModelOptModelLoader, which modelopt_fp4 gets (model_loader/
#   loader.py 4201-4207), is one (loader.py 3644). "flash_rl" (QuantizedRLModelLoader, loader.py
#   1165-1305) is not for these checkpoints: it loads a BF16 checkpoint and quantizes it online to
#   FP8, and only for Qwen2/Qwen3 dense loaders that declare its contract (loader.py 1229-1240).
# - recapture_cuda_graph (default false) re-captures the CUDA graphs after the load (weight_updater.py
#   247-255). It is needed wherever the post-load processing may give a parameter new storage: a
#   graph captured before keeps reading the old storage. ``copy_or_rebind_param`` (layers/utils/
#   common.py 58-71) rebinds ``.data`` whenever the processed shape or dtype differs (padding,
#   swizzled or requantized scales), and the reload re-runs that processing (loader.py 1028-1090
#   load_weights_and_postprocess). bf16: the unquantized linear and MoE methods keep each
#   parameter's storage (layers/quantization/unquant.py 568-570, 852-920: the ROCm aiter shuffle
#   and CPU AMX repack through copy_or_rebind_param with equal shapes; on CUDA the FlashInfer
#   TRT-LLM block layout permutes the experts in place and reshapes them as a view, 976-1041, and
#   the fused-SwiGLU interleave, off by default, writes in place, 922-974), and
#   restore_weights_before_loading gives a reload the checkpoint's shapes back (1099-1112) -> no
#   recapture. fp8 block (Fp8LinearMethod / Fp8MoEMethod process_weights_after_loading_block_quant,
#   layers/quantization/fp8.py 743-944, 1877-2290: requantization to UE8M0 scales and new Parameters
#   on some backends), nvfp4 (ModelOptFp4LinearMethod.process_weights_after_loading, modelopt_quant.py
#   1886-2075: padded and shuffled weights, swizzled scales, rebinds when padded) and mxfp4
#   (Mxfp4MoEMethod, mxfp4.py 635-1137: backend wrappers that "cannot restore", loader.py 1097-1098)
#   -> recapture.
# - No quantized method of these formats implements restore_weights_before_loading (the base is a
#   no-op, layers/quantization/base_config.py 49-54; only unquant.py 1099 and compressed-tensors
#   implement it; loader.py 1091-1101 calls it). A reload therefore writes checkpoint-layout tensors
#   into the processed parameters: correct only while processing kept their shapes (an NVFP4 layer
#   whose N or K needed padding fails the load, and a failed load is no refusal: its "rollback"
#   re-reads the new path and the server exits, docs/sglang-contract.md row 6, weight_updater.py
#   228-237). Whether NVFP4 and MXFP4
#   reload in place correctly on a given backend is what the GPU check verifies; it has not run.
RECAPTURE_CUDA_GRAPH = {"bf16": False, "fp8": True, "nvfp4": True, "mxfp4": True}


def update_weights_request(model_path: str, version: int, weight_format: str) -> dict[str, Any]:
    """The ``/update_weights_from_disk`` body that activates ``version`` (staged at ``model_path``)
    on an SGLang server serving ``weight_format`` (see the notes above for each field).

    ``flush_cache`` is sent explicitly true (SGLang's default): after a ``retract`` pause the flush
    succeeds, and the radix cache then holds no prefix KV of the old version. ``abort_all_requests``
    stays false: paused requests resume. Raises ValueError for an unknown format."""
    if weight_format not in RECAPTURE_CUDA_GRAPH:
        raise ValueError(f"unknown weight format {weight_format!r} (known: {', '.join(FORMATS)})")
    return {
        "model_path": model_path,
        "weight_version": str(version),
        "flush_cache": True,
        "abort_all_requests": False,
        "recapture_cuda_graph": RECAPTURE_CUDA_GRAPH[weight_format],
    }

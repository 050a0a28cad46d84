"""The SGLang release's image and server command line: its image tag and digest, every server flag
the fleet emits, and what each weight format needs on that command line.

The pin itself -- the release number and the HTTP protocol values the engine client and the local
engine speak -- is :mod:`core.sglang_release` (modal-free, below every package that speaks the
protocol); this module builds on it (``IMAGE_TAG`` from its ``SGLANG_VERSION``) and declares
none of its values again. Everything here was read from the released ``sglang 0.5.23`` wheel on
PyPI (``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``); each value names the file it
comes from. The module is pure (no modal). :func:`server_argv` is the one place an SGLang command
line is built.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from core.formats import WeightFormat
from core.sglang_release import SAMPLING_MASK_MAX_TOKENS_DEFAULT, SGLANG_VERSION, update_weights_request

# The CUDA line of the release: the wheel's METADATA requires ``cuda-python>=13.0``,
# ``flashinfer_python[cu13]==0.7.2`` and ``torch==2.14.1``. The release images are built by
# sgl-project/sglang .github/workflows/_docker-build-and-publish.yml (x86_64 CUDA 13:
# CUDA_VERSION=13.0.1, BUILD_TYPE=all, i.e. kernels for every architecture) and tagged
# ``v{version}-cu130`` (the tag_config of its release callers); the last CUDA 12 tag is
# ``v0.5.19-cu129``. ``IMAGE_TAG`` is derived from that scheme, not read from Docker Hub.
CUDA_LINE = "13.0"
IMAGE_TAG = f"lmsysorg/sglang:v{SGLANG_VERSION}-cu130"
LAUNCH_MODULE = "sglang.launch_server"

# The image's digest beside its tag, so that a re-pushed tag cannot change what the servers run.
# Not read: Docker Hub cannot be reached from where this pin was written, and no public source
# found (searched 2026-12-02: GitHub code, documentation and web pages for the tag with
# "sha256:") names the digest of this tag. Set IMAGE_DIGEST (with the date read and the source)
# or MIXFLEET_SGLANG_IMAGE_DIGEST to the tag's manifest-list digest, e.g. from
# ``docker buildx imagetools inspect lmsysorg/sglang:v0.5.23-cu130`` (its "Digest:" line).
IMAGE_DIGEST: str | None = None
IMAGE_DIGEST_READ: str | None = None  # "<date read>, <source>" when IMAGE_DIGEST is set
IMAGE_DIGEST_ENV = "MIXFLEET_SGLANG_IMAGE_DIGEST"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")

# --- server flags (python/sglang/srt/arg_groups/fields/*.py; a field ``x_y`` is ``--x-y``,
# arg_groups/arg_utils.py ``_field_to_cli_name``; a bool field is ``store_true``) -------------
FLAG_MODEL_PATH = "--model-path"  # fields/model.py Model.model_path
FLAG_HOST = "--host"  # fields/serving.py Serving.host
FLAG_PORT = "--port"  # fields/serving.py Serving.port
FLAG_TP_SIZE = "--tp-size"  # fields/parallel.py Parallel.tp_size (alias --tensor-parallel-size)
FLAG_QUANTIZATION = "--quantization"  # fields/model.py Model.quantization (QUANTIZATION_CHOICES)
FLAG_KV_CACHE_DTYPE = "--kv-cache-dtype"  # fields/model.py Model.kv_cache_dtype
FLAG_WEIGHT_VERSION = "--weight-version"  # fields/serving.py Serving.weight_version (default "default")
FLAG_ENABLE_METRICS = "--enable-metrics"  # fields/observability.py: without it there is no /metrics
# server_args.py ServerArgs.add_cli_args adds --sampling-backend by hand (its field is no_cli);
# choices BUILT_IN_SAMPLING_BACKENDS = {flashinfer, pytorch, ascend, intel_xpu} (arg_groups/choices.py).
# The default resolves to flashinfer on CUDA (arg_groups/overrides.py _sampling_backend_default),
# which asserts when sampling_seed is combined with top-k/top-p; the fleet always runs pytorch.
FLAG_SAMPLING_BACKEND = "--sampling-backend"
SAMPLING_BACKEND = "pytorch"
# fields/exec_.py ExecFeatures.sampling_mask_max_tokens: the largest sampling mask returned;
# a request whose realized support exceeds it is aborted.
FLAG_SAMPLING_MASK_MAX_TOKENS = "--sampling-mask-max-tokens"  # default SAMPLING_MASK_MAX_TOKENS_DEFAULT

# Every flag :func:`server_argv` may emit; tests check each against the release's parser.
FLAGS_USED = (
    FLAG_MODEL_PATH,
    FLAG_HOST,
    FLAG_PORT,
    FLAG_TP_SIZE,
    FLAG_QUANTIZATION,
    FLAG_KV_CACHE_DTYPE,
    FLAG_WEIGHT_VERSION,
    FLAG_ENABLE_METRICS,
    FLAG_SAMPLING_BACKEND,
    FLAG_SAMPLING_MASK_MAX_TOKENS,
)

# fields/model.py Model.kv_cache_dtype choices (the fleet uses auto, bf16 and fp8_e4m3).
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16")

# The --quantization value for each weight format the fleet converts to. bf16 loads unquantized
# (no flag). fp8 and modelopt_fp4 are entries of QUANTIZATION_CHOICES (arg_groups/choices.py);
# mxfp4 is too, but SGLang reads its checkpoint layout only for the architectures below.
QUANTIZATION_BY_FORMAT: dict[WeightFormat, str | None] = {
    "bf16": None,
    "fp8": "fp8",
    "nvfp4": "modelopt_fp4",
    "mxfp4": "mxfp4",
}
QUANTIZATION_CHOICES = (
    "awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
    "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4", "w8a8_int8",
    "w8a8_fp8", "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8", "compressed-tensors",
    "modelslim", "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8",
    "unquant", "humming",
)  # fmt: skip
# The architectures whose loader takes an mxfp4 (``*_blocks`` / ``*_scales``) checkpoint:
# models/gpt_oss.py GptOssForCausalLM._load_mxfp4_experts_weights is the only one in the release.
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)

# --- HTTP protocol (python/sglang/srt/managers/io_struct.py, entrypoints/http_server.py) ---------
# PauseGenerationReqInput.mode: core.sglang_release.PAUSE_MODES, default "abort"; the fleet sends
# PAUSE_MODE ("retract": running requests are recomputed under the new weights; replica.activation
# says why). UpdateWeightFromDiskReqInput (io_struct.py 1970-1993): model_path is required; the fleet
# sends the five fields of core.sglang_release.update_weights_request -- model_path, weight_version,
# flush_cache (true), abort_all_requests (false) and recapture_cuda_graph (true for the quantized
# formats) -- and leaves load_format to the server's own. UPDATE_WEIGHTS_DEFAULTS are SGLang's
# defaults of the optional ones.
UPDATE_WEIGHTS_FIELDS = tuple(update_weights_request("/staged", 1, "bf16"))
UPDATE_WEIGHTS_DEFAULTS = {"flush_cache": True, "abort_all_requests": False, "recapture_cuda_graph": False}
# GenerateReqInput.sampling_logprobs_mode: SAMPLING_LOGPROBS_MODES ("support" returns the
# support's log-probs with the mask); the meta_info keys the fleet reads: META_* (all in
# core.sglang_release).
# http_server.py routes: /pause_generation, /continue_generation, /update_weights_from_disk,
# /flush_cache, /update_weight_version and /model_info (which carries weight_version); the release
# has no /get_weight_version.
ROUTE_PAUSE = "/pause_generation"
ROUTE_CONTINUE = "/continue_generation"
ROUTE_UPDATE_WEIGHTS = "/update_weights_from_disk"
ROUTE_MODEL_INFO = "/model_info"


def quantization_for(weight_format: str) -> str | None:
    """The ``--quantization`` value for ``weight_format`` (None: unquantized); KeyError if unknown."""
    return QUANTIZATION_BY_FORMAT[weight_format]


def server_argv(
    *,
    model_path: str,
    port: int,
    weight_format: str,
    kv_cache_dtype: str,
    tp_size: int,
    weight_version: str | None = None,
    host: str = "127.0.0.1",
    sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS_DEFAULT,
    engine_args: Sequence[str] = (),
    python: str = "python3",
) -> list[str]:
    """The command line that starts one SGLang server of this release for a sampler group.

    The server listens on ``host:port``, loads ``model_path`` with the format's quantization, keeps
    its KV cache in ``kv_cache_dtype``, shards over ``tp_size`` GPUs, exports ``/metrics`` and
    samples with the pytorch backend. ``engine_args`` (the group's extra flags) come last, so
    they can add flags but not silently repeat one set here (ValueError names a repeated flag).
    Raises ValueError for an unknown format, KV dtype, non-positive size or port out of range.
    """
    if weight_format not in QUANTIZATION_BY_FORMAT:
        raise ValueError(
            f"unknown weight format {weight_format!r} (known: {', '.join(QUANTIZATION_BY_FORMAT)})"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV-cache dtype {kv_cache_dtype!r} (SGLang {SGLANG_VERSION} takes: "
                         f"{', '.join(KV_CACHE_DTYPES)})")  # fmt: skip
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if sampling_mask_max_tokens < 2:
        raise ValueError(f"sampling_mask_max_tokens must be >= 2, got {sampling_mask_max_tokens}")
    argv = [python, "-m", LAUNCH_MODULE, FLAG_MODEL_PATH, model_path, FLAG_HOST, host, FLAG_PORT, str(port)]
    argv += [FLAG_TP_SIZE, str(tp_size)]
    quantization = QUANTIZATION_BY_FORMAT[weight_format]
    if quantization is not None:
        argv += [FLAG_QUANTIZATION, quantization]
    argv += [FLAG_KV_CACHE_DTYPE, kv_cache_dtype]
    if weight_version is not None:
        argv += [FLAG_WEIGHT_VERSION, weight_version]
    argv += [FLAG_ENABLE_METRICS, FLAG_SAMPLING_BACKEND, SAMPLING_BACKEND]
    argv += [FLAG_SAMPLING_MASK_MAX_TOKENS, str(sampling_mask_max_tokens)]
    ours = set(argv)
    for arg in engine_args:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and name in ours:
            raise ValueError(f"engine_args repeats {name}, which the fleet sets itself")
    return argv + list(engine_args)


def image_digest(environ: Mapping[str, str] = os.environ) -> str | None:
    """The digest the SGLang image is pinned by: ``MIXFLEET_SGLANG_IMAGE_DIGEST`` when set, else
    :data:`IMAGE_DIGEST` (None: unpinned). ``ValueError`` naming the variable for a value that is
    not ``sha256:`` and 64 lower-case hex digits."""
    digest = environ.get(IMAGE_DIGEST_ENV) or IMAGE_DIGEST
    if digest is not None and not _DIGEST.fullmatch(digest):
        raise ValueError(f"{IMAGE_DIGEST_ENV} must be sha256: and 64 lower-case hex digits, got {digest!r}")
    return digest


def image_ref(environ: Mapping[str, str] = os.environ) -> str:
    """The image reference the GPU servers start from: ``tag@sha256:...`` when pinned, else the tag."""
    digest = image_digest(environ)
    return f"{IMAGE_TAG}@{digest}" if digest else IMAGE_TAG


def unpinned_warning(environ: Mapping[str, str] = os.environ) -> str | None:
    """A one-line warning while the image is pinned by tag only (None once a digest is set)."""
    if image_digest(environ) is not None:
        return None
    return (
        f"the SGLang image {IMAGE_TAG} is pinned by tag only (its digest was not read): a re-pushed "
        f"tag changes what the servers run; set {IMAGE_DIGEST_ENV}=sha256:... "
        f"(docker buildx imagetools inspect {IMAGE_TAG})"
    )

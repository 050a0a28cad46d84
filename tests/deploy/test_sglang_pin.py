"""The SGLang pin: every flag the fleet emits is one SGLang 0.5.23's server takes, each format's argv
carries the right quantization, KV dtype and sampling settings, and bad input is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import sglang_release
from core.formats import FORMATS
from fleet.specs import load_preset
from images import sglang

REFERENCE = Path(__file__).with_name("sglang_0_5_23_flags.txt")
RELEASE_FLAGS = frozenset(
    line.strip() for line in REFERENCE.read_text().splitlines() if line.strip() and not line.startswith("#")
)
# Flags that take no value (bool fields are store_true: arg_groups/arg_utils.py).
NO_VALUE = {sglang.FLAG_ENABLE_METRICS}


def _pairs(argv: list[str]) -> dict[str, str | None]:
    """The flags of a server argv with their values; asserts the argv is well formed."""
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    out: dict[str, str | None] = {}
    rest = argv[3:]
    i = 0
    while i < len(rest):
        flag = rest[i]
        assert flag.startswith("--"), f"value without a flag: {flag!r} in {argv}"
        assert flag not in out, f"{flag} given twice"
        if flag in NO_VALUE:
            out[flag] = None
            i += 1
        else:
            assert i + 1 < len(rest) and not rest[i + 1].startswith("--"), f"{flag} has no value"
            out[flag] = rest[i + 1]
            i += 2
    return out


def test_reference_is_the_release_parser() -> None:
    assert sglang.SGLANG_VERSION == "0.5.23"
    assert len(RELEASE_FLAGS) > 500
    # spot checks: a field, its alias, a flag server_args.py adds by hand
    assert {"--tp-size", "--tensor-parallel-size", "--sampling-backend", "--model-path"} <= RELEASE_FLAGS


def test_every_flag_the_fleet_uses_is_in_the_release() -> None:
    assert set(sglang.FLAGS_USED) <= RELEASE_FLAGS, set(sglang.FLAGS_USED) - RELEASE_FLAGS


def test_image_is_the_cuda13_tag_of_the_release() -> None:
    assert sglang.IMAGE_TAG == "lmsysorg/sglang:v0.5.23-cu130"
    assert sglang.CUDA_LINE.startswith("13")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kv", ["auto", "bf16", "fp8_e4m3"])
def test_argv_of_every_format(fmt: str, kv: str) -> None:
    argv = sglang.server_argv(
        model_path="/stage/run/x/v000003", port=30000, weight_format=fmt, kv_cache_dtype=kv, tp_size=2,
        weight_version="3",
    )  # fmt: skip
    flags = _pairs(argv)
    assert set(flags) <= RELEASE_FLAGS
    assert flags["--model-path"] == "/stage/run/x/v000003"
    assert flags["--port"] == "30000" and flags["--host"] == "127.0.0.1"
    assert flags["--tp-size"] == "2"
    assert flags["--kv-cache-dtype"] == kv
    assert flags["--weight-version"] == "3"
    assert "--enable-metrics" in flags
    assert flags["--sampling-backend"] == "pytorch"
    assert flags["--sampling-mask-max-tokens"] == "4096"
    expected_quant = {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4", "mxfp4": "mxfp4"}[fmt]
    assert flags.get("--quantization") == expected_quant
    if expected_quant is not None:
        assert expected_quant in sglang.QUANTIZATION_CHOICES


def test_engine_args_come_last_and_may_not_repeat_ours() -> None:
    base = dict(model_path="/m", port=30000, weight_format="fp8", kv_cache_dtype="fp8_e4m3", tp_size=1)
    argv = sglang.server_argv(**base, engine_args=("--mem-fraction-static", "0.85"))
    assert argv[-2:] == ["--mem-fraction-static", "0.85"]
    assert set(_pairs(argv)) <= RELEASE_FLAGS
    with pytest.raises(ValueError, match="engine_args repeats --kv-cache-dtype"):
        sglang.server_argv(**base, engine_args=("--kv-cache-dtype=auto",))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_format": "int3"}, "unknown weight format 'int3'"),
        ({"kv_cache_dtype": "fp16"}, "unknown KV-cache dtype 'fp16'"),
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"port": 70000}, "port must be in 1..65535"),
    ],
)
def test_bad_argv_input_is_refused(change: dict, message: str) -> None:
    args = dict(model_path="/m", port=30000, weight_format="bf16", kv_cache_dtype="auto", tp_size=1) | change
    with pytest.raises(ValueError, match=message):
        sglang.server_argv(**args)


@pytest.mark.parametrize("preset", ["mixed", "homogeneous", "local"])
def test_preset_engine_args_are_release_flags(preset: str) -> None:
    for g in load_preset(preset).groups:
        assert {a.split("=")[0] for a in g.engine_args if a.startswith("--")} <= RELEASE_FLAGS


def test_protocol_values_of_the_release() -> None:
    assert sglang_release.PAUSE_MODE == "retract" and sglang_release.PAUSE_MODE in sglang_release.PAUSE_MODES
    assert sglang.UPDATE_WEIGHTS_FIELDS == (
        "model_path",
        "weight_version",
        "flush_cache",
        "abort_all_requests",
        "recapture_cuda_graph",
    )
    assert set(sglang.UPDATE_WEIGHTS_DEFAULTS) <= set(sglang.UPDATE_WEIGHTS_FIELDS)
    assert sglang_release.SAMPLING_LOGPROBS_MODES == ("selected", "support")
    assert sglang.MXFP4_ARCHITECTURES == ("GptOssForCausalLM",)


DIGEST = "sha256:" + "ab" * 32


def test_the_image_is_pinned_by_digest_beside_its_tag_when_one_is_set() -> None:
    assert sglang.image_ref({sglang.IMAGE_DIGEST_ENV: DIGEST}) == f"lmsysorg/sglang:v0.5.23-cu130@{DIGEST}"
    assert sglang.unpinned_warning({sglang.IMAGE_DIGEST_ENV: DIGEST}) is None
    for bad in ("ab" * 32, "sha256:" + "AB" * 32, "sha256:" + "ab" * 31):
        with pytest.raises(ValueError, match=f"^{sglang.IMAGE_DIGEST_ENV} must be sha256:"):
            sglang.image_ref({sglang.IMAGE_DIGEST_ENV: bad})


def test_an_unpinned_image_is_its_tag_with_a_warning() -> None:
    if sglang.IMAGE_DIGEST is not None:  # read and recorded: then the date and the source are too
        assert (
            sglang.IMAGE_DIGEST_READ and sglang.image_ref({}) == f"{sglang.IMAGE_TAG}@{sglang.IMAGE_DIGEST}"
        )
        return
    assert sglang.image_ref({}) == sglang.IMAGE_TAG
    warning = sglang.unpinned_warning({})
    assert warning and "pinned by tag only" in warning and sglang.IMAGE_DIGEST_ENV in warning

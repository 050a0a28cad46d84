"""``mixfleet deploy``: each kind of bad preset fails with its one-line message before anything is
contacted; ``--dry-run`` prints every server with GPU, format, KV dtype, SGLang argv and autoscaling."""

from __future__ import annotations

import math
import shlex
import subprocess
from pathlib import Path

import pytest

from deploy import plan as deploy_plan
from fleet.specs import load_preset
from images import sglang
from mixfleet.cli import main
from tests.support.checkpoints import MoESpec, write_checkpoint, write_sparse_checkpoint
from tests.support.procs import mixfleet_argv
from tests.support.router import write_preset


def _preset(tmp_path: Path, body: str, architecture: str | None = None) -> str:
    path = tmp_path / "p.toml"
    head = f'architecture = "{architecture}"\n' if architecture else ""
    path.write_text(head + body)
    return str(path)


def _group(accelerator: str = "H100", **fields: object) -> str:
    lines = ["[[groups]]", 'name = "g"', f'accelerator = "{accelerator}"']
    for key, value in fields.items():
        lines.append(f"{key} = {value!r}".replace("'", '"'))
    return "\n".join(lines) + "\n"


def _deploy(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    rc = main(["deploy", "--dry-run", *args])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


@pytest.mark.parametrize(
    ("body", "architecture", "line"),
    [
        (
            _group("H300"),
            None,
            "mixfleet deploy: error: group g: GPU 'H300' is not a Modal GPU type (documented: T4, L4, A10,",
        ),
        (
            _group("h100!"),
            None,
            "mixfleet deploy: error: group g: GPU 'h100!' is not a Modal GPU type; write it as 'H100!'",
        ),
        (
            _group("H100:x"),
            None,
            "mixfleet deploy: error: group g: GPU 'H100:x': the count after ':' must be an integer in 1..8",
        ),
        (
            _group("A10", gpus_per_replica=8),
            None,
            "mixfleet deploy: error: group g: gpus_per_replica 8 > 4, the most A10 GPUs per container",
        ),
        (
            _group("H100:2"),
            None,
            "mixfleet deploy: error: group g: accelerator 'H100:2' names 2 GPU(s) but gpus_per_replica is 1;",
        ),
        (
            _group("cpu"),
            None,
            "mixfleet deploy: error: group g: accelerator 'cpu' is a local group; a Modal server needs a GPU",
        ),
        (
            _group(weight_format="mxfp4"),
            "Qwen3MoeForCausalLM",
            "mixfleet deploy: error: group g: weight_format mxfp4 needs an architecture SGLang 0.5.23's "
            "mxfp4 loader takes (GptOssForCausalLM), not Qwen3MoeForCausalLM",
        ),
        (
            _group().replace('"g"', '"router"'),
            None,
            "mixfleet deploy: error: group router: the name 'router' is the app's router function's; "
            "a group needs another name",
        ),
        (
            _group().replace('"g"', '"publish"'),
            None,
            "mixfleet deploy: error: group publish: the name 'publish' is the app's publish function's;",
        ),
        (_group(weight_format="int3"), None, "mixfleet deploy: error: "),
        (_group(min_replicas=3, max_replicas=1), None, "mixfleet deploy: error: "),
        (_group(buffer_replicas=5, max_replicas=2), None, "mixfleet deploy: error: "),
        (_group(scaledown_window_s=1), None, "mixfleet deploy: error: "),
    ],
)
def test_each_bad_preset_fails_with_its_line(capsys, tmp_path, body, architecture, line) -> None:
    rc, out, err = _deploy(capsys, "--preset", _preset(tmp_path, body, architecture))
    assert rc == 2
    assert out == []  # nothing planned, nothing printed as a plan
    assert len(err) == 1, err
    assert err[0].startswith(line), err[0]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (_group(weight_format="int3"), "groups.0.weight_format (group 'g'): Input should be 'bf16', 'fp8',"),
        (
            _group(min_replicas=3, max_replicas=1),
            "groups.0 (group 'g'): Value error, min_replicas 3 > max_replicas 1",
        ),
        (_group(buffer_replicas=5, max_replicas=2), "buffer_replicas 5 > max_replicas 2"),
        (
            _group(scaledown_window_s=1),
            "groups.0.scaledown_window_s (group 'g'): Input should be greater than",
        ),
    ],
)
def test_invalid_fields_name_the_field_and_group(capsys, tmp_path, body, needle) -> None:
    _, _, err = _deploy(capsys, "--preset", _preset(tmp_path, body))
    assert needle in err[0]


def test_every_problem_is_its_own_line(capsys, tmp_path) -> None:
    body = _group("H300") + _group("cpu").replace('"g"', '"h"') + _group("B300").replace('"g"', '"k"')
    rc, _, err = _deploy(capsys, "--preset", _preset(tmp_path, body))
    assert rc == 2
    assert err == [
        "mixfleet deploy: error: group g: GPU 'H300' is not a Modal GPU type (documented: T4, L4, A10, L40S, "
        "A100, A100-40GB, A100-80GB, RTX-PRO-6000, H100, H100!, H200, B200, B200+)",
        "mixfleet deploy: error: group h: accelerator 'cpu' is a local group; a Modal server needs a GPU",
        "mixfleet deploy: warning: group k: GPU 'B300' is not in Modal's documented GPU list "
        "(used by Modal's Stitch)",
    ]


def test_mxfp4_on_gpt_oss_and_b300_deploy_with_a_warning(capsys, tmp_path) -> None:
    body = _group("B300", weight_format="mxfp4", price_per_gpu_hour=7.1)
    rc, out, err = _deploy(capsys, "--preset", _preset(tmp_path, body, "GptOssForCausalLM"))
    assert rc == 0
    assert err == []  # warnings are part of the printed plan
    assert (
        "warning: group g: GPU 'B300' is not in Modal's documented GPU list (used by Modal's Stitch)" in out
    )
    assert "warning: group g: price 7.1 USD/GPU-hour is unverified (no source)" in out
    assert any("--quantization mxfp4" in line for line in out)


def test_local_preset_is_not_deployable(capsys) -> None:
    rc, _, err = _deploy(capsys, "--preset", "local")
    errors = [line for line in err if ": error: " in line]
    assert rc == 2 and len(errors) == 3
    assert all("a Modal server needs a GPU" in line for line in errors)


@pytest.mark.parametrize("preset", ["mixed", "homogeneous"])
def test_dry_run_prints_every_server(preset: str) -> None:
    done = subprocess.run(
        mixfleet_argv("deploy", "--dry-run", "--preset", preset), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    fleet = load_preset(preset)
    assert out[0] == f"app mixfleet: preset {preset} (Qwen3MoeForCausalLM), {len(fleet.groups)} server(s)"
    for g in fleet.groups:
        at = next(i for i, line in enumerate(out) if line.startswith(f"server {g.name}: "))
        head, volume, scaling, argv_line = out[at : at + 4]
        assert volume == "  volume mixfleet-weights at /weights, key from secret mixfleet-replica-key"
        assert f"gpu {g.accelerator} " in head
        assert f"weights {g.weight_format}, kv {g.kv_cache_dtype}, port 8000, proxy auth on" in head
        assert scaling == (
            f"  autoscaling: min {g.min_replicas}, max {g.max_replicas}, buffer {g.buffer_replicas}, "
            f"scaledown {g.scaledown_window_s}s, target concurrency {g.sessions_per_replica}, "
            f"max concurrency {g.sessions_per_replica + deploy_plan.CONTROL_HEADROOM}"
        )
        assert argv_line.startswith("  sglang: ")
        assert out[at + 4] == deploy_plan.NO_FIT_LINE  # no --checkpoint: the fit is not checked
        argv = shlex.split(argv_line.removeprefix("  sglang: "))
        assert argv == deploy_plan.sglang_argv(g, f"{deploy_plan.STAGE_DIR}/v<N>", "<N>")
        assert argv[argv.index("--kv-cache-dtype") + 1] == g.kv_cache_dtype
        quant = sglang.QUANTIZATION_BY_FORMAT[g.weight_format]
        assert (argv[argv.index("--quantization") + 1] if "--quantization" in argv else None) == quant
    assert any(line.startswith("router: asgi app, containers 2..") for line in out)
    assert any(line.startswith("convert: cpu ") for line in out)


def test_mixed_preset_is_the_study_fleet() -> None:
    fleet = load_preset("mixed")
    served = {(g.accelerator, g.weight_format) for g in fleet.groups}
    assert served == {
        ("B200", "nvfp4"),
        ("B300", "nvfp4"),
        ("H100!", "fp8"),
        ("H100!", "bf16"),
        ("H200", "fp8"),
        ("H200", "bf16"),
        ("A100-80GB", "bf16"),
        ("RTX-PRO-6000", "bf16"),
    }
    assert {g.kv_cache_dtype for g in fleet.groups} == {"fp8_e4m3"}
    prices = {g.accelerator: (g.price_per_gpu_hour, g.price_verified) for g in fleet.groups}
    assert prices == {
        "B200": (6.25, True),
        "B300": (7.10, False),
        "H100!": (3.95, True),
        "H200": (4.54, True),
        "A100-80GB": (2.50, True),
        "RTX-PRO-6000": (3.03, True),
    }
    assert all(g.price_date and g.price_source for g in fleet.groups)
    homogeneous = load_preset("homogeneous").groups
    assert [(g.accelerator, g.weight_format, g.kv_cache_dtype) for g in homogeneous] == [
        ("B200", "bf16", "bf16")
    ]


# --- memory fit (deploy.fit): a group's GPUs must hold the weights plus one full-context sequence

# Qwen3-30B-A3B-Instruct-2507's config.json dimensions (30.5B parameters, 262,144-token context),
# written as a sparse checkpoint: real safetensors headers, data sections that are holes.
QWEN3_30B = MoESpec(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    mlp_only_layers=(),
    shard_bytes=16 << 30,
    extra={"max_position_embeddings": 262144},
)
GIB = 1 << 30
# SGLang 0.5.23's default --mem-fraction-static (arg_groups/memory_hook.py 281-327), worked by hand
# from nvidia-smi's memory.total (MiB) and the band's chunked_prefill_size / decode max_bs:
#   H100 81559, tp 1: R = 512 + 1.5*8192 + 1024/8 + 2*256 = 13440 -> round(68119/81559, 3) = 0.835
#   H100 81559, tp 2: R = 512 + 12288 + 256 + 512 = 13568       -> round(67991/81559, 3) = 0.834
#   L40S 46068 (< 60 GiB, no 10 GiB floor): R = 512 + 6144 + 128 + 64 = 6848 -> 0.851
#   H200 143771: R = 13440 -> 0.907;  A100-80GB 81920: R = 13440 -> 0.836
#   B200 183359: R = 512 + 1.5*16384 + 128 + 2*512 = 26240 -> 0.857
GPU = {"H100!": (81559, 0.835), "L40S": (46068, 0.851), "H200": (143771, 0.907), "B200": (183359, 0.857)}


def _fp8_kept(spec: MoESpec) -> set[str]:
    """The fp8 layers SGLang's block-FP8 loader refuses (a merged part, q/k/v or gate/up, or an
    MoE expert size, not a multiple of 128: layers/quantization/fp8.py 600-610, 1584-1593), which
    the converter keeps in BF16: every tensor name prefix of such a merged layer."""
    kept = set()
    d = spec.head_dim
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}"
        heads = (spec.num_attention_heads * d, spec.num_key_value_heads * d)
        if any(n % 128 for n in heads):
            kept |= {f"{p}.self_attn.{x}_proj." for x in "qkv"}
        dense = i in spec.mlp_only_layers
        inter = spec.intermediate_size if dense else spec.moe_intermediate_size
        if inter % 128:
            kept |= {f"{p}.mlp.gate_proj.", f"{p}.mlp.up_proj."} if dense else {f"{p}.mlp.experts."}
    return kept


def _weights(spec: MoESpec, fmt: str) -> int:
    """The converted checkpoint's tensor bytes, restated from the format definitions: every
    ``*_proj.weight`` is quantized in fp8 (1 byte + F32 per 128x128 block; but for the layers of
    :func:`_fp8_kept`) and nvfp4 (half a byte + E4M3 per 16 + two F32 scalars); everything else,
    and all of bf16, is 2 bytes a value."""
    total = 0
    kept = _fp8_kept(spec) if fmt == "fp8" else set()
    for name, shape in spec.tensor_shapes():
        count = math.prod(shape)
        if fmt == "bf16" or not name.endswith("_proj.weight") or any(name.startswith(k) for k in kept):
            total += 2 * count
        elif fmt == "fp8":
            total += count + 4 * math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
        else:
            total += count // 2 + count // 16 + 8
    return total


def _usable(kind: str, count: int = 1, fraction: float | None = None) -> float:
    mib, default = GPU[kind]
    return int(mib * (1 << 20) * (fraction or default)) * count / GIB


@pytest.fixture(scope="module")
def qwen3_30b(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-30b") / "ckpt"
    write_sparse_checkpoint(directory, QWEN3_30B)
    return directory


FIT_GROUPS = [
    {"name": "h100-bf16", "accelerator": "H100!", "weight_format": "bf16", "kv_cache_dtype": "fp8_e4m3"},
    {"name": "l40s-bf16", "accelerator": "L40S", "weight_format": "bf16", "kv_cache_dtype": "fp8_e4m3"},
    {"name": "h200-bf16", "accelerator": "H200", "weight_format": "bf16", "kv_cache_dtype": "fp8_e4m3"},
    {"name": "h100-fp8", "accelerator": "H100!", "weight_format": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    {"name": "b200-nvfp4", "accelerator": "B200", "weight_format": "nvfp4", "kv_cache_dtype": "bf16"},
]


def test_a_group_that_cannot_hold_the_model_is_refused_in_one_line(tmp_path, qwen3_30b) -> None:
    preset = write_preset(tmp_path / "fit.toml", FIT_GROUPS, name="fit")
    done = subprocess.run(
        mixfleet_argv("deploy", "--dry-run", "--preset", str(preset), "--checkpoint", str(qwen3_30b)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    bf16 = _weights(QWEN3_30B, "bf16") / GIB
    # one 262,144-token sequence: 48 layers x (K, V) x 4 KV heads x 128 x 1 byte (fp8) = 12 GiB
    assert done.stderr.splitlines() == [
        "mixfleet deploy: error: group h100-bf16: 1 x H100! cannot hold the model: "
        f"weights {bf16:.1f} GiB + KV minimum 12.0 GiB (262144 tokens of fp8_e4m3) > usable "
        f"{_usable('H100!'):.1f} GiB (1 x 79.6 GiB x mem-fraction-static 0.835, SGLang's default)",
        "mixfleet deploy: error: group l40s-bf16: 1 x L40S cannot hold the model: "
        f"weights {bf16:.1f} GiB + KV minimum 12.0 GiB (262144 tokens of fp8_e4m3) > usable "
        f"{_usable('L40S'):.1f} GiB (1 x 45.0 GiB x mem-fraction-static 0.851, SGLang's default)",
    ]
    assert f"{bf16:.1f}" == "56.9" and f"{_usable('H100!'):.1f}" == "66.5"


def test_groups_that_fit_show_their_memory(capsys, tmp_path, qwen3_30b) -> None:
    groups = [g for g in FIT_GROUPS if g["name"] not in ("h100-bf16", "l40s-bf16")]
    groups += [
        # two GPUs share the weights (and the 4 KV heads, 2 each); a shorter context lowers the KV
        {"name": "h100x2-bf16", "accelerator": "H100!", "gpus_per_replica": 2, "kv_cache_dtype": "fp8_e4m3"},
        {"name": "h100-short", "accelerator": "H100!", "engine_args": ["--context-length", "32768"]},
    ]
    preset = write_preset(tmp_path / "fit.toml", groups, name="fit")
    rc, out, err = _deploy(capsys, "--preset", str(preset), "--checkpoint", str(qwen3_30b))
    assert rc == 0 and err == [], err
    memory = [line.strip() for line in out if line.strip().startswith("memory: ")]
    w = {f: _weights(QWEN3_30B, f) / GIB for f in ("bf16", "fp8", "nvfp4")}
    assert memory == [
        f"memory: weights {w['bf16']:.1f} GiB + KV minimum 12.0 GiB (262144 tokens of fp8_e4m3) <= usable "
        f"{_usable('H200'):.1f} GiB (1 x 140.4 GiB x mem-fraction-static 0.907, SGLang's default); "
        f"KV room for {int((_usable('H200') - w['bf16']) // 12)} full-context sequence(s)",
        f"memory: weights {w['fp8']:.1f} GiB + KV minimum 12.0 GiB (262144 tokens of fp8_e4m3) <= usable "
        f"{_usable('H100!'):.1f} GiB (1 x 79.6 GiB x mem-fraction-static 0.835, SGLang's default); "
        f"KV room for {int((_usable('H100!') - w['fp8']) // 12)} full-context sequence(s)",
        f"memory: weights {w['nvfp4']:.1f} GiB + KV minimum 24.0 GiB (262144 tokens of bf16) <= usable "
        f"{_usable('B200'):.1f} GiB (1 x 179.1 GiB x mem-fraction-static 0.857, SGLang's default); "
        f"KV room for {int((_usable('B200') - w['nvfp4']) // 24)} full-context sequence(s)",
        f"memory: weights {w['bf16']:.1f} GiB + KV minimum 12.0 GiB (262144 tokens of fp8_e4m3) <= usable "
        f"{_usable('H100!', 2, 0.834):.1f} GiB (2 x 79.6 GiB x mem-fraction-static 0.834, SGLang's default); "
        f"KV room for {int((_usable('H100!', 2, 0.834) - w['bf16']) // 12)} full-context sequence(s)",
        # auto: the model's dtype (BF16), 2 bytes: 32,768 tokens x 48 x 2 x 4 x 128 x 2 = 3 GiB
        f"memory: weights {w['bf16']:.1f} GiB + KV minimum 3.0 GiB (32768 tokens of auto) <= usable "
        f"{_usable('H100!'):.1f} GiB (1 x 79.6 GiB x mem-fraction-static 0.835, SGLang's default); "
        f"KV room for {int((_usable('H100!') - w['bf16']) // 3)} full-context sequence(s)",
    ]


def test_the_checkpoints_vocabulary_is_shown_and_shipped_to_the_router(
    capsys, monkeypatch, tmp_path, qwen3_30b
):
    """``--checkpoint``'s ``config.json`` ``vocab_size`` is the router's ``--vocab-size`` (shipped
    as ``MIXFLEET_VOCAB_SIZE``); the dry run says what the router will check."""
    from mixfleet import deploy as deploy_cmd

    for name in (deploy_plan.CHAT_MODEL_ENV, deploy_plan.VOCAB_SIZE_ENV, deploy_plan.FLEET_ENV):
        monkeypatch.delenv(name, raising=False)
    groups = [g for g in FIT_GROUPS if g["name"] not in ("h100-bf16", "l40s-bf16")]
    preset = str(write_preset(tmp_path / "fit.toml", groups, name="fit"))
    rc, out, _ = _deploy(capsys, "--preset", preset, "--checkpoint", str(qwen3_30b))
    assert (
        rc == 0 and "vocabulary: the router refuses input ids >= 151936 (--checkpoint's config.json)" in out
    )
    rc, out, _ = _deploy(capsys, "--preset", preset, "--chat-model", "/weights/base")
    assert rc == 0 and deploy_plan.vocab_line(None, "/weights/base") in out
    rc, out, _ = _deploy(capsys, "--preset", preset)
    assert rc == 0 and "vocabulary: not checked (no --checkpoint or --chat-model" in "\n".join(out)
    calls: list[dict[str, str]] = []
    monkeypatch.setattr(deploy_cmd.subprocess, "call", lambda argv, env: calls.append(env) or 0)
    monkeypatch.setenv(deploy_plan.VOCAB_SIZE_ENV, "7")  # a stale one is not shipped
    assert main(["deploy", "--preset", preset, "--checkpoint", str(qwen3_30b)]) == 0
    assert main(["deploy", "--preset", preset]) == 0
    capsys.readouterr()
    assert [env.get(deploy_plan.VOCAB_SIZE_ENV) for env in calls] == ["151936", None]


def test_the_weight_bytes_are_the_converters(tmp_path) -> None:
    """On a small checkpoint converted for real, each format's figure is the bytes of the tensors
    the converter wrote (the shard files less their headers)."""
    from deploy.fit import read_model
    from weight_sync.convert import convert_checkpoint

    spec = write_checkpoint(tmp_path / "small", MoESpec(hidden_size=256, moe_intermediate_size=128))
    model = read_model(tmp_path / "small", ["bf16", "fp8", "nvfp4", "mxfp4"])
    for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
        out = tmp_path / fmt
        convert_checkpoint(tmp_path / "small", out, fmt, workers=1)
        shards = sorted(out.glob("*.safetensors"))
        data = sum(p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little") for p in shards)
        assert model.weight_bytes[fmt] == data, fmt
        if fmt in ("bf16", "fp8", "nvfp4"):
            assert model.weight_bytes[fmt] == _weights(spec, fmt), fmt


def test_a_checkpoint_the_preset_does_not_serve_is_refused(capsys, tmp_path, qwen3_30b) -> None:
    body = _group("B200", weight_format="mxfp4")
    rc, _, err = _deploy(
        capsys, "--preset", _preset(tmp_path, body, "GptOssForCausalLM"), "--checkpoint", str(qwen3_30b)
    )
    assert rc == 2
    assert err[0] == (
        f"mixfleet deploy: error: checkpoint {qwen3_30b} is Qwen3MoeForCausalLM, "
        "not the preset's GptOssForCausalLM"
    )
    rc, _, err = _deploy(capsys, "--preset", "mixed", "--checkpoint", str(tmp_path / "nowhere"))
    assert rc == 2 and err == [
        f"mixfleet deploy: error: source checkpoint {tmp_path / 'nowhere'} is not a directory"
    ]


def test_the_mixed_fleet_at_full_context(capsys, qwen3_30b) -> None:
    """The study fleet serving Qwen3-30B-A3B-2507 at its full context: the BF16 groups on 80 GB
    GPUs cannot hold one sequence beside the weights; every other group can."""
    rc, _, err = _deploy(capsys, "--preset", "mixed", "--checkpoint", str(qwen3_30b))
    assert rc == 2
    errors = [line for line in err if ": error: " in line]
    assert [line.split(": ")[2] for line in errors] == ["group h100-bf16", "group a100-bf16"], err


@pytest.mark.parametrize(
    ("fields", "tokens"),
    [
        ({"max_position_embeddings": 32768}, 32768),
        ({"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 131072),
        (
            {
                "max_position_embeddings": 131072,
                "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768},
            },
            131072,
        ),
        ({"seq_length": 8192, "max_position_embeddings": 32768}, 8192),  # SGLang's key order
        ({}, 2048),
    ],
)
def test_context_length_is_sglangs(tmp_path, fields: dict, tokens: int) -> None:
    from deploy.fit import context_length

    assert context_length(fields, tmp_path / "config.json") == tokens


def test_every_gpu_type_has_its_memory() -> None:
    from images.accelerators import DOCUMENTED, MEMORY_MIB, UNDOCUMENTED

    assert set(MEMORY_MIB) == set(DOCUMENTED) | set(UNDOCUMENTED)


def test_bad_fit_inputs_are_one_line(capsys, tmp_path, qwen3_30b) -> None:
    groups = [{"name": "g", "accelerator": "H200", "engine_args": ["--mem-fraction-static", "most"]}]
    preset = write_preset(tmp_path / "p.toml", groups)
    rc, _, err = _deploy(capsys, "--preset", str(preset), "--checkpoint", str(qwen3_30b))
    assert rc == 2 and err == [
        "mixfleet deploy: error: group g: engine_args --mem-fraction-static 'most' is not a number"
    ]
    groups[0]["engine_args"] = ["--mem-fraction-static=1.5"]
    preset = write_preset(tmp_path / "p.toml", groups)
    rc, _, err = _deploy(capsys, "--preset", str(preset), "--checkpoint", str(qwen3_30b))
    assert rc == 2 and err == [
        "mixfleet deploy: error: group g: engine_args --mem-fraction-static 1.5 is not in (0, 1]"
    ]
    bad = tmp_path / "bad"
    write_checkpoint(bad, MoESpec(extra={"max_position_embeddings": "long"}))
    rc, _, err = _deploy(capsys, "--preset", str(preset), "--checkpoint", str(bad))
    assert rc == 2 and err == [
        f"mixfleet deploy: error: {bad / 'config.json'}: "
        "max_position_embeddings must be a positive integer, got 'long'"
    ]


def test_dry_run_warns_while_the_sglang_image_has_no_digest(capsys, monkeypatch) -> None:
    monkeypatch.delenv(sglang.IMAGE_DIGEST_ENV, raising=False)
    monkeypatch.setattr(sglang, "IMAGE_DIGEST", None)
    rc, out, err = _deploy(capsys, "--preset", "homogeneous")
    assert rc == 0 and err == []
    assert out[-1] == f"warning: {sglang.unpinned_warning({})}"

    monkeypatch.setenv(sglang.IMAGE_DIGEST_ENV, "sha256:" + "0" * 64)
    rc, out, err = _deploy(capsys, "--preset", "homogeneous")
    assert rc == 0 and err == [] and not any("pinned by tag only" in line for line in out)

    monkeypatch.setenv(sglang.IMAGE_DIGEST_ENV, "latest")
    rc, out, err = _deploy(capsys, "--preset", "homogeneous")
    assert rc == 2 and out == []
    assert err == [
        f"mixfleet deploy: error: {sglang.IMAGE_DIGEST_ENV} must be sha256: and 64 lower-case hex digits, "
        "got 'latest'"
    ]


def test_the_chat_model_is_shown_and_checked_before_anything_is_contacted(capsys, monkeypatch) -> None:
    monkeypatch.delenv(deploy_plan.CHAT_MODEL_ENV, raising=False)
    rc, out, _ = _deploy(capsys, "--preset", "mixed")
    assert rc == 0 and deploy_plan.chat_model_line(None) in out
    assert "answer 503" in deploy_plan.chat_model_line(None)
    rc, out, _ = _deploy(capsys, "--preset", "mixed", "--chat-model", "/weights/checkpoints/base")
    assert rc == 0 and "chat APIs: rendered with /weights/checkpoints/base (the router's --chat-model)" in out
    monkeypatch.setenv(deploy_plan.CHAT_MODEL_ENV, "/weights/v0")
    rc, out, _ = _deploy(capsys, "--preset", "mixed")
    assert rc == 0 and deploy_plan.chat_model_line("/weights/v0") in out
    rc, out, err = _deploy(capsys, "--preset", "mixed", "--chat-model", "./base-checkpoint")
    assert rc == 2 and not out
    assert err == [
        "mixfleet deploy: error: chat model './base-checkpoint': must be a directory on the weights "
        "Volume (under /weights/)"
    ]


def test_deploy_hands_modal_the_app_file_with_the_preset(capsys, monkeypatch, tmp_path) -> None:
    # Nothing is deployed: the modal deploy command is captured, then its file is loaded by modal's
    # own CLI from another directory, as ``modal deploy`` loads it (``modal run FILE::FUNCTION
    # --help`` imports the file by path and needs no token).
    import sys

    from mixfleet import deploy as deploy_cmd

    # a fleet left in the environment would be deployed in place of the preset checked
    monkeypatch.setenv(deploy_plan.FLEET_ENV, load_preset("mixed").model_dump_json())
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(deploy_cmd.subprocess, "call", lambda argv, env: calls.append((argv, env)) or 0)
    assert main(["deploy", "--preset", "homogeneous", "--run", "r7"]) == 0
    capsys.readouterr()
    [(argv, env)] = calls
    assert argv[:4] == [sys.executable, "-m", "modal", "deploy"]
    app = Path(argv[4])
    assert app.is_file() and app.samefile(Path(__file__).resolve().parents[2] / "deploy" / "modal_app.py")
    assert env["MIXFLEET_PRESET"] == "homogeneous" and env["MIXFLEET_RUN"] == "r7"
    assert deploy_plan.FLEET_ENV not in env
    done = subprocess.run(
        [sys.executable, "-m", "modal", "run", f"{app}::publish", "--help"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--checkpoint TEXT" in done.stdout

"""``mixfleet deploy``: each kind of bad preset fails with its one-line message before anything is
contacted; ``--dry-run`` prints every server with GPU, format, KV dtype, SGLang argv and autoscaling."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from deploy import plan as deploy_plan
from fleet.specs import load_preset
from images import sglang
from mixfleet.cli import main
from tests.support.procs import mixfleet_argv


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
    assert rc == 2 and len(err) == 3
    assert all("a Modal server needs a GPU" in line for line in err)


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

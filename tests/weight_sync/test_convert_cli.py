"""``mixfleet convert`` as a real subprocess: every format, every bad input, and a kill mid-way.

Bad inputs must give exactly one line on stderr (``mixfleet convert: error: ...`` naming the
problem), a non-zero exit, and no DST (nor a temporary directory left beside it). The bad-input
subprocesses run concurrently (module fixture) to keep the suite fast on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.formats import FORMATS
from tests.support.checkpoints import MoESpec, load_all, write_checkpoint
from tests.support.procs import REPO, mixfleet_argv
from tests.weight_sync.conversion_checks import check_conversion
from weight_sync.convert import convert_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(mixfleet_argv("convert", *args), capture_output=True, text=True, cwd=REPO, env=ENV)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli") / "src"
    write_checkpoint(d, MoESpec())
    return d


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_each_format(ckpt, tmp_path, fmt) -> None:
    dst = tmp_path / "out" / fmt
    r = _run("--format", fmt, str(ckpt), str(dst))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"converted {ckpt} -> {dst}: format {fmt},") and r.stderr == ""
    manifest = check_conversion(ckpt, dst, fmt)
    assert f"{manifest.tensor_count} tensors" in r.stdout
    kept = f", {len(manifest.unquantized)} modules kept BF16 (manifest.json: unquantized)"
    assert r.stdout.rstrip().endswith(kept) == bool(manifest.unquantized) == (fmt == "fp8")


def test_convert_with_sha256_manifest(ckpt, tmp_path) -> None:
    """``--checksum sha256``: every manifest entry is the file's sha256, and the files verify."""
    import hashlib

    from weight_sync.manifest import Manifest, verify_dir

    dst = tmp_path / "sha"
    r = _run("--format", "fp8", "--checksum", "sha256", str(ckpt), str(dst))
    assert r.returncode == 0, r.stderr
    m = Manifest.read(dst)
    assert {e.algorithm for e in m.files.values()} == {"sha256"}
    for name, entry in m.files.items():
        assert entry.digest == hashlib.sha256((dst / name).read_bytes()).hexdigest(), name
    verify_dir(dst)
    bad = _run("--format", "fp8", "--checksum", "md5", str(ckpt), str(tmp_path / "md5"))
    assert bad.returncode != 0 and "unknown checksum 'md5'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "md5").exists()


# --- bad input --------------------------------------------------------------------------------


def _copy(ckpt: Path, root: Path, name: str) -> Path:
    d = root / name
    shutil.copytree(ckpt, d)
    return d


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


Case = Callable[..., None]  # case(name, fmt, src, fragment, dst=None, *flags)


def _make_bad_cases(ckpt: Path, root: Path) -> dict[str, tuple[list[str], str, Path]]:
    """name -> (argv after 'convert', expected stderr fragment, DST that must not appear)."""
    cases: dict[str, tuple[list[str], str, Path]] = {}

    def case(name: str, fmt: str, src: Path, fragment: str, dst: Path | None = None, *flags: str) -> None:
        dst = dst or root / f"dst-{name}"
        cases[name] = (["--format", fmt, *flags, str(src), str(dst)], fragment, dst)

    _bad_config_cases(ckpt, root, case)
    _bad_tensor_cases(ckpt, root, case)
    _bad_file_cases(ckpt, root, case)
    return cases


def _bad_config_cases(ckpt: Path, root: Path, case: Case) -> None:
    """A source whose config.json is missing, not JSON, of another architecture or already quantized."""
    d = _copy(ckpt, root, "no-config")
    (d / "config.json").unlink()
    case("missing_config", "fp8", d, "config.json does not exist")

    d = _copy(ckpt, root, "bad-json")
    (d / "config.json").write_text("{ not json")
    case("config_not_json", "fp8", d, "config.json is not valid JSON")

    d = _copy(ckpt, root, "llama")
    _edit_config(d, architectures=["LlamaForCausalLM"], model_type="llama")
    case("unknown_architecture", "nvfp4", d, "architecture ['LlamaForCausalLM'] is not supported")

    d = _copy(ckpt, root, "quantized")
    _edit_config(d, quantization_config={"quant_method": "fp8"})
    case("already_quantized", "fp8", d, "already quantized")


def _bad_tensor_cases(ckpt: Path, root: Path, case: Case) -> None:
    """A source tensor that is not BF16, holds a NaN, or has a shape the format cannot take."""
    d = _copy(ckpt, root, "f32")
    shard = d / "model-00002-of-00002.safetensors"
    tensors = load_all(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    mine = {k: v for k, v in tensors.items() if index[k] == shard.name}
    victim = sorted(mine)[0]
    mine[victim] = mine[victim].float()
    save_file(mine, str(shard))
    case("non_bf16_tensor", "bf16", d, f"tensor '{victim}' is F32, not BF16")

    d = _copy(ckpt, root, "nan")
    shard = d / "model-00001-of-00002.safetensors"
    mine = {k: v for k, v in load_all(d).items() if index[k] == shard.name}
    victim = sorted(k for k in mine if k.endswith("o_proj.weight"))[0]
    mine[victim][3, 5] = float("nan")
    save_file(mine, str(shard))
    case("nan_in_weight", "fp8", d, f"tensor '{victim}': fp8.quantize: tensor of shape")
    # copied, not quantized, tensors are checked as well: bf16 copies the o_proj above, and every
    # format copies the norms (a NaN policy would otherwise be published to the BF16 groups)
    case("nan_in_copied_weight", "bf16", d, f"tensor '{victim}' of shape [160, 160] contains NaN or Inf")
    d = _copy(ckpt, root, "inf-norm")
    shard = d / "model-00001-of-00002.safetensors"
    mine = {k: v for k, v in load_all(d).items() if index[k] == shard.name}
    norm = sorted(k for k in mine if k.endswith("input_layernorm.weight"))[0]
    mine[norm][7] = float("-inf")
    save_file(mine, str(shard))
    case("inf_in_copied_norm", "fp8", d, f"tensor '{norm}' of shape [160] contains NaN or Inf")

    d = root / "k168"
    write_checkpoint(d, MoESpec(hidden_size=168, head_dim=42, shards=1))
    case("k_not_divisible_nvfp4", "nvfp4", d, "not divisible by the NVFP4 group size 16")

    d = root / "k176"
    write_checkpoint(d, MoESpec(hidden_size=176, head_dim=44, shards=1))
    case("k_not_divisible_mxfp4", "mxfp4", d, "not divisible by the MXFP4 block size 32")

    # k/v with N = 2 x 32 = 64 (as the tiny preset's): SGLang's block-FP8 loader refuses qkv_proj.
    d = root / "kv64"
    write_checkpoint(d, MoESpec(head_dim=32, intermediate_size=256, moe_intermediate_size=128, shards=1))
    case(
        "fp8_quantize_all_refused_shape",
        "fp8",
        d,
        "tensor 'model.layers.0.self_attn.k_proj.weight' of shape [64, 160] cannot be block-FP8 for "
        "SGLang: model.layers.0.self_attn.k_proj has N=64, not a multiple of block_n=128; SGLang requires "
        "it of every shard of a merged linear (here model.layers.0.self_attn.qkv_proj): "
        "layers/quantization/fp8.py 600-610",
        None,
        "--quantize-all",
    )


def _bad_file_cases(ckpt: Path, root: Path, case: Case) -> None:
    """Corrupt or missing safetensors files, a destination that holds something else, an unknown format."""
    d = _copy(ckpt, root, "truncated")
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    case("truncated_safetensors", "fp8", d, "corrupt safetensors file")

    d = _copy(ckpt, root, "garbage-header")
    shard = d / "model-00001-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8:40] = b"\xff" * 32
    shard.write_bytes(bytes(raw))
    case("garbage_safetensors_header", "bf16", d, "corrupt safetensors file")

    d = _copy(ckpt, root, "missing-shard")
    (d / "model-00002-of-00002.safetensors").unlink()
    case("index_names_missing_shard", "bf16", d, "model-00002-of-00002.safetensors', which does not exist")

    held = root / "held"
    convert_checkpoint(ckpt, held, "bf16")
    case("dst_holds_other_conversion", "fp8", ckpt, "already holds a different conversion (format bf16", held)

    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    case(
        "dst_foreign_directory", "bf16", ckpt, "is not an empty directory or a converted checkpoint", foreign
    )

    case("unknown_format", "int3", ckpt, "unknown weight format 'int3'")


@pytest.fixture(scope="module")
def bad_results(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    cases = _make_bad_cases(ckpt, root)
    before = {
        name: (dst.exists(), sorted(os.listdir(dst)) if dst.exists() else None)
        for name, (_, _, dst) in cases.items()
    }
    procs = {
        name: subprocess.Popen(
            mixfleet_argv("convert", *argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=ENV,
        )
        for name, (argv, _, _) in cases.items()
    }
    results = {name: (p.wait(timeout=120), *p.communicate()) for name, p in procs.items()}
    return cases, before, results


BAD_CASES = [
    "missing_config",
    "config_not_json",
    "unknown_architecture",
    "already_quantized",
    "non_bf16_tensor",
    "nan_in_weight",
    "nan_in_copied_weight",
    "inf_in_copied_norm",
    "k_not_divisible_nvfp4",
    "k_not_divisible_mxfp4",
    "fp8_quantize_all_refused_shape",
    "truncated_safetensors",
    "garbage_safetensors_header",
    "index_names_missing_shard",
    "dst_holds_other_conversion",
    "dst_foreign_directory",
    "unknown_format",
]


@pytest.mark.parametrize("name", BAD_CASES)
def test_bad_input_one_line_nonzero_no_dst(bad_results, name) -> None:
    cases, before, results = bad_results
    assert set(BAD_CASES) == set(cases)
    _argv, fragment, dst = cases[name]
    rc, out, err = results[name]
    assert rc != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mixfleet convert: error: ") and fragment in lines[0], lines[0]
    existed, listing = before[name]
    assert dst.exists() == existed and (sorted(os.listdir(dst)) if existed else None) == listing
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.converting")]


# --- killed mid-way ---------------------------------------------------------------------------


def test_killed_converter_leaves_no_dst(tmp_path) -> None:
    """SIGKILL while shards are being written: DST never appears, only a hidden temporary."""
    src = tmp_path / "src"
    spec = MoESpec(
        hidden_size=512, moe_intermediate_size=512, num_experts=8, head_dim=64, num_hidden_layers=3
    )
    write_checkpoint(src, spec)
    dst = tmp_path / "dst"
    proc = subprocess.Popen(
        mixfleet_argv("convert", "--format", "nvfp4", "--workers", "1", str(src), str(dst)),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        tmp: list[Path] = []
        while not tmp and time.monotonic() < deadline and proc.poll() is None:
            tmp = [p for p in tmp_path.iterdir() if p.name.startswith(".dst.converting")]
            if tmp and not any(tmp[0].glob("*.safetensors")):
                tmp = []  # wait until shards are being written
            time.sleep(0.002)
        assert tmp, "the converter never started writing"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists()
    assert [p.name.startswith(".dst.converting") for p in tmp_path.iterdir() if p.name != "src"] == [True]
    # A new run converts from scratch next to the leftover and succeeds.
    r = _run("--format", "bf16", str(src), str(dst))
    assert r.returncode == 0, r.stderr
    assert torch.equal(load_all(dst)["model.norm.weight"], load_all(src)["model.norm.weight"])

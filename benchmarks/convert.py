"""Checkpoint converter throughput and memory: G elements/s per format vs a plain torch copy.

Usage: ``python benchmarks/convert.py [--gib 1.0] [--shard-mib 256] [--formats bf16 fp8 nvfp4 mxfp4]
[--reps 3] [--workers W] [--keep DIR]``

Generates a synthetic BF16 Qwen3-MoE checkpoint of at least ``--gib`` GiB in several shards
(``tests/support/checkpoints.py``), then, in the same run:

- baseline: ``dst.copy_(src)`` of the same number of bytes in 256 MiB pieces, all threads (the
  cost of touching the weights once in memory);
- per format, ``--reps`` times (interleaved: format after format, round after round, so load
  swings hit every format alike): ``convert_checkpoint`` end to end (read, quantize, write,
  checksum every output file and the source, manifest) in a fresh subprocess, so that its peak
  RSS (``VmHWM``) is the conversion's own. Before timing, the subprocess warms up: it imports
  the converter and runs each quantizer once on a tiny tensor, which loads the compiled numba
  kernels from their on-disk cache (or compiles them on a first run); that one-off cost per
  process is the ``warm-up s`` column, not part of the conversion time. The line shows the best
  and the median round: seconds, G source elements/s, the time ratio to the copy (how many plain
  copies one conversion costs), CPU seconds (all threads) with G elements per CPU-second and
  their ratio to the copy's, peak RSS, peak RSS minus the RSS before converting (torch, numba
  and Python themselves), and that delta over the largest source shard;
- the floor set by checksumming the format's output on one core: xxh3-128 (what manifests use)
  and, for comparison, sha256.

On a shared, loaded machine wall times swing with other tenants, CPU time much less; the
per-CPU-second rate times the core count bounds what idle cores can do. Prints the load average
before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_CHILD = r"""
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
import torch
from weight_sync.convert import convert_checkpoint
from weight_sync.formats import fp8, mxfp4, nvfp4

def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

w = torch.ones(128, 128, dtype=torch.bfloat16)
fp8.quantize(w), nvfp4.quantize(w), mxfp4.quantize(w)  # every kernel the conversion calls
warmup = time.perf_counter() - t0
src, dst, fmt, workers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
before = status_kib("VmRSS")
t0, c0 = time.perf_counter(), time.process_time()
m = convert_checkpoint(Path(src), Path(dst), fmt, workers=None if workers == "auto" else int(workers))
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
# VmHWM: this process's own peak RSS (ru_maxrss would include the parent's RSS at fork).
out = {"seconds": dt, "cpu": cpu, "warmup": warmup, "rss_before_kib": before, "peak_kib": status_kib("VmHWM")}
out["bytes"] = m.total_bytes
print(json.dumps(out))
"""


def spec_for(gib: float, shard_mib: int):
    from tests.support.checkpoints import MoESpec

    base = dict(
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_experts=32,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=32000,
        mlp_only_layers=(0,),
        shard_bytes=shard_mib << 20,
        straddle=False,
    )
    per_layer = MoESpec(**base, num_hidden_layers=2).numel() - MoESpec(**base, num_hidden_layers=1).numel()
    fixed = MoESpec(**base, num_hidden_layers=1).numel()
    layers = max(2, 1 + math.ceil((gib * 2**30 / 2 - fixed) / per_layer))
    return MoESpec(**base, num_hidden_layers=layers)


def copy_baseline(nbytes: int) -> tuple[float, float]:
    import torch

    piece = 256 << 20
    src = torch.empty(piece // 2, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, best_cpu = float("inf"), float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        done = 0
        while done < nbytes:
            n = min(piece, nbytes - done) // 2
            dst[:n].copy_(src[:n])
            done += n * 2
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu


def checksum_seconds(directory: Path, algorithm: str) -> float:
    """One core's time to checksum the ``*.safetensors`` files of ``directory`` (page cache)."""
    from weight_sync.checksum import file_digest

    t0 = time.perf_counter()
    for p in sorted(directory.iterdir()):
        if p.suffix == ".safetensors":
            file_digest(p, algorithm)
    return time.perf_counter() - t0


def convert_once(src: Path, dst: Path, fmt: str, workers: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst), fmt, workers],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if r.returncode != 0:
        raise SystemExit(f"{fmt}: conversion failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (BF16)")
    p.add_argument("--shard-mib", type=int, default=256)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "nvfp4", "mxfp4"])
    p.add_argument("--reps", type=int, default=3, help="conversions per format (best and median shown)")
    p.add_argument("--workers", default="auto", help="conversion threads (default: torch's thread count)")
    p.add_argument("--keep", type=Path, default=None, help="generate/keep the checkpoint here")
    args = p.parse_args()

    import torch

    from tests.support.checkpoints import write_checkpoint

    root = args.keep or Path(tempfile.mkdtemp(prefix="mixfleet-bench-convert-"))
    src = root / "src"
    spec = spec_for(args.gib, args.shard_mib)
    try:
        if not (src / "model.safetensors.index.json").exists():
            t0 = time.perf_counter()
            write_checkpoint(src, spec)
            print(f"generated {src} in {time.perf_counter() - t0:.1f}s")
        shards = sorted(src.glob("*.safetensors"))
        src_bytes = sum(s.stat().st_size for s in shards)
        largest = max(s.stat().st_size for s in shards)
        elems = src_bytes // 2
        print(
            f"checkpoint: {spec.num_hidden_layers} layers, {spec.num_experts} experts, "
            f"hidden {spec.hidden_size}, "
            f"{elems / 1e9:.3f} G elements, {src_bytes / 2**30:.2f} GiB in {len(shards)} shards "
            f"(largest {largest / 2**20:.0f} MiB); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, "
            f"{os.cpu_count()} cpus; load average {os.getloadavg()[0]:.2f}"
        )
        t_copy, cpu_copy = copy_baseline(src_bytes)
        head = (
            f"{'case':12s} {'seconds':>8s} {'G elem/s':>9s} {'x copy':>7s} {'cpu s':>7s} {'G el/cpu-s':>10s} "
            f"{'x copy cpu':>10s} {'peak RSS':>9s} {'RSS delta':>10s} {'delta/shard':>11s} {'warm-up s':>9s}"
        )
        print(head)
        print(
            f"{'copy':12s} {t_copy:8.3f} {elems / t_copy / 1e9:9.3f} {1.0:7.1f} {cpu_copy:7.2f} "
            f"{elems / cpu_copy / 1e9:10.3f} {1.0:10.1f}"
        )
        runs: dict[str, list[dict]] = {fmt: [] for fmt in args.formats}
        for _ in range(args.reps):
            for fmt in args.formats:
                runs[fmt].append(convert_once(src, root / f"out-{fmt}", fmt, str(args.workers)))
        for fmt in args.formats:
            by_time = sorted(runs[fmt], key=lambda r: r["seconds"])
            for label, res in (("best", by_time[0]), ("median", by_time[len(by_time) // 2])):
                dt, cpu = res["seconds"], res["cpu"]
                delta = (res["peak_kib"] - res["rss_before_kib"]) * 1024
                name = f"{fmt} {label}"
                print(
                    f"{name:12s} {dt:8.3f} {elems / dt / 1e9:9.3f} {dt / t_copy:7.1f} {cpu:7.2f} "
                    f"{elems / cpu / 1e9:10.3f} {cpu / cpu_copy:10.1f} "
                    f"{res['peak_kib'] / 1024:8.0f}M {delta / 2**20:9.0f}M {delta / largest:11.2f} "
                    f"{res['warmup']:9.2f}"
                )
        print(f"{'format':8s} {'out GiB':>8s} {'xxh3 s':>8s} {'sha256 s':>9s}  (checksum floor, one core)")
        for fmt in args.formats:
            dst = root / f"out-{fmt}"
            out_bytes = runs[fmt][-1]["bytes"]
            print(
                f"{fmt:8s} {out_bytes / 2**30:8.3f} {checksum_seconds(dst, 'xxh3_128'):8.3f} "
                f"{checksum_seconds(dst, 'sha256'):9.3f}"
            )
            shutil.rmtree(dst, ignore_errors=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

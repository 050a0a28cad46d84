"""Quantizer throughput: G elements/s per format, and the ratio to a plain torch copy of the same bytes.

Usage: ``python benchmarks/formats.py [--shape N K] [--reps R] [--threads T] [--dequantize]``

Measures, in one process and interleaved round by round (so background load hits every line
alike), ``quantize`` for each format on one random BF16 tensor, and ``dst.copy_(w)`` into a
preallocated BF16 tensor of the same shape (the memory-copy baseline; the quantizers also allocate
their outputs, which the baseline does not). Each line reports its best round: wall time, G
elements/s by wall time, ``ratio`` = quantize wall time / copy wall time, and the CPU time of the
whole process (all threads) with G elements per CPU-second. On a shared machine the wall numbers
move with other load (the load average is printed); CPU time moves much less. The one-off cost of
loading the compiled kernels (numba's on-disk cache; a first run compiles them) is printed
separately and not part of any line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weight_sync.formats import fp8, mxfp4, nvfp4  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=(4096, 4096), metavar=("N", "K"))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dequantize", action="store_true", help="also time dequantize (float32 output)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, k = args.shape
    torch.manual_seed(0)
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    dst = torch.empty_like(w)
    gs = nvfp4.global_scale(w)
    cases = {
        "copy (baseline)": lambda: dst.copy_(w),
        "fp8": lambda: fp8.quantize(w),
        "nvfp4": lambda: nvfp4.quantize(w),
        "nvfp4 (given weight_scale_2)": lambda: nvfp4.quantize(w, weight_scale_2=gs),
        "mxfp4": lambda: mxfp4.quantize(w),
    }
    if args.dequantize:
        packed = {name: mod.quantize(w) for name, mod in (("fp8", fp8), ("nvfp4", nvfp4), ("mxfp4", mxfp4))}
        cases["fp8 dequantize"] = lambda: fp8.dequantize(packed["fp8"])
        cases["nvfp4 dequantize"] = lambda: nvfp4.dequantize(packed["nvfp4"])
        cases["mxfp4 dequantize"] = lambda: mxfp4.dequantize(packed["mxfp4"])
    best = dict.fromkeys(cases, float("inf"))
    best_cpu = dict.fromkeys(cases, float("inf"))
    t0 = time.perf_counter()
    for f in cases.values():  # warm-up: the kernels (loaded from numba's cache or compiled), worker threads
        f()
    warmup = time.perf_counter() - t0
    load0 = os.getloadavg()[0]
    for _ in range(args.reps):
        for name, f in cases.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
            best_cpu[name] = min(best_cpu[name], time.process_time() - c0)
    elems = n * k
    print(
        f"tensor {n}x{k} bfloat16 ({elems / 1e6:.1f} M elements, {w.nbytes / 2**20:.0f} MiB), "
        f"torch {torch.__version__}, {args.threads} threads, best of {args.reps} rounds, "
        f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; warm-up (kernel load) {warmup:.2f}s"
    )
    base = best["copy (baseline)"]
    print(f"{'case':30s} {'wall ms':>8s} {'G elem/s':>9s} {'ratio':>6s} {'CPU ms':>8s} {'G elem/CPU-s':>13s}")
    for name, t in best.items():
        c = best_cpu[name]
        print(
            f"{name:30s} {t * 1e3:8.2f} {elems / t / 1e9:9.3f} {t / base:6.1f} "
            f"{c * 1e3:8.2f} {elems / c / 1e9:13.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

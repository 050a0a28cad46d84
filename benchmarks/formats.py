"""Quantizer throughput: G elements/s per format, and the ratio to a plain torch copy of the same bytes.

Usage: ``python benchmarks/formats.py [--shape N K] [--reps R] [--threads T]``

Measures, in one process and interleaved round by round (so background load hits every line
alike), the wall time of ``quantize`` for each format on one random BF16 tensor, and of
``dst.copy_(w)`` into a preallocated BF16 tensor of the same shape (the memory-copy baseline). Each
line reports the best round. ``ratio`` = quantize time / copy time (how many copies one
quantization costs). Prints the load average, since the machine is shared.
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
    best = dict.fromkeys(cases, float("inf"))
    for f in cases.values():  # warm-up: allocator, thread pool
        f()
    for _ in range(args.reps):
        for name, f in cases.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    elems = n * k
    print(f"tensor {n}x{k} bfloat16 ({elems / 1e6:.1f} M elements, {w.nbytes / 2**20:.0f} MiB), "
          f"torch {torch.__version__}, {args.threads} threads, best of {args.reps} rounds, "
          f"load average {os.getloadavg()[0]:.2f}")
    base = best["copy (baseline)"]
    print(f"{'case':30s} {'ms':>9s} {'G elem/s':>9s} {'ratio to copy':>14s}")
    for name, t in best.items():
        print(f"{name:30s} {t * 1e3:9.2f} {elems / t / 1e9:9.3f} {t / base:14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

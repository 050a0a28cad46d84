"""Warm numba's on-disk kernel cache at image build time (``python -m images.warm``).

Runs every weight quantizer once on bfloat16 and float32 input, which compiles each fused kernel
for both input widths and writes it to numba's cache (``NUMBA_CACHE_DIR``), so a container built
from the image starts converting without compiling. numba reuses a cached kernel only on a CPU
of the same model; elsewhere it compiles again (correct, just slower to start).
"""

from __future__ import annotations

import sys


def warm() -> list[str]:
    """Quantize a 128x128 tensor in every format and dtype; returns what ran (``fmt/dtype``)."""
    import importlib

    import torch

    from core.formats import QUANTIZED

    done = []
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.linspace(-3.0, 3.0, 128 * 128, dtype=torch.float32).reshape(128, 128).to(dtype)
        for fmt in QUANTIZED:
            quantizer = importlib.import_module(f"weight_sync.formats.{fmt}")
            quantizer.quantize(w, quantizer.global_scale(w)) if fmt == "nvfp4" else quantizer.quantize(w)
            done.append(f"{fmt}/{str(dtype).removeprefix('torch.')}")
    return done


if __name__ == "__main__":
    print("numba kernels warmed:", ", ".join(warm()), file=sys.stderr)

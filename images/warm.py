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
    import torch

    from weight_sync.formats import fp8, mxfp4, nvfp4

    done = []
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.linspace(-3.0, 3.0, 128 * 128, dtype=torch.float32).reshape(128, 128).to(dtype)
        fp8.quantize(w)
        mxfp4.quantize(w)
        nvfp4.quantize(w, nvfp4.global_scale(w))
        done += [f"{fmt}/{str(dtype).removeprefix('torch.')}" for fmt in ("fp8", "mxfp4", "nvfp4")]
    return done


if __name__ == "__main__":
    print("numba kernels warmed:", ", ".join(warm()), file=sys.stderr)

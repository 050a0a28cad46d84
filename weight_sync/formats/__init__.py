"""Bit-exact weight formats: ``bf16``, ``fp8`` (128x128 blocks), ``nvfp4`` (ModelOpt), ``mxfp4`` (OCP MX).

Each format is a module with ``quantize(w) -> dict[str, Tensor]`` and ``dequantize(dict) -> float32``
(``nvfp4`` also has ``global_scale``); ``fp4`` holds the E2M1 element code they share. CPU only,
importing nothing else from the project: the quantizers run fused numba kernels (``_kernels``,
compiled on first use and cached on disk) on the tensors' bits; dequantizing is torch.
"""

from __future__ import annotations

"""The numba options every kernel of the project compiles with (plain values: ``core`` imports
no numba; ``engine`` and ``weight_sync`` pass them to ``numba.njit``).

``NJIT``: release the GIL (callers run disjoint slices on their own threads), cache the machine
code on disk, IEEE float32 arithmetic (``fastmath`` off: correctly rounded, subnormals kept) and
numpy's error model, no bounds checks. ``FASTMATH_DOT``: the ``fastmath`` flags of kernels whose
float sums may be reordered and fused (dot products: vectorized partial sums, fused multiply-add).
"""

from __future__ import annotations

from typing import Any

NJIT: dict[str, Any] = {
    "nogil": True,
    "cache": True,
    "fastmath": False,
    "error_model": "numpy",
    "boundscheck": False,
}

FASTMATH_DOT: frozenset[str] = frozenset({"contract", "reassoc"})

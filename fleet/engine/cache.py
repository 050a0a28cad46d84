"""Per-sequence KV cache.

One ``SequenceCache`` holds the keys and values of one sequence for every layer, in a single
growable tensor ``[layers, 1, 2 * kv_heads, capacity, head_dim]`` (per layer: K heads, then V
heads, in SDPA's 4-D layout, so one copy stores both and reads are views). With ``kv_cache_dtype="fp8_e4m3"``
the storage is ``float8_e4m3fn`` and values are written as SGLang does with its default
per-tensor scale of 1.0 (clamped to +-448 so no value turns into NaN); reads dequantize to
float32. Positions ``[0, length)`` are valid; nothing past ``length`` is ever read.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")


def storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The tensor dtype a cache with this ``--kv-cache-dtype`` stores K and V in.

    ``auto`` keeps the compute dtype (float32): the engine's BF16 baseline. ``bf16`` stores
    through bfloat16 (what an SGLang BF16 model's cache holds). ``fp8_e4m3`` stores float8.
    """
    if kv_cache_dtype == "auto":
        return torch.float32
    if kv_cache_dtype == "bf16":
        return torch.bfloat16
    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")


class SequenceCache:
    """KV cache of one sequence. Create it with ``Model.new_sequence()``.

    ``length`` is the number of positions whose keys and values are stored; ``Model.forward``
    appends to it. ``truncate(n)`` forgets positions ``>= n`` (e.g. to re-score or retract);
    ``free()`` releases the memory (``length`` becomes 0; the cache can be reused).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_length: int, geometry: tuple) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.max_length = max_length
        self.geometry = geometry
        self.length = 0
        self._kv: torch.Tensor | None = None
        self._layers: list[torch.Tensor] = []  # per-layer views [1, 2 * kv_heads, capacity, head_dim]

    @property
    def capacity(self) -> int:
        return 0 if self._kv is None else self._kv.shape[3]

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions (``0 <= length <= self.length``)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def free(self) -> None:
        """Drop the stored keys and values; afterwards ``length == 0``."""
        self._kv = None
        self._layers = []
        self.length = 0

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` positions in total (grows by doubling, keeps contents)."""
        if needed > self.max_length:
            raise ValueError(
                f"sequence of {needed} tokens exceeds the model's maximum context {self.max_length}"
            )
        if needed <= self.capacity:
            return
        cap = max(64, self.capacity)
        while cap < needed:
            cap *= 2
        cap = min(cap, self.max_length)
        kv = torch.zeros(self.num_layers, 1, 2 * self.num_kv_heads, cap, self.head_dim, dtype=self.dtype)
        if self._kv is not None and self.length:
            kv[:, :, :, : self.length] = self._kv[:, :, :, : self.length]
        self._kv = kv
        self._layers = list(kv.unbind(0))

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """Store ``kv`` (``[1, 2 * kv_heads, T, head_dim]`` float32: K heads then V heads) at positions
        ``start .. start+T`` of ``layer`` (``reserve`` must have made room)."""
        if self.dtype == torch.float8_e4m3fn:
            kv = kv.clamp(-FP8_MAX, FP8_MAX)
        self._layers[layer][:, :, start : start + kv.shape[2]] = kv

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, end)`` of ``layer``, float32 ``[1, kv_heads, end, head_dim]`` each."""
        kv = self._layers[layer][:, :, :end]
        if self.dtype != torch.float32:
            kv = kv.float()
        return kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]

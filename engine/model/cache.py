"""KV cache: one ``SequenceCache`` per sequence, stored in slots of shared pools.

A ``KVPool`` holds the keys and values of many sequences of one geometry (layers, KV heads,
head dim, storage dtype, max context) and one capacity class in one tensor
``[layers, slots, 2 * kv_heads, capacity, head_dim]`` (per layer and slot: K heads, then V heads,
in SDPA's 4-D layout, so one copy stores both and reads are views). Capacity classes are 64, 128,
256, ... up to the maximum context; a sequence lives in the smallest class that holds it and
moves up (copying its positions) when it outgrows it, so memory stays within about twice what
the sequences use, as with per-sequence doubling. Because the sequences of a class share one
tensor, ``Model.forward`` runs the attention of every decoding sequence of a class as one SDPA
call over the pool's slots (masked to each slot's length) instead of one call per sequence.

Pools are shared by every model of the same geometry (a weight swap keeps serving the running
sequences' caches). A slot returns to its pool when its cache is freed or garbage-collected; a
pool with no sequence left drops its tensor.

With ``kv_cache_dtype="fp8_e4m3"`` the storage is ``float8_e4m3fn`` and values are written as
SGLang does with its default per-tensor scale of 1.0 (clamped to +-448 so no value turns into
NaN); reads dequantize to float32. Positions ``[0, length)`` of a slot are valid; positions past
``length`` hold zeros or the same sequence's older values (a slot is zeroed when handed out), which
attention masks out.

Memory: a class's tensor has room for as many slots as were in use at once (rounded up to a power
of two), so sequences of similar length share it tightly; a batched decode call reads the slots
``[0, highest in the step]`` and positions up to the longest sequence of the class in the step.
"""

from __future__ import annotations

import heapq
import threading
import weakref

import torch

FP8_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
MIN_CAPACITY = 64


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


def to_storage(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kv`` (float32) cast to the storage ``dtype`` (fp8: clamped to +-448 first)."""
    if dtype == torch.float8_e4m3fn:
        kv = kv.clamp(-FP8_MAX, FP8_MAX)
    return kv.to(dtype)


class KVPool:
    """Slots of one capacity class: ``kv`` ``[layers, slots, 2 * kv_heads, capacity, head_dim]``
    (``None`` while no slot is in use). ``acquire`` hands out the lowest free slot, growing the
    tensor (doubling the slots, keeping contents) when all are taken, so the slots in use stay
    packed at the front; ``release`` returns one (thread-safe: caches may be collected anywhere).
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.capacity = capacity
        self.kv: torch.Tensor | None = None
        self._free: list[int] = []
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._in_use

    def acquire(self) -> int:
        """A free slot, zeroed (a previous sequence's values could be non-finite, and attention
        multiplies masked positions' values by 0)."""
        with self._lock:
            if not self._free:
                self._grow()
            self._in_use += 1
            slot = heapq.heappop(self._free)
            assert self.kv is not None
            self.kv[:, slot].zero_()
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._in_use -= 1
            if self._in_use == 0:  # nobody left: give the memory back
                self.kv = None
                self._free = []
            else:
                heapq.heappush(self._free, slot)

    def _grow(self) -> None:
        old = 0 if self.kv is None else self.kv.shape[1]
        slots = max(4, 2 * old)
        kv = torch.zeros(
            self.num_layers, slots, 2 * self.num_kv_heads, self.capacity, self.head_dim, dtype=self.dtype
        )
        if self.kv is not None:
            kv[:, :old] = self.kv
        self.kv = kv
        self._free.extend(range(old, slots))
        heapq.heapify(self._free)


_pools: dict[tuple, KVPool] = {}
_pools_lock = threading.Lock()


def pool_for(
    geometry: tuple, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int
) -> KVPool:
    """The process-wide pool of this geometry and capacity class (created on first use)."""
    key = (geometry, capacity)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = KVPool(num_layers, num_kv_heads, head_dim, dtype, capacity)
        return pool


class SequenceCache:
    """KV cache of one sequence. Create it with ``Model.new_sequence()``.

    ``length`` is the number of positions whose keys and values are stored; ``Model.forward``
    appends to it. ``truncate(n)`` forgets positions ``>= n`` (e.g. to re-score or retract);
    ``free()`` releases the memory (``length`` becomes 0; the cache can be reused). ``pool`` and
    ``slot`` say where the positions live (``None`` / -1 before the first ``reserve``).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_length: int,
        geometry: tuple,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.max_length = max_length
        self.geometry = geometry
        self.length = 0
        self.pool: KVPool | None = None
        self.slot = -1
        self._release: weakref.finalize | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.pool is None else self.pool.capacity

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions (``0 <= length <= self.length``)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def free(self) -> None:
        """Drop the stored keys and values; afterwards ``length == 0``."""
        self._leave()
        self.length = 0

    def _leave(self) -> None:
        if self._release is not None:
            self._release()  # returns the slot (once)
        self._release = None
        self.pool = None
        self.slot = -1

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` positions in total (moves to a larger class, keeps contents)."""
        if needed > self.max_length:
            raise ValueError(
                f"sequence of {needed} tokens exceeds the model's maximum context {self.max_length}"
            )
        if needed <= self.capacity:
            return
        cap = MIN_CAPACITY
        while cap < needed:
            cap *= 2
        cap = min(cap, self.max_length)
        pool = pool_for(self.geometry, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, cap)
        slot = pool.acquire()
        assert pool.kv is not None
        if self.pool is not None and self.length:
            assert self.pool.kv is not None
            pool.kv[:, slot, :, : self.length] = self.pool.kv[:, self.slot, :, : self.length]
        self._leave()
        self.pool, self.slot = pool, slot
        self._release = weakref.finalize(self, pool.release, slot)

    def layer(self, layer: int) -> torch.Tensor:
        """This sequence's storage for ``layer``: a view ``[1, 2 * kv_heads, capacity, head_dim]``
        (valid until the next ``reserve`` of any cache)."""
        assert self.pool is not None and self.pool.kv is not None
        return self.pool.kv[layer, self.slot : self.slot + 1]

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """Store ``kv`` (``[1, 2 * kv_heads, T, head_dim]`` float32: K heads then V heads) at positions
        ``start .. start+T`` of ``layer`` (``reserve`` must have made room)."""
        self.layer(layer)[:, :, start : start + kv.shape[2]] = to_storage(kv, self.dtype)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, end)`` of ``layer``, float32 ``[1, kv_heads, end, head_dim]`` each."""
        kv = self.layer(layer)[:, :, :end]
        if self.dtype != torch.float32:
            kv = kv.float()
        return kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]

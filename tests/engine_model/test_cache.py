"""The pooled KV cache: batched decode attention across slots and capacity classes, slot reuse.

References are computed independently of batching: the same sequence run alone on a fresh
cache (full recomputation, or the same incremental steps alone for low-precision caches, whose
rounding depends on which positions went through the cache). Tolerances as in test_reference.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.model.cache import MIN_CAPACITY
from engine.model.model import load_model
from weight_sync.base_model import VOCAB_SIZE

ATOL = 1e-4


def _ids(n: int, seed: int, vocab: int = VOCAB_SIZE) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv", ["auto", "bf16", "fp8_e4m3"])
def test_mixed_step_across_capacity_classes_matches_each_sequence_alone(tiny_dir: Path, kv: str) -> None:
    model = load_model(tiny_dir, kv_cache_dtype=kv)
    # Prefix lengths around the class boundaries (64 -> 128): 63 + 1 stays in the first class,
    # 64 + 1 moves to the next one in this very step; 130 sits in the third.
    prefixes = [5, 63, 64, 100, 130, 20]
    seqs = [_ids(p + 4, 30 + i) for i, p in enumerate(prefixes)]
    caches = [model.new_sequence() for _ in prefixes]
    spare = [model.new_sequence() for _ in prefixes]
    for seq, p, c, s in zip(seqs, prefixes, caches, spare, strict=True):
        model.forward([seq[:p]], [s])  # occupies slots between ours, freed below: holes
        model.forward([seq[:p]], [c])
    for s in spare[::2]:
        s.free()
    # One step: four sequences decode one token, one runs a 3-token chunk, one does nothing.
    feed = [
        seqs[0][5:6],
        seqs[1][63:64],
        seqs[2][64:65],
        seqs[3][100:103],
        seqs[4][130:131],
        torch.empty(0, dtype=torch.long),
    ]
    out = model.forward(feed, caches)
    assert [c.length for c in caches] == [6, 64, 65, 103, 131, 20]
    assert caches[2].capacity == 2 * MIN_CAPACITY and caches[1].capacity == MIN_CAPACITY
    # A second, decode-only step in three pools.
    step = model.forward([seq[c.length : c.length + 1] for seq, c in zip(seqs, caches, strict=True)], caches)
    for i, (seq, p) in enumerate(zip(seqs, prefixes, strict=True)):
        n_new = feed[i].numel()
        alone = model.new_sequence()
        model.forward([seq[:p]], [alone])
        ref = model.forward([seq[p : p + n_new]], [alone])[0] if n_new else torch.empty(0, VOCAB_SIZE)
        ref_step = model.forward([seq[p + n_new : p + n_new + 1]], [alone])[0]
        torch.testing.assert_close(out[i], ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(step[i], ref_step, atol=ATOL, rtol=0)
        if kv == "auto":  # float32 cache: incremental equals full recomputation
            full = model.forward([seq[: p + n_new + 1]], [model.new_sequence()])[0]
            torch.testing.assert_close(step[i][0], full[-1], atol=ATOL, rtol=0)


def test_slots_return_to_the_pool_and_are_reused_clean(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    a, b = model.new_sequence(), model.new_sequence()
    model.forward([_ids(10, 1), _ids(12, 2)], [a, b])
    pool = a.pool
    assert pool is b.pool and pool.in_use >= 2 and a.slot != b.slot
    used = pool.in_use
    slot_b = b.slot
    # Poison b's storage (as a sequence that produced non-finite values would leave it), drop it.
    with torch.inference_mode():  # the storage is an inference tensor, made inside forward
        pool.kv[:, slot_b] = float("nan")
    del b
    gc.collect()
    assert pool.in_use == used - 1
    c = model.new_sequence()
    ids = _ids(7, 3)
    first = model.forward([ids[:6]], [c])[0]
    assert c.slot == slot_b  # the lowest free slot
    step = model.forward([ids[6:7], _ids(1, 4)], [c, a])
    full = model.forward([ids], [model.new_sequence()])[0]
    torch.testing.assert_close(first, full[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(step[0][0], full[6], atol=ATOL, rtol=0)
    assert torch.isfinite(step[1]).all()


def test_a_pool_with_no_sequence_left_gives_its_memory_back(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    # A class no other test uses (lengths 1025..2048), so no other cache holds a slot in it.
    c = model.new_sequence()
    model.forward([_ids(1100, 5)], [c])
    pool = c.pool
    assert pool.capacity == 2048 and pool.kv is not None and pool.in_use == 1
    c.free()
    assert c.pool is None and c.length == 0 and pool.in_use == 0 and pool.kv is None


def test_caches_survive_a_model_of_the_same_shape(tiny_dir: Path) -> None:
    """A weight swap keeps the running sequences' caches: a second model of the same geometry
    decodes them (batched with its own new sequences) exactly as the first would."""
    first, second = load_model(tiny_dir), load_model(tiny_dir)
    ids = _ids(20, 6)
    old = first.new_sequence()
    first.forward([ids[:19]], [old])
    new = second.new_sequence()
    second.forward([ids[:10]], [new])
    step = second.forward([ids[19:20], ids[10:11]], [old, new])
    full = first.forward([ids], [first.new_sequence()])[0]
    torch.testing.assert_close(step[0][0], full[19], atol=ATOL, rtol=0)
    torch.testing.assert_close(step[1][0], full[10], atol=ATOL, rtol=0)


@pytest.mark.parametrize("order", ["slot order", "reversed"])
def test_decode_step_in_and_out_of_slot_order_matches_each_alone(tiny_dir: Path, order: str) -> None:
    """A step whose rows are the pool's slots 0..n-1 in order runs without scatter / gather around
    the batched call; reversed rows take the general path. Both equal decoding each alone."""
    gc.collect()  # caches other tests dropped give their slots back
    model = load_model(tiny_dir, kv_cache_dtype="fp8_e4m3")  # a geometry whose pools start empty here
    seqs = [_ids(9 + i, 50 + i) for i in range(4)]
    caches = [model.new_sequence() for _ in seqs]
    model.forward([s[:-1] for s in seqs], caches)
    assert caches[0].pool.in_use == 4, "another live cache holds a slot of this pool"
    assert [c.slot for c in caches] == [0, 1, 2, 3]
    idx = [0, 1, 2, 3] if order == "slot order" else [3, 2, 1, 0]
    step = model.forward([seqs[i][-1:] for i in idx], [caches[i] for i in idx])
    for row, i in enumerate(idx):
        alone = model.new_sequence()
        model.forward([seqs[i][:-1]], [alone])
        torch.testing.assert_close(step[row], model.forward([seqs[i][-1:]], [alone])[0], atol=ATOL, rtol=0)

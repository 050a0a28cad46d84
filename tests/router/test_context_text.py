"""router.context_text: the JSON text of a session's engine input is that of the input, byte for
byte (against the standard library's encoding), whatever sequence of extensions, forks, other
sessions and evictions came before; the cache stays within its bound."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from router.context_text import ContextText


def reference(ids: np.ndarray) -> bytes:
    return json.dumps(ids.tolist(), separators=(",", ":")).encode()


def ids_of(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


def test_the_next_turn_of_a_session_reuses_its_text_and_is_exact() -> None:
    cache = ContextText(1 << 20)
    first = ids_of([1, 22, 333])
    assert cache.encode("s", first) == b"[1,22,333]"
    text = cache.encode("s", first)
    assert cache.encode("s", first) is text  # the same input: the cached text itself
    longer = ids_of([1, 22, 333, 4_294_967_295, 0])
    assert cache.encode("s", longer) == reference(longer)
    assert len(cache) == 1 and cache.size == longer.nbytes + len(reference(longer))


@pytest.mark.parametrize(
    "after",
    [[1, 22], [9, 22, 333, 4], [1, 22, 334, 5], [1], [7]],
    ids=["shorter", "first-differs", "last-differs", "prefix", "other"],
)
def test_an_input_that_does_not_extend_the_cached_one_is_encoded_whole(after: list[int]) -> None:
    cache = ContextText(1 << 20)
    cache.encode("s", ids_of([1, 22, 333]))
    assert cache.encode("s", ids_of(after)) == reference(ids_of(after))
    assert cache.encode("s", ids_of([*after, 8])) == reference(ids_of([*after, 8]))


def test_random_turns_of_many_sessions_always_give_the_inputs_text() -> None:
    rng = random.Random(7)
    cache = ContextText(6_000)  # small: evictions happen
    sessions: dict[str, list[int]] = {}
    for _ in range(3_000):
        sid = f"s{rng.randrange(12)}"
        ids = sessions.get(sid, [])
        action = rng.random()
        if action < 0.7:  # the next turn: output, then new tokens
            ids = ids + [rng.randrange(2**32) for _ in range(rng.randrange(0, 40))]
        elif action < 0.8:  # a fork: history edited somewhere
            if ids:
                ids = list(ids)
                ids[rng.randrange(len(ids))] ^= 1
        elif action < 0.9:
            ids = ids[: rng.randrange(len(ids) + 1)]
        else:
            cache.forget(sid)
        if not ids:
            ids = [rng.randrange(100)]
        sessions[sid] = ids
        array = ids_of(ids) if rng.random() < 0.8 else np.array(ids, dtype=np.int64)
        assert cache.encode(sid, array) == reference(array)
        assert cache.size <= cache.max_bytes


def test_the_bound_keeps_the_sessions_kept_and_drops_only_stale_entries_for_new_ones() -> None:
    one = ids_of(list(range(100)))
    per_entry = one.nbytes + len(reference(one))
    now = [0.0]
    cache = ContextText(5 * per_entry, stale_s=60.0, clock=lambda: now[0])
    sids = [f"s{i}" for i in range(10)]
    first = {sid: cache.encode(sid, one) for sid in sids}  # agents in rounds: more than the bound
    assert len(cache) == 5 and cache.size == 5 * per_entry
    again = {sid: cache.encode(sid, one) for sid in sids}
    kept = [sid for sid in sids if again[sid] is first[sid]]  # the cached text itself: a hit
    assert kept == sids[:5]  # the same five hit every round; the others encode whole
    assert all(again[sid] == reference(one) for sid in sids)
    cache.forget("s0")
    cache.forget("gone")
    assert cache.encode("s9", one) is not first["s9"] and len(cache) == 5  # s9 took s0's room
    now[0] = 61.0  # every entry unused for longer than stale_s: the oldest (s1) makes room
    s5 = cache.encode("s5", one)
    assert len(cache) == 5 and cache.encode("s5", one) is s5
    s1 = cache.encode("s1", one)  # not kept any more: encoded whole, then kept in s2's room
    assert s1 is not first["s1"] and cache.encode("s1", one) is s1
    assert cache.encode("s3", one) is first["s3"]
    none = ContextText(0)
    assert none.encode("a", one) == reference(one) and len(none) == 0 and none.size == 0
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        ContextText(-1)

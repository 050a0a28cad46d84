"""router.context_text: the JSON text of a session's engine input is that of the input, byte for
byte (against the standard library's encoding), and the context a stored turn left is exactly
its input and output after exactly its number of turns, whatever sequence of extensions, forks,
other sessions and evictions came before; the cache stays within its bound."""

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
    assert cache.encode("s", first) == (b"[1,22,333]", False)
    assert cache.encode("s", first) == (b"[1,22,333]", True)
    longer = ids_of([1, 22, 333, 4_294_967_295, 0])
    assert cache.encode("s", longer) == (reference(longer), True)
    assert cache.encode("other", longer) == (reference(longer), False)
    assert len(cache) == 2 and cache.size == 2 * (longer.nbytes + len(reference(longer)))


@pytest.mark.parametrize(
    "after",
    [[1, 22], [9, 22, 333, 4], [1, 22, 334, 5], [1], [7]],
    ids=["shorter", "first-differs", "last-differs", "prefix", "other"],
)
def test_an_input_that_does_not_extend_the_cached_one_is_encoded_whole(after: list[int]) -> None:
    cache = ContextText(1 << 20)
    cache.encode("s", ids_of([1, 22, 333]))
    assert cache.encode("s", ids_of(after)) == (reference(ids_of(after)), False)
    assert cache.encode("s", ids_of([*after, 8])) == (reference(ids_of([*after, 8])), True)


def test_a_stored_turn_notes_the_context_it_left_for_its_own_input_only() -> None:
    cache = ContextText(1 << 20)
    first = ids_of([1, 22, 333])
    assert cache.known("s") is None
    cache.encode("s", first)
    assert cache.known("s") is None  # sent, not yet stored
    cache.stored("s", ids_of([1, 22, 333]), 1, ids_of([5]))  # equal, but not the input encoded
    assert cache.known("s") is None
    cache.stored("s", first, 1, ids_of([5, 6]))
    turns, context = cache.known("s")
    assert turns == 1 and context.tolist() == [1, 22, 333, 5, 6]
    assert cache.size == first.nbytes + len(reference(first)) + 8
    cache.encode("s", ids_of([1, 22, 333, 5, 6, 7]))  # the next turn is sent: its turn not stored
    assert cache.known("s") is None
    cache.stored("other", first, 1, ids_of([5]))  # no entry: nothing noted
    assert cache.known("other") is None
    cache.forget("s")
    assert cache.known("s") is None and len(cache) == 0 and cache.size == 0


def test_random_turns_of_many_sessions_always_give_the_inputs_text() -> None:
    rng = random.Random(7)
    cache = ContextText(6_000)  # small: entries are not kept, stale ones dropped
    sessions: dict[str, list[int]] = {}
    stored: dict[str, tuple[int, list[int]]] = {}  # the store: turns and context of each session
    reused = known = 0
    for step in range(3_000):
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
        if (have := cache.known(sid)) is not None:
            known += 1
            assert (have[0], have[1].tolist()) == stored[sid], step
        text, hit = cache.encode(sid, array)
        assert text == reference(array), step
        if rng.random() < 0.7:  # the turn is stored: its output follows in the session's context
            output = [rng.randrange(2**32) for _ in range(rng.randrange(1, 8))]
            turns = stored.get(sid, (0, []))[0] + 1
            stored[sid] = (turns, ids + output)
            cache.stored(sid, array, turns, ids_of(output))
            sessions[sid] = ids + output
        assert cache.size <= cache.max_bytes
        reused += hit
    assert reused > 500 and known > 300  # the cache was exercised, not only bypassed


def test_the_bound_keeps_the_sessions_kept_and_drops_only_stale_entries_for_new_ones() -> None:
    one = ids_of(list(range(100)))
    per_entry = one.nbytes + len(reference(one))
    now = [0.0]
    cache = ContextText(5 * per_entry, stale_s=60.0, clock=lambda: now[0])
    sids = [f"s{i}" for i in range(10)]

    def reused(*which: str) -> list[str]:
        return [sid for sid in which if cache.encode(sid, one)[1]]

    assert reused(*sids) == []  # agents in rounds: more sessions than the bound holds
    assert len(cache) == 5 and cache.size == 5 * per_entry
    assert reused(*sids) == sids[:5]  # the same five are reused every round; the others encode whole
    assert reused(*sids) == sids[:5]
    cache.forget("s0")
    cache.forget("gone")
    assert reused("s9", "s9") == ["s9"] and len(cache) == 5  # s9 took s0's room
    now[0] = 61.0  # every entry unused for longer than stale_s: the oldest (s1) makes room
    assert reused("s5", "s5") == ["s5"] and len(cache) == 5
    assert reused("s1", "s1", "s3") == ["s1", "s3"]  # s1 again in s2's room; s3 still kept
    none = ContextText(0)
    assert none.encode("a", one) == (reference(one), False) and len(none) == 0 and none.size == 0
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        ContextText(-1)

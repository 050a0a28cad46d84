"""The retention rule (``weight_sync/retention.py``), pure: checked exhaustively against a
brute-force reading of its contract over every small run.

Every run of up to five versions in two formats (bf16 and fp8), each version absent, full, or a
delta over any lower number (which may be absent: a broken chain), with every pointer and
``keep`` 1-3, and a protected version or none: the kept set is the smallest set that holds the
roots the contract names and is closed under "a kept delta's committed base is kept", and the
bf16 stream also keeps every root another format keeps.
"""

from __future__ import annotations

import itertools

import pytest

from weight_sync.retention import Layer, StreamView, retained, to_delete

MAX_V = 5
FULL = Layer()


def _layers(n: int):
    """Every stream over versions 1..n: each version absent, full, or a delta over a lower one."""
    choices = []
    for v in range(1, n + 1):
        choices.append([None, FULL, *(Layer("delta", b) for b in range(1, v))])
    for combo in itertools.product(*choices):
        yield {v: layer for v, layer in zip(range(1, n + 1), combo, strict=True) if layer is not None}


def _closure(versions: dict[int, Layer], roots: set[int]) -> set[int]:
    kept = set(roots)
    while True:
        more = {
            versions[v].base_version
            for v in kept
            if versions[v].kind == "delta" and versions[v].base_version in versions
        } - kept
        if not more:
            return kept
        kept |= more


def _expected(streams: dict[str, StreamView], keep: int, protect: set[int]) -> dict[str, set[int]]:
    every = sorted({v for s in streams.values() for v in s.versions})
    newest = set(every[len(every) - keep :]) if keep < len(every) else set(every)
    roots = {}
    for fmt, s in streams.items():
        r = {v for v in s.versions if v in newest or v in protect}
        if s.pointer is not None:
            r |= {v for v in s.versions if v >= s.pointer}
        roots[fmt] = r
    if "bf16" in streams:
        roots["bf16"] |= {v for r in roots.values() for v in r} & streams["bf16"].versions.keys()
    return {fmt: _closure(s.versions, roots[fmt]) for fmt, s in streams.items()}


def _cases():
    fp8_layers = [{}, {1: FULL, 2: Layer("delta", 1), 4: FULL}, {3: FULL, 5: Layer("delta", 3)}]
    for n in range(1, MAX_V + 1):
        for bf16 in _layers(n):
            if not bf16:
                continue
            for fp8 in fp8_layers:
                for pointer in [None, *bf16]:
                    yield bf16, fp8, pointer


def test_retained_matches_the_contract_on_every_small_run() -> None:
    checked = 0
    for bf16, fp8, pointer in _cases():
        fp8_pointer = max(fp8) if fp8 else None
        streams = {"bf16": StreamView(bf16, pointer), "fp8": StreamView(fp8, fp8_pointer)}
        for keep in (1, 2, 3):
            for protect in (set(), {2}):
                got = retained(streams, keep, protect=protect)
                want = _expected(streams, keep, protect)
                assert got == want, (bf16, fp8, pointer, keep, protect)
                # invariants any answer must hold
                for fmt, s in streams.items():
                    assert got[fmt] <= s.versions.keys()
                    if s.pointer is not None and s.pointer in s.versions:
                        assert s.pointer in got[fmt]
                    for v in got[fmt]:
                        layer = s.versions[v]
                        if layer.kind == "delta" and layer.base_version in s.versions:
                            assert layer.base_version in got[fmt]  # no kept delta loses its base
                deleted = to_delete(streams, keep, protect=protect)
                for fmt, s in streams.items():
                    assert set(deleted[fmt]) | got[fmt] == s.versions.keys()
                    assert not set(deleted[fmt]) & got[fmt]
                checked += 1
    assert checked > 10_000


def test_a_long_delta_chain_keeps_every_base_it_resolves_through() -> None:
    chain = {0: FULL, **{v: Layer("delta", v - 1) for v in range(1, 40)}, 40: FULL, 41: Layer("delta", 40)}
    kept = retained({"bf16": StreamView(chain, 41)}, 1)
    assert kept == {"bf16": frozenset({40, 41})}
    kept = retained({"bf16": StreamView(chain, 41)}, 3)  # 39 is a delta: its whole chain stays
    assert kept["bf16"] == frozenset(range(42))


def test_bf16_keeps_what_validate_and_delta_publishes_read_for_other_formats() -> None:
    bf16 = {v: FULL for v in range(1, 8)}
    fp8 = {v: FULL for v in range(1, 8)}
    # a lagging fp8 replica serves 3 (protected); a publish in progress committed fp8 8 only
    fp8[8] = FULL
    kept = retained({"bf16": StreamView(bf16, 7), "fp8": StreamView(fp8, 7)}, 2, protect={3})
    assert kept["fp8"] == {3, 7, 8}
    assert kept["bf16"] == {3, 7}  # bf16 has no 8; 3 is what validate compares the fp8 group with


def test_newest_counts_versions_of_the_run_not_of_each_format() -> None:
    """A format added later (bootstrap) keeps what the run's newest versions are in it."""
    kept = retained(
        {"bf16": StreamView({1: FULL, 2: FULL, 3: FULL}, 3), "nvfp4": StreamView({3: FULL}, 3)}, 2
    )
    assert kept == {"bf16": frozenset({2, 3}), "nvfp4": frozenset({3})}


def test_cycles_and_missing_bases_end_the_walk() -> None:
    versions = {2: Layer("delta", 3), 3: Layer("delta", 2), 5: Layer("delta", 4)}
    assert retained({"fp8": StreamView(versions, 5)}, 1) == {"fp8": frozenset({5})}
    assert retained({"fp8": StreamView(versions, 5)}, 3) == {"fp8": frozenset({2, 3, 5})}


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_refused(keep) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        retained({"bf16": StreamView({1: FULL}, 1)}, keep)

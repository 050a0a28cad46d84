"""trainer.batch's vectorized decoder against the router's standard-library decoder: the same
bytes decode to the same values, token for token."""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from router import records
from router.turn_data import TurnData
from trainer.batch import BatchFormatError, decode_batch


def _turn(
    rng: random.Random, index: int, group: str, n: int, vocab: int, context: int = 0, fork: bool = False
) -> TurnData:
    output = [rng.randrange(vocab) for _ in range(n)]
    supports, values = [], []
    for tok in output:
        if rng.random() < 0.2:
            supports.append([])
            values.append([])
            continue
        k = rng.randint(1, 40)
        ids = sorted(set(rng.sample(range(vocab), k)) | {tok})
        lps = [math.log(rng.random() + 1e-9) for _ in ids]
        supports.append(ids)
        values.append(lps)
    mu = [
        values[i][supports[i].index(t)] if supports[i] else math.log(rng.random() + 1e-9)
        for i, t in enumerate(output)
    ]
    raw = [None if rng.random() < 0.1 else math.log(rng.random() + 1e-9) for _ in output]
    half = n // 2
    spans = [{"version": 3, "start": 0, "end": half}, {"version": 4, "start": half, "end": n}] if n else []
    return TurnData(
        turn=index,
        group=group,
        replica=f"{group}-0",
        context=0 if fork else context,
        fork={"stored": context, "common": rng.randrange(context + 1)} if fork else None,
        append_ids=[rng.randrange(vocab) for _ in range(rng.randint(0 if context else 1, 30))],
        output_ids=output,
        logprobs=mu,
        raw_logprobs=raw,
        support_ids=supports,
        support_logprobs=values,
        weight_versions=[s for s in spans if s["end"] > s["start"]],
        finish_reason={"type": "length", "length": n},
        timings={},
        moved_from=None,
    )


def _batch(seed: int, f16: bool, vocab: int = 300_000) -> bytes:
    rng = random.Random(seed)
    items = []
    for s in range(5):
        group = ("cpu-bf16", "cpu-fp8", "cpu-nvfp4")[s % 3]
        turns = _trajectory(rng, group, 3, vocab)
        blobs = [records.encode_turn(t, f16=f16) for t in turns]
        header = {"session_id": f"s{s}", "group": group, "reward": float(s % 2), "metadata": {}}
        header["version_age"] = {"min": 0, "max": 1, "mean": 0.5}
        items.append((header, blobs))
    return records.encode_batch("lease-1", 2, items)


def _trajectory(rng: random.Random, group: str, n_turns: int, vocab: int) -> list[TurnData]:
    """Turns of one trajectory, each placed after its segment's tokens; some turns fork."""
    turns: list[TurnData] = []
    length = 0
    for i in range(n_turns):
        fork = i > 0 and rng.random() < 0.3
        t = _turn(rng, i, group, rng.randint(0, 60), vocab, context=length, fork=fork)
        turns.append(t)
        length = t.context + len(t.append_ids) + len(t.output_ids)
    return turns


def _inputs(turns: list[dict]) -> list[list[int]]:
    """Each JSON turn's engine input, rebuilt from its segment (context, then its append)."""
    out, segment = [], []
    for t in turns:
        if t["fork"] is not None or not out:
            segment = []
        assert t["context"] == len(segment)
        segment = segment + t["append_ids"]
        out.append(segment)
        segment = segment + t["output_ids"]
    return out


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_values_as_the_standard_library_decoder(seed: int, f16: bool) -> None:
    data = _batch(seed, f16)
    want = records.decode_batch(data)
    got = decode_batch(data)
    assert got.lease_id == "lease-1" and got.held_back == 2
    tokens, mu, raw, sizes, ids, lps, versions, groups = [], [], [], [], [], [], [], []
    for t in want["trajectories"]:
        for turn in t["turns"]:
            for rec in turn["records"]:
                tokens.append(rec["token_id"])
                mu.append(rec["logprob"])
                raw.append(math.nan if rec["raw_logprob"] is None else rec["raw_logprob"])
                sizes.append(len(rec["support_ids"]))
                ids.extend(rec["support_ids"])
                lps.extend(rec["support_logprobs"])
                versions.append(-1 if rec["weight_version"] is None else rec["weight_version"])
                groups.append(turn["group"])
    assert got.token_ids.tolist() == tokens
    np.testing.assert_array_equal(got.logprobs, np.array(mu, dtype=np.float32))
    np.testing.assert_array_equal(got.raw_logprobs, np.array(raw, dtype=np.float32))
    assert np.diff(got.support_offsets).tolist() == sizes
    assert got.support_ids.tolist() == ids
    np.testing.assert_array_equal(got.support_logprobs, np.array(lps, dtype=np.float32))
    assert got.versions.tolist() == versions
    assert [got.groups[i] for i in got.group_index] == groups
    assert len(got.trajectories) == 5 and len(got.turns) == 15
    inputs = [x for t in want["trajectories"] for x in _inputs(t["turns"])]
    assert [t["input_ids"].tolist() for t in got.turns] == inputs
    assert [t["append_ids"].tolist() for t in got.turns] == [
        t["append_ids"] for traj in want["trajectories"] for t in traj["turns"]
    ]
    assert (got.version_ages == -1).all()  # the header names no trainer version
    arrays = [v for v in vars(got).values() if isinstance(v, np.ndarray)]
    arrays += [t["input_ids"] for t in got.turns]
    assert len(arrays) > 11 and all(a.flags.writeable for a in arrays)  # torch.from_numpy takes them


def test_truncated_and_foreign_bytes_are_refused_with_a_message() -> None:
    data = _batch(5, False)
    with pytest.raises(BatchFormatError, match="truncated"):
        decode_batch(data[: len(data) - 7])
    with pytest.raises(BatchFormatError, match="magic"):
        decode_batch(b"XYZ\x01" + data[4:])
    with pytest.raises(BatchFormatError, match="trailing"):
        decode_batch(data + b"\x00")


def test_turns_of_both_precisions_in_one_batch() -> None:
    rng = random.Random(7)
    turns = _trajectory(rng, "cpu-fp8", 4, 300_000)
    blobs = [records.encode_turn(t, f16=i % 2 == 1) for i, t in enumerate(turns)]
    header = {"session_id": "s", "group": "cpu-fp8", "reward": 1.0, "metadata": {}}
    data = records.encode_batch("lease-2", 0, [(header, blobs)], trainer_version=5)
    turns_json = records.decode_batch(data)["trajectories"][0]["turns"]
    want = [lp for t in turns_json for r in t["records"] for lp in r["support_logprobs"]]
    got = decode_batch(data)
    np.testing.assert_array_equal(got.support_logprobs, np.array(want, dtype=np.float32))
    assert got.trainer_version == 5
    assert got.version_ages.tolist() == [5 - v for v in got.versions.tolist()]


@pytest.mark.parametrize(
    "values",
    [
        [0, 1, 127, 128, 300, 2**14, 2**21 + 5, 2**28, 2**35 + 1, 2**42, 2**49, 2**56 + 3, 2**63 - 1],
        [128, 300, 2**14, 2**21 + 5, 2**28, 2**35 + 1, 2**42, 2**49, 2**56 - 1, 1000, 151_935],
    ],
    ids=["one to nine bytes", "multi-byte only, up to eight bytes"],
)
def test_varints_of_every_length_decode_exactly(values: list[int]) -> None:
    """Ids and gaps of 1 to 9 varint bytes (values up to 2**63 - 1) next to one-byte ones, and
    a stream of multi-byte values only (the word-at-a-time decode of large vocabularies)."""
    output = values + [5, 6]
    supports = [[v] for v in values] + [[0, 127, 128, 2**40], [2**55, 2**56 - 1]]
    turn = TurnData(
        turn=0,
        group="g",
        replica="g-0",
        append_ids=values,
        output_ids=output,
        logprobs=[0.0] * len(output),
        raw_logprobs=[None] * len(output),
        support_ids=supports,
        support_logprobs=[[0.0] * len(s) for s in supports],
    )
    data = records.encode_batch("l", 0, [({"session_id": "s"}, [records.encode_turn(turn)])])
    got = decode_batch(data)
    assert got.token_ids.tolist() == output
    assert got.turns[0]["input_ids"].tolist() == values
    assert got.support_ids.tolist() == [i for s in supports for i in s]


@pytest.mark.parametrize("seed", range(4))
def test_corrupted_bytes_decode_or_raise_batch_format_error(seed: int) -> None:
    """Flipped, dropped and inserted bytes never escape as another exception type."""
    data = _batch(seed, seed % 2 == 1)
    rng = random.Random(seed)
    for _ in range(200):
        with contextlib.suppress(BatchFormatError):
            decode_batch(_broken(data, rng))


def _broken(data: bytes, rng: random.Random) -> bytes:
    """``data`` with 1-3 bytes changed, dropped or inserted."""
    broken = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(broken))
        kind = rng.random()
        if kind < 0.6:
            broken[at] = rng.randrange(256)
        elif kind < 0.8:
            del broken[at]
        else:
            broken.insert(at, rng.randrange(256))
    return bytes(broken)


@pytest.mark.parametrize("seed", range(4))
def test_both_decoders_refuse_the_same_corrupted_batches(seed: int) -> None:
    """A corrupted batch is refused by both decoders (each with its own format error, nothing
    else) or decoded by both to the same values: neither hands out records the other would not,
    e.g. a turn block with bytes left over, a header missing a field, a support run holding
    more or fewer ids than its sizes say, a context its segment does not hold."""
    data = _batch(seed, seed % 2 == 1)
    rng = random.Random(seed)
    refused = 0
    for _ in range(300):
        broken = _broken(data, rng)
        try:
            want = records.decode_batch(broken)
        except records.RecordFormatError:
            want = None
        try:
            got = decode_batch(broken)
        except BatchFormatError:
            got = None
        assert (want is None) == (got is None), broken
        if want is None:
            refused += 1
            continue
        recs = [r for t in want["trajectories"] for turn in t["turns"] for r in turn["records"]]
        assert got.token_ids.tolist() == [r["token_id"] for r in recs]
        assert got.support_ids.tolist() == [i for r in recs for i in r["support_ids"]]
        np.testing.assert_array_equal(got.logprobs, np.array([r["logprob"] for r in recs], dtype=np.float32))
    assert 100 < refused < 300  # most corruptions are caught; changed log-prob bytes cannot be


@pytest.mark.parametrize("others", [b"\x05", b"\x85\x02"], ids=["one-byte", "two-byte"])
def test_a_varint_over_nine_bytes_is_refused(others: bytes) -> None:
    """Next to many one-byte values (the sparse path) and to many two-byte ones (the byte-column
    path), also when the long value's length does not fit a byte."""
    from trainer.batch import _varint_values

    for run in (10, 300):
        stream = bytes([0x81] * run + [0x01]) + others * 1000
        with pytest.raises(BatchFormatError, match="longer than 9 bytes"):
            _varint_values(np.frombuffer(stream, dtype=np.uint8))


def test_a_version_beyond_int64_or_below_zero_is_a_batch_format_error() -> None:
    """A trainer version or weight version the kit's int64 arrays cannot hold (or a negative one,
    which -1 'unknown' would hide) is a :class:`BatchFormatError` naming it, never an
    OverflowError; the largest one decodes."""
    rng = random.Random(2)
    turn = _turn(rng, 0, "g", 4, 1000)
    header = {"session_id": "s", "group": "g", "reward": 1.0, "metadata": {}}
    top = 2**63 - 1
    ok = decode_batch(records.encode_batch("L", 0, [(header, [records.encode_turn(turn)])], top))
    assert ok.trainer_version == top and ok.version_ages.tolist() == [top - v for v in ok.versions.tolist()]
    for bad in (2**63, 2**64 + 5, -1):
        data = records.encode_batch("L", 0, [(header, [records.encode_turn(turn)])], trainer_version=bad)
        with pytest.raises(BatchFormatError, match=f"batch header: trainer_version {bad} is not a version"):
            decode_batch(data)
        spans = [{"version": bad, "start": 0, "end": 2}, {"version": 1, "start": 2, "end": 4}]
        for weight_versions in (spans[:1], spans):  # the one-span path and the general one
            odd = records.encode_turn(replace(turn, weight_versions=weight_versions))
            with pytest.raises(BatchFormatError, match=f"turn 0: weight version {bad} is not a version"):
                decode_batch(records.encode_batch("L", 0, [(header, [odd])], trainer_version=3))


def _blocks(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every turn block of a batch, read by hand from its layout."""
    from trainer.batch import _varint_at

    size, pos = _varint_at(data, 4)
    pos += size
    out = []
    while pos < len(data):
        size, pos = _varint_at(data, pos)
        out.append((pos, size))
        pos += size
    return out


def _offsets(message: str) -> list[int]:
    import re

    return [int(x) for x in re.findall(r"offset (\d+)", message)]


def test_a_corrupted_turn_block_is_refused_naming_offsets_in_the_batch() -> None:
    """Both decoders name where a corrupted turn block lies in the batch's bytes: the block's own
    offset, and only offsets inside the batch (the standard-library decoder named offsets within
    the block, as if from the batch's start, and no block; the kit named an offset millions of
    bytes past the batch's end for a header length that overran its block)."""
    data = _batch(3, False)
    blocks = _blocks(data)
    at, size = next((b, s) for b, s in blocks[1:] if data[b + 5] >= 0x80 and s < 16_000)
    overrun = bytearray(data)
    overrun[at + 5 : at + 7] = b"\xff\x7f"  # the header's length: 16383 bytes, more than the block
    not_json = bytearray(data)
    not_json[at + 7] = ord("}")  # the header's first byte
    for broken in (bytes(overrun), bytes(not_json)):
        decoders = ((records.decode_batch, records.RecordFormatError), (decode_batch, BatchFormatError))
        for decode, error in decoders:
            with pytest.raises(error) as info:
                decode(broken)
            message = str(info.value)
            named = _offsets(message)
            assert named and all(0 <= x < len(data) for x in named), message
            assert any(at <= x < at + size for x in named), message
    with pytest.raises(BatchFormatError, match=f"turn block at offset {at}: its header of 16383 bytes"):
        decode_batch(bytes(overrun))
    with pytest.raises(records.RecordFormatError, match=f"block at offset {at}"):
        records.decode_batch(bytes(overrun))


def test_a_batch_header_without_its_lease_or_a_corrupted_section_name_is_refused_by_both() -> None:
    """Corruptions the kit decoded and the standard-library decoder refused: a batch header whose
    ``lease_id`` or ``held_back`` key, or a trajectory whose ``session_id`` key, is corrupted
    (the kit answered a batch with ``lease_id`` None: trajectories the trainer could never
    acknowledge), and a section name that is not UTF-8 (the kit skipped the ``routed_experts``
    section as unknown: the turn's routes silently gone)."""
    from router.turn_data import ROUTES_SECTION, RoutedExperts

    rng = random.Random(11)
    turn = _turn(rng, 0, "g", 3, 1000)
    routes = RoutedExperts(0, 3, 2, np.arange(6, dtype="<i4").tobytes())
    turn = replace(turn, sections={ROUTES_SECTION: routes.to_section()})
    header = {"session_id": "s", "group": "g", "reward": 1.0, "metadata": {}}
    data = records.encode_batch("L", 0, [(header, [records.encode_turn(turn)])])
    assert decode_batch(data).turns[0]["routes"].shape == (3, 2)
    name = ROUTES_SECTION.encode()
    at = data.rindex(name)
    for old, new in (
        (b'"lease_id"', b'"lXase_id"'),
        (b'"held_back"', b'"hXld_back"'),
        (b'"session_id"', b'"sXssion_id"'),
    ):
        broken = data.replace(old, new, 1)
        with pytest.raises(records.RecordFormatError):
            records.decode_batch(broken)
        with pytest.raises(BatchFormatError, match=old.decode().strip('"')):
            decode_batch(broken)
    broken = data[: at + 1] + b"\xff" + data[at + 2 :]
    with pytest.raises(records.RecordFormatError, match="not UTF-8"):
        records.decode_batch(broken)
    with pytest.raises(BatchFormatError, match="section name .* is not UTF-8"):
        decode_batch(broken)


def test_a_corrupted_routes_section_or_fork_is_refused_by_both_naming_where() -> None:
    """A routed_experts section whose counts do not match its bytes: the standard-library decoder
    raised a bare ValueError (from ``RoutedExperts.from_section``, not its RecordFormatError), and
    the kit named an offset counted from the section's start; a fork without its ``stored`` /
    ``common`` fields was refused by one decoder only."""
    from router.turn_data import ROUTES_SECTION, RoutedExperts

    rng = random.Random(12)
    first = _turn(rng, 0, "g", 3, 1000)
    routes = RoutedExperts(0, 3, 2, np.arange(6, dtype="<i4").tobytes())
    first = replace(first, sections={ROUTES_SECTION: routes.to_section()})
    context = len(first.append_ids) + len(first.output_ids)
    forked = _turn(rng, 1, "g", 2, 1000, context=context, fork=True)
    header = {"session_id": "s", "group": "g", "reward": 1.0, "metadata": {}}
    data = records.encode_batch("L", 0, [(header, [records.encode_turn(first), records.encode_turn(forked)])])
    section = data.index(ROUTES_SECTION.encode()) + len(ROUTES_SECTION) + 1  # its size, then its bytes
    assert data[section : section + 3] == bytes([0, 3, 2])  # start 0, 3 rows, width 2
    broken = data[: section + 1] + bytes([9]) + data[section + 2 :]  # 9 rows
    with pytest.raises(records.RecordFormatError, match="session s, turn 0 .*routed_experts"):
        records.decode_batch(broken)
    with pytest.raises(BatchFormatError, match=f"bad routed_experts section at offset {section} "):
        decode_batch(broken)
    broken = data.replace(b'"common"', b'"cXmmon"', 1)
    with pytest.raises(records.RecordFormatError, match="common"):
        records.decode_batch(broken)
    with pytest.raises(BatchFormatError, match="turn 1: bad fork"):
        decode_batch(broken)

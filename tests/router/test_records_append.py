"""Append-only trajectories (issue 20): the storage bound at the study's shape, forks and
segments in both decoders, optional sections, and how a turn's input is placed on the stored
context."""

from __future__ import annotations

import json

import numpy as np
import pytest

from router import records
from router.segments import as_ids, locate, pack, place, unpack
from router.turn_data import TurnData
from tests.support.sessions import SessionShape, minimal_bytes, synthetic_session
from trainer.batch import BatchFormatError
from trainer.batch import decode_batch as decode_arrays

HEADER = {"session_id": "s", "group": "g", "reward": 1.0, "metadata": {}, "version_age": {}}


@pytest.mark.parametrize("f16", [False, True])
def test_a_long_session_stores_and_serves_each_token_once_within_the_bound(f16: bool) -> None:
    """60 turns growing from 4K to ~98K tokens (64 generated + 1,500 tool tokens a turn, Qwen3
    vocabulary): stored and served bytes <= 1.2 x (every token once as a varint id + the
    generated tokens' records)."""
    shape = SessionShape()
    turns = synthetic_session(shape)
    blobs = [records.encode_turn(t, f16=f16) for t in turns]
    context = turns[-1].prompt_len + len(turns[-1].output_ids)
    assert 95_000 < context < 100_000
    bound = 1.2 * minimal_bytes(turns, f16=f16)
    stored = sum(map(len, blobs))
    served = records.encode_batch("L", 0, [(HEADER, blobs)], trainer_version=7)
    assert stored <= bound and len(served) <= bound, (stored, len(served), bound)
    got = decode_arrays(served)
    want = [x for t in turns for x in (*t.append_ids, *t.output_ids)]
    assert got.sequence_ids.tolist() == want and got.sequence_offsets.tolist() == [0, context]
    assert int(got.loss_mask.sum()) == len(got) == shape.turns * shape.generated
    assert got.turns[-1]["input_ids"].size == turns[-1].prompt_len


def _turn(
    index: int, append: list[int], output: list[int], context: int, fork: dict | None = None
) -> TurnData:
    n = len(output)
    return TurnData(
        turn=index,
        group="g",
        replica="r",
        append_ids=append,
        output_ids=output,
        logprobs=[-0.5] * n,
        raw_logprobs=[-0.25] * n,
        support_ids=[[t] for t in output],
        support_logprobs=[[-0.5]] * n,
        context=context,
        fork=fork,
    )


def test_a_fork_starts_a_segment_in_both_decoders() -> None:
    turns = [
        _turn(0, [1, 2, 3], [4, 5], 0),
        _turn(1, [6], [7], 5),
        _turn(2, [1, 2, 9], [10], 0, {"stored": 7, "common": 2}),
        _turn(3, [], [11], 4),
    ]
    data = records.encode_batch("L", 0, [(HEADER, [records.encode_turn(t) for t in turns])])
    js = records.decode_batch(data)["trajectories"][0]["turns"]
    assert [(t["context"], t["fork"]) for t in js] == [
        (0, None),
        (5, None),
        (0, {"stored": 7, "common": 2}),
        (4, None),
    ]
    got = decode_arrays(data)
    assert got.sequence_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 1, 2, 9, 10, 11]
    assert got.sequence_offsets.tolist() == [0, 7, 12] and got.segment_trajectory.tolist() == [0, 0]
    assert got.loss_mask.nonzero()[0].tolist() == got.token_positions.tolist() == [3, 4, 6, 10, 11]
    assert [t["segment"] for t in got.turns] == [0, 0, 1, 1]
    assert [t["input_ids"].tolist() for t in got.turns] == [
        [1, 2, 3],
        [1, 2, 3, 4, 5, 6],
        [1, 2, 9],
        [1, 2, 9, 10],
    ]


def test_a_context_that_is_not_the_segments_length_is_refused() -> None:
    turns = [_turn(0, [1, 2], [3], 0), _turn(1, [4], [5], 2)]  # the segment holds 3 tokens
    data = records.encode_batch("L", 0, [(HEADER, [records.encode_turn(t) for t in turns])])
    with pytest.raises(BatchFormatError, match="context 2 but its segment holds 3"):
        decode_arrays(data)
    with pytest.raises(ValueError, match="a fork starts at 0"):
        _turn(0, [1], [2], 3, {"stored": 3, "common": 0})


def test_sections_round_trip_and_are_skipped_by_the_trainer_decoder() -> None:
    plain = _turn(0, [300, 2], [7, 8], 0)
    extra = TurnData(**{**plain.__dict__, "sections": {"unknown": b"\x00\x01\x02", "x": b""}})
    blob = records.encode_turn(extra, f16=True)
    assert blob[4] == 0x03  # float16 and sections
    back = records.decode_turn(blob)
    assert back.sections == {"unknown": b"\x00\x01\x02", "x": b""}
    assert back.to_json() == records.decode_turn(records.encode_turn(plain, f16=True)).to_json()
    data = records.encode_batch("L", 0, [(HEADER, [blob, records.encode_turn(_turn(1, [9], [10], 4))])])
    got = decode_arrays(data)
    assert got.token_ids.tolist() == [7, 8, 10] and got.sequence_ids.tolist() == [300, 2, 7, 8, 9, 10]
    with pytest.raises(records.RecordFormatError, match="do not fit"):
        records.decode_turn(blob[:-4] + b"\xff\xff\x00\x00")


def test_an_input_is_placed_after_the_stored_context_or_forks() -> None:
    stored = pack([5, 6, 7])
    assert unpack(stored) == [5, 6, 7] and len(stored) == 12
    assert place([1, 2], b"") == place([1, 2], b"")
    at = place([5, 6, 7, 8, 9], stored)
    assert (at.context, list(at.append), at.fork) == (3, [8, 9], None)
    at = place([5, 6, 7], stored)
    assert (at.context, list(at.append), at.fork) == (3, [], None)
    at = place([5, 0, 7, 8], stored)
    assert (at.context, list(at.append), at.fork) == (0, [5, 0, 7, 8], {"stored": 3, "common": 1})
    at = place([5, 6], stored)  # shorter than the stored context: history was cut
    assert (at.context, at.fork) == (0, {"stored": 3, "common": 2})
    assert np.frombuffer(pack([2**31 - 1]), dtype="<u4").tolist() == [2**31 - 1]
    whole, at = locate(None, [8], stored)  # appended tokens extend the stored context
    assert (whole.tolist(), at.context, at.append, at.fork) == ([5, 6, 7, 8], 3, [8], None)
    assert whole.dtype == np.uint32  # the engine's input stays one array, never a list of the context
    whole, at = locate([5, 6, 1], None, stored)
    assert (whole.tolist(), at.context, at.fork) == ([5, 6, 1], 0, {"stored": 3, "common": 2})
    whole, at = locate(np.asarray([5, 6, 7, 9], dtype=np.int64), None, stored)
    assert (whole.tolist(), at.context, at.append, at.fork) == ([5, 6, 7, 9], 3, [9], None)
    refused = (
        ([1, -1], r"\[1\] = -1 is not a token id"),
        ([2.0], r"\[0\] = 2\.0 is not"),
        (["3"], r'\[0\] = "3" is not'),
        ([4, True], r"\[1\] = true is not"),
    )
    for bad, why in refused:
        with pytest.raises(ValueError, match=why):
            locate(None, bad, stored)
    with pytest.raises(ValueError, match="no stored context"):
        locate(None, [], b"")


def test_a_bool_is_no_token_id_wherever_it_is() -> None:
    """``array`` takes ``True`` / ``False`` as 1 / 0; ``as_ids`` refuses them, naming the first
    entry that is not an id, among few 0 / 1 ids (only those are looked at) or many (every entry
    is), and takes the integers 0 and 1 as before."""
    many = [7] * 1000
    few_low = many[:500] + [0, 1, 1] + many[500:]
    assert as_ids(few_low).tolist() == few_low
    assert as_ids([0, 1] * 600).tolist() == [0, 1] * 600
    for ids, where in (
        (many[:500] + [0, True] + many[500:], 501),  # few entries of 0 or 1
        ([0, 1] * 300 + [False] + [1, 0] * 300, 600),  # mostly 0 and 1: every entry is looked at
        ([True], 0),
        ([5, 1 << 40, True], 1),  # the first entry that is no id is named, whatever it is
    ):
        with pytest.raises(
            ValueError, match=rf"^\[{where}\] = \S+ is not a token id \(an integer in 0\.\."
        ) as exc:
            as_ids(ids)
        assert str(exc.value).split(" = ")[1].split()[0] == json.dumps(ids[where])
    with pytest.raises(
        ValueError, match=r"^\[3\] = true is not a token id \(an integer in 0\.\.2147483647\)$"
    ):
        as_ids((9, 9, 9, True, 2**31), 2**31 - 1)
    with pytest.raises(ValueError, match="bool array is not a list of token ids"):
        as_ids(np.array([True, False]))
    with pytest.raises(ValueError) as exc:  # a long value is cut
        as_ids(["x" * 100])
    assert str(exc.value) == '[0] = "' + "x" * 59 + " ... is not a token id (an integer in 0..4294967295)"

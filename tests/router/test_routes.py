"""Routed experts (issue 21) as the turn block's ``routed_experts`` section: the section round-trips
through the standard-library decoder and ``trainer.batch`` in every id width, the engine answer's
routes become the section, and an answer without them (an engine without
``--enable-return-routed-experts``) is refused naming the flag."""

from __future__ import annotations

import base64
import struct

import numpy as np
import pytest

from router.engine_answer import parse_turn
from router.records import decode_batch, decode_turn, encode_batch, encode_stored, encode_turn
from router.turn_data import ROUTES_SECTION, RoutedExperts, TurnData
from trainer.batch import decode_batch as trainer_decode_batch


def _routes(values: list[int], rows: int) -> RoutedExperts:
    return RoutedExperts(0, rows, len(values) // rows, struct.pack(f"<{len(values)}i", *values))


def _turn(routes: RoutedExperts | None, n_in: int = 3, n_out: int = 2) -> TurnData:
    return TurnData(
        turn=0,
        group="g",
        replica="r",
        append_ids=list(range(1, n_in + 1)),
        output_ids=list(range(10, 10 + n_out)),
        logprobs=[-0.5] * n_out,
        raw_logprobs=[-0.25] * n_out,
        support_ids=[[1, 4]] * n_out,
        support_logprobs=[[-1.0, -0.5]] * n_out,
        sections={} if routes is None else {ROUTES_SECTION: routes.to_section()},
    )


@pytest.mark.parametrize("high", [7, 300, 70000, -1], ids=["u8", "u16", "i32", "negative"])
def test_the_section_round_trips_in_both_decoders(high: int) -> None:
    values = [0, 1, 2, 3, high, 5, 6, 2, 1, 0, 3, high]  # 4 rows (3 inputs + 2 outputs - 1) of 3
    routes = _routes(values, 4)
    turn = _turn(routes)
    blob, stored = encode_stored(turn)
    assert decode_turn(blob).routed_experts == stored.routed_experts == routes
    assert decode_turn(blob).routed_experts.values() == values
    plain = encode_turn(_turn(None))
    batch = encode_batch("L", 0, [({"session_id": "s1"}, [blob]), ({"session_id": "s2"}, [plain])])
    std = decode_batch(batch)
    assert std["trajectories"][0]["turns"][0]["routed_experts"] == {
        "start": 0, "rows": 4, "width": 3, "data": base64.b64encode(routes.data).decode()
    }  # fmt: skip
    assert "routed_experts" not in std["trajectories"][1]["turns"][0]
    fast = trainer_decode_batch(batch)
    np.testing.assert_array_equal(fast.routes(0, 3), np.array(values, dtype=np.int32).reshape(4, 1, 3))
    assert fast.routes(1, 3) is None
    assert fast.token_ids.tolist() == [10, 11] * 2


def test_an_answers_routes_become_the_section_and_their_absence_is_refused() -> None:
    values = list(range(4 * 6))
    body = {
        "output_ids": [10, 11],
        "meta_info": {
            "output_token_logprobs": [[-0.5, 10, None], [-0.5, 11, None]],
            "routed_experts": base64.b64encode(struct.pack("<24i", *values)).decode(),
        },
    }
    kw = dict(index=0, group="g", replica="r", input_ids=[1, 2, 3], moved_from=None, timings={})
    turn = parse_turn(body, sampling={"sampling_mask": False}, routed_experts=True, **kw)
    assert (turn.routed_experts.rows, turn.routed_experts.width) == (4, 6)
    assert turn.routed_experts.values() == values
    del body["meta_info"]["routed_experts"]
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        parse_turn(body, sampling={"sampling_mask": False}, routed_experts=True, **kw)


def test_a_segments_turns_assemble_its_routes() -> None:
    from router.turn_data import TurnData as T

    first = _turn(_routes(list(range(4 * 2)), 4))  # 3 appended + 2 outputs: positions 0..3
    later = RoutedExperts(4, 3, 2, struct.pack("<6i", *range(100, 106)))  # positions 4..6
    fields = {**_turn(None, n_in=1, n_out=2).__dict__, "turn": 1, "context": 5}
    second = T(**{**fields, "sections": {ROUTES_SECTION: later.to_section()}})
    data = encode_batch("L", 0, [({"session_id": "s"}, [encode_turn(first), encode_turn(second)])])
    batch = trainer_decode_batch(data)
    seq = batch.sequence_routes(1, 2)  # 5 + 1 appended + 2 outputs = 8 positions
    assert seq.shape == (8, 1, 2)
    want = [[0, 1], [2, 3], [4, 5], [6, 7], [100, 101], [102, 103], [104, 105], [-1, -1]]
    assert seq[:, 0].tolist() == want

"""A long synthetic agent session as recorded turns (no engine), and the storage bound of the
append-only record format (issue 20): the bytes stored and served per trajectory against what
its tokens need at least, each context token once as a varint id and each generated token's
behavior record."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from router.turn_data import TurnData

STUDY_VOCAB = 151_936  # Qwen3's vocabulary


@dataclass(frozen=True)
class SessionShape:
    """The study's shape: a first prompt, then per turn generated and tool tokens; supports of
    1..``max_support`` ids (top-p candidate sets) per generated token."""

    turns: int = 60
    prompt: int = 4_000
    generated: int = 64
    tool: int = 1_500
    max_support: int = 40
    vocab: int = STUDY_VOCAB


def synthetic_session(shape: SessionShape, seed: int = 0) -> list[TurnData]:
    """The session's turns as the router records them: turn 0 appends the prompt, every later
    turn the previous turn's tool tokens; each generates ``shape.generated`` tokens."""
    rng = random.Random(seed)
    turns = []
    context = 0
    for i in range(shape.turns):
        append = [rng.randrange(shape.vocab) for _ in range(shape.prompt if i == 0 else shape.tool)]
        out = [rng.randrange(shape.vocab) for _ in range(shape.generated)]
        supports = []
        for tok in out:
            k = rng.randint(1, shape.max_support)
            supports.append(sorted({tok, *(rng.randrange(shape.vocab) for _ in range(k - 1))}))
        lps = [[math.log(rng.random() + 1e-9) for _ in s] for s in supports]
        turns.append(
            TurnData(
                turn=i,
                group="g",
                replica="g/0",
                append_ids=append,
                output_ids=out,
                logprobs=[row[s.index(t)] for row, s, t in zip(lps, supports, out, strict=True)],
                raw_logprobs=[math.log(rng.random() + 1e-9) for _ in out],
                support_ids=supports,
                support_logprobs=lps,
                weight_versions=[{"version": 7, "start": 0, "end": len(out)}],
                finish_reason={"type": "stop", "matched": 151_645},
                timings={"engine_ms": 812.345, "router_ms": 1.234, "attempts": 1},
                context=context,
            )
        )
        context += len(append) + len(out)
    return turns


def varint_size(value: int) -> int:
    """Bytes of ``value`` as an unsigned LEB128 varint."""
    return max(1, (value.bit_length() + 6) // 7)


def minimal_bytes(turns: list[TurnData], *, f16: bool) -> int:
    """What the trajectory's content needs at least: every input token once as a varint id, and
    per generated token its record (id varint, two float32 log-probs, support size varint, gap
    coded support ids, support log-probs)."""
    total = 0
    for t in turns:
        total += sum(map(varint_size, t.append_ids))
        for tok, ids in zip(t.output_ids, t.support_ids, strict=True):
            gaps = [ids[0], *(b - a - 1 for a, b in zip(ids, ids[1:], strict=False))] if ids else []
            total += varint_size(tok) + 8 + varint_size(len(ids)) + sum(map(varint_size, gaps))
            total += len(ids) * (2 if f16 else 4)
    return total

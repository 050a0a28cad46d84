"""Bytes per token of the compact behavior record vs SGLang's JSON ``meta_info``, same masks.

What is measured. A real local engine serving the ``small`` preset (BF16) generates
``--requests`` x ``--tokens`` tokens with top_p 0.95 (temperature 1), returning log-probs and
sampling masks in SGLang 0.5.23's support mode (as the fleet asks). For exactly those tokens:

* JSON (same content): the ``meta_info`` fields that carry the behavior record, serialized
  compactly (no spaces, the favorable case for JSON): ``output_token_logprobs`` triples,
  ``output_token_sampling_mask`` (ranked) and ``output_token_sampling_logprobs`` (per token the
  support's log-probs, aligned with the mask).
* JSON (SGLang's selected mode): the same with mu per token in place of the support's log-probs
  (the trainer then cannot renormalize) - printed for reference.
* compact: :func:`router.records.encode_turn` of the same turn (input ids excluded), with the
  support log-probs as float32 and as float16.

Also prints encode / decode time per token, and the decode time per token of a whole trainer
batch of those turns (float32 support log-probs) by the router's standard-library decoder
(:func:`router.records.decode_batch`, the JSON shape) and by the trainer kit's vectorized one
(:func:`trainer.batch.decode_batch`, flat numpy arrays), best of ``--reps``, and their ratio;
then the same for those turns with every id scaled into a Qwen3-size vocabulary (151,936), where
ids and support gaps take 2-3 varint bytes instead of the small model's 1-2.
Targets: compact (float32) <= 1/4 of JSON; the trainer's decoder >= 20x faster per token.

Append-only trajectories (issue 20; no engine, through the encode functions): a synthetic
session at the study's shape (:class:`tests.support.sessions.SessionShape`: 60 turns growing
from 4K to ~98K tokens, 64 generated + 1,500 tool tokens a turn, Qwen3 vocabulary). Prints the
bytes stored and served for the trajectory against the bound 1.2 x (every token once as a
varint id + the generated tokens' records), what the format before (every turn repeating its
whole input) would have stored, and the router's own recording work per turn (reading the
stored context back from the memory store, placing the input on it, packing, encoding the block,
appending to the store; not HTTP parsing or the engine call) for a full-context and an
append-only turn at a short and a long context. The read back is a copy of the whole context:
what a turn costs whose context its router process does not keep (:mod:`router.context_text`:
another process served the session's last turn, or the cache was full); a kept context is not
read. Target: stored and served <= the bound; the encoding and storing of an append-only turn
flat in the context.

A short turn's record work (issue 20; no engine): the stub engine's ``/generate`` answer of
:func:`benchmarks.router.stub_generate_body` (64 output tokens, a ``--support``-id support each,
default 32, as SGLang sends it in support mode: masks most likely first, their log-probs as the
rows of ``output_token_sampling_logprobs``) decoded from its bytes
(:func:`core.jsonio.loads`), parsed (:func:`router.engine_answer.parse_turn`), encoded as stored
(:func:`router.records.encode_stored`, one appended token) and answered
(:meth:`~router.turn_data.TurnData.to_json` of the stored turn, then :func:`core.jsonio.dumps`:
the default answer, without the supports; the answer of a turn that asks ``return_support`` is
timed beside it, outside the total), per stage, per output token and per support id, CPU time
(``time.process_time``, best of ``--reps`` runs of 200).
Target (issue 20): the router's CPU per short turn <= 1 ms, all of it.

Run: ``.venv/bin/python benchmarks/records.py [--preset small] [--requests 8] [--tokens 64]
[--support 32]``
(``--session-only``: only the append-only part and the short turn's record work).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151_936
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--model-root", default=None, help="reuse model dirs here (default: a temp dir)")
    ap.add_argument("--batch-copies", type=int, default=16, help="trajectories per turn in the decoded batch")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--session-only", action="store_true", help="only the append-only session figures")
    ap.add_argument("--support", type=int, default=32, help="ids in each mask of the short turn's answer")
    args = ap.parse_args()
    if args.support < 1:
        ap.error("--support must be at least 1")
    session_report(args.reps)
    short_turn_report(args.reps, args.support)
    if args.session_only:
        return 0

    import httpx

    from core.sglang_release import SAMPLING_LOGPROBS_MODE
    from router.engine_answer import parse_turn
    from router.records import decode_batch, decode_turn, encode_batch, encode_turn
    from tests.support.engines import engine_process
    from tests.support.models import make_model_dir
    from trainer.batch import decode_batch as decode_arrays

    root = Path(args.model_root) if args.model_root else Path(tempfile.mkdtemp(prefix="bench-records-"))
    model = make_model_dir(root, args.preset, "bf16")
    bodies = []
    with engine_process(model, threads=2) as url:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        with httpx.Client(timeout=600) as c:
            for i in range(args.requests):
                r = c.post(
                    f"{url}/generate",
                    json={
                        "input_ids": [10 + i, 20, 30, 40],
                        "sampling_params": {
                            "max_new_tokens": args.tokens,
                            "temperature": 1.0,
                            "top_p": args.top_p,
                            "top_k": 4096,  # a sampling mask needs a finite top_k (SGLang 0.5.23)
                            "sampling_seed": i,
                            "ignore_eos": True,
                        },
                        "return_logprob": True,
                        "return_sampling_mask": True,
                        "sampling_logprobs_mode": SAMPLING_LOGPROBS_MODE,
                    },
                )
                r.raise_for_status()
                bodies.append(r.json())

    n = sum(len(b["output_ids"]) for b in bodies)
    support = sum(len(m) for b in bodies for m in b["meta_info"]["output_token_sampling_mask"])
    fields = ("output_token_logprobs", "output_token_sampling_mask", "output_token_sampling_logprobs")

    def selected(meta: dict, output_ids: list[int]) -> dict:
        """``meta`` as SGLang's selected mode sends it: mu per token in place of the support's."""
        rows, masks = meta["output_token_sampling_logprobs"], meta["output_token_sampling_mask"]
        mu = [row[mask.index(t)] for t, mask, row in zip(output_ids, masks, rows, strict=True)]
        return {**meta, "output_token_sampling_logprobs": mu}

    def json_bytes(select: bool) -> int:
        return sum(
            len(
                json.dumps(
                    {k: (selected(m, b["output_ids"]) if select else m)[k] for k in fields},
                    separators=(",", ":"),
                ).encode()
            )
            for b in bodies
            for m in (b["meta_info"],)
        )

    parsed = [
        parse_turn(b, index=0, group="g", replica="r", input_ids=[], moved_from=None, timings={})
        for b in bodies
    ]
    turns = _chained(parsed)
    t0 = time.perf_counter()
    blobs32 = [encode_turn(t) for t in turns]
    enc_s = time.perf_counter() - t0
    blobs16 = [encode_turn(t, f16=True) for t in turns]
    t0 = time.perf_counter()
    for b in blobs32:
        decode_turn(b)
    dec_s = time.perf_counter() - t0
    full, upstream = json_bytes(False), json_bytes(True)
    c32, c16 = sum(map(len, blobs32)), sum(map(len, blobs16))
    print(
        f"records benchmark: {args.preset} model (vocab {vocab}), {n} tokens, top_p {args.top_p}, "
        f"mean support {support / n:.1f} ids/token"
    )
    print(f"{'encoding':<44}{'bytes/token':>12}{'vs JSON':>9}")
    print(f"{'JSON meta_info, same content (with support lps)':<44}{full / n:>12.1f}{1.0:>9.3f}")
    print(f"{'JSON meta_info, SGLang selected mode (mu)':<44}{upstream / n:>12.1f}{upstream / full:>9.3f}")
    print(f"{'compact, float32 support log-probs':<44}{c32 / n:>12.1f}{c32 / full:>9.3f}")
    print(f"{'compact, float16 support log-probs':<44}{c16 / n:>12.1f}{c16 / full:>9.3f}")
    print(f"compact float32 vs selected-mode JSON (which lacks support log-probs): {c32 / upstream:.3f}")
    print(f"encode {enc_s / n * 1e6:.1f} us/token, decode {dec_s / n * 1e6:.1f} us/token (pure Python)")
    print(f"target <= 0.25 of JSON: {'met' if c32 / full <= 0.25 else 'NOT met'} (float32)")

    header = {"session_id": "s", "group": "g", "reward": 1.0, "metadata": {}}
    header["version_age"] = {"min": 0, "max": 0, "mean": 0.0}
    batch = encode_batch(
        "lease", 0, [(dict(header, session_id=f"s{i}"), blobs32) for i in range(args.batch_copies)]
    )
    batch_tokens = n * args.batch_copies

    def best(fn) -> float:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn(batch)
            times.append(time.perf_counter() - t0)
        return min(times) / batch_tokens * 1e6

    def report(label: str) -> None:
        py_us, np_us = best(decode_batch), best(decode_arrays)
        print(
            f"batch decode, {label} ({args.batch_copies * len(blobs32)} turns, {batch_tokens} tokens, "
            f"best of {args.reps}): "
            f"standard library {py_us:.2f} us/token, trainer.batch (numpy) {np_us:.3f} us/token, "
            f"ratio {py_us / np_us:.1f}x (target >= 20x: {'met' if py_us / np_us >= 20 else 'NOT met'})"
        )

    report(f"vocab {vocab}")
    # The same turns with every id scaled into a Qwen3-size vocabulary (a monotone map keeps the
    # supports sorted): token ids and support gaps then take 2-3 varint bytes, as they do there.
    scale = QWEN3_VOCAB // vocab
    scaled = [
        replace(
            t,
            output_ids=[i * scale for i in t.output_ids],
            support_ids=[[i * scale for i in row] for row in t.support_ids],
        )
        for t in turns
    ]
    blobs32 = [encode_turn(t) for t in scaled]
    batch = encode_batch(
        "lease", 0, [(dict(header, session_id=f"s{i}"), blobs32) for i in range(args.batch_copies)]
    )
    report(f"ids scaled x{scale} into vocab {QWEN3_VOCAB}")
    return 0


def _chained(turns: list) -> list:
    """``turns`` as one trajectory's: each turn's context is the tokens before it."""
    out, length = [], 0
    for i, t in enumerate(turns):
        out.append(replace(t, turn=i, context=length))
        length += len(t.append_ids) + len(t.output_ids)
    return out


def session_report(reps: int) -> None:
    """Bytes of a study-shape session against the bound, and the recording work per turn."""
    from router.records import encode_batch, encode_turn
    from tests.support.sessions import SessionShape, minimal_bytes, synthetic_session, varint_size

    shape = SessionShape()
    turns = synthetic_session(shape)
    context = turns[-1].prompt_len + len(turns[-1].output_ids)
    print(
        f"append-only session: {shape.turns} turns, {turns[0].prompt_len} -> {context} tokens, "
        f"{shape.generated} generated + {shape.tool} tool tokens a turn, vocab {shape.vocab}"
    )
    once = repeated = prefix = 0
    for t in turns:  # the format before stored every turn's whole input: its prefix again
        appended = sum(map(varint_size, t.append_ids))
        once += appended
        repeated += prefix + appended
        prefix += appended + sum(map(varint_size, t.output_ids))
    header = {"session_id": "s", "group": "g", "reward": 1.0, "metadata": {}, "version_age": {}}
    for f16 in (False, True):
        blobs = [encode_turn(t, f16=f16) for t in turns]
        stored = sum(map(len, blobs))
        served = len(encode_batch("L", 0, [(header, blobs)], trainer_version=7))
        bound = 1.2 * minimal_bytes(turns, f16=f16)
        old = stored - once + repeated
        print(
            f"  {'float16' if f16 else 'float32'} supports: stored {stored / 1e6:.3f} MB, served "
            f"{served / 1e6:.3f} MB, bound {bound / 1e6:.3f} MB ({served / bound:.3f} of it: "
            f"{'met' if max(stored, served) <= bound else 'NOT met'}); {served / context:.1f} bytes per "
            f"context token; whole input per turn (format 1) {old / 1e6:.2f} MB"
        )
    _turn_costs(turns, reps)


def short_turn_report(reps: int, support: int) -> None:
    """The record work of a short turn, per stage, per output token and per support id (module
    docstring)."""
    from benchmarks.router import stub_generate_body
    from core.jsonio import loads

    body = loads(stub_generate_body(support=support))
    n = len(body["output_ids"])
    stages = _short_turn_stages(body)
    ids = sum(map(len, body["meta_info"]["output_token_sampling_mask"]))
    print(f"  short turn record work, SGLang support mode ({n} tokens x {ids // n} ids), CPU best of {reps}:")
    total = 0.0
    for stage, run in stages.items():
        best = min(_cpu(run, 200) for _ in range(reps))
        total += best
        print(f"    {stage:<14} {_per(best, n, ids)}")
    print(f"    {'total':<14} {_per(total, n, ids)}")
    full = _short_turn_stages(body, with_support=True)
    for stage in ("to_json", "dumps"):
        best = min(_cpu(full[stage], 200) for _ in range(reps))
        print(f"    {stage + '+sup':<14} {_per(best, n, ids)}  (the answer with return_support)")


def _per(seconds: float, tokens: int, ids: int) -> str:
    """``seconds`` of a turn, per output token and per support id."""
    us, ns = seconds * 1e6, seconds * 1e9
    return f"{us:7.1f} us  {ns / tokens:7.0f} ns/token  {ns / ids:5.1f} ns/id"


def _short_turn_stages(body: dict, *, with_support: bool = False) -> dict:
    """The stages of a turn's record work on ``body``, each a call: the engine's answer decoded
    from its bytes, parsed, encoded as stored, the turn's answer (its JSON view, with the
    supports if ``with_support``), and its bytes."""
    from core.jsonio import dumps, loads
    from router.engine_answer import parse_turn
    from router.records import encode_stored

    kw = {"index": 0, "group": "g", "replica": "r", "input_ids": [1], "moved_from": None, "timings": {}}
    raw = dumps(body)
    turn = parse_turn(body, **kw)
    stored = encode_stored(turn)[1]
    answer = stored.to_json("s", with_input=False, with_support=with_support)
    return {
        "loads": lambda: loads(raw),
        "parse_turn": lambda: parse_turn(body, **kw),
        "encode_stored": lambda: encode_stored(turn),
        "to_json": lambda: stored.to_json("s", with_input=False, with_support=with_support),
        "dumps": lambda: dumps(answer),
    }


def _cpu(run, calls: int) -> float:
    """CPU seconds per call of ``run`` over ``calls`` calls."""
    t0 = time.process_time()
    for _ in range(calls):
        run()
    return (time.process_time() - t0) / calls


def _turn_costs(turns: list, reps: int) -> None:
    """The router's recording work for one turn at a short and a long context (memory store)."""
    import asyncio

    from router.records import encode_stored
    from router.segments import locate, pack
    from router.state.base import TurnRecord
    from router.state.memory import MemoryStore

    async def one(turn, prior: list, full: bool) -> tuple[float, float, float]:
        store = MemoryStore()
        await store.create_session("s", "g", {}, now=0.0)
        seq = [x for t in prior for x in (*t.append_ids, *t.output_ids)]
        await store.append_turn("s", TurnRecord("r0", b"", "g", "r", 0, None, None, pack(seq)))
        request = seq + list(turn.append_ids) if full else list(turn.append_ids)
        t0 = time.perf_counter()
        _, stored = await store.get_session_context("s")
        _, at = locate(request, None, stored) if full else locate(None, request, stored)
        t1 = time.perf_counter()
        done = replace(turn, context=at.context, append_ids=at.append, fork=at.fork)
        blob, _ = encode_stored(done)
        record = TurnRecord("r1", blob, "g", "r", 64, 7, 7, pack(at.append) + pack(done.output_ids))
        await store.append_turn("s", record)
        t2 = time.perf_counter()
        return t2 - t0, t1 - t0, t2 - t1

    print(
        f"  router work per turn (best of {reps}; the context read back (a copy: a turn whose context this "
        "process does not keep) + check/rebuild the input, then encode + store):"
    )
    for index in (2, len(turns) - 1):
        turn, prior = turns[index], turns[:index]
        for full in (True, False):
            runs = [asyncio.run(one(turn, prior, full)) for _ in range(reps)]
            total, where, record = (min(r[i] for r in runs) for i in range(3))
            kind = "full context" if full else "append only "
            print(
                f"    {kind} at {turn.context:>6} context tokens ({len(turn.append_ids)} appended): "
                f"{total * 1e3:6.2f} ms = input {where * 1e3:5.2f} ms + record {record * 1e3:5.2f} ms"
            )


if __name__ == "__main__":
    sys.exit(main())

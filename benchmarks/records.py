"""Bytes per token of the compact behavior record vs SGLang's JSON ``meta_info``, same masks.

What is measured. A real local engine serving the ``small`` preset (BF16) generates
``--requests`` x ``--tokens`` tokens with top_p 0.95 (temperature 1), returning log-probs and
sampling masks. For exactly those tokens:

* JSON (same content): the ``meta_info`` fields that carry the behavior record, serialized
  compactly (no spaces, the favorable case for JSON): ``output_token_logprobs`` triples,
  ``output_token_sampling_mask``, ``output_token_sampling_logprobs`` (mu) and the support's
  log-probs (``output_token_sampling_support_logprobs``).
* JSON (upstream SGLang shape): the same without the support log-probs (upstream SGLang does
  not send them; the trainer then cannot renormalize) - printed for reference.
* compact: :func:`router.records.encode_turn` of the same turn (input ids excluded), with the
  support log-probs as float32 and as float16.

Also prints encode / decode time per token, and the decode time per token of a whole trainer
batch of those turns (float32 support log-probs) by the router's standard-library decoder
(:func:`router.records.decode_batch`, the JSON shape) and by the trainer kit's vectorized one
(:func:`trainer.batch.decode_batch`, flat numpy arrays), best of ``--reps``, and their ratio;
then the same for those turns with every id scaled into a Qwen3-size vocabulary (151,936), where
ids and support gaps take 2-3 varint bytes instead of the small model's 1-2.
Targets: compact (float32) <= 1/4 of JSON; the trainer's decoder >= 20x faster per token.

Run: ``.venv/bin/python benchmarks/records.py [--preset small] [--requests 8] [--tokens 64]``.
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
    args = ap.parse_args()

    import httpx

    from router.records import decode_batch, decode_turn, encode_batch, encode_turn, parse_turn
    from tests.support.engines import engine_process
    from tests.support.models import make_model_dir
    from trainer.batch import decode_batch as decode_arrays

    root = Path(args.model_root) if args.model_root else Path(tempfile.mkdtemp(prefix="bench-records-"))
    model = make_model_dir(root, args.preset, "bf16")
    bodies = []
    with engine_process(model, threads=2) as url:
        vocab = httpx.get(f"{url}/model_info").json()["vocab_size"]
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
                    },
                )
                r.raise_for_status()
                bodies.append(r.json())

    n = sum(len(b["output_ids"]) for b in bodies)
    support = sum(len(m) for b in bodies for m in b["meta_info"]["output_token_sampling_mask"])
    fields_full = (
        "output_token_logprobs",
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
        "output_token_sampling_support_logprobs",
    )
    fields_upstream = fields_full[:3]

    def json_bytes(fields: tuple[str, ...]) -> int:
        return sum(
            len(json.dumps({k: b["meta_info"][k] for k in fields}, separators=(",", ":")).encode())
            for b in bodies
        )

    turns = [
        parse_turn(b, index=0, group="g", replica="r", input_ids=[], moved_from=None, timings={})
        for b in bodies
    ]
    t0 = time.perf_counter()
    blobs32 = [encode_turn(t) for t in turns]
    enc_s = time.perf_counter() - t0
    blobs16 = [encode_turn(t, f16=True) for t in turns]
    t0 = time.perf_counter()
    for b in blobs32:
        decode_turn(b)
    dec_s = time.perf_counter() - t0
    full, upstream = json_bytes(fields_full), json_bytes(fields_upstream)
    c32, c16 = sum(map(len, blobs32)), sum(map(len, blobs16))
    print(
        f"records benchmark: {args.preset} model (vocab {vocab}), {n} tokens, top_p {args.top_p}, "
        f"mean support {support / n:.1f} ids/token"
    )
    print(f"{'encoding':<44}{'bytes/token':>12}{'vs JSON':>9}")
    print(f"{'JSON meta_info, same content (with support lps)':<44}{full / n:>12.1f}{1.0:>9.3f}")
    print(f"{'JSON meta_info, upstream SGLang fields':<44}{upstream / n:>12.1f}{upstream / full:>9.3f}")
    print(f"{'compact, float32 support log-probs':<44}{c32 / n:>12.1f}{c32 / full:>9.3f}")
    print(f"{'compact, float16 support log-probs':<44}{c16 / n:>12.1f}{c16 / full:>9.3f}")
    print(f"compact float32 vs upstream-shape JSON (which lacks support log-probs): {c32 / upstream:.3f}")
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


if __name__ == "__main__":
    sys.exit(main())

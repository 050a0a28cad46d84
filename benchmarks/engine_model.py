"""Benchmark: the engine model's batched decode step vs transformers' forward, same batch, same run.

Measured on the same checkpoint (the ``small`` preset by default; float32 compute on both sides),
``--batch`` sequences with prompts of ``--prompt-len`` tokens (equal lengths, so transformers
needs no padding), the same torch thread count:

- engine: ``Model.forward`` with one new token per sequence (the decode step the scheduler runs
  for 32 concurrent requests), after a batched prefill;
- transformers: ``Qwen3MoeForCausalLM`` forward of ``[batch, 1]`` new tokens with its
  ``DynamicCache``, after the same prefill (its ``generate`` runs exactly this step);

``--steps`` decode steps each, the two alternated ``--reps`` times; prints the best wall time and
the best CPU time (process time, less disturbed by other processes on a shared machine) per step,
decode tokens/s, and the ratio engine / transformers for both clocks. Also prints the prefill time
of each. Usage: ``python benchmarks/engine_model.py [--model DIR | --preset small] [--batch 32]
[--steps 16] [--threads N] [--reps 3] [--hf-experts eager|default]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _clock(fn: Any) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: init-model --preset)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--hf-experts", default="eager", help="HF experts_implementation or 'default'")
    args = parser.parse_args()

    import torch
    from transformers import Qwen3MoeForCausalLM
    from transformers.cache_utils import DynamicCache

    from engine.model.model import load_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from mixfleet.init_model import write_model

            model_dir = write_model(Path(tmp) / args.preset, args.preset)
        model = load_model(model_dir)
        extra = {} if args.hf_experts == "default" else {"experts_implementation": args.hf_experts}
        hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (args.batch, args.prompt_len), generator=g)
        nxt = torch.randint(0, 256, (args.steps, args.batch), generator=g)
        print(
            f"model {model_dir} | batch {args.batch}, prompts of {args.prompt_len}, {args.steps} decode steps"
            f" | {args.threads} torch threads | transformers experts: {hf.config._experts_implementation}",
            flush=True,
        )

        def engine_run() -> dict[str, tuple[float, float]]:
            caches = [model.new_sequence() for _ in range(args.batch)]
            prefill = _clock(lambda: model.forward(list(ids), caches))

            def decode() -> None:
                for s in range(args.steps):
                    model.forward(list(nxt[s, :, None]), caches)

            return {"prefill": prefill, "decode": _clock(decode)}

        def hf_run() -> dict[str, tuple[float, float]]:
            cache = DynamicCache(config=hf.config)
            with torch.inference_mode():
                prefill = _clock(lambda: hf(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1))

                def decode() -> None:
                    for s in range(args.steps):
                        hf(input_ids=nxt[s, :, None], cache=cache, use_cache=True)

                return {"prefill": prefill, "decode": _clock(decode)}

        best: dict[str, dict[str, list[float]]] = {}
        for rep in range(args.reps):
            for name, run in (
                (("engine", engine_run), ("transformers", hf_run))
                if rep % 2 == 0
                else (("transformers", hf_run), ("engine", engine_run))
            ):
                res = run()
                b = best.setdefault(name, {})
                for phase, (w, c) in res.items():
                    old = b.get(phase, [float("inf"), float("inf")])
                    b[phase] = [min(old[0], w), min(old[1], c)]
                print(
                    f"  rep {rep} {name:<12} prefill {res['prefill'][0]:6.2f}s  decode "
                    f"{res['decode'][0] / args.steps * 1e3:7.1f} ms/step wall, "
                    f"{res['decode'][1] / args.steps * 1e3:7.1f} ms/step cpu",
                    flush=True,
                )

    print()
    for name in ("engine", "transformers"):
        w, c = best[name]["decode"]
        rate = args.batch * args.steps / w
        print(
            f"{name:<13} decode {w / args.steps * 1e3:7.1f} ms/step wall ({rate:7.1f} tok/s), "
            f"{c / args.steps * 1e3:7.1f} ms/step cpu; prefill {best[name]['prefill'][0]:.2f}s"
        )
    ew, ec = best["engine"]["decode"]
    hw, hc = best["transformers"]["decode"]
    print(f"ratio engine / transformers (decode step speed): {hw / ew:.2f}x wall, {hc / ec:.2f}x cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())

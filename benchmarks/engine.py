"""Benchmark: generated tokens/s of the local CPU engine vs ``transformers``' ``generate``.

Measured in one run, on the same checkpoint (the ``small`` preset by default, float32 compute on
both sides), the same prompts (``--requests`` prompts of ``--prompt-len`` tokens, equal
lengths so ``generate`` needs no padding), the same sampling settings and the same number of
torch threads:

- engine: a real ``mixfleet engine`` process; all requests are sent at once over HTTP
  (``/generate``, ``ignore_eos``, one warm connection per request) and the clock runs from the
  first send to the last response, JSON decoding on the client excluded;
  tokens/s = requests x new tokens / wall time. Once without and once with
  ``return_sampling_mask`` (and ``return_logprob``), alternated ``--reps`` times, best of each;
  the engine's own split (time in steps, in ``Model.forward``, in the sampler) is printed too;
- transformers: ``Qwen3MoeForCausalLM.generate`` on the whole batch at once (``do_sample``,
  ``min_new_tokens = max_new_tokens``, ``experts_implementation`` from ``--hf-experts``, eager
  by default), after a warm-up, best of ``--hf-reps``; the engine process is stopped first so the
  two never share the cores.

Prints both rates, the ratio engine / transformers (target >= 2) and the cost of sampling masks
(target < 10%). On a shared machine the wall clock mostly measures the other processes, so each
round's CPU seconds are printed too (the engine process's, all threads, from ``/proc``; the
transformers process's own) with tokens per CPU-second and their ratio. Usage:
``python benchmarks/engine.py [--model DIR | --preset small] [--requests 32] [--new-tokens 128]
[--threads N] [--reps 2] [--hf-reps 1] [--hf-experts eager|default]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.engines import engine_argv  # noqa: E402
from tests.support.procs import free_port, process, wait_http  # noqa: E402


@contextlib.contextmanager
def engine_server(model_dir: Path, **flags: Any) -> Iterator[tuple[str, int]]:
    """A ``mixfleet engine`` process for ``model_dir``: yields its URL and pid once healthy."""
    port = free_port()
    with process(engine_argv(model_dir, port, **flags)) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", timeout=600, proc=proc)
        yield url, proc.pid


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, all threads (``None`` without /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


def engine_round(url: str, batch: list[list[int]], args: argparse.Namespace, masks: bool) -> float:
    """Seconds for all requests, sent at once over one warm connection pool, to finish."""

    def body(i: int) -> dict[str, Any]:
        return {
            "input_ids": batch[i],
            "sampling_params": {
                **sampling(args),
                "max_new_tokens": args.new_tokens,
                "ignore_eos": True,
                "sampling_seed": i,
            },
            "return_sampling_mask": masks,
            "return_logprob": masks,
        }

    async def go() -> tuple[float, list[dict[str, Any]]]:
        limits = httpx.Limits(max_connections=len(batch) + 4, max_keepalive_connections=len(batch) + 4)
        async with httpx.AsyncClient(timeout=3600, trust_env=False, limits=limits) as client:
            await asyncio.gather(*(client.get(url + "/health") for _ in batch))  # open the connections
            start = time.perf_counter()
            responses = await asyncio.gather(
                *(client.post(url + "/generate", json=body(i)) for i in range(len(batch)))
            )
            elapsed = time.perf_counter() - start
        for r in responses:
            r.raise_for_status()
        return elapsed, [r.json() for r in responses]

    elapsed, outs = asyncio.run(go())
    for o in outs:
        assert len(o["output_ids"]) == args.new_tokens, o["meta_info"]["finish_reason"]
        if masks:
            assert len(o["meta_info"]["output_token_sampling_mask"]) == args.new_tokens
    return elapsed


def transformers_round(
    model: Any, batch: list[list[int]], args: argparse.Namespace, new_tokens: int
) -> float:
    import torch

    ids = torch.tensor(batch)
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    kwargs["top_k"] = args.top_k if args.top_k > 0 else 0
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.config.pad_token_id,
            **kwargs,
        )
    elapsed = time.perf_counter() - start
    assert out.shape == (len(batch), len(batch[0]) + new_tokens), out.shape
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint dir (default: init-model --preset)"
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--reps", type=int, default=2, help="engine rounds per mask setting")
    parser.add_argument("--hf-reps", type=int, default=1, help="transformers rounds (they are slow)")
    parser.add_argument(
        "--hf-experts",
        default="eager",
        help="transformers experts_implementation (eager is its fastest on CPU here; 'default' = its choice)",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=4096, help="a sampling mask needs a finite top_k")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from mixfleet.init_model import write_model

            model_dir = write_model(Path(tmp) / args.preset, args.preset)
        batch = prompts(args.requests, args.prompt_len)
        n_tokens = args.requests * args.new_tokens
        print(
            f"model {model_dir} | {args.requests} requests x {args.new_tokens} new tokens, prompts of "
            f"{args.prompt_len} | sampling {sampling(args)} | {args.threads} torch threads",
            flush=True,
        )

        times: dict[bool, list[float]] = {False: [], True: []}
        forward: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        with engine_server(model_dir, threads=args.threads, max_running_requests=max(64, args.requests)) as (
            url,
            pid,
        ):
            engine_round(
                url, batch[:4], argparse.Namespace(**{**vars(args), "new_tokens": 8}), True
            )  # warm-up
            for rep in range(args.reps):
                for masks in (False, True) if rep % 2 == 0 else (True, False):
                    before = httpx.get(url + "/server_info").json()["internal_states"][0]
                    cpu0 = cpu_seconds(pid)
                    t = engine_round(url, batch, args, masks)
                    cpu1 = cpu_seconds(pid)
                    after = httpx.get(url + "/server_info").json()["internal_states"][0]
                    times[masks].append(t)
                    if cpu0 is not None and cpu1 is not None:
                        cpu[masks].append(cpu1 - cpu0)
                    forward[masks].append(after["forward_seconds"] - before["forward_seconds"])
                    split = {
                        k: after[k] - before[k] for k in ("step_seconds", "forward_seconds", "sample_seconds")
                    }
                    used = f", cpu {cpu[masks][-1]:.2f}s" if len(cpu[masks]) == len(times[masks]) else ""
                    print(
                        f"  engine masks={'on ' if masks else 'off'}: {t:7.2f}s  {n_tokens / t:8.1f} tok/s  "
                        f"(steps {split['step_seconds']:.2f}s, of which Model.forward "
                        f"{split['forward_seconds']:.2f}s, sampler {split['sample_seconds']:.2f}s{used})",
                        flush=True,
                    )

        from transformers import Qwen3MoeForCausalLM

        extra = {} if args.hf_experts == "default" else {"experts_implementation": args.hf_experts}
        hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()
        print(f"  transformers experts_implementation: {hf.config._experts_implementation}", flush=True)
        transformers_round(hf, batch[:4], args, 8)  # warm-up
        hf_times, hf_cpu = [], []
        for _ in range(args.hf_reps):
            c0 = time.process_time()
            t = transformers_round(hf, batch, args, args.new_tokens)
            hf_cpu.append(time.process_time() - c0)
            hf_times.append(t)
            print(
                f"  transformers generate: {t:7.2f}s  {n_tokens / t:8.1f} tok/s, cpu {hf_cpu[-1]:.2f}s",
                flush=True,
            )

    engine_rate = n_tokens / min(times[False])
    masks_rate = n_tokens / min(times[True])
    hf_rate = n_tokens / min(hf_times)
    print()
    print(f"engine (no masks)         {engine_rate:9.1f} tok/s")
    print(f"engine (sampling masks)   {masks_rate:9.1f} tok/s")
    print(f"transformers generate     {hf_rate:9.1f} tok/s")
    print(f"ratio engine / transformers: {engine_rate / hf_rate:.2f}x (target >= 2x)")
    print(f"cost of sampling masks: {100 * (1 - masks_rate / engine_rate):.1f}% (target < 10%)")
    # Masks cannot change the model's work; on a shared machine Model.forward's time is the noisy
    # part, so also compare everything else (sampler, scheduler, HTTP, JSON) between the modes.
    rest = {m: min(t - f for t, f in zip(times[m], forward[m], strict=True)) for m in (False, True)}
    extra = 100 * (rest[True] - rest[False]) / min(times[False])
    print(
        f"cost of sampling masks outside Model.forward: {extra:.1f}% of the no-mask wall time "
        f"({rest[False]:.2f}s -> {rest[True]:.2f}s of non-forward time)"
    )
    if cpu[False] and cpu[True]:
        per_cpu = {m: n_tokens / min(cpu[m]) for m in (False, True)}
        hf_per_cpu = n_tokens / min(hf_cpu)
        print(
            f"tokens per CPU-second: engine {per_cpu[False]:.1f} (masks {per_cpu[True]:.1f}), transformers "
            f"{hf_per_cpu:.1f}; ratio by CPU time {per_cpu[False] / hf_per_cpu:.2f}x, "
            f"masks cost {100 * (1 - per_cpu[True] / per_cpu[False]):.1f}% of CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

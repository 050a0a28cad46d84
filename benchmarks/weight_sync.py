"""Benchmark: publish -> every replica active, on the local fleet (three groups: bf16, fp8, nvfp4).

For each model size: a real engine process per group behind its sidecar, a LocalStore, the
base policy published as v1 and served; then version 2 (other weights) is published and the
clock runs until every replica serves it. The time is split into

- convert: each format's conversion inside its worker, and the wall time of all of them
  (formats convert in parallel worker processes of a warm pool, as the router runs them);
- publish: commit (fsync, manifest, rename) and pointer moves;
- stage: each replica copying and checksumming its format's files while serving;
- engine pause: ``/pause_generation`` sent -> ``/continue_generation`` answered (the engine's
  ``/update_weights_from_disk`` loads the new weights inside this window);

and compared with two baselines measured in the same run: the slowest format's conversion
alone (``convert_checkpoint`` in this process with every core, files fsynced as a publish
writes them, after one untimed warm-up conversion per format, median of 3), and the slowest
format's conversion inside this publish (where the formats share the cores, as they do in
production on a machine with fewer cores than formats). It also prints the CPU work of one
publish measured alone (every format's conversion and every engine's load of the result):
divided by the cores, the time before which no schedule can finish on this machine.
Targets: engine pause <= 5% of the total, total <= 2x the slowest conversion.

Three configurations are measured on the same fleet (sidecars restarted between them), all
activating by the one protocol (``replica.activation``: retract -> update with a cache flush ->
continue; the engine loads the new weights while paused): ``staged-copy`` (barrier publish,
staged copy: what a SGLang replica on Modal runs), ``default`` (barrier publish, staged in place:
as ``mixfleet up`` runs it), ``pipelined`` (per-format publish, in place: each group activates as
soon as its own format is committed). Each configuration runs one untimed warm-up publish, then ``--reps``
timed ones (medians reported). The publisher's pool has one worker per core and at least one
per format, as the router's has; the replicas are woken when a pointer moves, without holding
up the publisher, as the router wakes them.

Usage: ``python benchmarks/weight_sync.py [--sizes small,small2x] [--reps 3] [--configs ...]``.
Sizes: ``tiny``, ``small`` (init-model presets) and ``small2x`` (``small`` with twice the layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.fleet import LOCAL_GROUPS, local_fleet  # noqa: E402
from weight_sync.convert import convert_checkpoint  # noqa: E402
from weight_sync.publish import ConversionPool, publish_checkpoint  # noqa: E402


def write_size(root: Path, size: str, seed: int) -> Path:
    from mixfleet.init_model import PRESETS, write_model

    out = root / f"{size}-s{seed}"
    if out.is_dir():
        return out
    if size == "small2x":
        base = PRESETS["small"]
        spec = dataclasses.replace(base, num_hidden_layers=2 * base.num_hidden_layers, shards=4)
    else:
        spec = PRESETS[size]
    write_model(out, spec, seed)
    return out


def params_of(ckpt: Path) -> int:
    """Parameter count of a BF16 checkpoint (2 bytes each; safetensors headers are negligible)."""
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) // 2


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One format's work measured alone in this process (medians): its conversion's wall and CPU
    seconds (every core), and the CPU seconds of an engine loading the result (one thread, as
    the engines run)."""

    convert_s: float
    convert_cpu_s: float
    load_cpu_s: float


def baseline(ckpt: Path, fmt: str, work: Path, reps: int = 3) -> Baseline:
    """Convert ``ckpt`` into ``fmt`` ``reps`` times, then load the result ``reps`` times."""
    import torch

    from engine.model.model import load_model

    dst = work / f"baseline-{fmt}"
    walls, cpus, loads = [], [], []
    for _ in range(reps):
        shutil.rmtree(dst, ignore_errors=True)
        t0, c0 = time.perf_counter(), time.process_time()
        convert_checkpoint(ckpt, dst, fmt, fsync=True)  # durable, as a publish must write it
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(reps):
            c0 = time.process_time()
            model = load_model(dst)
            loads.append(time.process_time() - c0)
            del model
    finally:
        torch.set_num_threads(threads)
    shutil.rmtree(dst, ignore_errors=True)
    med = statistics.median
    return Baseline(med(walls), med(cpus), med(loads))


CONFIGS = {
    # name: (publish mode, sidecar stage mode)
    "staged-copy": ("barrier", "copy"),  # what a SGLang replica on Modal runs
    "default": ("barrier", "inplace"),  # as `mixfleet up` runs it
    "pipelined": ("per_format", "inplace"),  # + each group activates as its format lands
}


def one_round(
    fleet, pool: ConversionPool, version: int, ckpt: Path, mode: str, waker: ThreadPoolExecutor
) -> dict:
    def wake(kind: str, info: dict) -> None:
        # As the router's publish does: a pointer that moved wakes its replicas at once, without
        # holding up the publisher (the router posts the wake-ups from its event loop).
        if kind == "advanced":
            for r in fleet.replicas:
                if r.weight_format == info["format"]:
                    waker.submit(httpx.post, r.url + "/v1/wake", timeout=5)

    t0 = time.time()
    result = publish_checkpoint(
        fleet.store,
        fleet.run_id,
        version,
        ckpt,
        fleet.formats,
        mode=mode,
        conversion_pool=pool,
        on_event=wake,
    )
    t_published = time.time()
    acts = {}
    deadline = time.monotonic() + 600
    while len(acts) < len(fleet.replicas):
        for r in fleet.replicas:
            if r.group in acts:
                continue
            st = fleet.status(r)
            if st["active_version"] == version:
                acts[r.group] = st["last_activation"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas did not activate v{version}")
        time.sleep(0.02)
    t_end = max(a["at"] for a in acts.values())
    return {"result": result, "publish_s": t_published - t0, "total_s": t_end - t0, "acts": acts}


def report(name: str, rounds: list[dict], slowest: tuple[str, float]) -> dict:
    mode, stage_mode = CONFIGS[name]
    print(f"\n### {name}: publish {mode}, stage {stage_mode}")
    print(
        f"{'rep':>3} {'total':>7} {'convert':>8} {'commit':>7} {'ptrs':>6} | "
        "per format: convert / stage / pause (update) / pointer seen -> active"
    )
    for i, rd in enumerate(rounds):
        res = rd["result"]
        per = []
        for g, f in LOCAL_GROUPS:
            fr = next(x for x in res.formats if x.format == f)
            a = rd["acts"][g]
            per.append(
                f"{f} {fr.convert_s:.2f}/{a['stage_s']:.2f}/{a['pause_s']:.2f} ({a['update_s']:.2f})"
                f"/{a['total_s']:.2f}"
            )
        print(
            f"{i:>3} {rd['total_s']:7.2f} {res.convert_wall_s:8.2f} {res.commit_wall_s:7.3f} "
            f"{res.advance_wall_s:6.3f} | " + "; ".join(per)
        )
    total = statistics.median(rd["total_s"] for rd in rounds)
    pause = statistics.median(max(a["pause_s"] for a in rd["acts"].values()) for rd in rounds)
    update = statistics.median(max(a["update_s"] for a in rd["acts"].values()) for rd in rounds)
    conv = statistics.median(rd["result"].convert_wall_s for rd in rounds)
    in_run = statistics.median(
        rd["total_s"] / max(f.convert_s for f in rd["result"].formats) for rd in rounds
    )
    stage = statistics.median(max(a["stage_s"] for a in rd["acts"].values()) for rd in rounds)
    commit = statistics.median(rd["result"].commit_wall_s + rd["result"].advance_wall_s for rd in rounds)
    fmt, base = slowest
    print(
        f"median: total {total:.2f}s; convert (parallel wall) {conv:.2f}s, commit + pointers {commit:.2f}s, "
        f"stage max {stage:.2f}s, engine update max {update:.2f}s, engine pause max {pause:.2f}s"
    )
    print(
        f"engine pause / total = {pause / total:.1%} (target <= 5%); total / slowest conversion alone "
        f"({fmt} {base:.2f}s) = {total / base:.2f}x, total / slowest conversion in the same publish "
        f"= {in_run:.2f}x (target <= 2x)"
    )
    return {"total": total, "pause": pause}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,small2x")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {', '.join(CONFIGS)}")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-weight-sync-"))
    root.mkdir(parents=True, exist_ok=True)
    groups = ", ".join(f"{g}({f})" for g, f in LOCAL_GROUPS)
    print(f"# weight sync benchmark: local fleet {groups}, one engine thread each; work dir {root}")
    print(
        f"# load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores"
    )
    summary = []
    for size in args.sizes.split(","):
        base = write_size(root / "models", size, 1)
        upd = write_size(root / "models", size, 2)
        n_params = params_of(base)
        print(
            f"\n## {size}: {n_params / 1e6:.1f} M parameters, "
            f"{sum(p.stat().st_size for p in base.glob('*.safetensors')) / 1e6:.0f} MB BF16"
        )
        pool = ConversionPool.for_formats(len(LOCAL_GROUPS))  # as the router sizes its pool
        pool.warm()
        work = root / f"fleet-{size}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        version = 1
        row = {"size": size, "params": n_params}
        with local_fleet(work, base, LOCAL_GROUPS, run_id="bench") as fleet:
            for name in configs:
                # The baseline is measured right before each configuration (the machine is shared).
                for _, f in LOCAL_GROUPS:  # warm-up: imports, kernels, page cache
                    baseline(upd, f, root, reps=1)
                bases = {f: baseline(upd, f, root) for _, f in LOCAL_GROUPS}
                base_times = {f: b.convert_s for f, b in bases.items()}
                slowest_fmt = max(base_times, key=base_times.get)
                row["slowest"] = base_times[slowest_fmt]
                cores = os.cpu_count() or 1
                work_cpu = sum(b.convert_cpu_s + b.load_cpu_s for b in bases.values())
                print(
                    "\nbaseline, each format alone in this process: conversion wall / CPU (all cores), "
                    "engine load CPU (one thread): "
                    + ", ".join(
                        f"{f} {b.convert_s:.2f}s / {b.convert_cpu_s:.2f}s, {b.load_cpu_s:.2f}s"
                        for f, b in bases.items()
                    )
                )
                print(
                    f"CPU work of one publish (every conversion + every engine load) {work_cpu:.2f}s: "
                    f"on {cores} cores no schedule finishes before {work_cpu / cores:.2f}s = "
                    f"{work_cpu / cores / base_times[slowest_fmt]:.2f}x the slowest conversion alone"
                )
                mode, stage_mode = CONFIGS[name]
                for r in fleet.replicas:
                    fleet.kill_sidecar(r)
                    fleet.start_sidecar(r, "--stage-mode", stage_mode)
                fleet.wait_ready()
                rounds = []
                with ThreadPoolExecutor(len(fleet.replicas)) as waker:
                    # One untimed publish first, as the baseline is warmed up: an engine's first
                    # replacement also grows its heap (page faults for a second copy of the model)
                    version += 1
                    warm = one_round(fleet, pool, version, base, mode, waker)
                    print(f"\n(warm-up publish, not in the medians: total {warm['total_s']:.2f}s)", end="")
                    for rep in range(args.reps):
                        version += 1
                        ckpt = upd if rep % 2 == 0 else base
                        rounds.append(one_round(fleet, pool, version, ckpt, mode, waker))
                row[name] = report(name, rounds, (slowest_fmt, base_times[slowest_fmt]))
                row[name]["slowest"] = base_times[slowest_fmt]
        pool.close()
        summary.append(row)
    if len(summary) > 1:
        print("\n## scaling with model size (medians)")
        first = summary[0]
        for row in summary:
            cells = ", ".join(
                f"{name} total {row[name]['total']:.2f}s ({row[name]['total'] / first[name]['total']:.2f}x)"
                for name in configs
            )
            size_x = row["params"] / first["params"]
            slow_x = row["slowest"] / first["slowest"]
            print(
                f"{row['size']:8s} {row['params'] / 1e6:6.1f} M params ({size_x:.2f}x): "
                f"slowest conversion alone {row['slowest']:.2f}s ({slow_x:.2f}x); {cells}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

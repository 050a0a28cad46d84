"""Learn a multi-turn chat task by asynchronous RL on the local mixed fleet: SFT warm start, then
RL with --method, the agents chatting through each session's OpenAI API (the ``openai`` client).

``mixfleet demo [--out DIR] [--method sc-mis-topp] [--router URL --base DIR]``

Without ``--router`` it starts ``mixfleet up`` (preset ``local``: bf16, fp8 and nvfp4 CPU groups;
a ``tiny`` base policy created on first run) on a free loopback port with its data in
``--data-dir`` (default ``<out>/fleet``), runs the demo against it and stops it afterwards, also
on Ctrl-C or an error. With ``--router`` it uses that fleet (key from ``--api-key`` or
``MIXFLEET_API_KEY``, scopes rollout, trainer and admin) and ``--base``, the checkpoint its
version 0 was made from, on this machine.

The router must serve the chat APIs (``--chat-model``: ``mixfleet up`` passes its base policy,
which every ``init-model`` preset makes a chat model). The loop is :func:`trainer.demo.run_demo`.
After: ``<out>/demo.json``, ``<out>/episodes.jsonl``, ``<out>/demo.png`` and the cost report of
the fleet's ledger (``mixfleet report``) in ``<out>/report/``; a summary of the rewards and of
the episodes (turns per episode, forks) is printed. Needs the ``demo`` extra (transformers,
openai, tqdm; matplotlib for the plot).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import time
from pathlib import Path

from core.errors import UserError
from core.fs import make_dir
from mixfleet.argtypes import tcp_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trainer.demo_config import DemoConfig

    d = DemoConfig()
    parser.add_argument("--out", default="demo-out", help="output directory (default demo-out)")
    parser.add_argument(
        "--method",
        default=d.method,
        help=f"loss: grpo, grpo-mis, sc, sc-mis or sc-mis-topp (default {d.method})",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the task, SFT and agents")
    parser.add_argument("--router", default=None, help="use this running fleet instead of starting one")
    parser.add_argument("--api-key", default=None, help="key for --router (default: MIXFLEET_API_KEY)")
    parser.add_argument("--base", default=None, help="the fleet's base checkpoint (needed with --router)")
    parser.add_argument("--data-dir", default=None, help="data of the started fleet (default OUT/fleet)")
    parser.add_argument(
        "--port", type=tcp_port, default=None, help="port of the started router (default: free)"
    )
    parser.add_argument("--model-preset", default="tiny", choices=("tiny", "small"), help="base size (tiny)")
    parser.add_argument("--updates", type=int, default=d.updates, help=f"RL updates (default {d.updates})")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=d.time_limit_s,
        help=f"RL seconds at most (default {d.time_limit_s:g})",
    )
    parser.add_argument(
        "--sft-steps", type=int, default=d.sft_steps, help=f"SFT steps (default {d.sft_steps})"
    )
    parser.add_argument("--sft-lr", type=float, default=d.sft_lr, help=f"SFT learning rate ({d.sft_lr:g})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"RL learning rate (default {d.lr:g})")
    parser.add_argument("--prompts", type=int, default=d.prompts, help=f"prompts per update ({d.prompts})")
    parser.add_argument("--samples", type=int, default=d.samples, help=f"samples per prompt ({d.samples})")
    parser.add_argument("--agents", type=int, default=d.agents, help=f"concurrent agents ({d.agents})")
    parser.add_argument(
        "--max-version-age", type=int, default=d.max_version_age, help="staleness bound of a batch"
    )
    parser.add_argument(
        "--outstanding",
        type=int,
        default=d.outstanding,
        help=f"sessions sampled and not yet taken or held back, at most (default {d.outstanding})",
    )
    parser.add_argument("--min-len", type=int, default=d.min_len, help=f"shortest digit string ({d.min_len})")
    parser.add_argument("--max-len", type=int, default=d.max_len, help=f"longest digit string ({d.max_len})")
    parser.add_argument("--no-partial-credit", action="store_true", help="reward 0 for any inexact answer")
    parser.add_argument(
        "--turns", type=int, default=d.turns, help=f"answers per episode at most, with feedback ({d.turns})"
    )
    parser.add_argument("--top-p", type=float, default=d.top_p, help=f"sampling top-p (default {d.top_p})")
    parser.add_argument("--trainer-threads", type=int, default=d.trainer_threads, help="torch threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _config(args: argparse.Namespace):
    from trainer.demo_config import DemoConfig

    try:
        return DemoConfig(
            method=args.method,
            seed=args.seed,
            min_len=args.min_len,
            max_len=args.max_len,
            partial_credit=not args.no_partial_credit,
            turns=args.turns,
            sft_steps=args.sft_steps,
            sft_lr=args.sft_lr,
            updates=args.updates,
            time_limit_s=args.time_limit,
            prompts=args.prompts,
            samples=args.samples,
            agents=args.agents,
            lr=args.lr,
            max_version_age=args.max_version_age,
            outstanding=args.outstanding,
            top_p=args.top_p,
            trainer_threads=args.trainer_threads,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _say(line: str) -> None:
    print(f"mixfleet demo: {line}", flush=True)


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("transformers", "openai", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"the demo needs {', '.join(missing)}: install it with .venv/bin/pip install -e '.[demo]'"
        )
    config = _config(args)
    out = make_dir(Path(args.out).expanduser().resolve(), "--out")
    if args.router is not None:
        key = args.api_key or os.environ.get("MIXFLEET_API_KEY")
        if not key:
            raise UserError("--router needs a key: --api-key or MIXFLEET_API_KEY")
        if args.base is None or not (Path(args.base) / "config.json").is_file():
            raise UserError("--router needs --base, the fleet's base checkpoint directory (with config.json)")
        return _demo(args.router, key, Path(args.base).resolve(), out, config, args)
    data = make_dir(
        Path(args.data_dir).expanduser().resolve() if args.data_dir else out / "fleet", "--data-dir"
    )
    with _local_fleet(data, args.port, args.model_preset) as (url, key):
        return _demo(url, key, data / "base", out, config, args)


def _demo(url: str, key: str, base: Path, out: Path, config, args: argparse.Namespace) -> int:
    from trainer.client import RouterError
    from trainer.demo import ActivationError, run_demo
    from trainer.demo_plot import write_plot
    from trainer.policy import CheckpointError

    try:
        record = asyncio.run(
            run_demo(url, key, base, out, config, show_progress=not args.no_progress, log=_say)
        )
    except (RouterError, ActivationError, CheckpointError) as exc:
        raise UserError(str(exc)) from None
    plot = write_plot(record, out / "demo.png")
    s = record["summary"]
    if s["updates"]:
        _say(
            f"{s['updates']} updates in {s['rl_wall_s']:.0f} s of RL ({s['wall_s']:.0f} s in all): mean "
            f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} (first and last fifth), exact "
            f"{s['exact_first']:.3f} -> {s['exact_last']:.3f}"
        )
        turns = ", ".join(f"{n} turn{'s' * (n != '1')}: {c}" for n, c in s["turns"].items())
        _say(
            f"{s['episodes']} episodes trained on, {s['turns_mean']:.2f} turns per episode ({turns}); "
            f"forks: {s['forks']} (turns that did not extend their session's recorded tokens; expected 0)"
        )
    else:
        _say("no update was made")
    plotted = f" and {plot}" if plot else " (no plot: matplotlib is not installed)"
    _say(f"wrote {out / 'demo.json'}, {out / 'episodes.jsonl'}{plotted}")
    _cost_report(url, key, out / "report")
    return 0


def _cost_report(url: str, key: str, out: Path) -> None:
    """``mixfleet report`` from the router's ledger into ``out`` while the fleet is still up; a
    failure is reported in one line and does not fail the demo."""
    import subprocess

    from launcher.children import mixfleet_command

    argv = [*mixfleet_command(), "report", "--out", str(out), "--router", url]
    env = {**os.environ, "MIXFLEET_API_KEY": key}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode == 0:
        _say(f"cost report: {out / 'report.html'}")
    else:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
        _say(f"no cost report: {lines[-1]}")


class _local_fleet:
    """``mixfleet up`` as a child process for the duration of the block; yields (url, key)."""

    def __init__(self, data: Path, port: int | None, model_preset: str) -> None:
        self.data = data
        self.port = port
        self.model_preset = model_preset
        self.child = None

    def __enter__(self) -> tuple[str, str]:
        from core import tcp
        from launcher import children

        host = "127.0.0.1"
        port = self.port or tcp.free_port(host)
        if not tcp.port_is_free(host, port):
            raise UserError(f"port {port} on {host} is in use (pick another with --port)")
        self.data.mkdir(parents=True, exist_ok=True)
        log = self.data / "up.log"
        argv = ["up", "--preset", "local", "--port", str(port), "--data-dir", str(self.data)]
        argv += ["--model-preset", self.model_preset]
        _say(f"starting the local fleet (log {log}) ...")
        self.child = children.spawn("up", argv, log, {"MIXFLEET_API_KEYS": "", "MIXFLEET_API_KEY": ""})
        url = f"http://{host}:{port}"
        try:
            key = self._wait_ready(url, log)
        except BaseException:
            self.__exit__()
            raise
        return url, key

    def _wait_ready(self, url: str, log: Path, timeout_s: float = 900.0) -> str:
        """Block until ``up`` printed its banner (every group ready); return the key."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.child.returncode()
            if code is not None:
                raise UserError(f"mixfleet up exited with {code} during start-up; see {log}")
            if "mixfleet is up:" in log.read_text(errors="replace"):
                break
            if time.monotonic() > deadline:
                raise UserError(f"the fleet was not up after {timeout_s:.0f} s; see {log}")
            time.sleep(0.3)
        _say(f"fleet up at {url}")
        return (self.data / "api_key").read_text().strip()

    def __exit__(self, *exc: object) -> None:
        from launcher import children

        if self.child is not None:
            _say("stopping the fleet ...")
            children.stop([self.child], grace_s=20.0)
            self.child = None

"""The GPU check: SGLang on each format's converted checkpoint, through the fleet's own path.

``python -m deploy.gpu_check --out DIR [--model DIR] [--formats bf16,fp8] [--engine sglang|local]``

Run it once on a machine with a GPU and SGLang 0.5.23 installed (the image of
:mod:`images.modal_images`, or ``pip install sglang==0.5.23``) before trusting a format on a new
accelerator. Everything between the trainer's BF16 checkpoint and a sampled token is the fleet's
production code; only the router and replicas run on one machine instead of Modal:

1. **convert**: the BF16 checkpoint (``--model``; default a ``small`` model made by
   ``mixfleet init-model``) is converted once per format into a local store
   (:func:`weight_sync.publish.bootstrap`), version 0.
2. **fleet**: a router (``mixfleet router``, memory state, the store's weight routes) and one
   replica per format (``mixfleet replica --engine-command``: staging, the engine, the sidecar and
   its reconciler). With ``--engine sglang`` the engine is SGLang started by
   :func:`images.sglang.server_argv`, exactly the argv a Modal server runs; with ``--engine
   local`` it is the local CPU engine (the suite runs the check that way).
3. **masks**: per group, turns sampled at top-p 0.95 through the router: every token's support is
   non-empty and holds the token, the support's log-probs sum to 1 and the token's μ is its
   support log-prob (:func:`check_records`).
4. **ladder**: levels 1-5 of ``mixfleet validate`` (:func:`validate.run.run_validation`) on every
   group against version 0's BF16 weights (``--model``): precision contract, converter, one operator,
   fixed-prefix scoring against a ``transformers`` BF16 forward, routes (the engines start with
   ``--enable-return-routed-experts``) and decode-versus-prefill; step 5 is level 6. Each group's
   levels go to the report, a failed one to its failures. Needs ``transformers`` (SGLang's images
   have it).
5. **activation under load**: while sessions sample long turns continuously on every group,
   ``mixfleet weights verify`` (:func:`validate.live_update.run_verify`) publishes a known perturbation
   (two rows of ``lm_head`` swapped), waits until every replica serves it, checks that the
   fixed-prefix scores moved exactly as predicted, rolls back and checks they returned. Every load
   turn must complete, and every turn's weight-version spans must be well formed: contiguous,
   covering every token, versions non-decreasing and among those published
   (:func:`check_spans`); turns that crossed an activation are counted per group.

Writes ``DIR/gpu_check.json`` (every check's figures and failures) and one line per step;
exits 0 when every check passed, 1 otherwise, 2 with one line when the fleet cannot start (the
router or a replica exited: the line names its log). Formats default to what the device runs natively
(:func:`native_formats`): NVFP4 needs compute capability 10.0 (Blackwell), FP8 8.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.errors import UserError
from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG
from core.tcp import free_port
from launcher.children import Child, ChildFailed, Launcher, Probe

RUN = "gpu-check"
ENGINES = ("sglang", "local")
MASK_PARAMS = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 32}
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@dataclass(frozen=True)
class CheckConfig:
    """One run of the check: where, on which engine and formats, and how much load."""

    out: Path
    model: Path | None
    formats: tuple[str, ...]
    engine: str = "sglang"
    sessions_per_group: int = 4
    turn_tokens: int = 256
    timeout_s: float = 1800.0
    gpu: str = "H100"


@dataclass
class Report:
    """What the check found; ``ok`` when no step failed."""

    engine: str
    formats: list[str]
    steps: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def native_formats() -> tuple[str, ...]:
    """The formats the first CUDA device runs natively (bf16 only without one)."""
    import torch

    if not torch.cuda.is_available():
        return ("bf16",)
    major, minor = torch.cuda.get_device_capability(0)
    cc = major * 10 + minor
    return ("bf16",) + (("fp8",) if cc >= 89 else ()) + (("nvfp4",) if cc >= 100 else ())


def engine_command(engine: str, weight_format: str, kv_cache_dtype: str, port: int) -> str:
    """The replica's ``--engine-command`` (``{model}`` and ``{version}`` filled in by the replica)."""
    import shlex

    if engine == "local":
        return ""  # mixfleet replica's default: the local CPU engine
    from images.sglang import server_argv

    argv = server_argv(
        model_path="{model}",
        port=port,
        weight_format=weight_format,
        kv_cache_dtype=kv_cache_dtype,
        tp_size=1,
        weight_version="{version}",
        python=sys.executable,
        engine_args=(ENABLE_RETURN_ROUTED_EXPERTS_FLAG,),
    )
    return shlex.join(argv)


def preset_toml(formats: Sequence[str], engine: str, gpu: str) -> str:
    """A preset with one group ``check-<format>`` per format, one replica each."""
    accelerator = "cpu" if engine == "local" else gpu
    lines = ['name = "gpu-check"']
    for fmt in formats:
        lines += [
            "",
            "[[groups]]",
            f'name = "check-{fmt}"',
            f'accelerator = "{accelerator}"',
            f'weight_format = "{fmt}"',
            "sessions_per_replica = 16",
            f'engine_args = ["{ENABLE_RETURN_ROUTED_EXPERTS_FLAG}"]',
            "min_replicas = 1",
            "max_replicas = 1",
        ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ checks


def check_records(turn: dict[str, Any], tol: float = 1e-3) -> list[str]:
    """Problems of a masked turn's records (empty: every record is consistent)."""
    problems = []
    for i, rec in enumerate(turn["records"]):
        ids, lps = rec["support_ids"], rec["support_logprobs"]
        where = f"{turn['group']} turn {turn['turn']} token {i}"
        if not ids:
            problems.append(f"{where}: empty support at top_p < 1")
            continue
        if rec["token_id"] not in ids:
            problems.append(f"{where}: sampled token {rec['token_id']} is not in its support")
            continue
        total = math.fsum(math.exp(x) for x in lps if x is not None)
        if abs(total - 1.0) > tol:
            problems.append(f"{where}: support probabilities sum to {total:.6f}")
        mu = lps[ids.index(rec["token_id"])]
        if rec["logprob"] is None or mu is None or abs(rec["logprob"] - mu) > tol:
            problems.append(f"{where}: logprob {rec['logprob']} is not its support log-prob {mu}")
    return problems


def check_spans(turn: dict[str, Any], published: set[int]) -> list[str]:
    """Problems of a turn's weight-version spans (empty: contiguous from 0 to the turn's length,
    versions non-decreasing and published, each record's version that of its span)."""
    spans, n = turn["weight_versions"], len(turn["output_ids"])
    where = f"{turn['group']} turn {turn['turn']}"
    if not spans:
        return [f"{where}: no weight-version spans"]
    problems, end, last = [], 0, -1
    for span in spans:
        if span["start"] != end or span["end"] <= span["start"]:
            problems.append(f"{where}: span {span} does not continue at {end}")
        if span["version"] < last or span["version"] not in published:
            problems.append(f"{where}: span version {span['version']} after {last} (published {published})")
        end, last = span["end"], span["version"]
    if end != n:
        problems.append(f"{where}: spans end at {end}, the turn has {n} tokens")
    versions = [r["weight_version"] for r in turn["records"]]
    expected = [s["version"] for s in spans for _ in range(s["start"], s["end"])]
    if not problems and versions != expected:
        problems.append(f"{where}: record versions {versions} differ from the spans")
    return problems


# ------------------------------------------------------------------------------ the fleet


@dataclass
class Fleet:
    """The router and the replicas of one check, started by :func:`start_fleet`."""

    url: str
    admin_key: str
    groups: tuple[str, ...]
    children: list[Child] = field(default_factory=list)


@contextmanager
def start_fleet(cfg: CheckConfig, model: Path) -> Iterator[Fleet]:
    """Convert ``model`` into a store under ``cfg.out``, start the router and one replica per
    format, and yield once every group serves version 0; stops every process on exit."""
    from weight_sync.publish import bootstrap
    from weight_sync.store.local import LocalStore

    store_root, logs = cfg.out / "store", cfg.out / "logs"
    bootstrap(LocalStore(store_root), RUN, model, list(cfg.formats))
    preset = cfg.out / "preset.toml"
    preset.write_text(preset_toml(cfg.formats, cfg.engine, cfg.gpu))
    admin, replica = secrets.token_hex(16), secrets.token_hex(16)
    keys = json.dumps({admin: ["rollout", "trainer", "admin"], replica: ["replica"]})
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    fleet = Fleet(url, admin, tuple(f"check-{f}" for f in cfg.formats))
    deadline = time.monotonic() + cfg.timeout_s
    with Launcher(store_root, RUN, router_url=url) as launcher, Probe() as probe:
        env = {"MIXFLEET_API_KEYS": keys, "MIXFLEET_STORE": str(store_root), "MIXFLEET_RUN": RUN}
        argv = ["router", "--preset", str(preset), "--port", str(port)]
        router = launcher.spawn("router", argv, logs / "router.log", env)
        probe.wait_http(url + "/healthz", router, deadline)
        children = [router]
        for fmt in cfg.formats:
            log = logs / f"replica-{fmt}.log"
            children.append(
                launcher.spawn(
                    f"replica-{fmt}", _replica_argv(cfg, fmt, preset, url), log, {"MIXFLEET_API_KEY": replica}
                )
            )
        _wait_groups(fleet, deadline, children)
        yield fleet


def _replica_argv(cfg: CheckConfig, fmt: str, preset: Path, router_url: str) -> list[str]:
    kv = "auto"
    engine_port = free_port("127.0.0.1")
    argv = ["replica", "--preset", str(preset), "--group", f"check-{fmt}", "--store", str(cfg.out / "store")]
    argv += ["--run", RUN, "--port", str(free_port("127.0.0.1")), "--engine-port", str(engine_port)]
    argv += ["--stage-dir", str(cfg.out / "staging" / fmt), "--router", router_url]
    argv += ["--log-dir", str(cfg.out / "logs"), "--ready-timeout", str(cfg.timeout_s)]
    command = engine_command(cfg.engine, fmt, kv, engine_port)
    return argv + (["--engine-command", command] if command else [])


def _wait_groups(fleet: Fleet, deadline: float, children: Sequence[Child] = ()) -> None:
    """Block until every group of ``fleet`` has a ready replica in rotation; ``ChildFailed`` (a
    UserError naming its log) as soon as one of ``children`` (the router, the replicas) exits."""
    from trainer.client import RolloutClient

    with RolloutClient(fleet.url, fleet.admin_key) as client:
        while True:
            for child in children:
                code = child.returncode()
                if code is not None:
                    raise ChildFailed(child, f"exited with {code} before its group was ready")
            groups = {g["name"]: g for g in client.groups().get("groups", [])}
            if all(groups.get(g, {}).get("ready_replicas", 0) > 0 for g in fleet.groups):
                return
            if time.monotonic() > deadline:
                raise UserError(f"groups not ready in time: {sorted(groups)}; see the logs")
            time.sleep(1.0)


# ------------------------------------------------------------------------------ steps


def sample_with_masks(fleet: Fleet, report: Report) -> None:
    """Step 3: two masked turns per group; every record checked by :func:`check_records`."""
    from trainer.client import RolloutClient

    found: dict[str, Any] = {}
    with RolloutClient(fleet.url, fleet.admin_key) as client:
        for group in fleet.groups:
            session = client.create_session(group=group)
            turns = [
                client.turn(session.session_id, PROMPT, MASK_PARAMS, return_support=True) for _ in range(2)
            ]
            problems = [p for t in turns for p in check_records(t)]
            sizes = [len(r["support_ids"]) for t in turns for r in t["records"]]
            found[group] = {"tokens": len(sizes), "mean_support": sum(sizes) / max(len(sizes), 1)}
            report.failures += problems[:10]
    report.steps["masks"] = found


class Load:
    """Sessions sampling long turns continuously on every group until :meth:`stop`.

    Session ``k`` of a group asks for ``turn_tokens + 13 * k`` tokens a turn: sessions batched
    together would otherwise end their turns at the same step and start the next together, so the
    gaps between their turns (the router's round trip, when nothing of theirs is running) line up,
    and an activation in such a gap finds no turn to cross it."""

    def __init__(self, fleet: Fleet, sessions_per_group: int, turn_tokens: int) -> None:
        self.fleet, self.per_group, self.tokens = fleet, sessions_per_group, turn_tokens
        self.turns: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    async def _main(self) -> None:
        from trainer.client import AsyncRolloutClient

        async with AsyncRolloutClient(self.fleet.url, self.fleet.admin_key) as client:
            lengths = [self.tokens + 13 * k for k in range(self.per_group)]
            tasks = [self._agent(client, g, n) for g in self.fleet.groups for n in lengths]
            await asyncio.gather(*tasks)

    async def _agent(self, client: Any, group: str, tokens: int) -> None:
        params = {**MASK_PARAMS, "max_new_tokens": tokens, "stop_token_ids": []}
        session = await client.create_session(group=group)
        context = list(PROMPT)
        while not self._stop.is_set():
            try:
                turn = await client.turn(session.session_id, context, params, return_support=True)
            except Exception as exc:  # every failure is a finding, none may stop the others
                self.errors.append(f"{group}: {type(exc).__name__}: {exc}")
                return
            self.turns.append(turn)
            context = list(PROMPT)  # a fresh turn of the same prompt: long outputs, short input


def activate_under_load(fleet: Fleet, cfg: CheckConfig, report: Report) -> None:
    """Step 5: ``weights verify`` while :class:`Load` samples; then every load turn checked."""
    from clients.router import WeightsClient
    from validate.live_update import run_verify

    with (
        Load(fleet, cfg.sessions_per_group, cfg.turn_tokens) as load,
        WeightsClient(fleet.url, fleet.admin_key) as weights,
    ):
        time.sleep(2.0)  # let every session have a turn running
        verify = run_verify(weights, timeout=cfg.timeout_s, say=lambda line: print(f"  {line}", flush=True))
        time.sleep(2.0)
    published = {v for v in (verify.latest, verify.perturbed, verify.rolled_back) if v is not None}
    report.failures += verify.failures + load.errors
    crossed = {g: 0 for g in fleet.groups}
    for turn in load.turns:
        report.failures += check_spans(turn, published)[:3]
        crossed[turn["group"]] += len(turn["weight_versions"]) > 1
    report.steps["activation"] = {
        "verify": asdict(verify),
        "turns": len(load.turns),
        "turns_across_an_activation": crossed,
        "load_errors": load.errors,
    }


def ladder(fleet: Fleet, cfg: CheckConfig, model: Path, report: Report) -> None:
    """Step 4: levels 1-5 of ``mixfleet validate`` on every group at version 0 (``model``'s
    weights); step 5 is its level 6."""
    from clients.router import WeightsClient
    from validate.run import Options, run_validation

    with WeightsClient(fleet.url, fleet.admin_key) as weights:
        options = Options(live_update=False, timeout=cfg.timeout_s)
        say = lambda line: print(f"  {line}", flush=True)  # noqa: E731
        result = run_validation(weights, cfg.out / "store", checkpoint=model, options=options, say=say)
    report.steps["ladder"] = result.to_dict()
    for g in result.groups:
        report.failures += [f for lv in g.levels for f in lv.failures]


def run_check(cfg: CheckConfig) -> Report:
    """Steps 1-5 (see the module docstring); the report is also written to ``gpu_check.json``."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    model = cfg.model if cfg.model is not None else _make_model(cfg.out / "model")
    report = Report(cfg.engine, list(cfg.formats))
    with start_fleet(cfg, model) as fleet:
        print(f"fleet up: {', '.join(fleet.groups)} at {fleet.url}", flush=True)
        sample_with_masks(fleet, report)
        print(f"masks: {report.steps['masks']}", flush=True)
        ladder(fleet, cfg, model, report)
        print(f"ladder: {'OK' if report.steps['ladder']['ok'] else 'FAILED'}", flush=True)
        activate_under_load(fleet, cfg, report)
    (cfg.out / "gpu_check.json").write_text(json.dumps({"ok": report.ok, **asdict(report)}, indent=2))
    return report


def _make_model(path: Path) -> Path:
    from mixfleet.init_model import write_model

    if not (path / "config.json").exists():
        write_model(path, "small")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="store, logs and gpu_check.json go here")
    p.add_argument("--model", type=Path, default=None, help="BF16 HF checkpoint (default: a small one)")
    p.add_argument("--formats", default=None, help="comma-separated (default: what the GPU runs natively)")
    p.add_argument("--engine", choices=ENGINES, default="sglang", help="sglang (default) or local")
    p.add_argument("--gpu", default="H100", help="accelerator name for the preset (default H100)")
    p.add_argument("--sessions", type=int, default=4, help="load sessions per group (default 4)")
    p.add_argument("--turn-tokens", type=int, default=256, help="tokens per load turn (default 256)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per wait (default 1800)")
    args = p.parse_args(argv)
    formats = tuple(args.formats.split(",")) if args.formats else native_formats()
    cfg = CheckConfig(args.out.resolve(), args.model, formats, args.engine, args.sessions, args.turn_tokens,
                      args.timeout, args.gpu)  # fmt: skip
    try:
        report = run_check(cfg)
    except UserError as exc:
        print(f"gpu check: {exc}", file=sys.stderr)
        return 2
    for line in report.failures:
        print(f"FAIL {line}")
    print("gpu check: OK" if report.ok else f"gpu check: {len(report.failures)} failures")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

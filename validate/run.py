"""The ladder: levels 1-6 per group, each group stopping at the first level that fails.

Levels 1-3 hold the most fixed (the contract, the tensors, one operator); level 4 compares the
whole forward on fixed tokens; level 5 runs on level 4's sequences and runs even when level 4
failed, because it localizes a level-4 failure (the first MoE layer whose routes diverge); a
group stops after level 5 when either failed. Level 6 publishes a known perturbation for the whole
fleet and rolls it back (``validate.live_update``, what ``weights verify`` runs); it runs once,
when at least one group passed levels 1-5, and is reported for those groups.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.engine import EngineRejected
from core.errors import UserError
from validate import contract, converter, engine_calls, operator, routes, scoring
from validate.level import LevelResult
from validate.live_update import run_verify
from validate.target import GroupTarget, discover
from validate.thresholds import table

DEFAULT_PROMPTS = tuple(
    tuple(s.encode())
    for s in (
        "Hello, world",
        "The quick brown fox jumps over the lazy dog.",
        "def f(x):\n    return x * 2\n",
        "Once upon a time, in a land far away, there lived a",
    )
)


@dataclass
class GroupReport:
    target: GroupTarget
    levels: list[LevelResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(lv.ok for lv in self.levels)

    @property
    def first_failure(self) -> int | None:
        return next((lv.level for lv in self.levels if not lv.ok), None)

    def to_dict(self) -> dict[str, Any]:
        t = self.target
        return {
            "group": t.name,
            "format": t.format,
            "accelerator": t.accelerator,
            "version": t.version,
            "ok": self.ok,
            "first_failure": self.first_failure,
            "levels": [lv.to_dict() for lv in self.levels],
        }


@dataclass
class ValidationReport:
    groups: list[GroupReport]
    prompts: int
    live_update: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "prompts": self.prompts,
            "groups": [g.to_dict() for g in self.groups],
            "live_update": self.live_update,
            "thresholds": table(),
        }


def read_prompts(path: Path) -> list[tuple[int, ...]]:
    """Prompts from a JSON-lines file: each line a list of token ids or ``{"input_ids": [...]}``."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"--prompts {path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            v = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"--prompts {path} line {n}: not JSON ({exc.msg})") from None
        ids = v.get("input_ids") if isinstance(v, dict) else v
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise UserError(f"--prompts {path} line {n}: expected a non-empty list of token ids")
        out.append(tuple(ids))
    if not out:
        raise UserError(f"--prompts {path}: no prompts")
    return out


def check_prompts(prompts: Sequence[Sequence[int]], max_new: int, checkpoint: Path) -> None:
    """``UserError`` naming the first prompt with a token id outside the vocabulary of the model
    at ``checkpoint`` (its ``config.json``), or longer, with ``max_new`` sampled tokens, than the
    model's context (``max_position_embeddings``)."""
    config = json.loads((checkpoint / "config.json").read_text())
    vocab, context = int(config["vocab_size"]), config.get("max_position_embeddings")
    for n, ids in enumerate(prompts, 1):
        if max(ids) >= vocab:
            raise UserError(f"prompt {n}: token id {max(ids)} is outside the model's vocabulary [0, {vocab})")
        if context is not None and len(ids) + max_new > int(context):
            raise UserError(
                f"prompt {n}: {len(ids)} tokens + {max_new} sampled exceed the model's context of {context}"
            )


@dataclass(frozen=True)
class Options:
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS
    max_new_tokens: int = 48
    top_p: float = 0.9
    live_update: bool = True
    timeout: float = 600.0


def _ladder(
    client: Any, t: GroupTarget, opts: Options, refs: dict[Path, Any], say: Callable[[str], None]
) -> GroupReport:
    from validate.reference import Reference

    rep = GroupReport(t)
    for check in (contract.check, converter.check, operator.check):
        say(f"{t.name}: level {len(rep.levels) + 1}")
        rep.levels.append(check(t))
        if not rep.levels[-1].ok:
            return rep
    assert t.bf16_dir is not None
    if not t.replicas:
        why = "no live replica to sample and score with: scale the group up to validate levels 4-6"
        rep.levels.append(LevelResult(4, False, why, (why,)))
        return rep
    ref = refs.get(t.bf16_dir) or refs.setdefault(t.bf16_dir, Reference(t.bf16_dir))
    say(f"{t.name}: level 4")
    try:
        samples = engine_calls.sample(t.replicas[0].url, opts.prompts, opts.max_new_tokens, opts.top_p)
    except EngineRejected as exc:
        raise UserError(f"{t.name}: its engine refused a validation prompt: {exc.message}") from None
    fp = scoring.fixed_prefix(client, t, opts.prompts, samples, ref)
    rep.levels.append(scoring.check(t, fp, opts.top_p))
    say(f"{t.name}: level 5")
    cfg = ref.model.config
    rep.levels.append(routes.check(t, fp, ref.moe_layers, int(cfg.num_hidden_layers), ref.top_k))
    return rep


def run_validation(
    client: Any,
    store_root: Path | None,
    *,
    groups: list[str] | None = None,
    checkpoint: Path | None = None,
    options: Options = Options(),
    say: Callable[[str], None] = print,
) -> ValidationReport:
    """Run the ladder on every chosen group of the fleet behind ``client`` (``WeightsClient``); a
    delta version's whole content is staged, for the run, beside the store."""
    beside = store_root if store_root is not None and Path(store_root).is_dir() else None  # links reach
    with tempfile.TemporaryDirectory(prefix=".validate-", dir=beside) as scratch:
        return _validate(client, store_root, groups, checkpoint, options, say, Path(scratch))


def _validate(
    client: Any,
    store_root: Path | None,
    groups: list[str] | None,
    checkpoint: Path | None,
    options: Options,
    say: Callable[[str], None],
    scratch: Path,
) -> ValidationReport:
    targets = discover(client, store_root, groups, checkpoint, scratch)
    for reference in {t.bf16_dir for t in targets if t.bf16_dir is not None}:
        check_prompts(options.prompts, options.max_new_tokens, reference)
    refs: dict[Path, Any] = {}
    reports = [_ladder(client, t, options, refs, say) for t in targets]
    report = ValidationReport(reports, len(options.prompts))
    passed = [g for g in reports if g.ok]
    if options.live_update and passed:
        say("level 6: publishing a known perturbation for the whole fleet, then rolling it back")
        verify = run_verify(client, timeout=options.timeout, say=say)
        report.live_update = {
            "latest": verify.latest,
            "perturbed": verify.perturbed,
            "rolled_back": verify.rolled_back,
            "swap": verify.swap,
        }
        for g in passed:
            g.levels.append(_live_level(g.target.name, verify))
    return report


def _live_level(name: str, verify: Any) -> LevelResult:
    mine = [f for f in verify.failures if f.startswith((name + ":", name + "/"))]
    row = verify.groups.get(name, {})
    if not row and not mine:
        mine = [f"{name}: no score during the live update"]
    summary = (
        f"perturbation v{verify.perturbed}: log-prob rise expected {row.get('rise_expected', 0):+.4f}, "
        f"observed {row.get('rise_observed', 0):+.4f}; rolled back as v{verify.rolled_back}"
    )
    return LevelResult.checked(
        6,
        summary,
        mine,
        details=row,
        plot={"expected": row.get("rise_expected"), "observed": row.get("rise_observed")},
    )

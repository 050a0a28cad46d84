"""``mixfleet weights verify``: prove that a published update really activated on every group.

The perturbation is a swap of two rows ``t`` and ``s`` of the output projection (``lm_head``,
or the tied embedding). Every weight format keeps ``lm_head`` in BF16, and a row swap only
permutes the logits, so the softmax normalizer is unchanged and the effect is exact and known
in advance for every group, whatever its precision: at the scored position,
``logp_after(t) == logp_before(s)`` and ``logp_after(s) == logp_before(t)``, every other
candidate's log-prob is unchanged. ``t`` is chosen as the least likely candidate, so its
log-prob *rises* by ``logp_before(s) - logp_before(t)``.

It publishes two new versions, ``P`` and ``R`` below; the fleet ends at ``R``.

Steps (each must hold, else the check fails naming the group; a group without a live replica
to score with cannot be checked, and fails):

1. every replica serves the latest version ``L``; score ``prefix + [c]`` for every candidate
   ``c`` on every group (baseline);
2. publish the perturbation of ``L`` as ``P``; every group's manifest names ``P`` and every
   replica serves ``P``; each group's scores moved exactly as predicted (per-format tolerance);
3. roll back to ``L`` (a new number ``R`` with ``L``'s content); every replica serves ``R``;
   scores are back at the baseline.

Once the router has accepted the perturbation, the fleet is never left on it: should the check
stop before its rollback is published (Ctrl-C, a wait that times out, a failed call), it waits
for the perturbation job to end and, if it published ``P``, publishes the rollback before the
stop goes on, each said in one line on stderr (or, when that fails too, the command to run).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clients.router import WeightsClient
from core.errors import UserError

# Engines compute the same bf16 lm_head dot products before and after the swap; differences
# come only from kernel blocking (CPU) or batch-dependent reductions (GPU).
TOLERANCE = {"bf16": 2e-3, "fp8": 5e-3, "nvfp4": 5e-3, "mxfp4": 5e-3}
PREFIX = (72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100)
CANDIDATES = tuple(range(140, 172))


@dataclass
class VerifyReport:
    latest: int
    perturbed: int | None = None
    rolled_back: int | None = None
    swap: tuple[int, int] | None = None
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _scores(client: WeightsClient, prefix: tuple[int, ...], candidates: tuple[int, ...]) -> dict[str, Any]:
    """Per group: {"format", "versions": {replica: v}, "logp": {candidate: logp}} (replicas agree)."""
    body = {"input_ids": [list(prefix) + [c] for c in candidates], "logprob_start_len": len(prefix)}
    out: dict[str, Any] = {}
    for res in client.score(body)["results"]:
        g = out.setdefault(res["group"], {"format": res.get("format"), "versions": {}, "per_replica": {}})
        g["versions"][res["replica"]] = res["weight_version"]
        g["per_replica"][res["replica"]] = {
            c: seq[-1] for c, seq in zip(candidates, res["logprobs"], strict=True)
        }
    for g in out.values():
        first = next(iter(g["per_replica"].values()))
        g["logp"] = first
    return out


def run_verify(
    client: WeightsClient,
    *,
    timeout: float = 600.0,
    tolerance: dict[str, float] | None = None,
    say: Callable[[str], None] = print,
) -> VerifyReport:
    """Run the three steps above against the router; returns the report (``ok`` or failures)."""
    tol = {**TOLERANCE, **(tolerance or {})}
    status = client.status()
    latest = status.get("latest_version")
    if latest is None:
        raise UserError("nothing is published yet: publish a version before verifying")
    report = VerifyReport(latest=latest)
    say(
        f"verify publishes two new versions: a perturbation of v{latest}, then a rollback "
        f"to v{latest}'s content; waiting for every replica to serve version {latest}"
    )
    client.wait_active(latest, timeout)
    base = _scores(client, PREFIX, CANDIDATES)
    if not base:
        raise UserError("no group answered the scoring request")
    for g in status["groups"]:
        if g["group"] not in base:
            why = "not verified: no live replica answered the baseline scores"
            report.failures.append(f"{g['group']}: {why}")
    ref = next(iter(base.values()))["logp"]
    t = min(CANDIDATES, key=lambda c: ref[c])
    s = max(CANDIDATES, key=lambda c: ref[c])
    report.swap = (t, s)
    say(
        f"baseline at v{latest}: token {t} logp {ref[t]:.4f}, token {s} logp {ref[s]:.4f}; "
        "swapping their rows"
    )
    perturbation = client.perturb({"from_version": latest, "swap_rows": [t, s]})
    rollback: dict[str, Any] | None = None
    try:
        _perturb(client, perturbation, base, report, tol, timeout)
        say(f"perturbation active as v{report.perturbed}; rolling back to v{latest}")
        rollback = client.rollback({"to": latest})
        _roll_back(client, rollback, base, report, tol, timeout)
    except BaseException:  # Ctrl-C included: the fleet must not stay on the perturbation
        _restore(client, perturbation, rollback, latest, timeout)
        raise
    say(f"rolled back as v{report.rolled_back}")
    return report


def _restore(
    client: WeightsClient,
    perturbation: dict[str, Any],
    rollback: dict[str, Any] | None,
    latest: int,
    timeout: float,
) -> None:
    """The check stopped after the router accepted ``perturbation`` (a job): unless the job failed,
    see that a rollback to ``latest``'s content is published (``rollback``, when it was started
    already, else a new one), saying what happened on stderr; never raises."""

    def warn(line: str) -> None:
        print(f"verify: {line}", file=sys.stderr, flush=True)

    try:
        if rollback is None:
            job = _ended(client, perturbation["job_id"], timeout)
            if job["state"] != "done":
                warn(f"stopped; the perturbation of v{latest} was not published ({job.get('error')})")
                return
            warn(f"stopped after publishing v{job['version']}, the perturbation of v{latest}: rolling back")
            rollback = client.rollback({"to": latest})
        done = client.wait_job(rollback, timeout)
        warn(f"rolled back as v{done['version']} (v{latest}'s content); the replicas activate it")
    except (Exception, KeyboardInterrupt) as exc:
        warn(
            f"the fleet may be serving the perturbation of v{latest} ({type(exc).__name__}: {exc}): "
            f"run `mixfleet weights rollback --to {latest}`"
        )


def _ended(client: WeightsClient, job_id: str, timeout: float) -> dict[str, Any]:
    """The weights job ``job_id`` once it is no longer running (done or failed)."""
    deadline = time.monotonic() + timeout
    while (job := client.job(job_id))["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    return job


def _perturb(
    client: WeightsClient,
    job: dict[str, Any],
    base: dict[str, Any],
    report: VerifyReport,
    tol: dict[str, float],
    timeout: float,
) -> None:
    """Wait for the row swap's publish ``job``, until every replica serves it, and check each
    replica's scores against the exact prediction (the two swapped tokens trade log-probs, the
    others keep theirs)."""
    t, s = report.swap
    job = client.wait_job(job, timeout)
    perturbed = report.perturbed = job["version"]
    _check_manifests(client.wait_active(perturbed, timeout), perturbed, report)
    after = _scores(client, PREFIX, CANDIDATES)
    for name, g in base.items():
        fmt = g["format"]
        a = after.get(name)
        if a is None:
            report.failures.append(f"{name}: no score after the perturbation")
            continue
        eps = tol.get(fmt, 5e-3)
        row = report.groups.setdefault(name, {"format": fmt, "tolerance": eps})
        row["rise_expected"] = g["logp"][s] - g["logp"][t]
        row["rise_observed"] = a["logp"][t] - g["logp"][t]
        _expect_versions(name, a["versions"], perturbed, report)
        for rep, lp in a["per_replica"].items():
            errs = [abs(lp[t] - g["logp"][s]), abs(lp[s] - g["logp"][t])]
            errs += [abs(lp[c] - g["logp"][c]) for c in CANDIDATES if c not in (t, s)]
            worst = max(errs)
            row.setdefault("perturbed_err", {})[rep] = worst
            if worst > eps:
                report.failures.append(
                    f"{name}/{rep}: after the swap log-probs are off the prediction by {worst:.2e} "
                    f"(> {eps:.0e})"
                )


def _roll_back(
    client: WeightsClient,
    job: dict[str, Any],
    base: dict[str, Any],
    report: VerifyReport,
    tol: dict[str, float],
    timeout: float,
) -> None:
    """Wait for the rollback ``job`` (to the baseline's content), for every replica to serve it,
    and check that every replica's scores are the baseline's again."""
    job = client.wait_job(job, timeout)
    back = report.rolled_back = job["version"]
    _check_manifests(client.wait_active(back, timeout), back, report)
    again = _scores(client, PREFIX, CANDIDATES)
    for name, g in base.items():
        a = again.get(name)
        if a is None:
            report.failures.append(f"{name}: no score after the rollback")
            continue
        eps = tol.get(g["format"], 5e-3)
        _expect_versions(name, a["versions"], back, report)
        for rep, lp in a["per_replica"].items():
            worst = max(abs(lp[c] - g["logp"][c]) for c in CANDIDATES)
            report.groups.setdefault(name, {"format": g["format"], "tolerance": eps})
            report.groups[name].setdefault("rollback_err", {})[rep] = worst
            if worst > eps:
                report.failures.append(
                    f"{name}/{rep}: after rollback scores differ from baseline by {worst:.2e}"
                )


def _check_manifests(status: dict[str, Any], version: int, report: VerifyReport) -> None:
    for g in status["groups"]:
        fmt = g["format"]
        m = status["formats"].get(fmt, {}).get("manifest") or {}
        if m.get("version") != version or g.get("desired_version") != version:
            report.failures.append(
                f"{g['group']}: {fmt} manifest shows version {m.get('version')}, pointer "
                f"{g.get('desired_version')}, expected {version}"
            )


def _expect_versions(name: str, versions: dict[str, Any], version: int, report: VerifyReport) -> None:
    for rep, v in versions.items():
        if v != version:
            report.failures.append(f"{name}/{rep}: scored with weight version {v}, expected {version}")

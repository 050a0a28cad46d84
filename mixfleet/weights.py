"""Publish, inspect, roll back, verify and prune weight versions (publish | status | rollback |
verify | prune).

Every subcommand talks to the router named by ``--router`` or ``MIXFLEET_URL`` (default
``http://127.0.0.1:8300``, where ``mixfleet up`` listens) with the admin key in
``MIXFLEET_API_KEY`` (else ``.mixfleet/api_key``; with neither, the router's 401 says where the key
comes from). ``publish --store ROOT`` instead publishes
straight into a local store without a router (replicas still converge by polling); ``prune
--store ROOT`` prunes one (only while nothing publishes into it: the router prunes under its job
lock, this does not). ``prune`` only prints its plan unless given ``--apply``.

Ctrl-C while a command waits cancels nothing the router accepted (a weight job runs to its end):
it exits 130 with one line saying what goes on (the job, or the version the replicas are
activating) and how to follow it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.errors import UserError
from mixfleet.argtypes import processes, seconds

RUN_HELP = "run id: the router's run (the default; a router refuses another)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="weights_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--router", default=None, help="router URL (default $MIXFLEET_URL or http://127.0.0.1:8300)"
        )
        p.add_argument("--timeout", type=seconds, default=900.0, help="seconds to wait for jobs/activation")
        p.add_argument("--json", action="store_true", help="print the result as JSON")

    why = "convert a BF16 checkpoint once per format and publish it (as the next version)"
    p = sub.add_parser("publish", help=why, description=why)
    common(p)
    p.add_argument(
        "checkpoint", help="HF BF16 checkpoint directory, a path on the router's filesystem (checked there)"
    )
    p.add_argument(
        "--delta-of",
        type=int,
        default=None,
        metavar="BASE",
        help="CHECKPOINT holds only the BF16 tensors changed since version BASE; publish deltas over it",
    )
    p.add_argument("--version", type=int, default=None, help="version number (default: next)")
    p.add_argument("--run", default=None, help=RUN_HELP + "; with --store: any run")
    p.add_argument(
        "--per-format", action="store_true", help="move each format's pointer as soon as it is ready"
    )
    p.add_argument("--formats", default=None, help="comma-separated formats (default: what the fleet serves)")
    p.add_argument("--no-wait", action="store_true", help="return once published; do not wait for replicas")
    p.add_argument("--store", default=None, help="publish straight into this local store root (no router)")
    p.add_argument("--preset", default="local", help="with --store: the preset whose formats to publish")
    p.add_argument(
        "--workers",
        type=processes,
        default=None,
        help="with --store: conversion processes (default one per format; 0: convert in this process)",
    )

    why = "per group: desired version, replica versions, lag, last activation"
    p = sub.add_parser("status", help=why, description=why)
    common(p)

    why = "publish a new version whose content is version N (--to N)"
    p = sub.add_parser("rollback", help=why, description=why)
    common(p)
    p.add_argument("--to", type=int, required=True, help="the version whose content to serve again")
    p.add_argument("--run", default=None, help=RUN_HELP)
    p.add_argument("--no-wait", action="store_true", help="do not wait for replicas")

    why = "delete the store's versions a run no longer needs, keeping its newest N (dry run unless --apply)"
    p = sub.add_parser("prune", help=why, description=why)
    common(p)
    p.add_argument("--keep", type=int, required=True, help="how many of the run's newest versions to keep")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--dry-run", action="store_true", help="print what would be deleted (the default)")
    how.add_argument("--apply", action="store_true", help="delete it")
    p.add_argument("--store", default=None, help="prune this local store root directly (no router)")
    p.add_argument("--run", default=None, help=RUN_HELP + "; with --store: default 'default'")

    p = sub.add_parser(
        "verify",
        help="publish a known perturbation, check every group moved, roll back "
        "(publishes two new versions: the perturbation and the rollback)",
        description="Prove that a published update activates on every group: publish a known "
        "perturbation of the latest version L as a new version P, check every group's scores moved "
        "exactly as predicted, then roll back by publishing a second new version R with L's content. "
        "The fleet ends at R; the run's version numbers advance by two.",
    )
    common(p)


def run(args: argparse.Namespace) -> int:
    if args.weights_command == "publish" and args.store:
        return _publish_direct(args)
    if args.weights_command == "prune":
        from weight_sync.prune import check_keep

        check_keep(args.keep)
        if args.store:
            return _prune_direct(args)
    from clients.router import WeightsClient, api_key, router_url

    with WeightsClient(router_url(args.router), api_key()) as client:
        if args.weights_command == "publish":
            return _publish(client, args)
        if args.weights_command == "status":
            return _status(client, args)
        if args.weights_command == "rollback":
            return _rollback(client, args)
        if args.weights_command == "verify":
            return _verify(client, args)
        if args.weights_command == "prune":
            return _prune(client, args)
    raise UserError(f"unknown action {args.weights_command!r}")


@contextlib.contextmanager
def _goes_on(job: dict[str, Any]) -> Iterator[None]:
    """Ctrl-C while waiting for ``job``, which the router accepted: one line saying that the router
    carries it through (nothing cancels a weight job), then the interrupt goes on (exit 130)."""
    try:
        yield
    except KeyboardInterrupt:
        from clients.router import job_name

        _interrupted(
            f"the router goes on with its {job_name(job)}; `mixfleet weights status` shows what each "
            "group serves"
        )
        raise


@contextlib.contextmanager
def _activating(version: int) -> Iterator[None]:
    """Ctrl-C while waiting for the replicas to serve ``version``: one line saying it is published."""
    try:
        yield
    except KeyboardInterrupt:
        _interrupted(
            f"version {version} is published and the replicas activate it by themselves; "
            "`mixfleet weights status` shows what each group serves"
        )
        raise


def _interrupted(what: str) -> None:
    print(f"mixfleet weights: interrupted: {what}", file=sys.stderr, flush=True)


def _formats(arg: str | None) -> list[str] | None:
    if not arg:
        return None
    return [f.strip() for f in arg.split(",") if f.strip()]


def _publish(client, args: argparse.Namespace) -> int:
    # The path is the router's to judge (it may be on the router's volume, not here): sent as an
    # absolute path, refused by the router with the reason (weight_sync.publish.check_checkpoint).
    ckpt = Path(args.checkpoint).expanduser()
    body: dict[str, Any] = {
        "checkpoint": str(ckpt.resolve()),
        "version": args.version,
        "run_id": args.run,
        "mode": "per_format" if args.per_format else "barrier",
        "formats": _formats(args.formats),
        "delta_of": args.delta_of,
    }
    job = client.publish(body)
    quiet = args.json

    def show(ev: dict[str, Any]) -> None:
        if not quiet and ev.get("kind") == "converted":
            print(f"  converted {ev['format']} in {ev['seconds']:.2f}s", file=sys.stderr)

    with _goes_on(job):
        job = client.wait_job(job, args.timeout, on_event=show)
    result = job["result"]
    formats = [f["format"] for f in result["formats"]]
    with _activating(result["version"]):
        st = None if args.no_wait else client.wait_active(result["version"], args.timeout, formats=formats)
    if args.json:
        print(json.dumps({"result": result, "status": st}, indent=2))
        return 0
    _print_result(result)
    if st is not None:
        print(served_line(st, result["version"], formats))
    return 0


def _publish_direct(args: argparse.Namespace) -> int:
    from core.fs import make_dir
    from fleet.specs import load_preset
    from weight_sync.publish import next_version, publish_checkpoint, publish_delta
    from weight_sync.store.local import LocalStore

    root = make_dir(Path(args.store).expanduser(), "store")
    store = LocalStore(root)
    formats = _formats(args.formats) or list(load_preset(args.preset).formats)
    run_id = args.run or "default"
    version = args.version if args.version is not None else next_version(store, run_id, formats)

    def show(kind: str, info: dict[str, Any]) -> None:
        if not args.json:
            extra = f" in {info['seconds']:.2f}s" if "seconds" in info else ""
            print(f"  {kind} {info.get('format', '')}{extra}", file=sys.stderr, flush=True)

    mode = "per_format" if args.per_format else "barrier"
    kwargs = {"mode": mode, "workers": args.workers, "on_event": show}
    ckpt = Path(args.checkpoint)
    if args.delta_of is not None:
        result = publish_delta(store, run_id, version, ckpt, args.delta_of, formats, **kwargs)
    else:
        result = publish_checkpoint(store, run_id, version, ckpt, formats, **kwargs)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _print_result(result.to_dict())
    return 0


def _print_result(result: dict[str, Any]) -> None:
    print(result_lines(result))


def result_lines(result: dict[str, Any]) -> str:
    """The report of a publication (``weight_sync.publish.PublishResult.to_dict``): its timings,
    then per format what was done. A rollback's formats (``content_of`` set) are hard-linked from
    that version's files (copied where no link can be made), not converted: said so, with no
    conversion time."""
    source = result.get("content_of")
    what = f" (content of version {source})" if source is not None else ""
    made = "linked, not converted" if source is not None else f"convert {result['convert_wall_s']:.2f}s"
    lines = [
        f"published run {result['run_id']} version {result['version']}{what} in {result['total_s']:.2f}s "
        f"({result['mode']}; {made}, commit {result['commit_wall_s']:.2f}s, "
        f"pointers {result['advance_wall_s']:.3f}s)"
    ]
    for f in result["formats"]:
        if f["reused"]:
            how = "reused"
        elif source is not None:
            how = f"linked from version {source}, not converted"
        else:
            how = f"converted in {f['convert_s']:.2f}s"
        kind = " (delta: changed files only)" if f.get("kind") == "delta" else ""
        lines.append(
            f"  {f['format']:6s} {how}, {f['total_bytes'] / 1e6:.1f} MB, {f['tensor_count']} tensors{kind}"
        )
    return "\n".join(lines)


def _status(client, args: argparse.Namespace) -> int:
    st = client.status()
    print(json.dumps(st, indent=2) if args.json else status_table(st))
    return 0


def status_table(st: dict[str, Any]) -> str:
    """``weights status``'s table of the router's ``GET /v1/weights`` answer ``st``: per group the
    desired version, lag and each replica's active version, last activation and standing (not
    ready; silent: ready at its last heartbeat, which is too old to count; its error)."""
    lines = [
        f"run {st['run_id']}: latest published version {st['latest_version']}",
        f"{'group':16s} {'format':6s} {'desired':>7s} {'lag':>4s}  "
        "replicas (active version, last activation)",
    ]
    for g in st["groups"]:
        reps = ", ".join(_replica_cell(r) for r in g["replicas"]) or "(no replicas)"
        lag = "-" if g.get("lag") is None else str(g["lag"])
        desired = str(g.get("desired_version"))
        lines.append(f"{g['group']:16s} {g['format']:6s} {desired:>7s} {lag:>4s}  {reps}")
    return "\n".join(lines)


def _replica_cell(r: dict[str, Any]) -> str:
    cell = f"{r['replica_id']}=v{r.get('active_version')}"
    if r.get("last_activation_at"):
        cell += f" @{_clock(r['last_activation_at'])}"
    if not r.get("ready"):
        cell += " (not ready)"
    elif not r.get("fresh", True):
        cell += " (silent: no recent heartbeat)"
    return cell + (f" ERROR: {r['error']}" if r.get("error") else "")


def _rollback(client, args: argparse.Namespace) -> int:
    job = client.rollback({"to": args.to, "run_id": args.run})
    with _goes_on(job):
        job = client.wait_job(job, args.timeout)
    result = job["result"]
    with _activating(result["version"]):
        st = None if args.no_wait else client.wait_active(result["version"], args.timeout)
    if args.json:
        print(json.dumps({"result": result, "status": st}, indent=2))
    else:
        _print_result(result)
        if st is not None:
            print(served_line(st, result["version"]))
    return 0


def _prune(client, args: argparse.Namespace) -> int:
    if args.apply:
        job = client.prune({"keep": args.keep, "run_id": args.run})
        with _goes_on(job):
            plan = client.wait_job(job, args.timeout)["result"]
    else:
        plan = client.prune_plan(args.keep, args.run)
    print(json.dumps(plan, indent=2) if args.json else prune_lines(plan, applied=args.apply))
    return 0


def _prune_direct(args: argparse.Namespace) -> int:
    from weight_sync.prune import apply_prune, plan_prune, streams_of
    from weight_sync.store.local import LocalStore

    root = Path(args.store).expanduser()
    if not root.is_dir():
        raise UserError(f"--store {root}: not a directory")
    store = LocalStore(root)
    run_id = args.run or "default"
    if not streams_of(store, run_id):  # a misspelt run would print an empty plan
        runs = ", ".join(store.runs()) or "none"
        raise UserError(f"--store {root} has no run {run_id!r} (--run; the store's runs: {runs})")
    plan = plan_prune(store, run_id, args.keep)
    if args.apply:
        apply_prune(store, plan)
    print(
        json.dumps(plan.to_dict(), indent=2) if args.json else prune_lines(plan.to_dict(), applied=args.apply)
    )
    return 0


def prune_lines(plan: dict[str, Any], *, applied: bool) -> str:
    """``weights prune``'s report of a plan (``weight_sync.prune.PrunePlan.to_dict``)."""
    verb = "deleted" if applied else "would delete"
    deleted = {f: v for f, v in plan["deleted"].items() if v}
    lines = [f"run {plan['run_id']}, keeping the newest {plan['keep']} versions:"]
    for fmt, versions in sorted(plan["kept"].items()):
        gone = deleted.get(fmt, [])
        lines.append(f"  {fmt:6s} {verb} {_vlist(gone) or 'nothing'}; keeps {_vlist(versions) or 'nothing'}")
    lines.append(
        f"{verb} {sum(map(len, deleted.values()))} versions, {plan['bytes_freed'] / 1e6:.1f} MB freed"
    )
    if not applied:
        lines.append("(dry run: pass --apply to delete)")
    return "\n".join(lines)


def _vlist(versions: list[int]) -> str:
    return ", ".join(f"v{v}" for v in versions)


def _verify(client, args: argparse.Namespace) -> int:
    from validate.live_update import run_verify

    report = run_verify(client, timeout=args.timeout, say=(lambda m: None) if args.json else print)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "latest": report.latest,
                    "perturbed": report.perturbed,
                    "rolled_back": report.rolled_back,
                    "swap": report.swap,
                    "groups": report.groups,
                    "failures": report.failures,
                },
                indent=2,
            )
        )
    else:
        for name, row in report.groups.items():
            print(
                f"  {name:16s} {row['format']:6s} logp rise expected {row.get('rise_expected', 0):+.4f} "
                f"observed {row.get('rise_observed', 0):+.4f}; max error after swap "
                f"{max(row.get('perturbed_err', {0: 0}).values()):.1e}, after rollback "
                f"{max(row.get('rollback_err', {0: 0}).values()):.1e} (tolerance {row['tolerance']:.0e})"
            )
        for f in report.failures:
            print(f"FAIL {f}", file=sys.stderr)
        print(f"verify: {'OK' if report.ok else 'FAILED'}; {_published(report)}")
    return 0 if report.ok else 1


def _published(report) -> str:
    """What a verify run left published (it publishes two versions when it gets that far)."""
    made = []
    if report.perturbed is not None:
        made.append(f"v{report.perturbed} (the perturbation of v{report.latest})")
    if report.rolled_back is not None:
        made.append(f"v{report.rolled_back} (the rollback: v{report.latest}'s content)")
    if not made:
        return "published nothing"
    return "published " + " and ".join(made)


def _clock(epoch_s: float) -> str:
    """A wall-clock time, local and to the second (the CLI's status table)."""
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(epoch_s)))


def served_line(status: dict[str, Any], version: int, formats: list[str] | None = None) -> str:
    """What a wait for ``version`` established: every live replica of the groups serving
    ``formats`` (default all) serves it (the wait skips replicas without a recent heartbeat,
    :meth:`clients.router.RouterClient.wait_active`); the skipped ones are named, as they may
    still serve another version, and so are the groups of the formats not published."""
    mine = [g for g in status["groups"] if formats is None or g["format"] in formats]
    replicas = [(g["group"], r) for g in mine for r in g["replicas"]]
    live = sum(1 for _, r in replicas if r.get("fresh", True))
    skipped = [f"{group}/{r['replica_id']}" for group, r in replicas if not r.get("fresh", True)]
    others = [g["group"] for g in status["groups"] if g not in mine]
    line = f"every live replica ({live}) serves version {version}"
    if skipped:
        line += f"; not live, not waited for: {', '.join(skipped)}"
    if others:
        line += f"; not published for (their format is not in this version): {', '.join(others)}"
    return line

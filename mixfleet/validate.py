"""Run the validation ladder on each sampler group against the trainer's BF16 weights.

``mixfleet validate [--router URL] [--group G ...] [--prompts FILE] [--out DIR] [--json]``:
per group, levels 1-6 (precision contract, quantizer and converter, one operator, fixed-prefix
scoring, routes and request state, live update; see ``validate.run``), stopping each group at
the first level that fails. Runs where the store is (``--store``, default ``$MIXFLEET_STORE``):
it reads the active version's files and the BF16 copy of that version (``--checkpoint`` instead).
Level 6 publishes two versions (a perturbation and its rollback); ``--no-live-update`` skips it.
Exit status 0 when every level of every group passes, 1 when one fails, 2 for bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from core.errors import UserError
from core.fs import make_dir
from mixfleet.argtypes import seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router", default=None, help="router URL (default $MIXFLEET_URL or http://127.0.0.1:8300)"
    )
    parser.add_argument(
        "--group",
        action="append",
        default=None,
        metavar="G",
        help="a group to validate (repeat; default all)",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="JSON lines of token-id lists (default: built-in prompts)",
    )
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="write validate.json and validate.html here"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--store", default=None, help="version store root (default $MIXFLEET_STORE; one of them is required)"
    )
    parser.add_argument(
        "--checkpoint", default=None, help="the trainer's BF16 checkpoint of the active version"
    )
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens each group samples per prompt")
    parser.add_argument(
        "--top-p", type=float, default=0.9, help="top-p of the sampling and of the support check"
    )
    parser.add_argument(
        "--no-live-update", action="store_true", help="skip level 6 (it publishes two versions)"
    )
    parser.add_argument(
        "--timeout", type=seconds, default=600.0, help="seconds to wait for publishes and activation"
    )


def run(args: argparse.Namespace) -> int:
    from clients.router import WeightsClient, api_key, router_url
    from validate.report import table, write
    from validate.run import DEFAULT_PROMPTS, Options, read_prompts, run_validation

    if importlib.util.find_spec("transformers") is None:
        raise UserError(
            "levels 3-5 compare with a transformers forward of the BF16 weights: "
            "install it with .venv/bin/pip install -e '.[demo]'"
        )
    if not 0.0 < args.top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    store = args.store or os.environ.get("MIXFLEET_STORE")
    if not store:
        raise UserError(
            "no version store: pass --store ROOT (or set MIXFLEET_STORE), the store the fleet publishes into"
        )
    out = make_dir(Path(args.out), "--out") if args.out else None  # before the ladder, not after it
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        raise UserError(f"--checkpoint {checkpoint}: no config.json (not an HF checkpoint)")
    options = Options(
        prompts=read_prompts(Path(args.prompts)) if args.prompts else DEFAULT_PROMPTS,
        max_new_tokens=args.max_new_tokens,
        top_p=args.top_p,
        live_update=not args.no_live_update,
        timeout=args.timeout,
    )

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    with WeightsClient(router_url(args.router), api_key()) as client:
        report = run_validation(
            client,
            Path(store) if store else None,
            groups=args.group,
            checkpoint=checkpoint,
            options=options,
            say=(lambda m: None) if args.json else say,
        ).to_dict()
    if out is not None:
        try:
            paths = write(report, out)
        except OSError as exc:
            raise UserError(f"cannot write the report into {out}: {exc.strerror or exc}") from None
        if not args.json:
            say(f"wrote {paths['json']} and {paths['html']}")
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0 if report["ok"] else 1

"""Deploy the fleet to Modal (mixfleet deploy [--preset NAME|FILE] [--checkpoint DIR] [--chat-model DIR]
[--dry-run]).

The preset is checked first: every problem is one line on stderr (``error: group G: ...``), and
any error stops the command with status 2 before anything is contacted. With ``--checkpoint DIR``
(the BF16 checkpoint the fleet will serve; its ``config.json`` and safetensors headers are read,
not its data) a group whose GPUs cannot hold the model's weights in its format plus one
full-context sequence of KV cache is such an error (:mod:`deploy.fit`). ``--dry-run`` prints every
server (GPU, format, KV dtype, SGLang argv, autoscaling, memory fit), the router, the conversion
function and the chat model (``--chat-model``, a directory on the weights Volume: the router's
``--chat-model``; without one the chat APIs answer 503) and stops there; while the SGLang image
is pinned by tag only (no digest: :func:`images.sglang.unpinned_warning`) both print a warning,
and a malformed ``MIXFLEET_SGLANG_IMAGE_DIGEST`` is an error. Otherwise it runs ``modal deploy
deploy/modal_app.py`` with the preset (needs a Modal token: ``modal token new``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def app_file() -> Path:
    """The Modal app file ``modal deploy`` is given: ``deploy/modal_app.py`` where the ``deploy``
    package is (found without importing the app, which would build it)."""
    import deploy

    return Path(deploy.__file__).resolve().parent / "modal_app.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="mixed", help="mixed (default), homogeneous, or a TOML file")
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="the BF16 checkpoint the fleet serves: refuse groups whose GPUs cannot hold it",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan; contact nothing")
    parser.add_argument("--run", default=None, help="run id served (default: $MIXFLEET_RUN, else main)")
    parser.add_argument(
        "--chat-model",
        default=None,
        metavar="DIR",
        help="the router's chat model, a directory on the weights Volume (/weights/...; default: "
        "$MIXFLEET_CHAT_MODEL, else none: the chat APIs answer 503)",
    )


def _preset_arg(preset: str) -> str:
    """A built-in name as is, a file as an absolute path (modal deploy runs from elsewhere)."""
    path = Path(preset)
    return str(path.resolve()) if path.suffix or path.exists() else preset


def run(args: argparse.Namespace) -> int:
    from core.errors import UserError
    from deploy.plan import (
        CHAT_MODEL_ENV,
        FLEET_ENV,
        VOCAB_SIZE_ENV,
        PresetRejected,
        chat_model_dir,
        chat_model_line,
        describe,
        load_plan,
        vocab_line,
    )
    from images.sglang import unpinned_warning

    try:
        plan = load_plan(args.preset, args.checkpoint)
    except PresetRejected as exc:
        for problem in exc.problems:
            print(f"mixfleet deploy: {problem.line()}", file=sys.stderr)
        return 2
    except UserError as exc:  # the preset does not load: one line per invalid field
        for line in str(exc).splitlines():
            print(f"mixfleet deploy: error: {line}", file=sys.stderr)
        return 2
    try:
        image_warning = unpinned_warning()
        chat_model = chat_model_dir(args.chat_model or os.environ.get(CHAT_MODEL_ENV))
    except (ValueError, UserError) as exc:
        print(f"mixfleet deploy: error: {exc}", file=sys.stderr)
        return 2
    vocab_size = plan.model.vocab_size if plan.model is not None else None
    if args.dry_run:
        print(describe(plan))
        print(chat_model_line(chat_model))
        print(vocab_line(vocab_size, chat_model))
        if image_warning:
            print(f"warning: {image_warning}")
        return 0
    for problem in plan.warnings:
        print(f"mixfleet deploy: {problem.line()}", file=sys.stderr)
    if image_warning:
        print(f"mixfleet deploy: warning: {image_warning}", file=sys.stderr)
    env = {**os.environ, "MIXFLEET_PRESET": _preset_arg(args.preset)}
    env.pop(FLEET_ENV, None)  # else the app would be built from it, not from the preset checked here
    env.pop(CHAT_MODEL_ENV, None)
    if chat_model is not None:
        env[CHAT_MODEL_ENV] = chat_model
    env.pop(VOCAB_SIZE_ENV, None)
    if vocab_size is not None:
        env[VOCAB_SIZE_ENV] = str(vocab_size)
    if args.run:
        env["MIXFLEET_RUN"] = args.run
    return subprocess.call([sys.executable, "-m", "modal", "deploy", str(app_file())], env=env)

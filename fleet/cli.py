"""mixfleet: a serverless sampler fleet for asynchronous LLM RL.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``; the module's docstring's first line is the command's help. Modules are
named here by path so that ``fleet`` does not import ``router`` at import time (the router
depends on fleet's specs, not the other way round) and so heavy imports (torch) stay inside
``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from weight_sync.errors import UserError

COMMANDS: dict[str, str] = {
    "up": "fleet.up",
    "init-model": "fleet.engine.init_model",
    "convert": "weight_sync.convert_cli",
    "engine": "fleet.engine.server",
    "router": "router.cli",
    "sidecar": "fleet.sidecar_cli",
    "weights": "fleet.weights_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_path in COMMANDS.items():
        module = importlib.import_module(module_path)
        help_line = (module.__doc__ or name).strip().splitlines()[0]
        command = sub.add_parser(name, help=help_line, description=help_line)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"mixfleet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

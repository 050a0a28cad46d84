"""mixfleet: a serverless sampler fleet for asynchronous LLM RL.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``; the module's docstring's first paragraph is the command's help. Heavy imports
(torch, FastAPI) stay inside each ``run``, so ``mixfleet --help`` is quick. A process that
:mod:`launcher.children` started takes the processes it starts with it when it ends
(:func:`~launcher.children.guard_group`). A
:class:`~core.errors.UserError` from a command becomes one line on stderr and exit status 2.
A reader of stdout that goes away (``mixfleet weights status | head -1``) ends the command
quietly with status 1, as Python's documentation advises ("Note on SIGPIPE", ``signal`` module):
stdout is pointed at ``/dev/null`` so that the interpreter's last flush cannot fail again.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from types import ModuleType

from core.errors import UserError
from launcher.children import guard_group
from mixfleet import (
    convert,
    demo,
    deploy,
    engine,
    init_model,
    replica,
    report,
    router,
    scale,
    sidecar,
    up,
    validate,
    weights,
)

COMMANDS: dict[str, ModuleType] = {
    "up": up,
    "init-model": init_model,
    "convert": convert,
    "engine": engine,
    "router": router,
    "sidecar": sidecar,
    "replica": replica,
    "weights": weights,
    "deploy": deploy,
    "scale": scale,
    "report": report,
    "demo": demo,
    "validate": validate,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        help_line = " ".join((module.__doc__ or name).strip().split("\n\n")[0].split())
        command = sub.add_parser(name, help=help_line, description=help_line)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    guard_group()
    args = build_parser().parse_args(argv)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
        return code
    except BrokenPipeError:
        if not _stdout_broken():
            raise  # another pipe or socket: not the reader of our output
        return _stdout_gone()
    except UserError as exc:
        print(f"mixfleet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _stdout_broken() -> bool:
    """Whether stdout is the broken pipe: its buffered output still cannot be written, or it is a
    pipe whose reader has gone (``poll`` reports ``POLLERR`` on the write end of such a pipe)."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except BrokenPipeError:
        return True
    except (AttributeError, OSError, ValueError):  # no real stdout (a test's capture)
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _stdout_gone() -> int:
    """Stdout's reader closed the pipe: send what is still buffered to /dev/null; status 1."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


if __name__ == "__main__":
    sys.exit(main())

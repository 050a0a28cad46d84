"""The README's Modal set-up block, pasted into bash as printed: every ``modal`` and ``mixfleet``
command in it is one its CLI parses (``modal`` and ``mixfleet`` are stand-ins that record their
arguments; nothing is contacted), and the keys it creates are ones the router accepts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import click
import pytest

from router.auth import parse_keys

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!{python}
import json, os, sys
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({{"tool": {tool!r}, "argv": sys.argv[1:], "key": os.environ.get("MIXFLEET_API_KEY"),
                        "url": os.environ.get("MIXFLEET_URL")}}) + "\\n")
if {tool!r} == "python":
    print("https://ws--mixfleet-router.modal.run")
"""


def modal_block() -> str:
    """The first bash block of the README's "Production on Modal" section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Production on Modal") :]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start : section.index("```\n", start)]


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> list[dict]:
    cwd = tmp_path_factory.mktemp("paste")
    (cwd / ".venv" / "bin").mkdir(parents=True)
    for tool in ("modal", "mixfleet", "python"):
        stub = cwd / ".venv" / "bin" / tool
        stub.write_text(STUB.format(python=sys.executable, tool=tool))
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    log = cwd / "calls.jsonl"
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd), "CALLS": str(log)}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", modal_block()], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def _modal_command(argv: list[str]) -> click.Command:
    """The click command of ``modal ARGV`` after parsing every option and argument (UsageError if
    modal 1.6's CLI refuses them)."""
    from modal.cli.entry_point import entrypoint_cli

    command: click.Command = entrypoint_cli
    ctx = command.make_context("modal", list(argv))
    while isinstance(command, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        _, command, args = command.resolve_command(ctx, rest)
        ctx = command.make_context(command.name, args, parent=ctx)
    return command


def test_every_modal_command_parses(calls) -> None:
    modal_calls = [c["argv"] for c in calls if c["tool"] == "modal"]
    assert [argv[:2] for argv in modal_calls] == [
        ["token", "new"],
        ["secret", "create"],
        ["secret", "create"],
        ["secret", "create"],
        ["secret", "create"],
        ["volume", "create"],
        ["volume", "put"],
        ["server", "autoscaler"],
    ]
    for argv in modal_calls:
        _modal_command(argv)


def test_every_mixfleet_command_parses(calls) -> None:
    from mixfleet.cli import build_parser

    mixfleet_calls = [c["argv"] for c in calls if c["tool"] == "mixfleet"]
    assert [argv[0] for argv in mixfleet_calls] == ["deploy", "deploy", "weights", "weights", "scale"]
    for argv in mixfleet_calls:
        build_parser().parse_args(argv)  # SystemExit on a refused argument


def test_the_keys_created_are_ones_the_router_takes(calls) -> None:
    created = [c["argv"][2:] for c in calls if c["argv"][:2] == ["secret", "create"]]
    secrets = {name: dict(kv.split("=", 1) for kv in values) for name, *values in created}
    keys = parse_keys(secrets["mixfleet-api-keys"]["MIXFLEET_API_KEYS"], "MIXFLEET_API_KEYS")
    assert keys[secrets["mixfleet-replica-key"]["MIXFLEET_REPLICA_KEY"]] == {"replica"}
    assert sorted(keys.values(), key=len)[0] == {"rollout"}  # the agents' key
    # the commands after the export run with the trainer's key
    used = {c["key"] for c in calls if c["tool"] == "mixfleet" and c["argv"][0] in ("weights", "scale")}
    assert len(used) == 1 and {"trainer", "admin"} <= keys[used.pop()]


def test_the_router_url_is_the_deployed_router_functions(calls, monkeypatch) -> None:
    import modal

    from deploy.plan import APP_NAME, ROUTER_FUNCTION

    [lookup] = [c["argv"] for c in calls if c["tool"] == "python"]
    assert lookup[0] == "-c"
    looked_up = []

    class Found:
        def get_web_url(self) -> str:
            return "https://ws--mixfleet-router.modal.run"

    monkeypatch.setattr(modal.Function, "from_name", lambda *a, **k: looked_up.append(a) or Found())
    exec(compile(lookup[1], "README", "exec"), {})
    assert looked_up == [(APP_NAME, ROUTER_FUNCTION)]
    urls = {c["url"] for c in calls if c["tool"] == "mixfleet" and c["argv"][0] in ("weights", "scale")}
    assert urls == {"https://ws--mixfleet-router.modal.run"}

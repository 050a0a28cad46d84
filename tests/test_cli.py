"""The CLI's own contract: help works, presets validate, bad presets give one clear line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from core.errors import UserError
from fleet.specs import load_preset
from mixfleet.cli import COMMANDS, build_parser
from mixfleet.weights import served_line, status_table
from tests.support.procs import mixfleet_argv


def test_help_lists_commands() -> None:
    out = subprocess.run(mixfleet_argv("--help"), capture_output=True, text=True, check=True).stdout
    assert "usage: mixfleet" in out


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_says_what_it_does(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """A command's help is its module docstring's whole first paragraph: a sentence, not a usage
    line, not cut mid-sentence."""
    first = " ".join(COMMANDS[name].__doc__.strip().split("\n\n")[0].split())
    assert first[0].isupper() and first.endswith((".", ").")), first
    assert first in " ".join(_help(capsys, name).split())


@pytest.mark.parametrize("sub", ["publish", "status", "rollback", "verify"])
def test_every_weights_subcommand_says_what_it_does(capsys: pytest.CaptureFixture[str], sub: str) -> None:
    out = _help(capsys, "weights", sub)
    description = out.split("\n\n")[1]  # after the usage block, before the options
    assert not description.startswith(("options:", "positional")), out


@pytest.mark.parametrize("name", ["local", "mixed", "homogeneous"])
def test_builtin_presets_load(name: str) -> None:
    fleet = load_preset(name)
    assert fleet.groups and len({g.name for g in fleet.groups}) == len(fleet.groups)


def test_local_preset_is_three_cpu_groups() -> None:
    fleet = load_preset("local")
    assert [g.weight_format for g in fleet.groups] == ["bf16", "fp8", "nvfp4"]
    assert all(g.is_local for g in fleet.groups)


def test_bad_preset_names_the_problem(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[groups]]\nname = "g"\naccelerator = "cpu"\nweight_format = "int3"\n')
    with pytest.raises(UserError, match=r"groups\.0\.weight_format"):
        load_preset(bad)
    with pytest.raises(UserError, match="not found"):
        load_preset("no-such-preset")


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--router", "http://127.0.0.1:1", "--out", "r", "--timeout"],
        ["weights", "status", "--timeout"],
        ["validate", "--group", "g", "--timeout"],
        ["up", "--ready-timeout"],
        ["replica", "--group", "g", "--ready-timeout"],
    ],
)
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_wait_that_is_not_a_positive_finite_number_of_seconds_is_refused_by_name(
    argv: list[str], value: str, capsys
) -> None:
    flag = argv[-1]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, value])
    assert exc.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_a_publish_names_the_replicas_it_did_not_wait_for() -> None:
    status = {
        "groups": [
            {
                "group": "a",
                "replicas": [{"replica_id": "a-0", "fresh": True}, {"replica_id": "a-1", "fresh": False}],
            },
            {"group": "b", "replicas": [{"replica_id": "b-0", "fresh": True}]},
        ]
    }
    assert (
        served_line(status, 4) == "every live replica (2) serves version 4; not live, not waited for: a/a-1"
    )
    status["groups"][0]["replicas"].pop()
    assert served_line(status, 4) == "every live replica (2) serves version 4"
    status["groups"][0]["format"], status["groups"][1]["format"] = "bf16", "fp8"
    assert served_line(status, 4, ["fp8"]) == (
        "every live replica (1) serves version 4; not published for (their format is not in this version): a"
    )


def test_status_marks_a_silent_replica() -> None:
    """A replica ready at its last heartbeat but silent since (``fresh`` false: stopped, hung or
    partitioned) is marked; the table showed it as serving before."""
    rep = {"replica_id": "a-0", "active_version": 3, "ready": True, "fresh": False, "error": None}
    status = {
        "run_id": "r",
        "latest_version": 4,
        "groups": [{"group": "a", "format": "fp8", "desired_version": 4, "lag": 1, "replicas": [rep]}],
    }
    assert status_table(status).splitlines()[2].endswith("a-0=v3 (silent: no recent heartbeat)")
    rep["fresh"] = True
    assert status_table(status).splitlines()[2].endswith("a-0=v3")
    rep["ready"] = False
    assert status_table(status).splitlines()[2].endswith("a-0=v3 (not ready)")


def test_a_weights_command_without_a_key_says_how_to_give_one(tmp_path: Path) -> None:
    """Run outside the fleet's directory with MIXFLEET_API_KEY unset, a command sends no key: the
    router's 401 ("missing API key (Authorization: Bearer <key>)") is about a header the user never
    wrote, so the line adds where the key comes from; a wrong key's 401 adds nothing."""
    from tests.support.router import router_process, write_preset

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    with router_process(preset) as router:
        argv = mixfleet_argv("weights", "status", "--router", router.url)
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        bad_key = {**env, "MIXFLEET_API_KEY": "nope"}
        wrong = subprocess.run(argv, cwd=tmp_path, env=bad_key, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "HTTP 401: missing API key" in line and "no key was sent: set MIXFLEET_API_KEY" in line, line
    assert wrong.returncode == 2 and "invalid API key" in wrong.stderr
    assert "no key was sent" not in wrong.stderr


def test_a_rollback_says_its_files_were_linked_not_converted(tmp_path: Path) -> None:
    """A rollback hard-links the target version's files: its report said "converted in 0.00s"
    per format, a conversion that never ran."""
    from mixfleet.weights import result_lines
    from tests.weight_sync.publisher import FMT, RUN, open_store, publish
    from weight_sync.publish import rollback

    for version, payload in ((1, "a"), (2, "b")):
        publish(tmp_path, version, payload)
    report = result_lines(rollback(open_store(tmp_path), RUN, 1, [FMT]).to_dict())
    head, line = report.splitlines()
    assert "(content of version 1)" in head and "linked, not converted" in head, head
    assert line.split()[:6] == [FMT, "linked", "from", "version", "1,", "not"], line
    assert "convert" not in report.replace("not converted", ""), report


@pytest.mark.parametrize("value", ["-1", "-8", "two", "1.5"])
def test_publish_refuses_a_negative_or_fractional_worker_count_by_name(value: str, capsys) -> None:
    """``--workers -1`` was taken (and capped to one process deep in the publish): refused in one
    line naming the flag; 0 stays what it is, conversion in the command's own process."""
    argv = ["weights", "publish", "--store", "s", "ckpt", "--workers"]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, value])
    assert exc.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert "argument --workers: " in line, line
    assert build_parser().parse_args([*argv, "0"]).workers == 0


def test_a_router_url_with_an_extra_path_is_said_to_look_wrong(tmp_path: Path) -> None:
    """``--router http://ROUTER/v1`` sends ``GET /v1/v1/weights``: the line was "HTTP 404: Not Found",
    naming nothing wrong. A 404 from a path every router serves says the URL looks wrong (weights
    status and report, both on clients.router); the paths are checked against the router's OpenAPI
    (served, no 404 documented)."""
    import httpx

    from clients.router import ALWAYS_SERVED
    from tests.support.router import router_process, write_preset

    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXFLEET_")}
    with router_process(preset) as router:
        env["MIXFLEET_API_KEY"] = router.key
        routes = httpx.get(router.url + "/openapi.json", headers=router.headers, timeout=30).json()["paths"]
        runs = [
            subprocess.run(
                mixfleet_argv(*argv, "--router", router.url + "/v1"),
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            for argv in (("weights", "status"), ("report", "--out", str(tmp_path / "report")))
        ]
    for path in ALWAYS_SERVED:
        assert path in routes, path
        assert all("404" not in op["responses"] for op in routes[path].values()), path
    for done, path in zip(runs, ("/v1/weights", "/v1/ledger"), strict=True):
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert "HTTP 404" in line and f"the router URL {router.url}/v1 looks wrong" in line, line
        assert f"every router serves GET {path}" in line, line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["engine", "--model", "m", "--port", "70000"], "argument --port: must be in 1..65535"),
        (
            ["engine", "--model", "m", "--port", "1", "--max-running-requests", "0"],
            "--max-running-requests must be >= 1",
        ),
        (
            ["engine", "--model", "m", "--port", "1", "--log-level", "bogus"],
            "argument --log-level: must be one of",
        ),
        (["router", "--preset", "local", "--log-level", "bogus"], "argument --log-level: must be one of"),
        (["sidecar", "--log-level", "bogus"], "argument --log-level: must be one of"),
        (
            ["router", "--preset", "local", "--insecure-no-auth", "--state", "redis://127.0.0.1:notaport/0"],
            "Port could not be cast",
        ),
        (["demo", "--port", "70000"], "argument --port: must be in 1..65535"),
        (["demo", "--out", "{file}/x"], "--out {file}/x: not a directory"),
        (["demo", "--out", "{tmp}/d", "--data-dir", "{file}"], "--data-dir {file}: not a directory"),
        (["validate", "--store", "{tmp}", "--out", "{file}"], "--out {file}: not a directory"),
        (
            [
                "demo",
                "--router",
                "http://127.0.0.1:1",
                "--api-key",
                "k",
                "--base",
                "{tmp}/bad",
                "--out",
                "{tmp}/o",
            ],
            "{tmp}/bad: cannot load the tokenizer",
        ),
        (
            ["report", "--ledger", "{tmp}/ledger.json", "--out", "{tmp}/r"],
            "ledger: field 'fleet' is None, not str",
        ),
        (
            [
                "report",
                "--ledger",
                "{tmp}/ledger-ok.json",
                "--groups",
                "{tmp}/groups.json",
                "--out",
                "{tmp}/r",
            ],
            "cannot build the report from {tmp}/ledger-ok.json",
        ),
        (
            [
                "replica",
                *["--preset", "local", "--group", "cpu-bf16", "--run", "r", "--port", "1"],
                "--store",
                "{tmp}",
                "--engine-port",
                "99999",
            ],
            "argument --engine-port: must be in 1..65535",
        ),
        (
            [
                "replica",
                *["--preset", "local", "--group", "cpu-bf16", "--run", "r", "--port", "1"],
                "--store",
                "{tmp}",
                "--stage-dir",
                "{file}",
            ],
            "--stage-dir {file}: not a directory",
        ),
        (
            [
                "replica",
                *["--preset", "local", "--group", "cpu-bf16", "--run", "r", "--port", "1"],
                "--store",
                "{tmp}",
                "--stage-dir",
                "{tmp}/st",
                "--engine-command",
                "no-such-program {{model}}",
            ],
            "--engine-command: no program 'no-such-program'",
        ),
    ],
)
def test_bad_arguments_of_the_service_commands_are_one_line(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    """Each was a traceback (or, for the engine's port and request bound, a server that listened
    elsewhere or answered no request): exit 2 and one line naming the flag, nothing started."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    ledger = {"generated_at": 1.0, "fleet": None, "span_s": 1.0, "groups": [], "versions": [], "updates": []}
    (tmp_path / "ledger.json").write_text(json.dumps(ledger))
    row = {"name": "g1", "cost_dollars": 0.0, "tokens": 1, "sessions": 1}
    (tmp_path / "ledger-ok.json").write_text(json.dumps({**ledger, "fleet": "f", "groups": [row]}))
    (tmp_path / "groups.json").write_text(json.dumps({"groups": [{"name": "g1", "mismatch": 5}]}))
    fill = {"file": str(a_file), "tmp": str(tmp_path)}
    argv = [x.format(**fill) for x in argv]
    done = subprocess.run(mixfleet_argv(*argv), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message.format(**fill) in errors[0], done.stderr
    assert "Traceback" not in done.stderr, done.stderr

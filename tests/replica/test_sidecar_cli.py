"""``mixfleet sidecar``'s refusals: a value that would make a loop spin or stall is one line
naming its flag, before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from core.errors import UserError
from mixfleet.sidecar import add_arguments, run

ARGV = ["--engine", "http://127.0.0.1:1", "--group", "g", "--format", "bf16", "--run", "r", "--port", "18000"]


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*ARGV, "--store", str(tmp_path), *extra])


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--heartbeat-s", "0"),
        ("--heartbeat-s", "-1"),
        ("--heartbeat-s", "nan"),
        ("--backoff-max-s", "0"),
        ("--backoff-max-s", "inf"),
    ],
)
def test_a_bad_interval_is_refused_by_argparse_naming_its_flag(
    flag: str, value: str, tmp_path: Path, capsys
) -> None:
    with pytest.raises(SystemExit) as exc:
        _args(tmp_path, flag, value)
    assert exc.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--stage-rate-mb", "-5"), ("--stage-rate-mb", "nan"), ("--poll-s", "nan")],
)
def test_a_bad_rate_or_poll_interval_names_its_flag(flag: str, value: str, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=flag):
        run(_args(tmp_path, flag, value))

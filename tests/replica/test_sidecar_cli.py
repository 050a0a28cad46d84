"""``mixfleet sidecar``'s refusals: a value that would make a loop spin or stall is one line
naming its flag, before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from core.errors import UserError
from mixfleet.sidecar import add_arguments, run


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--heartbeat-s", "0"),
        ("--heartbeat-s", "-1"),
        ("--heartbeat-s", "nan"),
        ("--backoff-max-s", "0"),
        ("--backoff-max-s", "inf"),
        ("--stage-rate-mb", "-5"),
        ("--stage-rate-mb", "nan"),
        ("--poll-s", "nan"),
    ],
)
def test_a_bad_interval_or_rate_is_one_line_naming_its_flag(flag: str, value: str, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--engine", "http://127.0.0.1:1", "--group", "g", "--format", "bf16", "--store", str(tmp_path)]
    args = parser.parse_args([*argv, "--run", "r", "--port", "18000", flag, value])
    with pytest.raises(UserError, match=flag):
        run(args)

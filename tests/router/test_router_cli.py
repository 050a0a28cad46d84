"""``mixfleet router``: refuses to start without keys (one line on stderr), key parsing rules."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from router.auth import load_keys, parse_keys, scopes_for
from tests.support.procs import mixfleet_argv
from weight_sync.errors import UserError


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "MIXFLEET_API_KEYS"}
    return subprocess.run(
        mixfleet_argv("router", *args),
        capture_output=True,
        text=True,
        timeout=60,
        env={**full, **(env or {})},
    )


def test_router_without_keys_refuses_with_one_line() -> None:
    r = _run("--preset", "local", "--port", "1")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "MIXFLEET_API_KEYS" in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--preset", "no-such"), "not found"),
        (("--preset", "local", "--state", "postgres://x"), "--state"),
        (("--preset", "local", "--lease-timeout", "0"), "--lease-timeout"),
    ],
)
def test_router_bad_arguments(args, needle) -> None:
    r = _run(*args, env={"MIXFLEET_API_KEYS": json.dumps({"k" * 20: ["admin"]})})
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_key_parsing(tmp_path) -> None:
    keys = parse_keys(json.dumps({"a" * 16: ["rollout", "trainer"], "b" * 16: "admin"}), "env")
    assert keys["b" * 16] == frozenset({"admin"})
    assert scopes_for("a" * 16, keys) == frozenset({"rollout", "trainer"})
    assert scopes_for("a" * 15, keys) is None
    for bad, needle in [
        ("[]", "object"),
        ("{", "not JSON"),
        ('{"short": ["admin"]}', "16"),
        (json.dumps({"c" * 16: ["root"]}), "unknown scope"),
    ]:
        with pytest.raises(UserError, match=needle):
            parse_keys(bad, "env")
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"d" * 20: ["trainer"]}))
    assert load_keys(f) == {"d" * 20: frozenset({"trainer"})}
    with pytest.raises(UserError, match="not found"):
        load_keys(tmp_path / "missing.json")

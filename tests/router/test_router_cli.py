"""``mixfleet router``: refuses to start without keys (one line on stderr), key parsing rules."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from core.errors import UserError
from mixfleet.router import GC_THRESHOLD, add_arguments, build_config
from router.auth import load_keys, parse_keys, scopes_for
from tests.support.procs import mixfleet_argv


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


def test_router_bad_argument_is_one_line() -> None:
    r = _run("--preset", "no-such", env={"MIXFLEET_API_KEYS": json.dumps({"k" * 20: ["admin"]})})
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--state", "postgres://x"), "--state"),
        (("--lease-timeout", "0"), "--lease-timeout"),
        (("--heartbeat-timeout", "-1"), "--heartbeat-timeout"),
        (("--max-body-bytes", "10"), "--max-body-bytes"),
        (("--max-version-lag", "-2"), "--max-version-lag"),
        (("--keep-store-versions", "-1"), "--keep-store-versions"),
        (("--context-cache-mb", "-1"), "--context-cache-mb"),
        (("--heap-trim-interval", "-1"), "--heap-trim-interval"),
        (("--heap-trim-interval", "nan"), "--heap-trim-interval"),
        (("--heartbeat-timeout", "nan"), "--heartbeat-timeout"),
        (("--session-idle-timeout", "nan"), "--session-idle-timeout"),
        (("--affinity-hold", "-1"), "--affinity-hold"),
        (("--affinity-hold", "nan"), "--affinity-hold"),
        (("--affinity-queue-bound", "-1"), "--affinity-queue-bound"),
        (("--engine-timeout", "0"), "--engine-timeout"),
        (("--engine-timeout", "nan"), "--engine-timeout"),
        (("--engine-timeout", "inf"), "--engine-timeout"),
    ],
)
def test_bad_router_arguments_name_the_option(args, needle, monkeypatch) -> None:
    monkeypatch.setenv("MIXFLEET_API_KEYS", json.dumps({"k" * 20: ["admin"]}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserError, match=needle):
        build_config(parser.parse_args(["--preset", "local", *args]))


def test_insecure_flag_is_the_only_way_to_run_without_keys(monkeypatch) -> None:
    monkeypatch.delenv("MIXFLEET_API_KEYS", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build_config(parser.parse_args(["--preset", "local", "--insecure-no-auth"]))
    assert config.auth_disabled and not config.api_keys
    monkeypatch.setenv("MIXFLEET_API_KEYS", json.dumps({"k" * 20: ["admin"]}))
    config = build_config(parser.parse_args(["--preset", "local", "--insecure-no-auth"]))
    assert not config.auth_disabled  # keys given: they are enforced


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


def test_router_process_tunes_its_garbage_collector() -> None:
    """A router process's app (``app_from_args``, what every worker builds) leaves the collector
    with the startup heap frozen and :data:`mixfleet.router.GC_THRESHOLD` (run in a child: the
    setting is process-wide)."""
    code = (
        "import gc, json\n"
        "from mixfleet.router import app_from_args, default_args\n"
        "before = gc.get_threshold()\n"
        "app_from_args(default_args(preset='local', insecure_no_auth=True, log_level='warning'))\n"
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MIXFLEET_API_KEYS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after, frozen = json.loads(r.stdout.strip().splitlines()[-1])
    assert tuple(before) == (700, 10, 10)  # CPython's default, so the router's setting is what changed it
    assert tuple(after) == GC_THRESHOLD
    assert frozen > 10_000  # modules, the app and its models


def test_heap_trim_interval_sets_the_period_and_zero_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv("MIXFLEET_API_KEYS", json.dumps({"k" * 20: ["admin"]}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert build_config(parser.parse_args(["--preset", "local"])).heap_trim_s == 5.0
    assert (
        build_config(parser.parse_args(["--preset", "local", "--heap-trim-interval", "2.5"])).heap_trim_s
        == 2.5
    )
    assert (
        build_config(parser.parse_args(["--preset", "local", "--heap-trim-interval", "0"])).heap_trim_s
        is None
    )


def test_engine_timeout_is_the_routers_engine_timeout(monkeypatch) -> None:
    monkeypatch.setenv("MIXFLEET_API_KEYS", json.dumps({"k" * 20: ["admin"]}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert build_config(parser.parse_args(["--preset", "local"])).engine_timeout_s == 600.0
    config = build_config(parser.parse_args(["--preset", "local", "--engine-timeout", "45"]))
    assert config.engine_timeout_s == 45.0

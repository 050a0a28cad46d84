"""The cost report: a ledger built from a known sequence of heartbeats, turns and acknowledgements
(memory state, explicit times), written by ``mixfleet report --ledger`` and every figure of
report.json checked against values computed by hand from that sequence; the Markdown and HTML
carry them; a router on Redis books heartbeats, keeps its ledger across a restart and
``mixfleet report --router`` reads it; report.html rendered by headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from fleet.specs import FleetSpec, GroupSpec, load_preset
from mixfleet.cli import main
from router.report_render import COLORS
from router.routes_ledger import ledger_view
from router.state.base import TurnRecord
from router.state.memory import MemoryStore
from router.state.retention import Retention
from tests.support.procs import redis_server
from tests.support.router import router_process, write_preset

SPAN = 10.0
FAST = 2 * 3.6 / 3600  # dollars per replica-second: 2 GPUs at $3.60 per GPU-hour
SLOW = 1 * 1.8 / 3600  # 1 GPU at $1.80 per GPU-hour
FLEET = FleetSpec(
    name="two",
    groups=(
        GroupSpec(
            name="fast",
            accelerator="B200",
            gpus_per_replica=2,
            weight_format="nvfp4",
            price_per_gpu_hour=3.6,
            price_date="2026-09-30",
            price_source="test table",
            price_verified=True,
        ),
        GroupSpec(name="slow", accelerator="A100-80GB", price_per_gpu_hour=1.8, price_date="2026-09-30"),
    ),
)
BASELINE_TPS = 50.0


async def _session(
    store: MemoryStore, sid: str, group: str, spans: dict[int, int], finish: bool = True
) -> None:
    await store.create_session(sid, group, {}, now=1.0)
    await store.append_turn(
        sid,
        TurnRecord(
            f"{sid}-0",
            b"turn",
            group=group,
            replica=f"{group}/0",
            tokens=sum(spans.values()),
            min_version=min(spans),
            max_version=max(spans),
            version_tokens=spans,
        ),
    )
    if finish:
        await store.finish_session(sid, f"{sid}-f", 1.0, {})


async def _known_ledger(retention: Retention | None = None) -> dict:
    """The ledger of a known run (figures below), compacted under ``retention`` when given."""
    store = MemoryStore(retention)

    async def hb(rid: str, group: str, at: float, version: int) -> None:
        spec = FLEET.group(group)
        await store.book_replica(
            rid,
            group=group,
            version=version,
            at=at,
            span_s=SPAN,
            gpus_per_replica=spec.gpus_per_replica,
            price_per_gpu_hour=spec.price_per_gpu_hour,
        )

    await hb("fast/0", "fast", 0.0, 1)  # [0, 10)
    await hb("slow/0", "slow", 0.0, 1)  # [0, 10)
    await hb("fast/0", "fast", 5.0, 1)  # + [10, 15)
    await _session(store, "s1", "fast", {1: 100})
    await _session(store, "s2", "slow", {1: 50})
    lease = await store.take(10, trainer_version=1, max_version_age=None, lease_timeout_s=60)
    assert (await store.ack(lease.lease_id)).update == 1
    await hb("fast/0", "fast", 20.0, 2)  # + [20, 30): the silence 15..20 is not booked
    await hb("slow/0", "slow", 8.0, 1)  # + [10, 18)
    await _session(store, "s3", "fast", {1: 40, 2: 160})
    await _session(store, "s4", "slow", {1: 30})
    await _session(store, "s5", "fast", {2: 20}, finish=False)  # generated, in no update
    lease = await store.take(10, trainer_version=2, max_version_age=None, lease_timeout_s=60)
    assert (await store.ack(lease.lease_id)).update == 2
    if retention is not None:
        await store.compact()
    return ledger_view(await store.ledger(), FLEET, SPAN, now=time.time())


GROUPS_JSON = {  # what GET /v1/groups says about mismatch (slow: no trainer upload yet)
    "groups": [
        {"name": "fast", "mismatch": {"tokens": 100, "k3_kl": 0.0012, "abs_logprob_diff_mean": 0.031,
                                      "extreme_share": 0.02, "out_of_band_share": 0.05}},
        {"name": "slow", "mismatch": None},
    ]
}  # fmt: skip


# The figures of _known_ledger, computed by hand from its heartbeats, turns and acknowledgements.
FAST_RS, SLOW_RS = 10 + 5 + 10, 10 + 8  # replica-seconds
FAST_COST, SLOW_COST = FAST_RS * FAST, SLOW_RS * SLOW
FAST_TOKENS, SLOW_TOKENS = 100 + 200 + 20, 50 + 30
COST, TOKENS = FAST_COST + SLOW_COST, FAST_TOKENS + SLOW_TOKENS


def _approx(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_report_figures_match_the_hand_computed_ledger(tmp_path: Path, capsys) -> None:
    ledger = asyncio.run(_known_ledger())
    (tmp_path / "ledger.json").write_text(json.dumps(ledger))
    (tmp_path / "groups.json").write_text(json.dumps(GROUPS_JSON))
    out = tmp_path / "report"
    rc = main(
        ["report", "--out", str(out), "--ledger", str(tmp_path / "ledger.json"), "--groups",
         str(tmp_path / "groups.json"), "--baseline-tokens-per-s", str(BASELINE_TPS)]
    )  # fmt: skip
    assert rc == 0
    assert capsys.readouterr().out.split() == [str(out / f"report.{k}") for k in ("html", "md", "json")]
    r = json.loads((out / "report.json").read_text())
    assert (_approx(0.05), _approx(0.009)) == (FAST_COST, SLOW_COST)
    _check_groups(r)
    _check_totals_and_updates(r)
    _check_versions(r)
    base_cost = _check_what_if(r["what_if"])
    _check_markdown(out, base_cost)
    _check_html(out, ledger)


def _check_groups(r: dict) -> None:
    fast, slow = r["groups"]
    assert fast["name"] == "fast" and slow["name"] == "slow"
    assert fast["replica_seconds"] == _approx(FAST_RS) and slow["replica_seconds"] == _approx(SLOW_RS)
    assert fast["gpu_seconds"] == _approx(2 * FAST_RS) and slow["gpu_seconds"] == _approx(SLOW_RS)
    assert fast["cost_dollars"] == _approx(FAST_COST) and slow["cost_dollars"] == _approx(SLOW_COST)
    assert (fast["tokens"], slow["tokens"], fast["sessions"], slow["sessions"]) == (320, 80, 3, 2)
    assert fast["cost_per_1m_tokens"] == _approx(FAST_COST / FAST_TOKENS * 1e6)  # $156.25
    assert slow["cost_per_1m_tokens"] == _approx(SLOW_COST / SLOW_TOKENS * 1e6)  # $112.50
    assert (fast["token_share"], slow["token_share"]) == (_approx(0.8), _approx(0.2))
    assert (fast["session_share"], slow["session_share"]) == (_approx(0.6), _approx(0.4))
    assert fast["cost_share"] == _approx(FAST_COST / COST) and slow["cost_share"] == _approx(SLOW_COST / COST)
    assert (fast["price_per_gpu_hour"], fast["price_date"], fast["price_verified"]) == (
        3.6,
        "2026-09-30",
        True,
    )
    assert (slow["price_verified"], slow["gpus_per_replica"]) == (False, 1)
    assert fast["mismatch"] == {
        "tokens": 100,
        "k3_kl": 0.0012,
        "abs_logprob_diff_mean": 0.031,
        "extreme_share": 0.02,
    }
    assert slow["mismatch"] is None


def _check_totals_and_updates(r: dict) -> None:
    t = r["totals"]
    assert t["replica_seconds"] == _approx(FAST_RS + SLOW_RS)
    assert t["gpu_seconds"] == _approx(2 * FAST_RS + SLOW_RS)
    assert t["cost_dollars"] == _approx(COST)
    assert (t["tokens"], t["sessions"], t["updates"]) == (400, 5, 2)
    assert t["cost_per_1m_tokens"] == _approx(COST / TOKENS * 1e6)  # $147.50

    u1_cost = 15 * FAST + 10 * SLOW  # everything booked before the first acknowledgement
    u2_cost = 10 * FAST + 8 * SLOW  # booked between the two
    u1, u2 = r["updates"]
    assert (u1["seq"], u1["trajectories"], u1["tokens"]) == (1, 2, 150)
    assert (u2["seq"], u2["trajectories"], u2["tokens"]) == (2, 2, 230)
    assert u1["cost_dollars"] == _approx(u1_cost) and u2["cost_dollars"] == _approx(u2_cost)
    assert u1["cost_by_group"] == {"fast": _approx(15 * FAST), "slow": _approx(10 * SLOW)}
    assert u2["cost_by_group"] == {"fast": _approx(10 * FAST), "slow": _approx(8 * SLOW)}
    assert u1["cost_per_1m_tokens"] == _approx(u1_cost / 150 * 1e6)
    assert u2["cost_per_1m_tokens"] == _approx(u2_cost / 230 * 1e6)
    assert t["cost_per_update_mean"] == _approx((u1_cost + u2_cost) / 2)
    assert u1["at"] <= u2["at"]


def _check_versions(r: dict) -> None:
    by_version = {(v["group"], v["version"]): v for v in r["versions"]}
    assert list(by_version) == [("fast", 1), ("fast", 2), ("slow", 1)]
    assert (
        by_version[("fast", 1)]["replica_seconds"] == _approx(15) and by_version[("fast", 1)]["tokens"] == 140
    )
    assert (
        by_version[("fast", 2)]["cost_dollars"] == _approx(10 * FAST)
        and by_version[("fast", 2)]["tokens"] == 180
    )
    assert by_version[("slow", 1)]["gpu_seconds"] == _approx(18) and by_version[("slow", 1)]["tokens"] == 80
    assert by_version[("fast", 2)]["cost_per_1m_tokens"] == _approx(10 * FAST / 180 * 1e6)
    v1, v2 = r["version_totals"]
    assert (v1["version"], v1["tokens"], v2["version"], v2["tokens"]) == (1, 220, 2, 180)
    assert v1["replica_seconds"] == _approx(15 + 18) and v1["gpu_seconds"] == _approx(2 * 15 + 18)
    assert v1["cost_dollars"] == _approx(15 * FAST + 18 * SLOW) and v2["cost_dollars"] == _approx(10 * FAST)
    assert v1["cost_per_1m_tokens"] == _approx((15 * FAST + 18 * SLOW) / 220 * 1e6)


def _check_what_if(w: dict) -> float:
    homogeneous = load_preset("homogeneous").groups[0]
    base_rs = TOKENS / BASELINE_TPS  # 8 replica-seconds
    base_cost = base_rs * homogeneous.gpus_per_replica * homogeneous.price_per_gpu_hour / 3600
    assert w["available"] is True
    assert w["baseline"]["group"] == homogeneous.name == "b200-bf16"
    assert (
        w["baseline"]["accelerator"],
        w["baseline"]["weight_format"],
        w["baseline"]["kv_cache_dtype"],
    ) == (
        "B200",
        "bf16",
        "bf16",
    )
    assert w["baseline"]["tokens_per_s_per_replica"] == BASELINE_TPS
    assert w["baseline"]["throughput"] == "stated" and w["baseline"]["measured_tokens"] is None
    assert w["baseline"]["price_date"] == homogeneous.price_date.isoformat()
    assert w["tokens"] == 400
    assert w["replica_seconds"] == _approx(base_rs) and w["gpu_seconds"] == _approx(base_rs)
    assert w["cost_dollars"] == _approx(base_cost)
    assert w["cost_per_1m_tokens"] == _approx(base_cost / TOKENS * 1e6)
    assert w["mixed_cost_dollars"] == _approx(COST)
    assert w["mixed_over_baseline"] == _approx(COST / base_cost)
    assert w["savings_dollars"] == _approx(base_cost - COST)
    return base_cost


def _check_markdown(out: Path, base_cost: float) -> None:
    md = (out / "report.md").read_text()
    lines = md.splitlines()
    fast_row, fast_mismatch = [line for line in lines if line.startswith("| fast |")]
    slow_row, slow_mismatch = [line for line in lines if line.startswith("| slow |")]
    assert fast_row == (
        "| fast | B200 x2 | nvfp4 | $3.60 | 2026-09-30 | 0.00694 | $0.05000 | 320 | 3 | $156.25 "
        "| 80.0% | 60.0% | 84.7% |"
    )
    assert slow_row == (
        "| slow | A100-80GB x1 | bf16 | $1.80 | 2026-09-30 * | 0.005 | $0.009000 | 80 | 2 "
        "| $112.50 | 20.0% | 40.0% | 15.3% |"
    )
    per_version = md.split("## Per weight version (latest 50)")[1].split("## ")[0].strip().splitlines()
    assert per_version[2:] == [
        "| 1 | 0.00917 | 0.0133 | $0.03900 | 220 | $177.27 |",
        "| 2 | 0.00278 | 0.00556 | $0.02000 | 180 | $111.11 |",
    ]
    assert fast_mismatch == "| fast | nvfp4 | $0.05000 | $156.25 | 84.7% | 100 | 0.0012 | 0.031 | 2.0% |"
    assert slow_mismatch == "| slow | bf16 | $0.009000 | $112.50 | 15.3% | n/a | n/a | n/a | n/a |"
    assert (
        "50 generated tokens/s per replica (stated with --baseline-tokens-per-s" in md and "2026-09-30" in md
    )
    assert "\n* the price was not confirmed by independent sources" in md  # slow's starred price
    assert f"{COST / base_cost:.2f}x the baseline's cost" in md
    for name in ("cost_per_update.png", "cost_per_1m_tokens.png", "shares.png", "what_if.png"):
        assert f"]({name})" in md
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_html(out: Path, ledger: dict) -> None:
    page = (out / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing outside the file
    assert "$156.25" in page and "$112.50" in page
    assert json.loads((out / "ledger.json").read_text()) == ledger


def test_without_a_stated_throughput_the_what_if_measures_a_group_of_the_ledger(
    tmp_path: Path, capsys
) -> None:
    """No --baseline-tokens-per-s: the baseline is the ledger's first BF16 group (``slow``) at the
    tokens it booked per replica-second it booked, or the group --baseline-group names."""
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps(asyncio.run(_known_ledger())))
    approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)  # noqa: E731
    cost = 25 * FAST + 18 * SLOW  # the mixed fleet's booked cost (see the test above)
    for group, tokens, seconds, gpus, price in ((None, 80, 18.0, 1, 1.8), ("fast", 320, 25.0, 2, 3.6)):
        out = tmp_path / f"r-{group}"
        extra = ["--baseline-group", group] if group else []
        assert main(["report", "--out", str(out), "--ledger", str(ledger), *extra]) == 0
        w = json.loads((out / "report.json").read_text())["what_if"]
        b = w["baseline"]
        assert w["available"] is True and b["group"] == (group or "slow") and b["preset"] == "two"
        assert (b["throughput"], b["measured_tokens"], b["measured_replica_seconds"]) == (
            "measured",
            tokens,
            seconds,
        )
        assert b["tokens_per_s_per_replica"] == approx(tokens / seconds)
        base_rs = 400 / (tokens / seconds)  # the same 400 tokens at the measured rate
        assert w["replica_seconds"] == approx(base_rs) and w["gpu_seconds"] == approx(base_rs * gpus)
        assert w["cost_dollars"] == approx(base_rs * gpus * price / 3600)
        assert w["mixed_over_baseline"] == approx(cost / (base_rs * gpus * price / 3600))
        md = (out / "report.md").read_text()
        rate = f"{tokens / seconds:,.4g} generated tokens/s per replica"
        line = f"Measured throughput: {rate}: the {tokens} tokens"
        assert line in md and f"booked over its {seconds:.1f} replica-seconds in this ledger" in md, md
    assert (b["accelerator"], b["gpus_per_replica"], b["price_date"]) == ("B200", 2, "2026-09-30")
    assert (
        main(["report", "--out", str(tmp_path / "x"), "--ledger", str(ledger), "--baseline-group", "x"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the ledger has no group 'x' (known: fast, slow)" in err, err


def test_the_local_preset_prices_its_groups_notionally_so_a_local_report_shows_costs(tmp_path: Path) -> None:
    """The embedded default's groups carry a documented notional price (one CPU core-hour), so a
    ledger of a local run costs something per group, per update and per 1M tokens, and the what-if
    measures its BF16 group."""
    local = load_preset("local")
    for g in local.groups:
        assert g.price_per_gpu_hour == pytest.approx(0.0000131 * 3600, rel=1e-3) and g.gpus_per_replica == 1
        assert g.price_date is not None and "notional" in (g.price_source or "") and not g.price_verified
    store = MemoryStore()

    async def run() -> dict:
        for i, g in enumerate(local.groups):
            for at in (0.0, 5.0):
                await store.book_replica(
                    f"{g.name}-0", group=g.name, version=1, at=at, span_s=SPAN,
                    gpus_per_replica=g.gpus_per_replica, price_per_gpu_hour=g.price_per_gpu_hour,
                )  # fmt: skip
            await _session(store, f"s{i}", g.name, {1: 30 * (i + 1)})
        lease = await store.take(10, trainer_version=1, max_version_age=None, lease_timeout_s=60)
        await store.ack(lease.lease_id)
        return ledger_view(await store.ledger(), local, SPAN, now=time.time())

    (tmp_path / "ledger.json").write_text(json.dumps(asyncio.run(run())))
    assert main(["report", "--out", str(tmp_path / "r"), "--ledger", str(tmp_path / "ledger.json")]) == 0
    r = json.loads((tmp_path / "r" / "report.json").read_text())
    per_group = 15 * 0.0472 / 3600  # 15 replica-seconds each at the notional price
    assert [g["cost_dollars"] for g in r["groups"]] == [pytest.approx(per_group, rel=1e-12)] * 3
    assert r["updates"][0]["cost_dollars"] == pytest.approx(3 * per_group, rel=1e-12)
    assert all(g["cost_per_1m_tokens"] > 0 for g in r["groups"])
    w = r["what_if"]
    assert (
        w["available"] and w["baseline"]["group"] == "cpu-bf16" and w["baseline"]["throughput"] == "measured"
    )
    assert w["baseline"]["tokens_per_s_per_replica"] == pytest.approx(30 / 15, rel=1e-12)
    assert (
        "Measured throughput: 2 generated tokens/s per replica" in (tmp_path / "r" / "report.md").read_text()
    )


def test_report_refusals_are_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"groups": []}))
    cases = [
        (["--ledger", str(tmp_path / "missing.json")], "ledger file not found"),
        (["--ledger", str(bad)], "not JSON"),
        (["--ledger", str(partial)], "missing field 'generated_at'"),
        (["--ledger", str(partial), "--baseline-tokens-per-s", "0"], "--baseline-tokens-per-s must be > 0"),
        (
            ["--ledger", str(partial), "--baseline-tokens-per-s", "5", "--baseline-group", "x"],
            "has no group 'x'",
        ),
        (["--groups", str(bad)], "--groups needs --ledger"),
        (["--ledger", str(partial), "--router", "http://127.0.0.1:9"], "exclude each other"),
        (["--router", "http://127.0.0.1:9"], "cannot reach the router"),
    ]
    for extra, message in cases:
        assert main(["report", "--out", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and err.startswith("mixfleet report: error: "), err
    assert not (tmp_path / "o").exists()
    good = tmp_path / "ledger.json"
    good.write_text(json.dumps(asyncio.run(_known_ledger())))
    (tmp_path / "a-file").write_text("")
    assert main(["report", "--out", str(tmp_path / "a-file" / "sub"), "--ledger", str(good)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the report into" in err, err


def test_router_on_redis_books_heartbeats_keeps_the_ledger_across_a_restart(
    tmp_path: Path, capsys, monkeypatch
):
    preset = write_preset(
        tmp_path / "p.toml",
        [{"name": "g1", "accelerator": "H100", "gpus_per_replica": 2, "price_per_gpu_hour": 3.95}],
    )
    hb = {"replica_id": "g1-a", "group": "g1", "url": "http://127.0.0.1:9/", "ready": False}
    with redis_server() as redis_url:
        with router_process(preset, state=redis_url) as router:
            t0 = time.time()
            for body in (hb, {**hb, "ready": True, "active_version": 3}):
                r = httpx.post(router.url + "/v1/replicas/heartbeat", json=body, headers=router.headers)
                assert r.status_code == 200, r.text
            elapsed = time.time() - t0
            assert httpx.get(router.url + "/v1/ledger").status_code == 401
            before = httpx.get(router.url + "/v1/ledger", headers=router.headers).json()
            keys = {router.key: ["trainer"]}
        (g,) = before["groups"]
        assert before["span_s"] == 10.0 and g["name"] == "g1" and g["price_per_gpu_hour"] == 3.95
        assert 10.0 <= g["replica_seconds"] <= 10.0 + elapsed  # first heartbeat to last + the span
        assert g["gpu_seconds"] == pytest.approx(2 * g["replica_seconds"], rel=1e-12)
        assert g["cost_dollars"] == pytest.approx(g["gpu_seconds"] * 3.95 / 3600, rel=1e-12)
        assert [(v["group"], v["version"]) for v in before["versions"]] in (
            [("g1", None), ("g1", 3)],
            [("g1", None)],
        )
        assert sum(v["replica_seconds"] for v in before["versions"]) == pytest.approx(g["replica_seconds"])
        with router_process(preset, state=redis_url, keys=keys) as router:
            after = httpx.get(router.url + "/v1/ledger", headers=router.headers).json()
            assert {k: v for k, v in after.items() if k != "generated_at"} == {
                k: v for k, v in before.items() if k != "generated_at"
            }
            monkeypatch.setenv("MIXFLEET_API_KEY", router.key)
            assert main(["report", "--out", str(tmp_path / "r"), "--router", router.url]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["source"] == router.url
    assert report["totals"]["replica_seconds"] == pytest.approx(g["replica_seconds"], rel=1e-12)
    assert report["groups"][0]["mismatch"] is None and report["what_if"]["available"] is False
    assert "Not computed: no stated baseline throughput" in (tmp_path / "r" / "report.md").read_text()
    capsys.readouterr()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_report_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    ledger = asyncio.run(_known_ledger())
    (tmp_path / "ledger.json").write_text(json.dumps(ledger))
    (tmp_path / "groups.json").write_text(json.dumps(GROUPS_JSON))
    out = tmp_path / "report"
    argv = ["--ledger", str(tmp_path / "ledger.json"), "--groups", str(tmp_path / "groups.json")]
    assert main(["report", "--out", str(out), *argv, "--baseline-tokens-per-s", str(BASELINE_TPS)]) == 0
    png = tmp_path / "report.png"
    proc = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1280,2000", f"--screenshot={png}", (out / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 2000)
    pixels = Image.open(png).convert("RGB")
    colors = {c for _, c in pixels.getcolors(maxcolors=1 << 20)}
    for hex_color in COLORS[:3]:  # the inline plots were decoded and drawn
        assert tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5)) in colors, hex_color
    keep = os.environ.get("MIXFLEET_REPORT_PNG")  # where a person wants to look at it
    if keep:
        shutil.copy(png, keep)


def test_a_fleet_serving_turns_books_tokens_per_version_and_updates(engine_url: str, tmp_path: Path) -> None:
    """A real engine behind a router on Redis: ready polls book the static replica, turns book
    their tokens to version 0, each acknowledgement closes an update, and the report agrees."""
    preset = write_preset(
        tmp_path / "p.toml",
        [{"name": "cpu-a", "replicas": [engine_url], "gpus_per_replica": 2, "price_per_gpu_hour": 3.6}],
    )
    sp = {"max_new_tokens": 5, "temperature": 1.0, "seed": 7}
    with redis_server() as redis_url, router_process(preset, state=redis_url) as router:
        c = httpx.Client(base_url=router.url, headers=router.headers, timeout=60)
        deadline = time.monotonic() + 30
        while c.get("/v1/groups").json()["groups"][0]["ready_replicas"] == 0:
            assert time.monotonic() < deadline, "the engine never came into rotation"
            time.sleep(0.2)
        tokens = []
        for _update in range(2):
            for _ in range(2):
                sid = c.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
                n = 0
                for _ in range(2):
                    r = c.post(
                        f"/v1/sessions/{sid}/turns", json={"input_ids": [3, 4, 5], "sampling_params": sp}
                    )
                    assert r.status_code == 200, r.text
                    n += len(r.json()["output_ids"])
                assert c.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
                tokens.append(n)
            lease = c.post("/v1/batches/take", json={"size": 8}).json()["lease_id"]
            assert c.post(f"/v1/batches/{lease}/ack").json()["acked"] == 2
        ledger = c.get("/v1/ledger").json()
        c.close()
    (g,) = ledger["groups"]
    assert (g["tokens"], g["sessions"]) == (sum(tokens), 4)
    assert g["replica_seconds"] > 0 and g["gpu_seconds"] == pytest.approx(2 * g["replica_seconds"], rel=1e-12)
    assert g["cost_dollars"] == pytest.approx(g["gpu_seconds"] * 3.6 / 3600, rel=1e-12)
    assert [(v["group"], v["version"], v["tokens"]) for v in ledger["versions"]] == [
        ("cpu-a", 0, sum(tokens))
    ]
    u1, u2 = ledger["updates"]
    assert [(u["seq"], u["trajectories"], u["tokens"]) for u in (u1, u2)] == [
        (1, 2, tokens[0] + tokens[1]),
        (2, 2, tokens[2] + tokens[3]),
    ]
    assert u1["cost_dollars"] > 0 and u1["cost_dollars"] + u2["cost_dollars"] <= g["cost_dollars"] + 1e-12
    (tmp_path / "ledger.json").write_text(json.dumps(ledger))
    assert main(["report", "--out", str(tmp_path / "r"), "--ledger", str(tmp_path / "ledger.json")]) == 0
    w = json.loads((tmp_path / "r" / "report.json").read_text())["what_if"]  # measured on this fleet
    assert w["available"] and w["baseline"]["throughput"] == "measured" and w["baseline"]["group"] == "cpu-a"
    assert w["baseline"]["tokens_per_s_per_replica"] == pytest.approx(sum(tokens) / g["replica_seconds"])
    assert w["cost_dollars"] == pytest.approx(
        g["cost_dollars"], rel=1e-9
    )  # the one group is its own baseline
    r = json.loads((tmp_path / "r" / "report.json").read_text())
    assert r["totals"]["tokens"] == sum(tokens) and r["totals"]["updates"] == 2
    assert r["groups"][0]["cost_per_1m_tokens"] == pytest.approx(
        g["cost_dollars"] / sum(tokens) * 1e6, rel=1e-12
    )


def test_the_tables_show_what_the_router_rolled_up_so_they_add_up(tmp_path: Path) -> None:
    """Versions and updates the router rolled up (``--keep-versions``, ``--keep-updates``) are one
    row of each table, so each table adds up to what was booked: the per-version rows to the total
    cost, the update rows to the cost booked until the last acknowledgement."""

    async def compacted() -> dict:
        ledger = await _known_ledger(Retention(keep_versions=1, keep_updates=1))
        assert ledger["earlier_versions"] and ledger["earlier_updates"]["updates"] == 1
        return ledger

    (tmp_path / "ledger.json").write_text(json.dumps(asyncio.run(compacted())))
    out = tmp_path / "report"
    assert main(["report", "--out", str(out), "--ledger", str(tmp_path / "ledger.json")]) == 0
    md = (out / "report.md").read_text()
    per_version = md.split("## Per weight version (latest 50)")[1].split("## ")[0].strip().splitlines()
    assert per_version[2:] == [
        "| earlier (rolled up) | 0.00417 | 0.00833 | $0.03000 | 140 | $214.29 |",  # fast's version 1
        "| 1 | 0.005 | 0.005 | $0.009000 | 80 | $112.50 |",  # slow keeps its only version
        "| 2 | 0.00278 | 0.00556 | $0.02000 | 180 | $111.11 |",
    ]
    updates = md.split("## Updates (latest 50)")[1].split("## ")[0].strip().splitlines()
    assert [row.split(" | ")[::2] for row in updates[2:]] == [
        ["| 1-1 (rolled up)", "2", "$0.03500"],  # 15 * FAST + 10 * SLOW, booked before the first
        ["| 2", "2", "$0.02400"],  # 10 * FAST + 8 * SLOW
    ]

"""Two router processes share one Redis: a session opened on one continues on the other, the
trainer takes it from either, a sidecar heartbeat sent to one puts the replica in rotation on
both, and a turn costs Redis one script before the engine call and one after it (the first reads
the context only when the router does not hold it), and append-only turns alternating between
the routers build exactly the context the turns made. A router
whose Redis is gone answers 503 (retryable) and serves again once Redis is back."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import httpx
import pytest
import redis

from router.metrics import SNAPSHOT
from tests.support.metrics import Samples, samples_of, turn_replays
from tests.support.procs import free_port, redis_process, redis_server
from tests.support.router import router_process, write_preset
from tests.support.scripted import scripted_engine

SP = {"max_new_tokens": 3, "seed": 1}


@pytest.fixture(scope="module")
def shared_redis():
    with redis_server() as url:
        yield url


@pytest.fixture(scope="module")
def front(engine_url):
    """The engine of ``cpu-a``: the local engine behind a scripted stand-in (``delay_s`` holds each
    answer back)."""
    with scripted_engine(engine_url) as engine:
        yield engine


@pytest.fixture(scope="module")
def two_routers(front, shared_redis, tmp_path_factory):
    d = tmp_path_factory.mktemp("shared")
    preset = write_preset(d / "p.toml", [{"name": "cpu-a", "replicas": [front.url]}, {"name": "cpu-b"}])
    keys = {"k" * 32: ["rollout", "trainer", "admin"]}
    with (
        router_process(preset, state=shared_redis, keys=keys) as a,
        router_process(preset, state=shared_redis, keys=keys) as b,
    ):
        yield a, b


def test_a_session_moves_between_routers(two_routers) -> None:
    a, b = two_routers
    ca = httpx.Client(base_url=a.url, headers=a.headers, timeout=60)
    cb = httpx.Client(base_url=b.url, headers=b.headers, timeout=60)
    sid = ca.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
    t0 = ca.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2], "sampling_params": SP})
    t1 = cb.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2, 3], "sampling_params": SP, "turn": 1})
    assert t0.status_code == 200 and t1.status_code == 200, (t0.text, t1.text)
    assert [t0.json()["turn"], t1.json()["turn"]] == [0, 1]
    assert cb.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    assert ca.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1]}).status_code == 409
    batch = ca.post("/v1/batches/take", json={"size": 10}).json()
    mine = [t for t in batch["trajectories"] if t["session_id"] == sid]
    assert len(mine) == 1 and [t["output_ids"] for t in mine[0]["turns"]] == [
        t0.json()["output_ids"],
        t1.json()["output_ids"],
    ]
    assert cb.post(f"/v1/batches/{batch['lease_id']}/ack").json()["acked"] == len(batch["trajectories"])


def test_append_only_turns_alternating_between_routers_extend_the_stored_context(two_routers) -> None:
    """Each router holds the context its own last turn of a session left; a turn the other router
    stored since makes it read the store's: every whole input is the context the turns built."""
    a, b = two_routers
    clients = {
        name: httpx.Client(base_url=r.url, headers=r.headers, timeout=60) for name, r in (("a", a), ("b", b))
    }
    sid = clients["a"].post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
    context: list[int] = []
    wholes = []
    for i, name in enumerate("aabaabba"):
        append = [10 + i, 20 + i]
        t = clients[name].post(
            f"/v1/sessions/{sid}/turns", json={"append_ids": append, "sampling_params": SP, "turn": i}
        )
        assert t.status_code == 200, t.text
        wholes.append(context + append)
        context = wholes[-1] + t.json()["output_ids"]
    turns = clients["b"].get(f"/v1/sessions/{sid}/trajectory").json()["turns"]
    assert [t["fork"] for t in turns] == [None] * 8
    assert [t["context"] for t in turns] == [len(w) - 2 for w in wholes]
    segment: list[int] = []
    for t, whole in zip(turns, wholes, strict=True):
        assert segment + t["append_ids"] == whole
        segment = whole + t["output_ids"]


def test_a_keyed_turn_sent_to_both_routers_at_once_is_recorded_once(two_routers) -> None:
    """The same turn with the same ``Idempotency-Key`` sent to both routers at once: both answer
    the one turn recorded, byte for byte, the session holds it once, and exactly one of the two
    answers counts as a replay: ``found`` when one router had recorded it before the other looked,
    ``raced`` when both sampled and the later append found the first's turn."""
    a, b = two_routers
    sid = httpx.post(f"{a.url}/v1/sessions", json={"group": "cpu-a"}, headers=a.headers).json()["session_id"]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 12, "temperature": 1.0}}
    before = [turn_replays(r.url) for r in (a, b)]
    answers = _both_at_once((a, b), sid, "both", body)
    ra, rb = answers[a.url], answers[b.url]
    assert ra.status_code == rb.status_code == 200, (ra.text, rb.text)
    assert ra.content == rb.content
    assert httpx.get(f"{a.url}/v1/sessions/{sid}", headers=a.headers).json()["turns"] == 1
    after = [turn_replays(r.url) for r in (a, b)]
    assert sum(map(sum, after)) - sum(map(sum, before)) == 1, (before, after)


def _both_at_once(routers, sid: str, key: str, body: dict) -> dict[str, httpx.Response]:
    """The same turn request with ``Idempotency-Key`` ``key`` sent to every router at once."""
    answers: dict[str, httpx.Response] = {}
    start = threading.Barrier(len(routers))

    def send(r) -> None:
        start.wait()
        keyed = {**r.headers, "Idempotency-Key": key}
        answers[r.url] = httpx.post(f"{r.url}/v1/sessions/{sid}/turns", json=body, headers=keyed, timeout=60)

    threads = [threading.Thread(target=send, args=(r,)) for r in routers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_the_router_that_lost_a_keyed_race_continues_on_the_recorded_turn(two_routers, front) -> None:
    """Both routers sample the same keyed turn (the engine holds each answer back a second, so both
    looked the key up before either recorded): the later append stores nothing and its router
    answers the first's turn (``raced``); that router's next turn sends the engine the context the
    recorded turn left, not its own discarded sample."""
    a, b = two_routers
    sid = httpx.post(f"{a.url}/v1/sessions", json={"group": "cpu-a"}, headers=a.headers).json()["session_id"]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 12, "temperature": 1.0}}
    before = {r.url: turn_replays(r.url) for r in (a, b)}
    front.delay_s = 1.0
    try:
        answers = _both_at_once((a, b), sid, "race", body)
    finally:
        front.delay_s = 0.0
    ra, rb = answers[a.url], answers[b.url]
    assert ra.status_code == rb.status_code == 200 and ra.content == rb.content, (ra.text, rb.text)
    samples = [out for _input, out in front.generated[-2:]]
    assert samples[0] != samples[1]  # two samples: one was discarded
    after = {r.url: turn_replays(r.url) for r in (a, b)}
    replays = {u: [n - m for n, m in zip(after[u], before[u], strict=True)] for u in after}
    losers = [r for r in (a, b) if replays[r.url] == [0, 1]]
    assert len(losers) == 1 and sum(map(sum, replays.values())) == 1, replays
    loser = losers[0]
    t = httpx.post(
        f"{loser.url}/v1/sessions/{sid}/turns",
        json={"append_ids": [7], "sampling_params": SP, "turn": 1},
        headers=loser.headers,
        timeout=60,
    )
    assert t.status_code == 200, t.text
    assert front.generated[-1][0] == [1, 2, 3, *ra.json()["output_ids"], 7]


def test_a_heartbeat_to_one_router_reaches_the_other(two_routers, engine_url) -> None:
    a, b = two_routers
    hb = {
        "replica_id": "side-x",
        "group": "cpu-b",
        "url": engine_url.replace("127.0.0.1", "localhost"),
        "ready": True,
        "active_version": 0,
    }
    assert httpx.post(f"{a.url}/v1/replicas/heartbeat", json=hb, headers=a.headers).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        groups = httpx.get(f"{b.url}/v1/groups", headers=b.headers).json()["groups"]
        if next(g for g in groups if g["name"] == "cpu-b")["ready_replicas"] == 1:
            return
        time.sleep(0.2)
    raise AssertionError("router b never saw the heartbeat sent to router a")


def test_a_turn_is_two_scripts(two_routers, shared_redis) -> None:
    """Per turn: one ``EVALSHA`` reading the session (``HMGET``) and, unless this router holds
    it, its context (``GET``; not counted: the version poll sends it too) before the engine call,
    one ``EVALSHA`` (the turn, its context, the route to the serving replica, the counters) after it.
    Redis counts the commands a script runs as well, and the routers' background loops read
    heartbeats and versions, so the check covers the commands that only a turn could send; a
    first turn has loaded the scripts."""
    a, _b = two_routers
    r = redis.Redis.from_url(shared_redis)
    ca = httpx.Client(base_url=a.url, headers=a.headers, timeout=60)
    warm = ca.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
    assert (
        ca.post(f"/v1/sessions/{warm}/turns", json={"input_ids": [1], "sampling_params": SP}).status_code
        == 200
    )
    per_turn = ("hmget", "evalsha", "eval", "evalsha_ro", "multi", "exec", "lrange", "set", "script")

    def calls() -> dict[str, int]:
        stats = r.info("commandstats")
        return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in per_turn}

    def five_turns() -> tuple[str, dict[str, int]]:
        sid = ca.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
        before = calls()
        for i in range(5):  # the first turn sets the session's replica affinity too
            t = ca.post(
                f"/v1/sessions/{sid}/turns", json={"append_ids": [1, 2, i], "sampling_params": SP, "turn": i}
            )
            assert t.status_code == 200 and t.json()["turn"] == i, t.text
        after = calls()
        return sid, {name: after[name] - before[name] for name in per_turn}

    # Each router books its ready replicas in the ledger every poll (SET in a MULTI/EXEC, once a
    # second), which may fall inside a window; a turn's own commands are in every window, so one
    # clean window of three shows a turn sends nothing else.
    want = {**dict.fromkeys(per_turn, 0), "hmget": 5, "evalsha": 10}
    for _ in range(3):
        sid, delta = five_turns()
        if delta == want:
            break
    assert delta == want, delta
    info = r.hmget(f"mf:s:{sid}", "group", "replica", "n_turns")
    assert info[0] == b"cpu-a" and info[1] and info[2] == b"5"


@pytest.mark.slow
def test_a_router_without_its_redis_answers_503_and_recovers(engine_url, tmp_path) -> None:
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    port = free_port()
    with contextlib.ExitStack() as stack:
        down = contextlib.ExitStack()
        stack.callback(down.close)
        url = down.enter_context(redis_server(port=port))
        router = stack.enter_context(router_process(preset, state=url))
        c = httpx.Client(base_url=router.url, headers=router.headers, timeout=120)
        assert c.post("/v1/sessions", json={}).status_code == 200
        down.close()  # Redis stops; the router stays up
        assert httpx.get(f"{router.url}/healthz", timeout=30).json()["state"] is False
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 503 and "state store unavailable" in r.json()["detail"], r.text
        assert "Retry-After" in r.headers
        stack.enter_context(redis_server(port=port))
        deadline = time.monotonic() + 60  # the replica poll that stalled on the store runs again
        while (again := c.post("/v1/sessions", json={})).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert again.status_code == 200, again.text
        sid = again.json()["session_id"]
        t = c.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2], "sampling_params": SP})
        assert t.status_code == 200 and t.json()["turn"] == 0, t.text


def test_metrics_without_its_redis_answer_in_time_and_leave_the_fleet_out(tmp_path) -> None:
    """A scrape while Redis does not answer (SIGSTOPped: hung, or cut off) answers within a
    Prometheus scrape's default timeout (10 s) with the request-path families and
    ``mixfleet_router_state_up 0``, and leaves out the families read from the state (no older read
    repeated: the ledger's counters never go backwards); once Redis answers again they return."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": ["http://127.0.0.1:1"]}])
    port = free_port()
    with (
        redis_process(port, tmp_path) as redis_proc,
        router_process(preset, state=f"redis://127.0.0.1:{port}/0") as router,
    ):

        def scrape() -> tuple[Samples, float]:
            t0 = time.monotonic()
            r = httpx.get(f"{router.url}/metrics", timeout=60)
            assert r.status_code == 200, r.text
            return samples_of(r.text), time.monotonic() - t0

        up, _ = scrape()
        assert up[("mixfleet_router_state_up", ())] == 1
        assert ("mixfleet_group_cost_dollars_total", (("group", "cpu-a"),)) in up
        redis_proc.send_signal(signal.SIGSTOP)
        try:
            out, took = scrape()
        finally:
            redis_proc.send_signal(signal.SIGCONT)
        assert took < 10, f"the scrape took {took:.1f} s"
        assert out[("mixfleet_router_state_up", ())] == 0
        assert ("mixfleet_router_turns_total", (("group", "cpu-a"),)) in out  # the request path answers
        kept = {"mixfleet_router_state_up", "mixfleet_router_version_lag_bound"}  # not read from the state
        assert not [k for k, _ in out if k in {d.name for d in SNAPSHOT} - kept]
        deadline = time.monotonic() + 60
        while scrape()[0][("mixfleet_router_state_up", ())] == 0:
            assert time.monotonic() < deadline, "the scrape never read the state again"
            time.sleep(0.5)

"""A take whose client disconnects after the store made its lease, before the answer started: the
router releases the lease at once (what it held is ready again, not leased to nobody until the
lease timeout). A real router over HTTP on a real redis-server, with a TCP proxy in front of Redis
that holds the lease's take order (the one state write between the lease and the answer) until
the client has gone. A take whose client gave up without the router seeing it leave, retried
with its ``Idempotency-Key`` while it still waits: one lease in the end (memory and Redis); a
lease the retry was answered is not released when the first attempt's client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from tests.support.procs import redis_server
from tests.support.proxy import TcpProxy
from tests.support.router import router_process, write_preset
from tests.support.state import opened


def _finished(url: str, sid: str) -> None:
    async def main() -> None:
        async with opened(url) as store:
            await store.create_session(sid, "cpu-a", {}, now=time.time())
            await store.finish_session(sid, "f", 1.0, {})

    asyncio.run(main())


@contextlib.contextmanager
def _holding_take_orders(tmp_path, hold: Callable[[], object]) -> Iterator[tuple[Any, threading.Event]]:
    """A router on a redis-server behind a TCP proxy, one finished session ``s1`` ready, and the
    event the proxy sets when the router first writes a lease's take order (the one state write
    between a take's lease and its answer), which it then holds for ``hold()`` before passing it on."""
    held = threading.Event()

    def hold_the_take_order(direction: str, data: bytes, conn: dict) -> bytes:
        if direction == "up" and b"mf:lorder:" in data and not held.is_set():
            held.set()
            hold()
        return data

    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a"}])
    with redis_server() as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        proxy = TcpProxy(("127.0.0.1", port), hold_the_take_order)
        try:
            state = f"redis://127.0.0.1:{proxy.port}/0"
            with router_process(preset, state=state, extra_args=("--lease-timeout", "300")) as router:
                _finished(url, "s1")
                yield router, held
        finally:
            proxy.close()


def _raw_take(router: Any, headers: str = "", body: bytes = b'{"size": 1}') -> tuple[tuple[str, int], bytes]:
    """The address of ``router`` and the bytes of a take (``body``; ``headers``: more header
    lines, each ending ``\r\n``), to send on a socket the test holds or closes itself."""
    host, http_port = router.url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/batches/take HTTP/1.1\r\nHost: {host}\r\n{headers}"
        f"Authorization: Bearer {router.key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    return (host, int(http_port)), request


def test_a_take_whose_client_leaves_after_the_lease_was_made_releases_it(tmp_path) -> None:
    with _holding_take_orders(tmp_path, lambda: time.sleep(2.0)) as (
        router,
        held,
    ):  # the client leaves meanwhile
        address, request = _raw_take(router)
        with socket.create_connection(address) as client:
            client.sendall(request)
            assert held.wait(30), "the take never wrote its lease's take order"
        # the client is gone while its take's lease exists and its answer has not started
        with httpx.Client(base_url=router.url, headers=router.headers, timeout=30) as c:
            deadline = time.monotonic() + 10
            while (stats := c.get("/v1/batches/stats").json())["ready"] != 1:
                assert time.monotonic() < deadline, stats
                time.sleep(0.2)
            assert stats["pending"] == 0 and stats["leases"] == 0, stats
            again = c.post("/v1/batches/take", json={"size": 1}).json()
            assert [t["session_id"] for t in again["trajectories"]] == ["s1"]
            assert c.post(f"/v1/batches/{again['lease_id']}/ack").json()["acked"] == 1


def test_a_lease_answered_to_a_retry_is_not_released_when_the_first_attempt_leaves(tmp_path) -> None:
    """The first attempt of a take (an ``Idempotency-Key``) made its lease; the proxy holds its
    take order, so its answer has not started. The client's retry with the key is answered that
    lease; then the first attempt's client leaves. The router cancels the first attempt (a 4xx in
    its metrics) but leaves the lease: it is the retry's, its trajectory not ready for another
    take, and the retry's acknowledgement acknowledges it."""
    go = threading.Event()  # the retry is answered and the first attempt's client leaves meanwhile
    with _holding_take_orders(tmp_path, lambda: go.wait(30)) as (router, held):
        try:
            address, request = _raw_take(router, "Idempotency-Key: take-1\r\n")
            with httpx.Client(base_url=router.url, headers=router.headers, timeout=30) as c:
                with socket.create_connection(address) as first:
                    first.sendall(request)
                    assert held.wait(30), "the take never wrote its lease's take order"
                    retry = c.post(
                        "/v1/batches/take", json={"size": 1}, headers={"Idempotency-Key": "take-1"}
                    )
                    assert retry.status_code == 200, retry.text
                    batch = retry.json()
                    assert [t["session_id"] for t in batch["trajectories"]] == ["s1"]
                # the first attempt's client is gone, its answer not started: it is cancelled
                cancelled = 'mixfleet_router_request_seconds_count{route="/v1/batches/take",status="4xx"}'
                deadline = time.monotonic() + 10
                while cancelled not in c.get("/metrics").text:
                    assert time.monotonic() < deadline, "the first attempt was never cancelled"
                    time.sleep(0.1)
                go.set()
                stats = c.get("/v1/batches/stats").json()
                assert stats == {"ready": 0, "pending": 1, "held_back": 0, "leases": 1}, stats
                assert c.post("/v1/batches/take", json={"size": 1}).json()["trajectories"] == []
                assert c.post(f"/v1/batches/{batch['lease_id']}/ack").json()["acked"] == 1
        finally:
            go.set()


def _read_answer(sock: socket.socket) -> bytes:
    """One HTTP answer read from ``sock``: its head and its ``Content-Length`` of body."""
    answer = b""
    while True:
        head, sep, body = answer.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if sep and length is not None and len(body) >= int(length.group(1)):
            return answer
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed within the answer: {answer!r}"
        answer += chunk


def _finish(c: httpx.Client) -> str:
    """A session with one turn, finished: its id."""
    sid = c.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
    deadline = time.monotonic() + 30
    while True:  # a 503 until the router's first health poll put the engine in rotation
        turn = c.post(
            f"/v1/sessions/{sid}/turns", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        if turn.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert turn.status_code == 200, turn.text
    assert c.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    return sid


def test_a_take_retried_while_its_first_attempt_still_waits_ends_with_one_lease(
    tmp_path, engine_url: str, store_url: str
) -> None:
    """The first attempt of a take (``wait_s``, an ``Idempotency-Key``) picked one trajectory and
    waits for a second; its client gave up, but its connection stays open to the router (a proxy
    between them that keeps it, a half-open TCP connection), so the router cannot tell it is
    gone. The client's retry with the same key takes the key over: the first attempt answers 409
    at once and puts back what it picked; the retry gets both trajectories under one lease."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    with (
        router_process(preset, state=store_url) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
    ):
        first_sid = _finish(c)
        address, request = _raw_take(router, "Idempotency-Key: take-1\r\n", b'{"size": 2, "wait_s": 30}')
        with socket.create_connection(address) as abandoned:
            abandoned.sendall(request)
            deadline = time.monotonic() + 10
            while c.get("/v1/batches/stats").json()["pending"] != 1:  # it picked the first one
                assert time.monotonic() < deadline, "the first attempt never picked"
                time.sleep(0.05)
            answers: list[httpx.Response] = []

            def retry_the_take() -> None:  # the client's retry, on a connection of its own
                with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as own:
                    body = {"size": 2, "wait_s": 30}
                    answers.append(
                        own.post("/v1/batches/take", json=body, headers={"Idempotency-Key": "take-1"})
                    )

            retry = threading.Thread(target=retry_the_take)
            retry.start()
            abandoned.settimeout(10)
            answer = _read_answer(abandoned)  # what the router answers the first attempt (nobody reads it)
            assert answer.startswith(b"HTTP/1.1 409 "), answer[:200]
            assert b"took it over" in answer and b"retry-after" not in answer.lower(), answer
        second_sid = _finish(c)
        retry.join(30)
        assert answers and answers[0].status_code == 200, answers
        batch = answers[0].json()
        assert sorted(t["session_id"] for t in batch["trajectories"]) == sorted([first_sid, second_sid])
        assert c.get("/v1/batches/stats").json() == {"ready": 0, "pending": 2, "held_back": 0, "leases": 1}
        assert c.post(f"/v1/batches/{batch['lease_id']}/ack").json()["acked"] == 2

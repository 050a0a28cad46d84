"""A take whose client disconnects after the store made its lease, before the answer started: the
router releases the lease at once (what it held is ready again, not leased to nobody until the
lease timeout). A real router over HTTP on a real redis-server, with a TCP proxy in front of Redis
that holds the lease's take order (the one state write between the lease and the answer) until
the client has gone."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

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


def test_a_take_whose_client_leaves_after_the_lease_was_made_releases_it(tmp_path) -> None:
    held = threading.Event()

    def hold_the_take_order(direction: str, data: bytes, conn: dict) -> bytes:
        if direction == "up" and b"mf:lorder:" in data and not held.is_set():
            held.set()
            time.sleep(2.0)  # the client leaves meanwhile
        return data

    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a"}])
    with redis_server() as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        proxy = TcpProxy(("127.0.0.1", port), hold_the_take_order)
        try:
            state = f"redis://127.0.0.1:{proxy.port}/0"
            with router_process(preset, state=state, extra_args=("--lease-timeout", "300")) as router:
                _finished(url, "s1")
                host, http_port = router.url.removeprefix("http://").split(":")
                body = b'{"size": 1}'
                request = (
                    f"POST /v1/batches/take HTTP/1.1\r\nHost: {host}\r\n"
                    f"Authorization: Bearer {router.key}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode() + body
                with socket.create_connection((host, int(http_port))) as client:
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
        finally:
            proxy.close()

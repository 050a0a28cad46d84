"""The state store's small Redis client (router.state.resp) against a real redis-server: every
reply type, many concurrent (pipelined) commands matched to their callers, scripts after a
``SCRIPT FLUSH``, database selection, a restart within the outage window, and the end of it."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import pytest
import redis

from router.state.base import StateUnavailable
from router.state.resp import RespClient, RespError, _Incomplete, encode_command, parse_reply
from tests.support.procs import free_port, redis_server


def test_reply_parsing_needs_the_whole_reply() -> None:
    wire = b"*3\r\n$3\r\nabc\r\n:-7\r\n*2\r\n$-1\r\n+OK\r\n-ERR bad\r\n"
    for cut in range(len(wire) - len(b"-ERR bad\r\n")):
        with pytest.raises(_Incomplete):
            parse_reply(wire[:cut], 0)
    value, pos = parse_reply(wire, 0)
    assert value == [b"abc", -7, [None, "OK"]]
    err, end = parse_reply(wire, pos)
    assert isinstance(err, RespError) and str(err) == "ERR bad" and end == len(wire)
    assert encode_command(("SET", "k", b"\x00v", 5, 1.5)) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n\x00v\r\n$1\r\n5\r\n$3\r\n1.5\r\n"
    )


def test_replies_pipelining_scripts_and_databases() -> None:
    async def main(url: str, plain: redis.Redis) -> None:
        c = RespClient(url.rsplit("/", 1)[0] + "/3")
        assert await c.execute("SET", "k", b"v\r\n") == "OK"
        assert await c.execute("GET", "k") == b"v\r\n" and await c.execute("GET", "nope") is None
        assert plain.get("k") is None  # database 3, not 0
        assert redis.Redis.from_url(url.rsplit("/", 1)[0] + "/3").get("k") == b"v\r\n"
        with pytest.raises(RespError, match="WRONGTYPE"):
            await c.execute("HGET", "k", "f")
        # 500 commands issued at once: each caller gets its own reply
        got = await asyncio.gather(*(c.execute("INCRBY", f"n{i % 7}", i) for i in range(500)))
        totals: dict[int, int] = {}
        for i, v in enumerate(got):
            totals[i % 7] = totals.get(i % 7, 0) + i
            assert v == totals[i % 7]
        script = "return {redis.call('INCR', KEYS[1]), ARGV[1]}"
        assert await c.evalsha(script, ["s"], ["x"]) == [1, b"x"]
        await c.execute("SCRIPT", "FLUSH")
        assert await c.evalsha(script, ["s"], ["y"]) == [2, b"y"]  # NOSCRIPT: loaded again
        await c.close()

    with redis_server() as url:
        asyncio.run(main(url, redis.Redis.from_url(url)))


def test_a_restart_within_the_outage_window_is_waited_out_and_a_longer_one_is_unavailable() -> None:
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="resp-"))

    async def main() -> None:
        c = RespClient(f"redis://127.0.0.1:{port}/0", outage_s=15.0)
        short = RespClient(f"redis://127.0.0.1:{port}/0", outage_s=1.0)
        with redis_server(port=port, data_dir=data, appendonly=True):
            await c.execute("SET", "a", "1")
            await short.execute("PING")
        loop = asyncio.get_running_loop()
        # down for ~2 s: the patient client waits it out, the short one gives up
        restarted = loop.run_in_executor(None, _restart_later, port, data, 2.0)
        t0 = time.monotonic()
        with pytest.raises(StateUnavailable):
            await short.execute("GET", "a")
        assert time.monotonic() - t0 < 2.0
        assert await c.execute("GET", "a") == b"1"
        stop = await restarted
        stop.set()
        await c.close()
        await short.close()

    asyncio.run(main())


def _restart_later(port: int, data: Path, after: float):
    import threading

    time.sleep(after)
    stop = threading.Event()
    ready = threading.Event()

    def serve() -> None:
        with redis_server(port=port, data_dir=data, appendonly=True):
            ready.set()
            stop.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    ready.wait(30)
    return stop

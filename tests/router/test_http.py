"""The router as served (uvicorn in front of the FastAPI app) on a real router process over a real
engine, spoken to over raw sockets: turns on keep-alive connections, pipelined requests answered
in order (each turn recorded once), HTTP/1.0 and ``Connection: close``, chunked and
``Expect: 100-continue`` bodies, the keep-alive timeout; bodies pydantic coerces and the
refusals of the turn route (one error shape)."""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.router.conftest import KEYS

SP = {"max_new_tokens": 3, "temperature": 0.0}


def _session(router) -> str:
    r = httpx.post(router.url + "/v1/sessions", json={"group": "cpu-a"}, headers=router.headers)
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def _request(
    path: str, body: bytes, *, key: str | None = None, version: str = "1.1", extra: str = ""
) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{auth}{extra}\r\n"
    ).encode() + body


class Reader:
    """Reads HTTP/1.1 responses (Content-Length framed) off one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), "connection closed before a response"
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(headers["content-length"])
        while len(self.buf) < length:
            assert self._fill(), "connection closed inside a body"
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed(self) -> bool:
        self.sock.settimeout(10)
        return not self._fill() and not self.buf


def _connect(router) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", router.port), timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def test_turns_on_one_keep_alive_connection_and_pipelined_in_order(router) -> None:
    sid = _session(router)
    path = f"/v1/sessions/{sid}/turns"
    with _connect(router) as s:
        r = Reader(s)
        for i in range(3):
            body = json.dumps({"input_ids": [1, 2, 3 + i], "sampling_params": SP}).encode()
            s.sendall(_request(path, body, key=KEYS["all"]))
            status, headers, data = r.response()
            assert status == 200 and headers["content-type"] == "application/json" and "date" in headers
            assert json.loads(data)["turn"] == i
        # three requests in one write: answered in order, each turn recorded once
        batch = b"".join(
            _request(
                path,
                json.dumps({"input_ids": [7, j], "sampling_params": SP, "turn": 3 + j}).encode(),
                key=KEYS["all"],
            )
            for j in range(3)
        )
        s.sendall(batch)
        turns = [json.loads(r.response()[2])["turn"] for _ in range(3)]
        assert turns == [3, 4, 5]
        # a pipelined generate behind a turn, and a refusal behind that
        gen = json.dumps({"input_ids": [4, 5], "sampling_params": SP}).encode()
        s.sendall(
            _request(path, json.dumps({"input_ids": [9], "sampling_params": SP}).encode(), key=KEYS["all"])
            + _request("/generate", gen, key=KEYS["rollout"])
            + _request(path, b'{"input_ids": []}', key=KEYS["all"])
        )
        assert json.loads(r.response()[2])["turn"] == 6
        assert len(json.loads(r.response()[2])["output_ids"]) == 3
        status, _, data = r.response()
        assert status == 422 and "input_ids" in json.loads(data)["detail"]
    traj = httpx.get(f"{router.url}/v1/sessions/{sid}/trajectory", headers=router.headers).json()
    assert [t["turn"] for t in traj["turns"]] == list(range(7))


def test_http_1_0_and_connection_close_end_the_connection(router) -> None:
    sid = _session(router)
    body = json.dumps({"input_ids": [1], "sampling_params": SP}).encode()
    path = f"/v1/sessions/{sid}/turns"
    for version, extra in (("1.0", ""), ("1.1", "Connection: close\r\n")):
        with _connect(router) as s:
            s.sendall(_request(path, body, key=KEYS["all"], version=version, extra=extra))
            r = Reader(s)
            status, headers, _ = r.response()
            assert status == 200 and headers.get("connection") == "close"
            assert r.closed()


def test_chunked_and_expect_continue_bodies(router) -> None:
    sid = _session(router)
    body = json.dumps({"input_ids": [1, 2], "sampling_params": SP}).encode()
    head = (
        f"POST /v1/sessions/{sid}/turns HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEYS['all']}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    with _connect(router) as s:
        chunks = b"%x\r\n%s\r\n" % (5, body[:5]) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 5, body[5:])
        s.sendall(head + chunks)
        status, _, data = Reader(s).response()
        assert status == 200 and json.loads(data)["turn"] == 0
    with _connect(router) as s:
        head = _request(f"/v1/sessions/{sid}/turns", b"", key=KEYS["all"], extra="Expect: 100-continue\r\n")
        s.sendall(head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(body)))
        r = Reader(s)
        while b"\r\n\r\n" not in r.buf:
            r._fill()
        assert r.buf.startswith(b"HTTP/1.1 100")
        r.buf = r.buf.partition(b"\r\n\r\n")[2]
        s.sendall(body)
        status, _, data = r.response()
        assert status == 200 and json.loads(data)["turn"] == 1


def test_coerced_bodies_and_refusals_of_the_turn_route(router) -> None:
    sid = _session(router)
    url = f"{router.url}/v1/sessions/{sid}/turns"
    hdr = router.headers
    plain = httpx.post(url, json={"input_ids": [3, 4], "sampling_params": SP}, headers=hdr, timeout=60)
    # floats that pydantic turns into ints are accepted as the ints
    coerced = httpx.post(url, json={"input_ids": [3.0, 4.0], "sampling_params": SP}, headers=hdr, timeout=60)
    assert plain.status_code == coerced.status_code == 200
    a, b = plain.json(), coerced.json()
    assert set(a) == set(b) and (a["turn"], b["turn"]) == (0, 1)
    assert a["output_ids"] == b["output_ids"] and a["records"] == b["records"]  # greedy: same tokens
    refusals = [
        (httpx.post(url, json={"input_ids": [1]}), 401),
        (
            httpx.post(url, json={"input_ids": [1]}, headers={"Authorization": f"Bearer {KEYS['trainer']}"}),
            403,
        ),
        (httpx.post(url, content=b'{"input_ids": [1', headers=hdr), 422),
        (httpx.post(url, content=b'{"input_ids": [1]}', headers={**hdr, "content-type": "text/plain"}), 422),
        (httpx.post(url, json={"input_ids": [1] * 40_000}, headers=hdr), 413),
        (httpx.post(f"{router.url}/v1/sessions/nope/turns", json={"input_ids": [1]}, headers=hdr), 404),
        # SGLang 0.5.23 refuses a stream that is not a JSON bool (api/v1/api_types.py 1423-1424)
        (httpx.post(f"{router.url}/generate", json={"input_ids": [1], "stream": 1}, headers=hdr), 422),
    ]
    for r, status in refusals:
        assert r.status_code == status, (r.request.content[:60], r.status_code, r.text[:200])
        if status != 200:
            assert isinstance(r.json()["detail"], str)
    assert httpx.post(url, json={"input_ids": [1]}).headers["www-authenticate"] == "Bearer"


def test_keep_alive_timeout_counts_from_the_last_answer(router) -> None:
    """The router's keep-alive timeout (uvicorn's, 5 s): a connection used every 2 s stays open
    past 5 s, an idle one is closed about 5 s after its last answer."""
    sid = _session(router)
    sock = _connect(router)
    reader = Reader(sock)
    url = f"/v1/sessions/{sid}/turns"
    body = json.dumps({"input_ids": [1, 2], "sampling_params": SP}).encode()
    health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    t_start = time.monotonic()
    for i in range(4):  # answers at about 0, 2, 4 and 6 s
        if i:
            time.sleep(2.0)
        sock.sendall(_request(url, body, key=KEYS["rollout"]) if i % 2 == 0 else health)
        status, _, data = reader.response()
        assert status == 200, data
    assert time.monotonic() - t_start > 5.5
    last = time.monotonic()
    sock.settimeout(10)
    assert sock.recv(1) == b""  # closed by the server while idle
    waited = time.monotonic() - last
    assert 4.5 < waited < 7.5, waited
    sock.close()

"""The one router client (clients.router) against a real loopback server: the synchronous
WeightsClient's calls and their bodies, every failure as one RouterError line carrying the router's
message and status, retries of 409/503 answers, and the job wait's events, failure and timeout."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import pytest

from clients.router import Blocking, RouterClient, RouterError, WeightsClient
from tests.support.loopback import LoopbackServer
from tests.support.procs import free_port


class FakeRouter(LoopbackServer):
    """Answers ``answers[path]`` = (status, body bytes[, headers]), or a list of them answered in
    turn (the last one repeats); records (method, path, headers, body)."""

    def __init__(self, answers: dict[str, tuple | list[tuple]]) -> None:
        self.calls: list[tuple[str, str, dict[str, str], bytes]] = []
        router = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                router.calls.append(
                    (self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                answer = answers[self.path]
                if isinstance(answer, list):
                    answer = answer.pop(0) if len(answer) > 1 else answer[0]
                status, data, *extra = answer
                self.send_response(status)
                for name, value in (extra[0] if extra else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer  # noqa: N815

        super().__init__(Handler)


def test_calls_send_the_key_and_body_and_decode_the_answer() -> None:
    router = FakeRouter(
        {"/v1/weights": (200, b'{"latest_version":3}'), "/v1/weights/rollback": (200, b'{"job_id":"j"}')}
    )
    try:
        with WeightsClient(router.url, "k1") as client:
            assert client.status() == {"latest_version": 3}
            assert client.rollback({"to": 2}) == {"job_id": "j"}
    finally:
        router.close()
    (m1, p1, h1, b1), (m2, p2, h2, b2) = router.calls
    assert (m1, p1, b1) == ("GET", "/v1/weights", b"")
    assert (m2, p2, json.loads(b2)) == ("POST", "/v1/weights/rollback", {"to": 2})
    assert h1["authorization"] == h2["authorization"] == "Bearer k1"
    assert h2["content-type"] == "application/json"


def test_failures_are_one_line_with_the_routers_message() -> None:
    validation = {"detail": [{"loc": ["body", "to"], "msg": "Input should be a valid integer"}]}
    router = FakeRouter(
        {
            "/v1/weights": (409, b'{"detail":"a publish is already running"}'),
            "/v1/weights/rollback": (422, json.dumps(validation).encode()),
            "/v1/weights/jobs/x": (200, b"not json"),
            "/v1/weights/prune": (
                502,
                b"<html>\n<head><title>502 Bad Gateway</title></head>\n<body>nginx</body>\n</html>\n",
            ),
        }
    )
    try:
        with WeightsClient(router.url, None) as client:
            with pytest.raises(RouterError) as busy:
                client.publish({"checkpoint": "/c"})
            assert busy.value.status == 409
            assert str(busy.value) == "POST /v1/weights: HTTP 409: a publish is already running"
            with pytest.raises(RouterError, match=r"HTTP 422: body\.to: Input should be a valid integer"):
                client.rollback({"to": "x"})
            with pytest.raises(RouterError, match="not JSON"):
                client.job("x")
            with pytest.raises(RouterError) as proxy:  # a proxy's page: one line (it was printed as sent)
                client.prune({"keep": 1})
            assert str(proxy.value) == (
                "POST /v1/weights/prune: HTTP 502: <html> <head><title>502 Bad Gateway</title></head> "
                "<body>nginx</body> </html>"
            )
    finally:
        router.close()
    assert all("authorization" not in h for _, _, h, _ in router.calls)
    with WeightsClient(f"http://127.0.0.1:{free_port()}", None) as client:
        with pytest.raises(RouterError, match="cannot reach the router") as down:
            client.status()
        assert down.value.status is None


def _job(state: str, events: int, **extra: object) -> tuple[int, bytes]:
    body = {"job_id": "j", "state": state, "version": 3, "events": [{"n": i} for i in range(events)], **extra}
    return 200, json.dumps(body).encode()


def test_wait_job_reports_each_event_once_and_names_a_failure_or_a_timeout() -> None:
    router = FakeRouter(
        {
            "/v1/weights/jobs/j": [_job("running", 1), _job("running", 1), _job("done", 3)],
            "/v1/weights/jobs/f": [_job("failed", 0, kind="rollback", error="boom")],
            "/v1/weights/jobs/p": [_job("failed", 0, job_id="p", kind="prune", version=None, error="disk")],
            "/v1/weights/jobs/s": [_job("running", 0)],
        }
    )
    seen: list[dict] = []
    try:
        with WeightsClient(router.url, "k") as client:
            done = client.wait_job(
                {"job_id": "j", "state": "running", "events": []}, 30, on_event=seen.append
            )
            with pytest.raises(RouterError, match=r"rollback job j \(version 3\) failed: boom") as failed:
                client.wait_job("f", 30)
            with pytest.raises(RouterError) as pruned:  # a prune has no version: none is named
                client.wait_job("p", 30)
            with pytest.raises(RouterError, match="job still running after 0 s") as slow:
                client.wait_job("s", 0.0)
    finally:
        router.close()
    assert done["state"] == "done" and seen == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert failed.value.status is None and slow.value.status is None
    assert str(pruned.value) == "GET /v1/weights/jobs/p: prune job p failed: disk"


def test_503_and_a_409_with_retry_after_are_retried_then_raised() -> None:
    """A 409 that passes carries Retry-After (a publish job running); one without it (a finished
    session, a repeated upload) is raised at once."""
    later = {"Retry-After": "0"}
    router = FakeRouter(
        {
            "/v1/groups": [
                (503, b'{"detail":"busy"}'),
                (409, b'{"detail":"later"}', later),
                (200, b'{"groups":[]}'),
            ],
            "/v1/weights": [(409, b'{"detail":"a publish is already running"}', later)],
            "/v1/sessions/s/finish": [(409, b'{"detail":"session s is already finished"}')],
            "/v1/weights/rollback": [(400, b'{"detail":"bad"}'), (200, b"{}")],
        }
    )
    try:
        with Blocking(RouterClient(None, router.url, "k", retries=2, backoff_s=0.01)) as client:
            assert client.groups() == {"groups": []}
            with pytest.raises(RouterError, match="HTTP 409: a publish is already running"):
                client.publish({"checkpoint": "/c"})
            with pytest.raises(RouterError, match="HTTP 400: bad"):
                client.rollback({"to": 1})
            with pytest.raises(RouterError, match="HTTP 409: session s is already finished"):
                client.call("POST", "/v1/sessions/s/finish", {"reward": 1.0})
    finally:
        router.close()
    paths = [p for _, p, _, _ in router.calls]
    assert paths.count("/v1/groups") == 3 and paths.count("/v1/weights") == 3
    assert paths.count("/v1/sessions/s/finish") == 1
    assert paths.count("/v1/weights/rollback") == 1

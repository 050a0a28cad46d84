"""Client of the router's JSON API for the fleet's own tools: the admin weight routes
(``/v1/weights``), fixed-prefix scoring (``/v1/score``) and replica heartbeats.

:class:`RouterClient` is the async call (one ``aiohttp`` session, a Bearer key); every failure
is a :class:`RouterError` (a :class:`~weight_sync.errors.UserError`) carrying the router's
message, so CLI commands print one line. :class:`WeightsClient` is the synchronous face of the
``mixfleet weights`` commands, running the async client on a private event loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import aiohttp

from core.errors import UserError
from core.jsonio import dumps, loads

DEFAULT_URL = "http://127.0.0.1:8300"
KEY_FILE = Path(".mixfleet") / "api_key"


def router_url(explicit: str | None) -> str:
    """``--router``, else ``MIXFLEET_URL``, else the ``mixfleet up`` default."""
    url = explicit or os.environ.get("MIXFLEET_URL") or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise UserError(f"router URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def api_key() -> str | None:
    """``MIXFLEET_API_KEY``, else the key ``mixfleet up`` wrote to ``.mixfleet/api_key`` (if any)."""
    key = os.environ.get("MIXFLEET_API_KEY")
    if key:
        return key.strip()
    if KEY_FILE.is_file():
        return KEY_FILE.read_text().strip() or None
    return None


class RouterError(UserError):
    """A router call failed: ``status`` is the HTTP status, None when the router did not answer."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


class RouterClient:
    """Async JSON calls on the router at ``url`` over ``http``; ``timeout`` bounds each call."""

    def __init__(self, http: aiohttp.ClientSession, url: str, key: str | None, timeout: float = 60.0) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        """The decoded JSON answer of ``method path`` with ``body`` (JSON); raises
        :class:`RouterError` when the router cannot be reached or answers 4xx / 5xx / not JSON."""
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = dumps(body)
            headers["content-type"] = "application/json"
        try:
            async with self.http.request(
                method, self.url + path, data=data, headers=headers, timeout=self.timeout
            ) as r:
                status, content, reason = r.status, await r.read(), r.reason or ""
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
            raise RouterError(f"cannot reach the router at {self.url}: {reason}", None) from None
        if status >= 400:
            raise RouterError(f"{method} {path}: HTTP {status}: {_message(content, reason)}", status)
        try:
            return loads(content)
        except ValueError:
            raise RouterError(f"{method} {path}: the router's answer is not JSON", status) from None


def open_session() -> aiohttp.ClientSession:
    """A session for :class:`RouterClient` (call inside the running loop)."""
    return aiohttp.ClientSession(trust_env=False)


class WeightsClient:
    """Synchronous client of the weight routes; ``timeout`` bounds each HTTP call, not the waits.
    Close it (or use it as a context manager) to release its loop and connections."""

    def __init__(self, url: str, key: str | None, timeout: float = 60.0) -> None:
        self.url = url
        self._loop = asyncio.new_event_loop()
        http = self._loop.run_until_complete(_opened())
        self._router = RouterClient(http, url, key, timeout)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._router.http.close())
            self._loop.close()

    def __enter__(self) -> WeightsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        return self._loop.run_until_complete(self._router.call(method, path, body))

    # routes -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/weights")

    def publish(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/weights", body)

    def rollback(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/weights/rollback", body)

    def perturb(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/weights/perturbations", body)

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/weights/jobs/{job_id}")

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/score", body)

    # waits ------------------------------------------------------------------------------------
    def wait_job(self, job: dict[str, Any], timeout: float, on_event=None) -> dict[str, Any]:
        """Poll a publish job until it is done; raises ``UserError`` if it failed or timed out."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            if job.get("state") in ("done", "failed"):
                break
            if time.monotonic() > deadline:
                raise UserError(f"publish job {job['job_id']} still running after {timeout:.0f}s")
            time.sleep(0.2)
            job = self.job(job["job_id"])
            if on_event is not None:
                for ev in job.get("events", [])[seen:]:
                    on_event(ev)
                seen = len(job.get("events", []))
        if job["state"] == "failed":
            raise UserError(f"publish of version {job.get('version')} failed: {job.get('error')}")
        return job

    def wait_active(self, version: int, timeout: float) -> dict[str, Any]:
        """Poll status until every live replica (recent heartbeat) of every group reports ``version``.

        Groups without live replicas are skipped: a replica that joins later starts at the
        pointer's version anyway.
        """
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            lagging = [
                (g["group"], r["replica_id"], r.get("active_version"), r.get("error"))
                for g in st["groups"]
                for r in g["replicas"]
                if r.get("fresh", True) and r.get("active_version") != version
            ]
            if not lagging:
                return st
            if time.monotonic() > deadline:
                what = "; ".join(
                    f"{grp}/{rid} at {v}" + (f" ({err})" if err else "") for grp, rid, v, err in lagging
                )
                raise UserError(f"not every replica reached version {version} within {timeout:.0f}s: {what}")
            time.sleep(0.2)


async def _opened() -> aiohttp.ClientSession:
    return open_session()


def _message(content: bytes, reason: str) -> str:
    """The router's error message: ``detail`` (its first validation error's field and message),
    ``error`` or ``message``; else the body's text."""
    try:
        data = loads(content)
    except ValueError:
        return content[:300].decode(errors="replace") or reason
    if isinstance(data, dict):
        detail = data.get("detail", data.get("error", data.get("message", data)))
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            first = detail[0]
            detail = f"{'.'.join(str(x) for x in first.get('loc', []))}: {first.get('msg')}"
        return str(detail)
    return str(data)

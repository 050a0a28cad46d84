"""HTTP client for the router's admin weight routes (``/v1/weights``) and fixed-prefix scoring.

Every call authenticates with a Bearer key and turns an HTTP error into a
:class:`~weight_sync.errors.UserError` carrying the router's message, so CLI commands print
one line. The routes are served by :mod:`router.weights`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx

from weight_sync.errors import UserError

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


class WeightsClient:
    """Synchronous client; ``timeout`` bounds each HTTP call, not the waits."""

    def __init__(self, url: str, key: str | None, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = url
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> WeightsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise UserError(f"cannot reach the router at {self.url}: {exc}") from None
        if r.status_code >= 400:
            raise UserError(f"{method} {path}: HTTP {r.status_code}: {_message(r)}")
        return r.json()

    # routes -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/weights")

    def publish(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/weights", json=body)

    def rollback(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/weights/rollback", json=body)

    def perturb(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/weights/perturbations", json=body)

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/weights/jobs/{job_id}")

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/score", json=body)

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


def _message(r: httpx.Response) -> str:
    try:
        data = r.json()
    except ValueError:
        return r.text[:300] or r.reason_phrase
    if isinstance(data, dict):
        detail = data.get("detail", data.get("error", data.get("message", data)))
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            first = detail[0]
            detail = f"{'.'.join(str(x) for x in first.get('loc', []))}: {first.get('msg')}"
        return str(detail)
    return str(data)

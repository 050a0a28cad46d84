"""The one client of the router's HTTP API, for everything that calls the router: the fleet's
commands (``mixfleet weights``, ``report``, ``scale``, the live-update check), the sidecars'
heartbeats and the trainer kit (:mod:`trainer.client` builds the rollout calls on it).

* :class:`RouterClient`: async calls over ``aiohttp`` with a Bearer key.
  :meth:`~RouterClient.request` is the one transport (bytes in and out; answers with a status of
  ``retry_statuses``, 503 and a 409 carrying ``Retry-After`` by default, and unreachable routers
  are retried ``retries`` times with exponential backoff that honours ``Retry-After``);
  :meth:`~RouterClient.call` decodes JSON; then the weight routes, fixed-prefix scoring, groups
  and the two waits (:meth:`~RouterClient.wait_job`, :meth:`~RouterClient.wait_active`).
* :class:`RouterError`: every failure, a :class:`core.errors.UserError` (commands print it as one
  line) carrying the HTTP ``status`` (None when no HTTP answer decided it), the router's message
  (``detail``) and the request (``method``, ``path``).
* :class:`Blocking`: the one synchronous wrapper: an async client's coroutine methods, each run to
  completion on the wrapper's own event loop. :class:`WeightsClient` is the blocking
  :class:`RouterClient`; :class:`trainer.client.RolloutClient` the blocking rollout client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from core.errors import UserError
from core.jsonio import dumps, loads

DEFAULT_URL = "http://127.0.0.1:8300"
KEY_FILE = Path(".mixfleet") / "api_key"
RETRY_STATUSES = (409, 503)
"""Statuses a call is retried on (with ``retries`` > 0): a router busy (503), and a conflict the
router says passes (a 409 only with ``Retry-After``: a publish job running, turns of one session
racing; a finished session, a ``min_version`` above every servable version or a repeated upload
carries none and is raised at once)."""
DETAIL_CHARS = 500
NO_KEY_HINT = (
    f"set MIXFLEET_API_KEY (mixfleet up keeps its key in <data-dir>/api_key, read from {KEY_FILE} "
    "when the variable is unset)"
)
"""What a 401 adds when the client had no key to send (a command run outside the fleet's directory)."""
ALWAYS_SERVED = frozenset(
    {
        "/v1/batches/stats",
        "/v1/batches/take",
        "/v1/groups",
        "/v1/ledger",
        "/v1/replicas/heartbeat",
        "/v1/score",
        "/v1/sessions",
        "/v1/weights",
        "/v1/weights/prune",
    }
)
"""Paths every router serves (``mixfleet router``) and never answers 404 (no id in them, none
documents a 404): a 404 from one says the client's URL is not a router's root (``.../v1``, a
typo, another server), which the error then says (a test checks them against the router's
OpenAPI)."""


class BadRouterUrl(UserError, ValueError):
    """A router URL that is not an ``http://`` or ``https://`` URL (a ``ValueError`` to library
    callers, a one-line ``UserError`` to the commands)."""


def check_url(url: str) -> str:
    """``url`` without its trailing ``/``, when it starts with ``http://`` or ``https://``; else
    :class:`BadRouterUrl` naming it (``127.0.0.1:8300`` fails here, not at the first call)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadRouterUrl(f"router URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def router_url(explicit: str | None) -> str:
    """``--router``, else ``MIXFLEET_URL``, else the ``mixfleet up`` default (:func:`check_url`)."""
    return check_url(explicit or os.environ.get("MIXFLEET_URL") or DEFAULT_URL)


def api_key() -> str | None:
    """``MIXFLEET_API_KEY``, else the key ``mixfleet up`` wrote to ``.mixfleet/api_key`` (if any)."""
    key = os.environ.get("MIXFLEET_API_KEY")
    if key:
        return key.strip()
    if KEY_FILE.is_file():
        return KEY_FILE.read_text().strip() or None
    return None


class RouterError(UserError):
    """A router call failed: ``status`` is the HTTP status of the refusal, None when no HTTP
    answer decided it (the router could not be reached; a job that failed or outlived its wait);
    ``detail`` the router's message (or what went wrong); ``method`` and ``path`` the request;
    ``retry_after`` the refusal's ``Retry-After`` in seconds (None: it carried none)."""

    def __init__(
        self, method: str, path: str, status: int | None, detail: str, *, retry_after: float | None = None
    ) -> None:
        http = f"HTTP {status}: " if status is not None else ""
        super().__init__(f"{method} {path}: {http}{detail}")
        self.method = method
        self.path = path
        self.status = status
        self.detail = detail
        self.retry_after = retry_after


@dataclass(frozen=True)
class Answer:
    """A successful answer (status below 400): its status, body and ``Content-Type``."""

    status: int
    content: bytes
    content_type: str


def open_session() -> aiohttp.ClientSession:
    """A session to share between clients (call inside the running loop; the caller closes it).
    Idle connections are dropped after 2 s, before the router's keep-alive timeout (uvicorn: 5 s)
    can close one under the next request (aiohttp: "Can not write request body"), as
    ``clients.engine.make_http_client`` does for engines."""
    return aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(keepalive_timeout=2.0))


def job_key() -> dict[str, str]:
    """A fresh ``Idempotency-Key`` header for one weight job's request and its retries: the router
    answers an attempt sent again with the job the first started (one job, however many attempts
    reached it)."""
    return {"Idempotency-Key": uuid.uuid4().hex}


class RouterClient:
    """Calls on the router at ``url`` with ``key``; ``timeout`` bounds each HTTP call (not the
    waits). A ``url`` that is not http(s) is refused here (:func:`check_url`). With ``http`` the
    calls use that session (the caller's to close); without, the client opens its own on first
    use and :meth:`close` closes it (or use ``async with``)."""

    def __init__(
        self,
        http: aiohttp.ClientSession | None,
        url: str,
        key: str | None,
        timeout: float = 60.0,
        *,
        retries: int = 0,
        backoff_s: float = 0.25,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.url = check_url(url)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 10.0))
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._http = http
        self._owns_http = http is None

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the client's own session (a session it was given stays open)."""
        if self._owns_http and self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = open_session()
        return self._http

    # transport ------------------------------------------------------------------------------
    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        accept: str = "application/json",
        content_type: str = "application/json",
        retry_statuses: tuple[int, ...] = RETRY_STATUSES,
        headers: dict[str, str] | None = None,
        wait_s: float = 0.0,
    ) -> Answer:
        """``method path`` with ``body`` (sent as it is when ``bytes``, with ``content_type``;
        else as JSON). Raises :class:`RouterError` for a 4xx / 5xx answer or an unreachable
        router, once ``retries`` retries (of ``retry_statuses`` answers and unreachable routers)
        are spent. ``headers`` are added to every attempt (an ``Idempotency-Key`` makes the retries of
        a POST that records something safe: the router answers a retry with what it recorded).
        ``wait_s``: how long the router may hold the request before it answers (a long poll's
        wait), added to each attempt's timeout."""
        headers = {**self.headers, **(headers or {}), "Accept": accept}
        timeout = self.timeout
        if wait_s > 0 and timeout.total is not None:
            timeout = aiohttp.ClientTimeout(total=timeout.total + wait_s, sock_connect=timeout.sock_connect)
        data = None
        if isinstance(body, bytes):
            data, headers["Content-Type"] = body, content_type
        elif body is not None:
            data, headers["Content-Type"] = dumps(body), "application/json"
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                async with self._session().request(
                    method, self.url + path, data=data, headers=headers, timeout=timeout
                ) as r:
                    content, status = await r.read(), r.status
                    retry_after, ctype = r.headers.get("Retry-After"), r.headers.get("Content-Type", "")
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                if last:
                    reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
                    raise RouterError(
                        method, path, None, f"cannot reach the router at {self.url}: {reason}"
                    ) from None
                await asyncio.sleep(self._delay(attempt, None))
                continue
            if status < 400:
                return Answer(status, content, ctype)
            if status in retry_statuses and not last and (status != 409 or retry_after is not None):
                await asyncio.sleep(self._delay(attempt, retry_after))
                continue
            message = _message(content, r.reason or f"HTTP {status}")
            if status == 401 and "Authorization" not in self.headers:
                message += f"; no key was sent: {NO_KEY_HINT}"
            if status == 404 and path.partition("?")[0] in ALWAYS_SERVED:
                message += (
                    f"; the router URL {self.url} looks wrong: every router serves {method} "
                    f"{path.partition('?')[0]}; give the router's root URL (e.g. {DEFAULT_URL})"
                )
            raise RouterError(method, path, status, message, retry_after=_seconds(retry_after))
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        if retry_after is not None:
            with contextlib.suppress(ValueError):
                delay = max(delay, min(self.max_backoff_s, float(retry_after)))
        return delay

    async def call(
        self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None
    ) -> Any:
        """The decoded JSON answer of ``method path`` (None for an empty body); raises
        :class:`RouterError` as :meth:`request` does, and when the answer is not JSON."""
        answer = await self.request(method, path, body, headers=headers)
        if not answer.content:
            return None
        try:
            return loads(answer.content)
        except ValueError:
            raise RouterError(method, path, answer.status, "the router's answer is not JSON") from None

    # routes -----------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """``GET /v1/weights``: the run, latest version, formats and every group's replicas."""
        return await self.call("GET", "/v1/weights")

    async def publish(
        self,
        body: dict[str, Any],
        *,
        wait_s: float = 0.0,
        on_wait: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/weights``: start a publish job; returns the job. With ``wait_s``, a publish
        refused because another weight job runs (the router's 409 with ``Retry-After``; nothing
        was started) is sent again, at the ``Retry-After`` pace, until the job is done or
        ``wait_s`` seconds have passed since the call: ``on_wait`` gets one line when the wait
        starts; past ``wait_s`` the refusal is raised, naming the wait. Without, such a refusal
        is retried as any call's (``retries``). Every attempt carries one fresh ``Idempotency-Key``
        (:func:`job_key`): an attempt whose answer was lost is answered, when sent again, with the
        job it started."""
        key = job_key()
        if wait_s <= 0:
            return await self.call("POST", "/v1/weights", body, headers=key)
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                answer = await self.request("POST", "/v1/weights", body, retry_statuses=(503,), headers=key)
                return loads(answer.content)
            except RouterError as exc:
                left = deadline - time.monotonic()
                if exc.status != 409 or exc.retry_after is None:
                    raise
                if left <= 0:
                    raise RouterError(
                        exc.method, exc.path, 409, f"{exc.detail} (waited {wait_s:g} s for it)"
                    ) from None
                if not told and on_wait is not None:
                    on_wait(f"another weight job is running; waiting up to {wait_s:g} s for it to end")
                told = True
                await asyncio.sleep(min(max(exc.retry_after, 0.1), self.max_backoff_s, left))

    async def rollback(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/weights/rollback``: start a rollback job (one key for its retries, as publish)."""
        return await self.call("POST", "/v1/weights/rollback", body, headers=job_key())

    async def perturb(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/weights/perturbations``: start a perturbation job (one key, as publish)."""
        return await self.call("POST", "/v1/weights/perturbations", body, headers=job_key())

    async def prune(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/weights/prune``: start a prune job; returns the job."""
        return await self.call("POST", "/v1/weights/prune", body)

    async def prune_plan(self, keep: int, run_id: str | None = None) -> dict[str, Any]:
        """``GET /v1/weights/prune?keep=N[&run_id=R]``: what a prune would delete now."""
        query = f"keep={int(keep)}" + ("" if run_id is None else f"&run_id={quote(run_id)}")
        return await self.call("GET", f"/v1/weights/prune?{query}")

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self.call("GET", f"/v1/weights/jobs/{job_id}")

    async def score(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("POST", "/v1/score", body)

    async def groups(self) -> dict[str, Any]:
        return await self.call("GET", "/v1/groups")

    # waits ------------------------------------------------------------------------------------
    async def wait_job(
        self,
        job: str | dict[str, Any],
        timeout_s: float = 600.0,
        *,
        poll_s: float = 0.2,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll the weights job ``job`` (its id, or the job as a route answered it) until it is
        ``done``; returns it. ``on_event`` sees each of the job's events once, in order. Raises
        :class:`RouterError` (status None) when the job failed or is still running after
        ``timeout_s``."""
        job_id = job if isinstance(job, str) else job["job_id"]
        path = f"/v1/weights/jobs/{job_id}"
        deadline = time.monotonic() + timeout_s
        seen = 0
        current = await self.job(job_id) if isinstance(job, str) else job
        while True:
            events = current.get("events") or []
            for ev in events[seen:] if on_event is not None else ():
                on_event(ev)
            seen = len(events)
            state = current.get("state")
            if state == "done":
                return current
            if state == "failed":
                raise RouterError("GET", path, None, f"{job_name(current)} failed: {current.get('error')}")
            if time.monotonic() > deadline:
                raise RouterError("GET", path, None, f"job still {state} after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)
            current = await self.job(job_id)

    async def wait_active(
        self,
        version: int,
        timeout_s: float = 600.0,
        *,
        poll_s: float = 0.2,
        formats: Collection[str] | None = None,
    ) -> dict[str, Any]:
        """Poll :meth:`status` until every live replica (recent heartbeat) of every group reports
        ``version``; returns that status. Groups without live replicas are skipped: a replica
        that joins later starts at the pointer's version anyway. ``formats``: only the groups
        serving one of these (those a publish of some formats moves; default every group).
        Raises :class:`UserError` naming the lagging replicas after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = await self.status()
            lagging = [
                (g["group"], r["replica_id"], r.get("active_version"), r.get("error"))
                for g in st["groups"]
                if formats is None or g["format"] in formats
                for r in g["replicas"]
                if r.get("fresh", True) and r.get("active_version") != version
            ]
            if not lagging:
                return st
            if time.monotonic() > deadline:
                what = "; ".join(
                    f"{grp}/{rid} at {v}" + (f" ({err})" if err else "") for grp, rid, v, err in lagging
                )
                raise UserError(
                    f"not every replica reached version {version} within {timeout_s:.0f}s: {what}"
                )
            await asyncio.sleep(poll_s)


class Blocking:
    """The coroutine methods of ``client`` (an async client with an async ``close``), blocking:
    each call runs to completion on this wrapper's own event loop, so it must not be made from
    inside a running event loop; a call interrupted (Ctrl-C) is cancelled before the interrupt
    goes on, so nothing of it is left on the loop. Other attributes are the client's. Close the
    wrapper (or use it as a context manager) to close the client and the loop."""

    def __init__(self, client: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = client

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._client, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            task = self._loop.create_task(attr(*args, **kwargs))
            try:
                return self._loop.run_until_complete(task)
            except BaseException:  # Ctrl-C mid-call: end the call here, not at exit (a traceback)
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        self._loop.run_until_complete(task)
                raise

        return blocking

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeightsClient(Blocking):
    """:class:`RouterClient`'s calls, blocking (the ``mixfleet weights`` commands and the
    live-update check); ``timeout`` bounds each HTTP call, not the waits."""

    def __init__(self, url: str, key: str | None, timeout: float = 60.0) -> None:
        super().__init__(RouterClient(None, url, key, timeout))


def job_name(job: dict[str, Any]) -> str:
    """A weight job as a failure names it: its kind (publish, rollback, perturbation, prune) and
    its version when it has one (a prune has none; a job that failed before deciding one neither)."""
    version = job.get("version")
    return f"{job.get('kind') or 'weight'} job {job.get('job_id')}" + (
        "" if version is None else f" (version {version})"
    )


def _seconds(retry_after: str | None) -> float | None:
    """A ``Retry-After`` of delay seconds as a number (None: absent, or an HTTP date)."""
    if retry_after is None:
        return None
    with contextlib.suppress(ValueError):
        return max(0.0, float(retry_after))
    return None


def _message(content: bytes, reason: str) -> str:
    """The router's error message, one line of at most :data:`DETAIL_CHARS`: ``detail`` (its first
    validation error's field and message), ``error`` or ``message``; else the body's text (a
    proxy's HTML page: its whitespace runs made one space); else ``reason``."""
    try:
        data = loads(content)
    except ValueError:
        return " ".join(content[: 4 * DETAIL_CHARS].decode(errors="replace").split())[:DETAIL_CHARS] or reason
    if isinstance(data, dict):
        detail = data.get("detail", data.get("error", data.get("message", data)))
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            first = detail[0]
            detail = f"{'.'.join(str(x) for x in first.get('loc', []))}: {first.get('msg')}"
        data = detail
    return " ".join(str(data).split())[:DETAIL_CHARS]

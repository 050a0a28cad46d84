"""Clients of the router's rollout API for agents and trainers: :class:`AsyncRolloutClient`
(aiohttp) and :class:`RolloutClient` (the same calls, blocking, on a private event loop).

Every call authenticates with a Bearer key. A 409 or 503 answer is retried with exponential
backoff (honouring ``Retry-After``) up to ``retries`` times, then raised; any other 4xx/5xx
raises :class:`RouterError` at once, carrying the status, the router's ``detail`` and the
request. Batches are taken in the compact records encoding and decoded by
:func:`trainer.batch.decode_batch` into flat arrays. Nothing here imports the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from core.wire import LOGPROBS_MEDIA_TYPE, RECORDS_MEDIA_TYPE
from trainer.batch import Batch, decode_batch
from trainer.upload import encode_trainer_logprobs

RETRY_STATUSES = (409, 503)


class RouterError(Exception):
    """The router refused a call (or could not be reached: ``status`` 0)."""

    def __init__(self, method: str, path: str, status: int, detail: str) -> None:
        super().__init__(
            f"{method} {path}: HTTP {status}: {detail}" if status else f"{method} {path}: {detail}"
        )
        self.method = method
        self.path = path
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Session:
    session_id: str
    group: str


def _detail(status: int, body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode(errors="replace") or f"HTTP {status}"
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:500]
    return str(data)[:500]


class AsyncRolloutClient:
    """Calls on one router. Use as ``async with AsyncRolloutClient(url, key) as c: ...``."""

    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 5,
        backoff_s: float = 0.25,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10.0), trust_env=False
            )
        return self._http

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        accept: str = "application/json",
        content_type: str = "application/json",
        retry_statuses: tuple[int, ...] = RETRY_STATUSES,
    ) -> tuple[bytes, str]:
        """One call with retries; returns (body bytes, content type). ``body`` is sent as JSON,
        or as it is when it is ``bytes`` (with ``content_type``). Answers with a status in
        ``retry_statuses`` are retried."""
        headers = {**self.headers, "Accept": accept}
        data = None
        if isinstance(body, bytes):
            data = body
            headers["Content-Type"] = content_type
        elif body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        for attempt in range(self.retries + 1):
            try:
                async with self._session().request(method, self.url + path, data=data, headers=headers) as r:
                    content = await r.read()
                    status = r.status
                    retry_after = r.headers.get("Retry-After")
                    ctype = r.headers.get("Content-Type", "")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                if attempt == self.retries:
                    raise RouterError(
                        method, path, 0, f"router unreachable: {type(exc).__name__}: {exc}"
                    ) from None
                await asyncio.sleep(self._delay(attempt, None))
                continue
            if status < 400:
                return content, ctype
            if status in retry_statuses and attempt < self.retries:
                await asyncio.sleep(self._delay(attempt, retry_after))
                continue
            raise RouterError(method, path, status, _detail(status, content))
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        if retry_after is not None:
            with contextlib.suppress(ValueError):
                delay = max(delay, min(self.max_backoff_s, float(retry_after)))
        return delay

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        content, _ = await self.request(method, path, body)
        return json.loads(content) if content else None

    # sessions --------------------------------------------------------------------------
    async def create_session(
        self, group: str | None = None, metadata: dict[str, Any] | None = None
    ) -> Session:
        body: dict[str, Any] = {"metadata": metadata or {}}
        if group is not None:
            body["group"] = group
        out = await self._json("POST", "/v1/sessions", body)
        return Session(out["session_id"], out["group"])

    async def turn(
        self,
        session_id: str,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        min_version: int | None = None,
        max_version_age: int | None = None,
    ) -> dict[str, Any]:
        """Generate the next turn; returns the router's turn object (output ids, records)."""
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_params or {}}
        if min_version is not None:
            body["min_version"] = min_version
        if max_version_age is not None:
            body["max_version_age"] = max_version_age
        return await self._json("POST", f"/v1/sessions/{session_id}/turns", body)

    async def finish(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> Any:
        return await self._json(
            "POST", f"/v1/sessions/{session_id}/finish", {"reward": reward, "metadata": metadata or {}}
        )

    async def trajectory(self, session_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/sessions/{session_id}/trajectory")

    # trainer ---------------------------------------------------------------------------
    async def take(
        self,
        size: int,
        *,
        max_version_age: int | None = None,
        wait_s: float = 0.0,
        trainer_version: int | None = None,
    ) -> Batch:
        """Take up to ``size`` finished trajectories under a lease, decoded into arrays. An
        empty batch has no lease (``lease_id`` None)."""
        body: dict[str, Any] = {"size": size, "wait_s": wait_s}
        if max_version_age is not None:
            body["max_version_age"] = max_version_age
        if trainer_version is not None:
            body["trainer_version"] = trainer_version
        content, ctype = await self.request("POST", "/v1/batches/take", body, accept=RECORDS_MEDIA_TYPE)
        if not ctype.startswith(RECORDS_MEDIA_TYPE):
            raise RouterError(
                "POST", "/v1/batches/take", 200, f"expected {RECORDS_MEDIA_TYPE}, got {ctype!r}"
            )
        return decode_batch(content)

    async def ack(self, lease_id: str) -> Any:
        return await self._json("POST", f"/v1/batches/{lease_id}/ack")

    async def upload_trainer_logprobs(self, lease_id: str, logprobs: np.ndarray) -> dict[str, Any]:
        """Upload the trainer's log-prob of every token of the batch taken under ``lease_id``, in
        the batch's token order (``Batch.logprobs``' order), for the router's mismatch figures;
        returns the batch's figures per (group, version). Once per lease: a repeat is a 409,
        raised at once (it is not transient)."""
        content, _ = await self.request(
            "POST",
            f"/v1/batches/{lease_id}/trainer_logprobs",
            encode_trainer_logprobs(logprobs),
            content_type=LOGPROBS_MEDIA_TYPE,
            retry_statuses=(503,),
        )
        return json.loads(content)

    # weights and fleet -----------------------------------------------------------------
    async def publish(self, checkpoint: str, *, version: int | None = None, **fields: Any) -> dict[str, Any]:
        """Start publishing a BF16 checkpoint directory (an absolute path on the router's
        machine) as ``version`` (None: the router takes the next number, under its job lock);
        returns the job, whose ``version`` is the number taken (poll with :meth:`job` or
        :meth:`wait_job`)."""
        body = {"checkpoint": checkpoint, **fields}
        if version is not None:
            body["version"] = version
        return await self._json("POST", "/v1/weights", body)

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/weights/jobs/{job_id}")

    async def wait_job(self, job_id: str, *, poll_s: float = 0.2, timeout_s: float = 600.0) -> dict[str, Any]:
        """Poll a weights job until it is ``done``; raise RouterError when it ``failed`` or times out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            job = await self.job(job_id)
            state = job.get("state")
            if state == "done":
                return job
            if state == "failed":
                raise RouterError("GET", f"/v1/weights/jobs/{job_id}", 200, str(job.get("error") or job))
            if loop.time() > deadline:
                raise RouterError(
                    "GET", f"/v1/weights/jobs/{job_id}", 0, f"job still {state} after {timeout_s} s"
                )
            await asyncio.sleep(poll_s)

    async def weights_status(self) -> dict[str, Any]:
        return await self._json("GET", "/v1/weights")

    async def groups(self) -> dict[str, Any]:
        return await self._json("GET", "/v1/groups")


class RolloutClient:
    """:class:`AsyncRolloutClient`'s calls, blocking: each runs to completion on this client's
    own event loop (so it must not be called from inside a running event loop)."""

    def __init__(self, url: str, api_key: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = AsyncRolloutClient(url, api_key, **options)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def create_session(self, group: str | None = None, metadata: dict[str, Any] | None = None) -> Session:
        return self._run(self._client.create_session(group, metadata))

    def turn(
        self, session_id: str, input_ids: list[int], sampling_params: dict[str, Any] | None = None, **kw: Any
    ):
        return self._run(self._client.turn(session_id, input_ids, sampling_params, **kw))

    def finish(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> Any:
        return self._run(self._client.finish(session_id, reward, metadata))

    def trajectory(self, session_id: str) -> dict[str, Any]:
        return self._run(self._client.trajectory(session_id))

    def take(self, size: int, **kw: Any) -> Batch:
        return self._run(self._client.take(size, **kw))

    def ack(self, lease_id: str) -> Any:
        return self._run(self._client.ack(lease_id))

    def upload_trainer_logprobs(self, lease_id: str, logprobs: np.ndarray) -> dict[str, Any]:
        return self._run(self._client.upload_trainer_logprobs(lease_id, logprobs))

    def publish(self, checkpoint: str, **kw: Any) -> dict[str, Any]:
        return self._run(self._client.publish(checkpoint, **kw))

    def job(self, job_id: str) -> dict[str, Any]:
        return self._run(self._client.job(job_id))

    def wait_job(self, job_id: str, **kw: Any) -> dict[str, Any]:
        return self._run(self._client.wait_job(job_id, **kw))

    def weights_status(self) -> dict[str, Any]:
        return self._run(self._client.weights_status())

    def groups(self) -> dict[str, Any]:
        return self._run(self._client.groups())

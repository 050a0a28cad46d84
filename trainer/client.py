"""The trainer kit's client of the router's rollout API, for agents and trainers:
:class:`AsyncRolloutClient` and :class:`RolloutClient` (the same calls, blocking, on a private
event loop), built on the one router client (:mod:`clients.router`: its transport, its
:class:`RouterError`, its job wait and its blocking wrapper).

Every call authenticates with a Bearer key. A 503 answer, and a 409 carrying ``Retry-After`` (a
conflict that passes: a publish job running, turns of one session racing), is retried with
exponential backoff (honouring ``Retry-After``) up to ``retries`` times, then raised; any other
4xx/5xx (a finished session's 409 among them) raises :class:`RouterError` at once, carrying the
status, the router's ``detail`` and the request. Batches are taken in the compact records encoding
and decoded by :func:`trainer.batch.decode_batch` into flat arrays. Nothing here imports the
``router`` package.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from clients.router import Blocking, RouterClient, RouterError
from core.jsonio import loads
from core.wire import LOGPROBS_MEDIA_TYPE, RECORDS_MEDIA_TYPE
from trainer.batch import Batch, decode_batch
from trainer.upload import encode_trainer_logprobs

__all__ = ["AsyncRolloutClient", "RolloutClient", "RouterError", "Session"]


@dataclass(frozen=True)
class Session:
    """An open session: its id, its group, whether its turns record routed experts, and the base
    URLs of its chat APIs (None from a router that serves none), for the official ``openai`` and
    ``anthropic`` clients."""

    session_id: str
    group: str
    record_routes: bool = False
    openai_base_url: str | None = None
    anthropic_base_url: str | None = None


class AsyncRolloutClient:
    """Calls on one router. Use as ``async with AsyncRolloutClient(url, key) as c: ...``;
    ``url`` is the router's root, ``http://`` or ``https://`` (anything else is a ``ValueError``
    naming it, here rather than at the first call);
    ``timeout_s`` bounds each HTTP call; ``retries``, ``backoff_s`` and ``max_backoff_s`` are
    :class:`clients.router.RouterClient`'s."""

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
        self.router = RouterClient(
            None, url, api_key, timeout_s, retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s
        )

    @property
    def url(self) -> str:
        return self.router.url

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.router.close()

    # sessions --------------------------------------------------------------------------
    async def create_session(
        self, group: str | None = None, metadata: dict[str, Any] | None = None, *, record_routes: bool = False
    ) -> Session:
        """Open a session (in ``group``, else where the router's policy puts it; a turn no replica
        of its group can serve moves it to another, recorded in the turn's ``moved_from``). With
        ``record_routes`` every turn stores its routed experts, served in batches
        (:meth:`trainer.batch.Batch.routes`); the router refuses it (422, :class:`RouterError`)
        for a group whose engines cannot return them."""
        body: dict[str, Any] = {"metadata": metadata or {}}
        if group is not None:
            body["group"] = group
        if record_routes:
            body["record_routes"] = True
        out = await self.router.call("POST", "/v1/sessions", body)
        return Session(
            out["session_id"],
            out["group"],
            out["record_routes"],
            out.get("openai_base_url"),
            out.get("anthropic_base_url"),
        )

    async def turn(
        self,
        session_id: str,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        min_version: int | None = None,
        max_version_age: int | None = None,
        return_support: bool = False,
    ) -> dict[str, Any]:
        """Generate the next turn; returns the router's turn object (output ids, records; each
        record's ``support_ids`` and ``support_logprobs`` only with ``return_support``). The
        request carries a fresh ``Idempotency-Key``, so when the client retries it (the router was
        unreachable, or answered 503) the router answers with the turn it recorded, if it did,
        instead of sampling a second one."""
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_params or {}}
        if min_version is not None:
            body["min_version"] = min_version
        if max_version_age is not None:
            body["max_version_age"] = max_version_age
        if return_support:
            body["return_support"] = True
        key = {"Idempotency-Key": uuid.uuid4().hex}
        return await self.router.call("POST", f"/v1/sessions/{session_id}/turns", body, headers=key)

    async def finish(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> Any:
        return await self.router.call(
            "POST", f"/v1/sessions/{session_id}/finish", {"reward": reward, "metadata": metadata or {}}
        )

    async def trajectory(self, session_id: str) -> dict[str, Any]:
        return await self.router.call("GET", f"/v1/sessions/{session_id}/trajectory")

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
        empty batch has no lease (``lease_id`` None). The router may hold the call ``wait_s``
        seconds, which are added to its ``timeout_s``. The request carries a fresh
        ``Idempotency-Key``, kept on the client's own retries of it: when the router made the
        lease and its answer was lost (the connection cut), the retry gets that lease and its
        batch again while the lease is open, instead of a second lease (the first one's
        trajectories would come back only after the router's ``--lease-timeout``); a retry while
        the first attempt still waits on the router (its disconnect unseen) takes over from it,
        so the take ends with one lease (:mod:`router.routes_trainer`)."""
        body: dict[str, Any] = {"size": size, "wait_s": wait_s}
        if max_version_age is not None:
            body["max_version_age"] = max_version_age
        if trainer_version is not None:
            body["trainer_version"] = trainer_version
        answer = await self.router.request(
            "POST",
            "/v1/batches/take",
            body,
            accept=RECORDS_MEDIA_TYPE,
            wait_s=wait_s,
            headers={"Idempotency-Key": uuid.uuid4().hex},
        )
        if not answer.content_type.startswith(RECORDS_MEDIA_TYPE):
            raise RouterError(
                "POST",
                "/v1/batches/take",
                answer.status,
                f"expected {RECORDS_MEDIA_TYPE}, got {answer.content_type!r}",
            )
        return decode_batch(answer.content)

    async def ack(self, lease_id: str) -> dict[str, Any]:
        """Acknowledge the batch taken under ``lease_id``: the router's answer, ``acked`` and
        ``expired`` (trajectories handed out again since its lease timed out). Idempotent: when
        the client retries an ack whose answer it lost (the router unreachable, the connection
        cut), the router answers the first acknowledgement's counts with ``already_acked`` true,
        not an error; an unknown lease (never handed out, or forgotten: ``--lease-timeout`` +
        ``--retention`` after its take) raises :class:`RouterError` (404)."""
        return await self.router.call("POST", f"/v1/batches/{lease_id}/ack")

    async def release(self, lease_id: str) -> dict[str, Any]:
        """Hand the batch taken under ``lease_id`` back (a training step on it failed): its
        trajectories are ready for the next take at once instead of after the router's
        ``--lease-timeout``, and the lease is forgotten (its :meth:`ack` then raises
        :class:`RouterError`, 404). The router's answer: ``released``, how many went back.
        Idempotent: a lease released or acknowledged already, or unknown, answers ``released`` 0
        (a retry whose answer was lost is no error); an acknowledged lease stays acknowledged."""
        return await self.router.call("POST", f"/v1/batches/{lease_id}/release")

    async def queue_stats(self) -> dict[str, int]:
        """The trainer queue (``GET /v1/batches/stats``): ``ready``, ``pending`` (leased, not
        acknowledged), ``held_back`` (finished trajectories the takes so far found too stale for
        their bound) and ``leases`` (open)."""
        return await self.router.call("GET", "/v1/batches/stats")

    async def upload_trainer_logprobs(
        self, lease_id: str, logprobs: np.ndarray, route_mismatch: np.ndarray | None = None
    ) -> dict[str, Any]:
        """Upload the trainer's log-prob of every token of the batch taken under ``lease_id``, in
        the batch's token order (``Batch.logprobs``' order), for the router's mismatch figures
        (with ``route_mismatch``, ``Policy.route_mismatch()`` of the batch, its route figures);
        returns the batch's figures per (group, version). Once per lease: a retry of the same
        upload whose answer was lost (the client retries one it could not read) answers the
        same figures with ``already_uploaded`` true, counted once; other log-probs for a lease
        that took an upload are a 409, raised at once (it is not transient)."""
        answer = await self.router.request(
            "POST",
            f"/v1/batches/{lease_id}/trainer_logprobs",
            encode_trainer_logprobs(logprobs, route_mismatch),
            content_type=LOGPROBS_MEDIA_TYPE,
            retry_statuses=(503,),
        )
        return loads(answer.content)

    # weights and fleet -----------------------------------------------------------------
    async def publish(
        self,
        checkpoint: str,
        *,
        version: int | None = None,
        wait_s: float = 0.0,
        on_wait: Callable[[str], None] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Start publishing a BF16 checkpoint directory (an absolute path on the router's
        machine) as ``version`` (None: the router takes the next number, under its job lock);
        returns the job, whose ``version`` is the number taken (poll with :meth:`job` or
        :meth:`wait_job`). While another weight job runs, the publish waits for it up to
        ``wait_s`` seconds, telling ``on_wait`` once (:meth:`clients.router.RouterClient.publish`);
        then, or with no ``wait_s`` after ``retries``, :class:`RouterError` (409)."""
        body = {"checkpoint": checkpoint, **fields}
        if version is not None:
            body["version"] = version
        return await self.router.publish(body, wait_s=wait_s, on_wait=on_wait)

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self.router.job(job_id)

    async def wait_job(self, job_id: str, *, poll_s: float = 0.2, timeout_s: float = 600.0) -> dict[str, Any]:
        """Poll a weights job until it is ``done`` (:meth:`clients.router.RouterClient.wait_job`);
        raises :class:`RouterError` when it failed or is still running after ``timeout_s``."""
        return await self.router.wait_job(job_id, timeout_s, poll_s=poll_s)

    async def weights_status(self) -> dict[str, Any]:
        return await self.router.status()

    async def groups(self) -> dict[str, Any]:
        return await self.router.groups()


class RolloutClient(Blocking):
    """:class:`AsyncRolloutClient`'s calls, blocking: each runs to completion on this client's
    own event loop (so it must not be called from inside a running event loop)."""

    def __init__(self, url: str, api_key: str, **options: Any) -> None:
        super().__init__(AsyncRolloutClient(url, api_key, **options))

"""A trainer hands a lease back (``POST /v1/batches/{lease_id}/release``, the kit's ``release``):
a real router (``--lease-timeout 300``) on the memory state and on a real redis-server, a real
engine, the trainer kit over HTTP. What the lease held is ready for the next take at once (each
trajectory exactly once), the released lease's ack is a 404, a repeated release, one of an
acknowledged lease and one of an unknown lease answer 0 (the acknowledged one stays
acknowledged), and a lease answered again to a retry of its take id is released too. A trainer
log-prob upload against a released lease is a 409 naming it, counting nothing; the lease that
takes its trajectories next takes the upload."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from tests.router.test_take_disconnect import _finish
from tests.support.metrics import samples_of
from tests.support.router import router_process, write_preset
from trainer.client import RolloutClient, RouterError


@contextlib.contextmanager
def _router(tmp_path, engine_url: str, store_url: str) -> Iterator[tuple[httpx.Client, RolloutClient]]:
    """A router on ``store_url`` whose leases last 300 s: an HTTP client and the kit, both keyed."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    with (
        router_process(preset, state=store_url, extra_args=("--lease-timeout", "300")) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
        RolloutClient(router.url, router.key, retries=1, backoff_s=0.01) as kit,
    ):
        yield c, kit


def test_a_released_lease_is_ready_for_the_next_take_at_once(
    tmp_path, engine_url: str, store_url: str
) -> None:
    with _router(tmp_path, engine_url, store_url) as (c, kit):
        sids = sorted(_finish(c) for _ in range(2))
        first = kit.take(4)
        assert sorted(t["session_id"] for t in first.trajectories) == sids
        assert kit.release(first.lease_id) == {"lease_id": first.lease_id, "released": 2}
        assert c.get("/v1/batches/stats").json() == {"ready": 2, "pending": 0, "held_back": 0, "leases": 0}
        again = kit.take(4)  # at once, not after the 300 s lease timeout
        assert again.lease_id not in (None, first.lease_id)
        assert sorted(t["session_id"] for t in again.trajectories) == sids  # each exactly once
        with pytest.raises(RouterError) as err:
            kit.ack(first.lease_id)  # the released lease is forgotten
        assert err.value.status == 404 and "released" in err.value.detail
        assert kit.release(first.lease_id)["released"] == 0  # a retried release: no error
        assert kit.release("0" * 32)["released"] == 0  # unknown: 0 too (module docstring of the route)
        acked = kit.ack(again.lease_id)
        assert acked["acked"] == 2
        assert kit.release(again.lease_id)["released"] == 0  # acknowledged: stays acknowledged
        assert kit.ack(again.lease_id) == {**acked, "already_acked": True}
        assert kit.take(4).lease_id is None
        with pytest.raises(RouterError) as err:
            kit.release("not a lease")
        assert err.value.status == 422

        # a lease answered again to a retry of its take id (the kit's lost answer) is its holder's
        sid = _finish(c)
        body = {"size": 1}
        taken = c.post("/v1/batches/take", json=body, headers={"Idempotency-Key": "take-9"}).json()
        retried = c.post("/v1/batches/take", json=body, headers={"Idempotency-Key": "take-9"}).json()
        assert retried["lease_id"] == taken["lease_id"] and retried["trajectories"][0]["session_id"] == sid
        assert kit.release(taken["lease_id"])["released"] == 1
        batch = kit.take(1)
        assert [t["session_id"] for t in batch.trajectories] == [sid]
        assert kit.ack(batch.lease_id)["acked"] == 1


def test_an_upload_against_a_released_lease_is_refused_and_its_next_lease_takes_it(
    tmp_path, engine_url: str, store_url: str
) -> None:
    with _router(tmp_path, engine_url, store_url) as (c, kit):
        sid = _finish(c)
        first = kit.take(4)
        assert kit.release(first.lease_id)["released"] == 1
        with pytest.raises(RouterError) as err:
            kit.upload_trainer_logprobs(first.lease_id, first.logprobs)
        assert err.value.status == 409, err.value.detail
        assert f"lease {first.lease_id!r} was released" in err.value.detail
        again = kit.take(4)
        assert [t["session_id"] for t in again.trajectories] == [sid]
        answer = kit.upload_trainer_logprobs(again.lease_id, again.logprobs)
        assert answer["tokens"] == len(again) and answer["already_uploaded"] is False
        mismatch = c.get("/v1/groups").json()["groups"][0]["mismatch"]
        assert mismatch["tokens"] == len(again)  # the released lease's upload counted nothing


def test_a_take_ids_repeat_holds_its_lease_until_released_then_the_key_takes_afresh(
    tmp_path, engine_url: str, store_url: str
) -> None:
    """The take's repeat-vs-release rule through a real router (memory and Redis): a retry of a
    take with its ``Idempotency-Key`` is answered the open lease again, the same bytes, and takes
    nothing (no other take gets its trajectory); its holder's release puts it back; the key's
    next take then takes afresh (a new lease, the same trajectory, not redelivered), repeats
    that lease while it is open, and takes afresh again once it is acknowledged. On the memory
    store a take's client cannot leave between its lease and its answer (nothing in between
    waits), so the Redis-only test of that window (test_take_disconnect) has no memory twin."""
    preset = write_preset(tmp_path / "p.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    key = {"Idempotency-Key": "take-1"}
    with (
        router_process(preset, state=store_url, extra_args=("--lease-timeout", "300")) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
    ):
        sid = _finish(c)
        first, retry = (c.post("/v1/batches/take", json={"size": 1}, headers=key) for _ in "12")
        assert first.status_code == retry.status_code == 200 and first.content == retry.content
        lease = first.json()["lease_id"]
        assert [t["session_id"] for t in first.json()["trajectories"]] == [sid]
        assert c.get("/v1/batches/stats").json() == {"ready": 0, "pending": 1, "held_back": 0, "leases": 1}
        assert c.post("/v1/batches/take", json={"size": 1}).json()["lease_id"] is None
        assert c.post(f"/v1/batches/{lease}/release").json()["released"] == 1
        afresh = c.post("/v1/batches/take", json={"size": 1}, headers=key)
        assert afresh.status_code == 200 and afresh.json()["lease_id"] not in (None, lease)
        assert [t["session_id"] for t in afresh.json()["trajectories"]] == [sid]
        counted = samples_of(c.get("/metrics").text, "mixfleet_router_")
        assert counted[("mixfleet_router_leases_total", ())] == 2  # the repeat made none
        assert counted[("mixfleet_router_trajectories_redelivered_total", ())] == 0  # released: not delivered
        assert c.post("/v1/batches/take", json={"size": 1}, headers=key).content == afresh.content
        assert c.post(f"/v1/batches/{afresh.json()['lease_id']}/ack").json()["acked"] == 1
        done = c.post("/v1/batches/take", json={"size": 1}, headers=key).json()
        assert done["lease_id"] is None and done["trajectories"] == []
        assert c.post(f"/v1/batches/{lease}/ack").status_code == 404

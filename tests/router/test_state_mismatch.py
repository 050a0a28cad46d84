"""The state port's mismatch part, against the memory adapter and a real redis-server: a lease's
trajectory order is remembered for its TTL; mismatch sums add once per lease (a repeat changes
nothing), survive a new store on the same Redis, and come back exactly as added."""

from __future__ import annotations

import asyncio

import pytest

from router.mismatch import MismatchSums
from router.state import open_store

pytestmark = pytest.mark.anyio


A = MismatchSums(tokens=3, k3=0.1 + 0.2, abs_logprob_diff=1e-5, extreme=1, out_of_band=2)
B = MismatchSums(tokens=1, k3=0.7, abs_logprob_diff=2.5, extreme=0, out_of_band=1)


async def test_lease_order_is_kept_in_take_order_for_its_ttl(store_url: str) -> None:
    store = open_store(store_url)
    try:
        await store.record_lease_order("L1", ["s3", "s1", "s2"], ttl_s=0.3)
        assert await store.lease_order("L1") == ["s3", "s1", "s2"]
        assert await store.lease_order("other") is None
        await asyncio.sleep(0.4)
        assert await store.lease_order("L1") is None
    finally:
        await store.close()


async def test_mismatch_sums_add_once_per_lease(store_url: str) -> None:
    store = open_store(store_url)
    try:
        assert await store.mismatch() == {}
        k1, k2 = ("g|x", 3, "0-63"), ("g2", 12, "1024+")  # a group name may hold the separator
        assert await store.add_mismatch("L1", {k1: A, k2: B}, ttl_s=60) is True
        assert await store.add_mismatch("L1", {k1: A}, ttl_s=60) is False  # repeat: nothing changes
        assert await store.add_mismatch("L2", {k1: A}, ttl_s=60) is True
        got = await store.mismatch()
        assert got == {k1: A + A, k2: B}
        assert got[k1].k3 == (0.1 + 0.2) + (0.1 + 0.2) and got[k1].abs_logprob_diff == 2e-5
    finally:
        await store.close()
    if store_url != "memory":  # shared state: a new router on the same Redis sees the sums
        again = open_store(store_url)
        try:
            assert await again.mismatch() == {k1: A + A, k2: B}
            assert await again.add_mismatch("L1", {k1: A}, ttl_s=60) is False
        finally:
            await again.close()


async def test_a_lease_mark_expires_with_its_ttl(store_url: str) -> None:
    store = open_store(store_url)
    try:
        key = ("g", 1, "0-63")
        assert await store.add_mismatch("L", {key: B}, ttl_s=0.2) is True
        await asyncio.sleep(0.3)
        assert await store.add_mismatch("L", {key: B}, ttl_s=0.2) is True
        assert (await store.mismatch())[key] == B + B
    finally:
        await store.close()


async def test_a_lease_mark_keeps_the_digest_of_its_upload(store_url: str) -> None:
    """The mark remembers what identified the booked upload (the route answers a byte-identical
    retry from it), for as long as the mark lives; a repeat does not replace it."""
    store = open_store(store_url)
    try:
        key = ("g", 1, "0-63")
        assert await store.mismatch_digest("L") is None
        assert await store.add_mismatch("L", {key: B}, ttl_s=0.3, digest="d1") is True
        assert await store.add_mismatch("L", {key: B}, ttl_s=0.3, digest="d2") is False
        assert await store.mismatch_digest("L") == "d1"
        await asyncio.sleep(0.4)
        assert await store.mismatch_digest("L") is None
    finally:
        await store.close()

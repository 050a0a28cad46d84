"""How long the router's state keeps what it keeps: the rules every state adapter applies, so
that nothing it stores grows with the length of a run (pure: no I/O, no clock).

The rules (the table in ``docs/architecture.md``, section *State and its bounds*, lists them
with their flags):

* an **open session** without a creation or turn for ``session_idle_s`` is abandoned
  (:meth:`~router.state.base.StateStore.expire_idle`, run by the router's poll loop); a session
  with a turn running is not idle (its router marks it active first:
  :meth:`~router.state.base.StateStore.touch_sessions`);
* a **finished session** (a trajectory: ready, held back or leased) is accepted data: it stays
  until a lease that holds it is acknowledged, however long that takes;
* an **acknowledged trajectory** stays readable ``retention_s`` after its acknowledgement;
* a **lease** is known for :meth:`Retention.lease_record_s` (``lease_timeout_s + retention_s``)
  after its take: its acknowledgement, take order and trainer log-prob upload are accepted until
  then (later: unknown, a 404); what it did not acknowledge was redelivered after
  ``lease_timeout_s``; its **mismatch mark** (one upload per lease) lives as long after the upload;
* a ``/generate`` **route key** lives ``route_key_ttl_s`` after it last moved;
* a **replica heartbeat** entry is forgotten ``replica_forget_s`` after its last heartbeat
  (static replicas are polled, so refreshed, every ``poll_interval_s``); a replica's
  **booked-until mark** :func:`mark_ttl_s` (ten heartbeat timeouts) after its last booking;
* **mismatch sums** and the **ledger per version** keep, per group, the ``keep_versions`` highest
  versions; every older version is rolled into the group's ``earlier`` total
  (:func:`versions_to_roll`), so group totals stay exact;
* the ledger's **update records**: the latest ``keep_updates``; older ones are rolled into one
  summary (their count, trajectories, tokens and the cumulative cost at the last of them, which is
  what the next record's cost is measured from);
* the **routing window** holds the latest ``router.policy.WINDOW_SIZE`` assignments and the
  **weight jobs** the latest ``router.publishing.MAX_JOBS_KEPT``; counters are per group.

Expiry by time is a Redis TTL in the Redis adapter; in the memory adapter every read checks it and
:meth:`~router.state.base.StateStore.compact` removes what expired. ``compact``, which every
router runs every ``compact_interval_s``, also rolls versions and update records up (both
adapters), forgets silent replicas and, in Redis, the ready stream's lease consumers that own
nothing and were idle for twice ``lease_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    """The configurable bounds (``RouterConfig`` fields of the same names). ValueError names a
    value out of range."""

    retention_s: float = 3600.0
    lease_timeout_s: float = 300.0
    keep_versions: int = 16
    keep_updates: int = 1000
    replica_forget_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("retention_s", "lease_timeout_s", "replica_forget_s", "keep_versions", "keep_updates"):
            value = getattr(self, name)
            if not value > 0 or (name.startswith("keep") and value != int(value)):
                kind = "a whole number >= 1" if name.startswith("keep") else "> 0"
                raise ValueError(f"{name} must be {kind}, got {value!r}")

    def lease_record_s(self) -> float:
        """How long after its take a lease is known: its acknowledgement, its take order and its
        trainer log-prob upload are accepted until then (``lease_timeout_s + retention_s``)."""
        return self.lease_timeout_s + self.retention_s


def mark_ttl_s(span_s: float) -> float:
    """How long a replica's booked-until mark is kept after its last booking: ten spans, far
    beyond any observation that could still overlap it (one that comes later books its whole
    span, as it would with the mark)."""
    return 10.0 * span_s


def versions_to_roll(versions: Iterable[int | None], keep: int) -> list[int]:
    """The versions (ascending) to roll into a group's ``earlier`` total: all but the ``keep``
    highest; None (no version reported) is never rolled."""
    known = sorted({int(v) for v in versions if v is not None})
    return known[: max(0, len(known) - keep)]

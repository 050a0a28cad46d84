"""In-process state (the embedded default): the :class:`~router.state.base.StateStore` contract
for one router process. Nothing survives a restart. Every method runs without awaiting in the
middle of a mutation, so each one is atomic with respect to the event loop. Bounds: the rules of
:mod:`router.state.retention`; an entry past its time is invisible to every read and removed by
:meth:`MemoryStore.compact`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from router.ledger import EarlierUpdates, LedgerSnapshot, LedgerTotals, UpdateRecord, charge
from router.mismatch import MismatchKey, MismatchSums
from router.state.base import (
    AckResult,
    ChatState,
    Compacted,
    GroupCounters,
    Lease,
    LeaseNotFound,
    LeaseReleased,
    RequestRecorded,
    SessionFinished,
    SessionInfo,
    SessionNotFound,
    StateStore,
    StoredTurn,
    TakenTrajectory,
    TakeTakenOver,
    TurnConflict,
    TurnRecord,
    WindowEntry,
)
from router.state.retention import Retention, mark_ttl_s, versions_to_roll


@dataclass
class _Session:
    info: SessionInfo
    turns: list[bytes] = field(default_factory=list)
    context: bytearray = field(default_factory=bytearray)
    requests: dict[str, int] = field(default_factory=dict)
    request_digests: dict[str, str] = field(default_factory=dict)
    finish_request: str | None = None
    expires_at: float | None = None
    last_active: float = field(default_factory=time.time)
    chat: tuple[int, bytes] | None = None
    deliveries: int = 0  # takes that handed the trajectory out


class MemoryStore(StateStore):
    def __init__(self, retention: Retention | None = None) -> None:
        self.retention = retention or Retention()
        self.retention_s = self.retention.retention_s
        self._sessions: dict[str, _Session] = {}
        self._ids = itertools.count(1)
        self._ready: OrderedDict[int, str] = OrderedDict()
        # entry -> (sid, lease, delivered at; None: picked by a take that has not answered yet)
        self._pending: dict[int, tuple[str, str, float | None]] = {}
        self._held: dict[str, int] = {}
        # lease -> (entries, forgotten at, answered again to a repeat of its take id: release skips it)
        self._leases: dict[str, tuple[set[int], float, bool]] = {}
        self._acked_leases: dict[str, tuple[AckResult, float]] = {}  # lease -> (its ack, forgotten at)
        self._counters: defaultdict[str, dict[str, int]] = defaultdict(
            lambda: {"active_sessions": 0, "sessions": 0, "turns": 0, "tokens": 0}
        )
        self._replicas: dict[str, dict[str, Any]] = {}
        self._latest: int | None = None
        self._window: deque[WindowEntry] = deque()
        self._window_seq = 0
        self._job_lock: tuple[str, float] | None = None  # (job id, lapses at, monotonic)
        self._jobs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._route_keys: dict[str, tuple[dict[str, Any], float]] = {}
        self._lease_orders: dict[str, tuple[list[str] | None, float]] = {}  # None: released
        # take id -> (the lease it made, its entries in order, the lease as answered, forgotten at)
        self._take_ids: dict[str, tuple[list[int], Lease, float]] = {}
        self._take_claims: dict[str, str] = {}  # take id -> the lease id of the take that holds it
        self._mismatch: dict[MismatchKey, MismatchSums] = {}
        self._mismatch_totals: dict[str, MismatchSums] = {}
        self._mismatch_leases: dict[str, tuple[float, str]] = {}  # until, digest
        self._waiters: list[asyncio.Future[None]] = []
        self._marks: dict[str, tuple[float, float]] = {}  # replica -> (booked until, forgotten at)
        self._money: defaultdict[Any, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # group | (g, v)
        self._version_tokens: defaultdict[tuple[str, int | None], int] = defaultdict(int)
        self._earlier: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
        self._updates: list[UpdateRecord] = []
        self._earlier_updates = EarlierUpdates()

    # sessions -------------------------------------------------------------------------
    def _open(self, session_id: str) -> _Session:
        s = self._live(session_id)
        if s is None:
            raise SessionNotFound(session_id)
        if s.info.status != "open":
            raise SessionFinished(session_id)
        return s

    def _live(self, session_id: str) -> _Session | None:
        s = self._sessions.get(session_id)
        if s is not None and s.expires_at is not None and s.expires_at <= time.monotonic():
            del self._sessions[session_id]
            return None
        return s

    async def create_session(
        self,
        session_id: str,
        group: str,
        metadata: dict[str, Any],
        now: float,
        *,
        record_routes: bool = False,
    ) -> None:
        known = self._sessions.get(session_id)
        if known is not None:
            info = known.info
            if (info.created_at, info.metadata, info.record_routes) == (now, metadata, record_routes):
                return
            raise ValueError(f"session {session_id} exists")
        info = SessionInfo(session_id, group, None, "open", now, dict(metadata), record_routes=record_routes)
        self._sessions[session_id] = _Session(info, last_active=now)
        c = self._counters[group]
        c["active_sessions"] += 1
        c["sessions"] += 1

    async def get_session(self, session_id: str) -> SessionInfo | None:
        s = self._live(session_id)
        return None if s is None else s.info

    async def get_session_context(
        self, session_id: str, known_turns: int | None = None
    ) -> tuple[SessionInfo, bytes | None] | None:
        s = self._live(session_id)
        if s is None:
            return None
        if s.info.status == "open":
            s.last_active = time.time()
        return s.info, None if known_turns == s.info.n_turns else bytes(s.context)

    async def get_chat_state(self, session_id: str, known_turns: int | None = None) -> ChatState | None:
        s = self._live(session_id)
        if s is None:
            return None
        turn, note = s.chat or (None, b"")
        context = None if known_turns == s.info.n_turns else bytes(s.context)
        return ChatState(s.info, context, turn, note)

    async def put_chat_note(self, session_id: str, turn: int, note: bytes) -> bool:
        s = self._live(session_id)
        if s is None or s.info.status != "open" or (s.chat is not None and s.chat[0] >= turn):
            return False
        s.chat = (turn, bytes(note))
        return True

    async def append_turn(self, session_id: str, record: TurnRecord) -> int:
        s = self._live(session_id)
        if s is None:
            raise SessionNotFound(session_id)
        known = s.requests.get(record.request_id)
        if known is not None:
            raise RequestRecorded(record.request_id, known)
        if s.info.status != "open":
            raise SessionFinished(session_id)
        index = len(s.turns)
        if record.expected_turn is not None and record.expected_turn != index:
            raise TurnConflict(index)
        s.turns.append(bytes(record.blob))
        if record.fork:
            s.context = bytearray(record.context)
        else:
            s.context += record.context
        s.requests[record.request_id] = index
        if record.request_digest:
            s.request_digests[record.request_id] = record.request_digest
        s.last_active = time.time()
        info = s.info
        group = record.group
        if group != info.group:
            self._counters[info.group]["active_sessions"] -= 1
            self._counters[group]["active_sessions"] += 1
        s.info = replace(
            info,
            group=group,
            replica=record.replica,
            n_turns=index + 1,
            tokens=info.tokens + record.tokens,
            min_version=_min(info.min_version, record.min_version),
            max_version=_max(info.max_version, record.max_version),
        )
        c = self._counters[group]
        c["turns"] += 1
        c["tokens"] += record.tokens
        for v, n in record.version_tokens.items():
            self._version_tokens[(group, int(v))] += int(n)
        return index

    async def get_turns(self, session_id: str) -> list[bytes]:
        s = self._live(session_id)
        return [] if s is None else list(s.turns)

    async def turn_for_request(self, session_id: str, request_id: str) -> StoredTurn | None:
        s = self._live(session_id)
        index = None if s is None else s.requests.get(request_id)
        if index is None:
            return None
        return StoredTurn(index, s.turns[index], s.request_digests.get(request_id, ""))

    async def finish_session(
        self, session_id: str, request_id: str, reward: float, metadata: dict[str, Any]
    ) -> int:
        s = self._live(session_id)
        if s is not None and s.finish_request == request_id:
            return s.info.n_turns
        s = self._open(session_id)
        s.info = replace(s.info, status="finished", reward=reward, finish_metadata=dict(metadata))
        s.finish_request = request_id
        s.context = bytearray()
        s.chat = None
        self._counters[s.info.group]["active_sessions"] -= 1
        self._ready[next(self._ids)] = session_id
        self._wake()
        return s.info.n_turns

    async def delete_session(self, session_id: str) -> None:
        s = self._open(session_id)
        self._counters[s.info.group]["active_sessions"] -= 1
        del self._sessions[session_id]

    async def touch_sessions(self, session_ids: Sequence[str]) -> None:
        now = time.time()
        for sid in session_ids:
            s = self._sessions.get(sid)
            if s is not None and s.info.status == "open":
                s.last_active = now

    async def expire_idle(self, idle_s: float) -> list[tuple[str, str]]:
        before = time.time() - idle_s
        out = []
        for sid, s in list(self._sessions.items()):
            if s.info.status == "open" and s.last_active < before:
                self._counters[s.info.group]["active_sessions"] -= 1
                del self._sessions[sid]
                out.append((sid, s.info.group))
        return out

    # trainer queue --------------------------------------------------------------------
    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _too_old(self, info: SessionInfo, trainer_version: int, max_age: int | None) -> bool:
        if max_age is None or info.min_version is None:
            return False
        return trainer_version - info.min_version > max_age

    async def take(
        self,
        size: int,
        *,
        trainer_version: int,
        max_version_age: int | None,
        lease_timeout_s: float,
        wait_s: float = 0.0,
        take_id: str | None = None,
    ) -> Lease:
        """Pick, and wait (up to ``wait_s``, rechecking at least every second and every lease
        timeout) while fewer than ``size`` are picked; the entries picked are pending without a
        delivery time (no other take's redelivery sees them) until the lease is made of them at
        the answer. Cancelled while it waits, it puts them back on the ready queue. A take id
        whose lease is open answers it again (:meth:`_repeat`); else this take claims it, waking
        an earlier take with it that waits, which then gives up (:meth:`_check_claim`)."""
        if take_id is not None and (again := self._repeat(take_id, lease_timeout_s)) is not None:
            return again
        lease_id = uuid.uuid4().hex
        if take_id is not None:
            self._take_claims[take_id] = lease_id
            self._wake()
        self._release_held(trainer_version, max_version_age)
        picked: dict[int, TakenTrajectory] = {}
        deadline = time.monotonic() + max(0.0, wait_s)
        try:
            while True:
                self._check_claim(take_id, lease_id)
                self._pick(lease_id, size, trainer_version, max_version_age, lease_timeout_s, picked)
                remaining = deadline - time.monotonic()
                if len(picked) >= size or remaining <= 0:
                    break
                await self._wait(min(remaining, lease_timeout_s, 1.0))
        except BaseException:
            self._give_back(picked)
            raise
        finally:
            if take_id is not None and self._take_claims.get(take_id) == lease_id:
                del self._take_claims[take_id]
        lease = self._lease(lease_id, picked, trainer_version)
        if take_id is not None and picked:
            until = time.monotonic() + self.retention.lease_record_s()
            self._take_ids[take_id] = (list(picked), lease, until)
        return lease

    def _check_claim(self, take_id: str | None, lease_id: str) -> None:
        """:class:`TakeTakenOver` when a later take holds ``take_id`` (the take ``lease_id`` claimed
        it when it started)."""
        if take_id is not None and self._take_claims.get(take_id) != lease_id:
            raise TakeTakenOver(f"a later take with take id {take_id!r} took it over")

    def _repeat(self, take_id: str, lease_timeout_s: float) -> Lease | None:
        """The lease ``take_id``'s take made, answered again, while it owns every trajectory it
        handed out and has not timed out (None: no such take, or its lease is not open); the lease
        is marked answered again, so :meth:`release` leaves it."""
        entries, lease, until = self._take_ids.get(take_id) or ([], None, 0.0)
        now = time.monotonic()
        if lease is None or until <= now or lease.lease_id not in self._leases:
            return None
        for entry in entries:
            owner = self._pending.get(entry)
            if (
                owner is None
                or owner[1] != lease.lease_id
                or owner[2] is None
                or now - owner[2] >= lease_timeout_s
            ):
                return None
        record = self._leases[lease.lease_id]
        self._leases[lease.lease_id] = (record[0], record[1], True)
        return replace(lease, repeated=True)

    def _release_held(self, trainer_version: int, max_age: int | None) -> None:
        """Held-back trajectories that this bound admits go back to the ready queue."""
        for sid, vmin in list(self._held.items()):
            if max_age is None or trainer_version - vmin <= max_age:
                del self._held[sid]
                self._ready[next(self._ids)] = sid

    def _pick(
        self,
        lease_id: str,
        size: int,
        trainer_version: int,
        max_age: int | None,
        lease_timeout_s: float,
        picked: dict[int, TakenTrajectory],
    ) -> None:
        """Add to ``picked``, up to ``size``: entries delivered at least ``lease_timeout_s`` ago
        (their old lease keeps the entry id: its late ack sees it expired), then ready ones, in
        entry order; each becomes pending under ``lease_id`` with no delivery time. Too old for
        ``max_age``: held back instead; a session gone: dropped."""
        now = time.monotonic()
        expired = [
            (self._pending, entry, sid)
            for entry, (sid, _lease, at) in sorted(self._pending.items())
            if at is not None and now - at >= lease_timeout_s
        ]
        ready = [(self._ready, entry, sid) for entry, sid in self._ready.items()]
        for queue, entry, sid in [*expired, *ready]:
            if len(picked) >= size:
                return
            del queue[entry]
            s = self._live(sid)
            if s is None:
                continue
            if self._too_old(s.info, trainer_version, max_age):
                self._held[sid] = s.info.min_version  # type: ignore[assignment]
                continue
            self._pending[entry] = (sid, lease_id, None)
            picked[entry] = TakenTrajectory(s.info, list(s.turns))

    async def _wait(self, timeout_s: float) -> None:
        """Until a finish or a give-back wakes the waiting takes, or ``timeout_s``."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await waiter

    def _lease(self, lease_id: str, picked: dict[int, TakenTrajectory], trainer_version: int) -> Lease:
        """The lease of what a take picked: delivered now (its timeout counts from here); a
        trajectory an earlier take handed out counts as redelivered."""
        now = time.monotonic()
        redelivered = 0
        for entry, t in picked.items():
            self._pending[entry] = (t.session.session_id, lease_id, now)
            s = self._sessions[t.session.session_id]
            redelivered += s.deliveries > 0
            s.deliveries += 1
        if picked:
            self._leases[lease_id] = (set(picked), now + self.retention.lease_record_s(), False)
        return Lease(
            lease_id,
            list(picked.values()),
            held_back=len(self._held),
            redelivered=redelivered,
            trainer_version=trainer_version,
        )

    def _give_back(self, picked: dict[int, TakenTrajectory]) -> None:
        """What a take that does not answer picked goes back on the ready queue (behind what is
        there), and the waiting takes are woken for it."""
        for entry, t in picked.items():
            del self._pending[entry]
            self._ready[next(self._ids)] = t.session.session_id
        if picked:
            self._wake()

    async def release(self, lease_id: str, *, by_holder: bool = False) -> int:
        record = self._leases.get(lease_id)
        if record is None or (record[2] and not by_holder):
            return 0
        del self._leases[lease_id]
        self._lease_orders[lease_id] = (None, record[1])
        mine = {}
        for entry in record[0]:
            owner = self._pending.get(entry)
            s = None if owner is None or owner[1] != lease_id else self._sessions.get(owner[0])
            if s is not None:
                s.deliveries -= 1
                mine[entry] = TakenTrajectory(s.info, [])
        self._give_back(mine)
        return len(mine)

    async def ack(self, lease_id: str) -> AckResult:
        done = self._acked_leases.get(lease_id)
        if done is not None and done[1] > time.monotonic():
            return replace(done[0], already_acked=True)
        record = self._leases.pop(lease_id, None)
        if record is None or record[1] <= time.monotonic():
            raise LeaseNotFound(lease_id)
        result = self._end_lease(lease_id, record[0])
        self._acked_leases[lease_id] = (result, record[1])
        return result

    def _end_lease(self, lease_id: str, entries: set[int]) -> AckResult:
        """Acknowledge what ``lease_id`` still owns of ``entries``; its update, if it acked any."""
        acked = expired = tokens = 0
        expires = time.monotonic() + self.retention_s
        for entry in entries:
            owner = self._pending.get(entry)
            if owner is None or owner[1] != lease_id:
                expired += 1
                continue
            del self._pending[entry]
            acked += 1
            s = self._sessions.get(owner[0])
            if s is not None:
                s.info = replace(s.info, status="consumed")
                s.expires_at = expires
                tokens += s.info.tokens
        if not acked:
            return AckResult(acked=0, expired=expired)
        cumulative = {g: m[2] for g, m in self._money.items() if isinstance(g, str)}
        seq = self._earlier_updates.through_seq + len(self._updates) + 1
        self._updates.append(UpdateRecord(seq, time.time(), acked, tokens, cumulative))
        return AckResult(acked=acked, expired=expired, update=seq)

    async def queue_stats(self) -> dict[str, int]:
        return {
            "ready": len(self._ready),
            "pending": len(self._pending),
            "held_back": len(self._held),
            "leases": len({lease for _sid, lease, _at in self._pending.values()}),
        }

    # counters, replicas, versions --------------------------------------------------------
    async def counters(self) -> dict[str, GroupCounters]:
        return {g: GroupCounters(**c) for g, c in self._counters.items()}

    async def put_replica(self, replica_id: str, data: dict[str, Any]) -> None:
        self._replicas[replica_id] = dict(data)

    async def list_replicas(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self._replicas.items()}

    async def delete_replica(self, replica_id: str) -> bool:
        return self._replicas.pop(replica_id, None) is not None

    # routing window ----------------------------------------------------------------------
    async def assign(
        self, decide: Callable[[Sequence[WindowEntry], int], WindowEntry | None], size: int
    ) -> WindowEntry | None:
        entry = decide(list(self._window)[-size:], self._window_seq)
        if entry is None:
            return None
        self._window.append(entry)
        while len(self._window) > size:
            self._window.popleft()
        self._window_seq += 1
        return entry

    async def window(self, size: int) -> list[WindowEntry]:
        return list(self._window)[-size:]

    # weight jobs ---------------------------------------------------------------------------
    def _lock_holder(self) -> str | None:
        if self._job_lock is None or self._job_lock[1] <= time.monotonic():
            self._job_lock = None
            return None
        return self._job_lock[0]

    async def acquire_job_lock(self, job_id: str, ttl_s: float) -> bool:
        if self._lock_holder() not in (None, job_id):
            return False
        self._job_lock = (job_id, time.monotonic() + ttl_s)
        return True

    async def job_lock_holder(self) -> str | None:
        return self._lock_holder()

    async def release_job_lock(self, job_id: str) -> bool:
        if self._lock_holder() != job_id:
            return False
        self._job_lock = None
        return True

    async def put_job(self, job_id: str, view: dict[str, Any], keep: int) -> None:
        self._jobs[job_id] = dict(view)
        while len(self._jobs) > keep:
            self._jobs.popitem(last=False)

    async def get_job(self, job_id: str) -> dict[str, Any] | None:
        view = self._jobs.get(job_id)
        return None if view is None else dict(view)

    async def list_jobs(self, n: int) -> list[dict[str, Any]]:
        return [dict(v) for v in list(self._jobs.values())[-n:]] if n > 0 else []

    async def get_latest_version(self) -> int | None:
        return self._latest

    async def set_latest_version(self, version: int) -> int:
        self._latest = version if self._latest is None else max(self._latest, version)
        return self._latest

    async def get_route_key(self, key: str) -> dict[str, Any] | None:
        item = self._route_keys.get(key)
        if item is None:
            return None
        if item[1] <= time.monotonic():
            del self._route_keys[key]
            return None
        return dict(item[0])

    async def set_route_key(self, key: str, value: dict[str, Any], ttl_s: float) -> None:
        self._route_keys[key] = (dict(value), time.monotonic() + ttl_s)

    # cost ledger -----------------------------------------------------------------------
    async def book_replica(
        self,
        replica_id: str,
        *,
        group: str,
        version: int | None,
        at: float,
        span_s: float,
        gpus_per_replica: int,
        price_per_gpu_hour: float,
    ) -> float:
        mark = self._marks.get(replica_id)
        until = mark[0] if mark is not None and mark[1] > time.monotonic() else None
        c = charge(until, at, span_s, gpus_per_replica, price_per_gpu_hour)
        self._marks[replica_id] = (
            c.booked_until,
            time.monotonic() + mark_ttl_s(span_s),
        )
        if c.replica_seconds > 0:
            for key in (group, (group, version)):
                m = self._money[key]
                m[0] += c.replica_seconds
                m[1] += c.gpu_seconds
                m[2] += c.cost_dollars
        return c.replica_seconds

    async def ledger_totals(self) -> dict[str, LedgerTotals]:
        groups = {g for g in self._money if isinstance(g, str)} | set(self._counters)
        out = {}
        for g in sorted(groups):
            m = self._money.get(g, (0.0, 0.0, 0.0))
            c = self._counters.get(g, {})
            out[g] = LedgerTotals(m[0], m[1], m[2], c.get("tokens", 0), c.get("sessions", 0))
        return out

    async def ledger(self) -> LedgerSnapshot:
        keys = {k for k in self._money if isinstance(k, tuple)} | set(self._version_tokens)
        versions = {}
        for k in keys:
            m = self._money.get(k, (0.0, 0.0, 0.0))
            versions[k] = LedgerTotals(m[0], m[1], m[2], self._version_tokens.get(k, 0))
        earlier = {g: LedgerTotals(e[0], e[1], e[2], int(e[3])) for g, e in self._earlier.items()}
        return LedgerSnapshot(
            await self.ledger_totals(), versions, list(self._updates), earlier, self._earlier_updates
        )

    # mismatch ---------------------------------------------------------------------------
    async def record_lease_order(self, lease_id: str, session_ids: list[str], ttl_s: float) -> None:
        now = time.monotonic()
        held = self._lease_orders.get(lease_id)
        if held is None or held[1] <= now:
            self._lease_orders[lease_id] = (list(session_ids), now + ttl_s)

    async def lease_order(self, lease_id: str) -> list[str] | None:
        item = self._lease_orders.get(lease_id)
        if item is None or item[1] <= time.monotonic():
            return None
        if item[0] is None:
            raise LeaseReleased(lease_id)
        return list(item[0])

    async def add_mismatch(
        self, lease_id: str, sums: Mapping[MismatchKey, MismatchSums], ttl_s: float, digest: str = "-"
    ) -> bool:
        now = time.monotonic()
        await self.lease_order(lease_id)  # LeaseReleased
        if await self.mismatch_digest(lease_id) is not None:
            return False
        self._mismatch_leases[lease_id] = (now + ttl_s, digest)
        for key, part in sums.items():
            self._mismatch[key] = self._mismatch[key] + part if key in self._mismatch else part
            self._mismatch_totals[key[0]] = self._mismatch_totals.get(key[0], MismatchSums()) + part
        return True

    async def mismatch_digest(self, lease_id: str) -> str | None:
        until, digest = self._mismatch_leases.get(lease_id, (float("-inf"), None))
        return digest if until > time.monotonic() else None

    async def mismatch(self) -> dict[MismatchKey, MismatchSums]:
        return dict(self._mismatch)

    async def mismatch_totals(self) -> dict[str, MismatchSums]:
        return dict(self._mismatch_totals)

    # bounds ---------------------------------------------------------------------------
    async def compact(self, now: float | None = None) -> Compacted:
        wall = time.time() if now is None else now
        mono = time.monotonic()
        sessions = [
            sid for sid, x in self._sessions.items() if x.expires_at is not None and x.expires_at <= mono
        ]
        for sid in sessions:
            del self._sessions[sid]
        expired = 0
        for table, until in (
            (self._leases, lambda v: v[1]),
            (self._acked_leases, lambda v: v[1]),
            (self._marks, lambda v: v[1]),
            (self._route_keys, lambda v: v[1]),
            (self._lease_orders, lambda v: v[1]),
            (self._take_ids, lambda v: v[2]),
            (self._mismatch_leases, lambda v: v[0]),
        ):
            gone = [k for k, v in table.items() if until(v) <= mono]
            for k in gone:
                del table[k]
            expired += len(gone)
        stale = [
            rid
            for rid, d in self._replicas.items()
            if not d.get("static") and float(d.get("wall_seen", 0)) < wall - self.retention.replica_forget_s
        ]
        for rid in stale:
            del self._replicas[rid]
        versions = self._roll_ledger_versions() + self._roll_mismatch_versions()
        updates = max(0, len(self._updates) - self.retention.keep_updates)
        for u in self._updates[:updates]:
            self._earlier_updates = self._earlier_updates.roll(u)
        del self._updates[:updates]
        return Compacted(len(sessions), expired, versions, updates, len(stale))

    def _roll_ledger_versions(self) -> int:
        """Each group's versions beyond ``keep_versions`` into its earlier totals."""
        keys = {k for k in self._money if isinstance(k, tuple)} | set(self._version_tokens)
        rolled = 0
        for group in {g for g, _v in keys}:
            old = set(versions_to_roll((v for g, v in keys if g == group), self.retention.keep_versions))
            for key in [k for k in keys if k[0] == group and k[1] in old]:
                e = self._earlier[group]
                for i, x in enumerate(self._money.pop(key, (0.0, 0.0, 0.0))):
                    e[i] += x
                e[3] += self._version_tokens.pop(key, 0)
                rolled += 1
        return rolled

    def _roll_mismatch_versions(self) -> int:
        """Each group's mismatch versions beyond ``keep_versions`` into its version-None sums;
        returns the (group, version) entries rolled."""
        rolled = 0
        for group in {g for g, _v, _b in self._mismatch}:
            versions = (v for g, v, _b in self._mismatch if g == group)
            old = set(versions_to_roll(versions, self.retention.keep_versions))
            for key in [k for k in self._mismatch if k[0] == group and k[1] in old]:
                part = self._mismatch.pop(key)
                into = (group, None, key[2])
                self._mismatch[into] = self._mismatch[into] + part if into in self._mismatch else part
            rolled += len(old)
        return rolled

    async def footprint(self) -> dict[str, int]:
        return {
            "sessions": len(self._sessions),
            "turns": sum(len(x.turns) for x in self._sessions.values()),
            "ready": len(self._ready),
            "pending": len(self._pending),
            "held_back": len(self._held),
            "leases": len(self._leases) + len(self._acked_leases),
            "replicas": len(self._replicas),
            "window": len(self._window),
            "jobs": len(self._jobs),
            "route_keys": len(self._route_keys),
            "lease_orders": len(self._lease_orders),
            "take_ids": len(self._take_ids),
            "mismatch": len(self._mismatch),
            "mismatch_leases": len(self._mismatch_leases),
            "marks": len(self._marks),
            "ledger_versions": len(
                {k for k in self._money if isinstance(k, tuple)} | set(self._version_tokens)
            ),
            "updates": len(self._updates),
        }

    async def ping(self) -> bool:
        return True


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)

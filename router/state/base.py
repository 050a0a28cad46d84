"""The router's state port: sessions, recorded turns, the ready queue with leases, counters,
replica heartbeats, the latest published weight version, the routing window, and the weight jobs
with their lock: everything a router keeps that changes its answers, so that any router process
sharing the store can answer any request.

Adapters: :mod:`router.state.memory` (one process) and :mod:`router.state.redis` (several
routers share one Redis); :func:`router.state.open_store` picks one by URL. Both pass
``tests/router/test_state_contract.py``.

Contract, for every adapter:

* A session is ``open`` until finished; ``append_turn`` on it is atomic (the turn block, the
  session's context, its route to the serving group and replica, and the counters change
  together or not at all) and idempotent per ``request_id`` (a retried call raises
  :class:`RequestRecorded` with the first call's index and changes nothing, so no caller takes
  another call's turn for its own; :meth:`~StateStore.turn_for_request` reads what it stored,
  with the first call's ``request_digest``, for as long as the session is kept). Turn indices are
  0, 1, 2, ... in append order.
* An open session's context is the token sequence of its current segment (every turn's
  appended and output tokens since the first turn or the last fork), packed as uint32
  little-endian: a turn appends its :attr:`TurnRecord.context` to it, a fork replaces it.
  ``get_session_context`` reads the session and then its context, or not its context when the
  caller says it holds the context of the session's current ``n_turns`` (``known_turns``: a
  router process keeps the context its own last turn of a session left, and a turn at 128K
  tokens then does not read 512 KB back). Finishing or abandoning the session drops the context
  (the turn blocks hold every token).
* The chat routes keep one opaque note per open session, about one turn
  (:meth:`~StateStore.put_chat_note`: a later turn's note replaces it, never an earlier one's);
  :meth:`~StateStore.get_chat_state` reads the session, its context (unless ``known_turns``, as
  ``get_session_context``) and the note in one atomic step. Finishing or abandoning the session
  drops the note.
* ``finish_session`` atomically marks the session finished and enqueues it as ready for the
  trainer exactly once; a retried call with the same ``request_id`` is a no-op.
* The routing window holds the latest ``size`` session assignments (:class:`WindowEntry`, oldest
  first). ``assign`` reads it, lets the caller decide on exactly that window and appends the
  decision in one atomic step: no assignment by any router lands between the read a decision saw
  and its append. ``seq`` counts every assignment ever recorded.
* One weight job at a time across every router: ``acquire_job_lock`` takes the lock for a job
  unless another job holds it; the lock lapses ``ttl_s`` after its last acquire or renewal (a
  router that died mid-job frees it). Job views (``put_job``) are readable by every router; the
  latest ``keep`` stay.
* ``take`` hands out up to ``size`` ready trajectories under a fresh lease, waiting up to
  ``wait_s`` while fewer are ready. A trajectory whose oldest token is more than
  ``max_version_age`` behind ``trainer_version`` is held back (kept, counted in ``held_back``)
  instead; held-back trajectories are handed out by a later take whose bound admits them
  (``max_version_age=None`` admits all). Trajectories of a lease not acknowledged within
  ``lease_timeout_s`` of the take's answer are handed out again by a later take
  (:attr:`Lease.redelivered` counts those an earlier take handed out, whatever happened to them
  in between). What a take picks while it waits is its own until it answers: no other take,
  of any router, gets it meanwhile, and its lease's time starts at the answer. A take cancelled
  before it answers (its client gone) puts what it picked back on the ready queue at once;
  ``release`` does the same for a lease whose take answered the store but not its client,
  unless a take repeating its take id was answered that lease (below): its retry's client holds
  it, so ``release`` leaves it (the repeat marks it, in the atomic step that answers it) and it
  ends by its acknowledgement or its timeout, as any lease whose answer was sent.
  A take with a ``take_id`` (a client's retry of one take carries the same one) whose earlier
  take made a lease that is still open (not acknowledged, released or timed out: it still owns
  every trajectory it handed out) answers that lease again, ``repeated``, with the same
  trajectories in the same order, ``held_back``, ``redelivered`` and ``trainer_version``, and
  hands out nothing; otherwise it takes as without one and its lease is then the take id's (kept
  :meth:`~router.state.retention.Retention.lease_record_s`). An empty take is not kept. A take
  with a take id claims it when it starts, in one atomic step with that check: the latest take
  with a take id holds it, and only the take holding it makes a lease. An earlier take with the
  same take id still waiting (no lease yet: its client's retry came first, whatever router each
  runs on) gives up at once, puts back what it picked and raises :class:`TakeTakenOver`, so one
  logical take ends with one lease.
* ``ack`` acknowledges what the lease still owns, in one atomic step with the lease's end: of
  acknowledgements of one lease racing each other exactly one acknowledges; the others, and any
  later one while the lease is known (:meth:`~router.state.retention.Retention.lease_record_s`
  after its take), answer that one's result marked ``already_acked`` (a trainer's retry after a
  lost answer, or redis-py's retry of the script, is no error); a lease never handed out, or
  forgotten, raises :class:`LeaseNotFound`. A trajectory that a later take got (its lease timed
  out) counts as ``expired``, never as acknowledged too. Acknowledged trajectories are never
  handed out again and stay readable for ``retention_s``.
* Counters per group: ``active_sessions`` (open sessions), ``sessions``, ``turns``, ``tokens``.
* The cost ledger (rules in :mod:`router.ledger`): ``book_replica`` applies
  :func:`router.ledger.charge` to the replica's booked-until mark and adds the charge to its group
  and version in one atomic step; ``append_turn`` books ``version_tokens``; an ``ack`` that
  acknowledges anything appends its :class:`~router.ledger.UpdateRecord` in the same atomic step
  (``seq`` 1, 2, ... in acknowledgement order, cumulative costs never decreasing along it).
* Mismatch: ``add_mismatch`` adds a batch's sums once per lease (a repeated lease changes nothing);
  ``record_lease_order`` keeps a lease's trajectory order for the upload that needs it. A
  ``release`` that forgets a lease marks its order released in the same atomic step (kept as long
  as the lease record would have been): ``lease_order`` and ``add_mismatch`` of it then raise
  :class:`LeaseReleased` (its trajectories went back to the queue; their log-probs belong to the
  lease that takes them next), also an ``add_mismatch`` whose upload read the order before it.
* Bounds: everything stored is bounded or expires by the rules of
  :mod:`router.state.retention` (a :class:`~router.state.retention.Retention` given to the
  adapter); :meth:`StateStore.compact` applies the ones that are not a TTL (rolling old versions
  and update records into totals, forgetting silent replicas, and in the memory adapter dropping
  what expired) and is idempotent and safe to run from every router at once. No finished,
  unacknowledged trajectory is ever dropped.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from router.ledger import LedgerSnapshot, LedgerTotals
from router.mismatch import MismatchKey, MismatchSums

SessionStatus = Literal["open", "finished", "consumed"]


class StateError(Exception):
    """Base of the port's domain errors."""


class SessionNotFound(StateError):
    pass


class SessionFinished(StateError):
    """The session is finished (or consumed): it accepts no more turns and no second finish."""


class LeaseNotFound(StateError):
    pass


class LeaseReleased(StateError):
    """The lease was released (:meth:`StateStore.release`): what it held went back to the queue,
    so nothing may be booked against it any more."""


class TakeTakenOver(StateError):
    """A later take with this take's take id started before this one made its lease: this one
    handed out nothing (:meth:`StateStore.take`)."""


class StateUnavailable(StateError):
    """The backing store cannot be reached (after the adapter's own retries)."""


class StateNotAStore(StateUnavailable):
    """Something answers at the state URL, but not as the store (another server on that port): a
    request answers 503 as for a store that is down; ``mixfleet router`` refuses to start on it."""


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    group: str
    replica: str | None
    status: SessionStatus
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)
    n_turns: int = 0
    reward: float | None = None
    finish_metadata: dict[str, Any] = field(default_factory=dict)
    min_version: int | None = None
    max_version: int | None = None
    tokens: int = 0
    record_routes: bool = False  # its turns ask their engines for routed experts (any group's)


@dataclass(frozen=True)
class TurnRecord:
    """One turn to store (:meth:`StateStore.append_turn`): its turn block (``blob``), served by
    ``replica`` of ``group``; ``tokens`` it generated and the lowest / highest weight version of
    its spans; ``context``: the tokens it adds to the session's context (its appended input, then
    its output; uint32 little-endian), which replace the context when ``fork``; ``request_id`` the
    idempotency key and ``request_digest`` (empty: none) a digest of the request that made the
    turn, kept with it (:mod:`router.idempotency`); ``expected_turn`` (when set) the index it must
    get; ``version_tokens`` its tokens per weight version (for the ledger)."""

    request_id: str
    blob: bytes
    group: str
    replica: str | None
    tokens: int
    min_version: int | None
    max_version: int | None
    context: bytes = b""
    fork: bool = False
    expected_turn: int | None = None
    version_tokens: Mapping[int, int] = field(default_factory=dict)
    request_digest: str = ""


@dataclass(frozen=True)
class StoredTurn:
    """What :meth:`StateStore.append_turn` stored for a request id: the turn's index, its block
    and the request's digest (empty: the append gave none)."""

    index: int
    blob: bytes
    request_digest: str = ""


@dataclass(frozen=True)
class ChatState:
    """An open session as the chat routes read it (:meth:`StateStore.get_chat_state`): the
    session, its context (exactly the one its ``n_turns`` turns left; None when not read: the
    reader holds it) and the chat note kept for turn ``note_turn`` (None and empty: none kept)."""

    session: SessionInfo
    context: bytes | None
    note_turn: int | None = None
    note: bytes = b""


@dataclass(frozen=True)
class TakenTrajectory:
    session: SessionInfo
    turns: list[bytes]


@dataclass(frozen=True)
class Lease:
    """What a take handed out: ``held_back`` is the count held back after it (every take's),
    ``redelivered`` how many of ``trajectories`` an earlier take had handed out;
    ``trainer_version`` the version it was taken for; ``repeated``: this is the lease an earlier
    take with the same take id made, answered again (nothing was handed out now)."""

    lease_id: str
    trajectories: list[TakenTrajectory]
    held_back: int
    redelivered: int = 0
    trainer_version: int | None = None
    repeated: bool = False


@dataclass(frozen=True)
class AckResult:
    acked: int
    expired: int
    update: int | None = None  # the update this acknowledgement closed (None: it acked nothing)
    already_acked: bool = False  # the lease was acknowledged before: this is that result again


@dataclass(frozen=True)
class WindowEntry:
    """One session assignment in the routing window: the group it went to and the per-group
    token totals when it was made."""

    group: str
    tokens_total: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Compacted:
    """What one :meth:`StateStore.compact` removed or rolled up."""

    sessions: int = 0  # acknowledged trajectories past their retention (memory; Redis: TTL)
    expired: int = 0  # other expired entries: leases, take orders, marks, route keys (memory)
    versions: int = 0  # (group, version) entries rolled into earlier totals, ledger and mismatch
    updates: int = 0  # update records rolled up
    replicas: int = 0  # heartbeat entries forgotten


@dataclass(frozen=True)
class GroupCounters:
    active_sessions: int = 0
    sessions: int = 0
    turns: int = 0
    tokens: int = 0


class StateStore(abc.ABC):
    """Async state port. Methods raise :class:`StateUnavailable` when the store is down."""

    # sessions -------------------------------------------------------------------------
    @abc.abstractmethod
    async def create_session(
        self,
        session_id: str,
        group: str,
        metadata: dict[str, Any],
        now: float,
        *,
        record_routes: bool = False,
    ) -> None:
        """Create an open session in ``group`` (``record_routes`` kept as
        :attr:`SessionInfo.record_routes`); counts it active there. A repeated call with the same
        ``metadata``, ``now`` and ``record_routes`` (a retry) changes nothing; any other call for
        an existing ``session_id`` raises ValueError."""

    @abc.abstractmethod
    async def get_session(self, session_id: str) -> SessionInfo | None: ...

    @abc.abstractmethod
    async def get_session_context(
        self, session_id: str, known_turns: int | None = None
    ) -> tuple[SessionInfo, bytes | None] | None:
        """The session and its context (see the module docstring; empty once finished); None when
        the session is unknown. The context is None when ``known_turns`` is the session's
        ``n_turns`` (the caller holds the context those turns left: a session's context after a
        given number of turns never changes), else bytes. The context is never older than the
        session's ``n_turns``: an append that expects that index (``expected_turn``) stores
        against exactly that context or raises :class:`TurnConflict`. A turn starts with this
        read, so it marks an open session active (:meth:`expire_idle` counts from the latest of
        its last turn's start and end and :meth:`touch_sessions`)."""

    @abc.abstractmethod
    async def append_turn(self, session_id: str, record: TurnRecord) -> int:
        """Store one turn (:class:`TurnRecord`); return its index. Raises SessionNotFound /
        SessionFinished, and :class:`RequestRecorded` when the record's ``request_id`` already
        holds a turn of the session (stored by an earlier call: another router process's under
        the same idempotency key, or this very append repeated by the store client's retry after
        a lost reply); that call stored nothing and changed nothing.

        In the same atomic step the session's context takes the record's ``context`` (appended,
        or replacing it on a fork), the session's route becomes (``group``, ``replica``) (moving
        group moves its active count), and ``tokens`` and the version range are added to the
        session's and to ``group``'s counters. With ``expected_turn`` set, stores only if it
        equals the next index (else raises :class:`TurnConflict` carrying the next index, and
        nothing changes). ``version_tokens`` go to the ledger of ``group`` in the same step.
        """

    @abc.abstractmethod
    async def get_turns(self, session_id: str) -> list[bytes]: ...

    @abc.abstractmethod
    async def turn_for_request(self, session_id: str, request_id: str) -> StoredTurn | None:
        """The index, turn block and request digest that ``append_turn`` stored for ``request_id`` in
        ``session_id`` (what a retry of that request answers), whatever the session's status; None
        when that request stored nothing or the session is gone. One round trip."""

    @abc.abstractmethod
    async def get_chat_state(self, session_id: str, known_turns: int | None = None) -> ChatState | None:
        """The session, its context and its chat note, read in one atomic step (no turn lands
        between the reads); None when the session is unknown. One round trip. The context is not
        read (None) when ``known_turns`` is the session's ``n_turns``, as in
        :meth:`get_session_context`."""

    @abc.abstractmethod
    async def put_chat_note(self, session_id: str, turn: int, note: bytes) -> bool:
        """Keep ``note`` as the chat note of turn ``turn`` of an open session, unless a note of
        that turn or a later one is kept; False when it was not kept (that, or the session is
        unknown or no longer open). One round trip."""

    @abc.abstractmethod
    async def finish_session(
        self, session_id: str, request_id: str, reward: float, metadata: dict[str, Any]
    ) -> int:
        """Finish and enqueue for the trainer; its number of turns (as finished: a turn stored
        before the finish counts, none comes after). Raises SessionNotFound / SessionFinished."""

    @abc.abstractmethod
    async def delete_session(self, session_id: str) -> None:
        """Abandon an open session (not enqueued). Raises SessionNotFound / SessionFinished."""

    @abc.abstractmethod
    async def touch_sessions(self, session_ids: Sequence[str]) -> None:
        """Mark the open sessions among ``session_ids`` active now (a turn of each is running);
        an unknown, finished or abandoned one stays as it is (never re-added). One round trip."""

    @abc.abstractmethod
    async def expire_idle(self, idle_s: float) -> list[tuple[str, str]]:
        """Abandon (as :meth:`delete_session`) every open session without a creation, turn or
        :meth:`touch_sessions` in the last ``idle_s`` seconds; returns their (session id, group)."""

    # trainer queue --------------------------------------------------------------------
    @abc.abstractmethod
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
        """Up to ``size`` trajectories under a new lease (module docstring): the ready ones and
        those whose lease timed out, waiting up to ``wait_s`` for ``size``; what it picks is
        nobody else's until it answers, and its lease times out ``lease_timeout_s`` after the
        answer. Cancelled before it answers, it puts back what it picked (ready at once). An
        empty lease is not kept (its ``ack`` raises :class:`LeaseNotFound`). With ``take_id``: the
        open lease that take id made, ``repeated`` (from then on :meth:`release` leaves it); else
        the take claims the take id, and when a later take with it starts before this one makes
        its lease, this one puts back what it picked and raises :class:`TakeTakenOver`."""

    @abc.abstractmethod
    async def release(self, lease_id: str, *, by_holder: bool = False) -> int:
        """Put what the lease still owns back on the ready queue at once, as a take cancelled
        before it answers does (its handing-out is not counted: a later take's is no
        redelivery), and forget the lease (a later ``ack`` raises :class:`LeaseNotFound`): for a
        take whose answer did not reach its client. A lease that a take repeating its take id was
        answered (``repeated``, any time before this call's atomic step) is left as it is: that
        retry's client holds it; unless ``by_holder``: the lease's holder hands it back itself (a
        trainer whose step failed, ``POST /v1/batches/{lease_id}/release``), whichever answer of
        its take it read. Returns how many went back (0: an unknown, released or acknowledged
        lease, or one answered again without ``by_holder``; what a later take got after the lease
        timed out is not its own any more). An acknowledged lease stays acknowledged. A lease it
        forgets has its order marked released (module docstring: no upload books against it).
        Best effort: what it cannot put back is redelivered after the lease timeout, as any
        lease's."""

    @abc.abstractmethod
    async def ack(self, lease_id: str) -> AckResult:
        """End the lease, acknowledging the trajectories it still owns (``acked``; the others,
        handed out again since, are ``expired``) and appending its update when it acknowledged
        any, in one atomic step. Of the acknowledgements of one lease, however concurrent,
        exactly one does this; the others and any later one, while the lease is known, return
        its result with ``already_acked`` and change nothing. Raises :class:`LeaseNotFound` when
        the lease is unknown (never handed out, or forgotten)."""

    @abc.abstractmethod
    async def queue_stats(self) -> dict[str, int]:
        """``ready``, ``pending`` (leased, unacknowledged), ``held_back``, ``leases``."""

    # counters, replicas, versions --------------------------------------------------------
    @abc.abstractmethod
    async def counters(self) -> dict[str, GroupCounters]: ...

    @abc.abstractmethod
    async def put_replica(self, replica_id: str, data: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def list_replicas(self) -> dict[str, dict[str, Any]]: ...

    @abc.abstractmethod
    async def delete_replica(self, replica_id: str) -> bool: ...

    # routing window ----------------------------------------------------------------------
    @abc.abstractmethod
    async def assign(
        self, decide: Callable[[Sequence[WindowEntry], int], WindowEntry | None], size: int
    ) -> WindowEntry | None:
        """Call ``decide(window, seq)`` on the latest ``size`` assignments (oldest first) and the
        count of assignments recorded so far, and record what it returns as the newest (the oldest
        beyond ``size`` drop out); return it (None: ``decide`` declined and nothing changed).
        Atomic: when another assignment landed after the read, ``decide`` is called again on the
        new window, so ``decide`` must have no effects of its own."""

    @abc.abstractmethod
    async def window(self, size: int) -> list[WindowEntry]:
        """The latest ``size`` assignments, oldest first."""

    # weight jobs ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def acquire_job_lock(self, job_id: str, ttl_s: float) -> bool:
        """Take the one weight-job lock for ``job_id`` (or renew it when ``job_id`` holds it) for
        ``ttl_s`` seconds; False, changing nothing, while another job holds it."""

    @abc.abstractmethod
    async def job_lock_holder(self) -> str | None:
        """The job holding the lock now (None: free)."""

    @abc.abstractmethod
    async def release_job_lock(self, job_id: str) -> bool:
        """Free the lock if ``job_id`` holds it; False when it did not (nothing changes)."""

    @abc.abstractmethod
    async def put_job(self, job_id: str, view: dict[str, Any], keep: int) -> None:
        """Store ``view`` as the job's current state (replacing the last one); the ``keep`` jobs
        first put most recently stay, older ones are forgotten."""

    @abc.abstractmethod
    async def get_job(self, job_id: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def list_jobs(self, n: int) -> list[dict[str, Any]]:
        """The latest ``n`` jobs' views, oldest first."""

    @abc.abstractmethod
    async def get_latest_version(self) -> int | None: ...

    @abc.abstractmethod
    async def set_latest_version(self, version: int) -> int:
        """Raise the latest published version to ``version`` (never lowers); return the result."""

    @abc.abstractmethod
    async def get_route_key(self, key: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def set_route_key(self, key: str, value: dict[str, Any], ttl_s: float) -> None: ...

    # cost ledger -----------------------------------------------------------------------
    @abc.abstractmethod
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
        """Book an observation of ``replica_id`` at wall time ``at`` (:func:`router.ledger.charge`
        on its mark, added to ``group`` and ``version``); return the replica-seconds it added."""

    @abc.abstractmethod
    async def ledger_totals(self) -> dict[str, LedgerTotals]:
        """Per group: booked replica-, GPU-seconds and dollars, tokens and sessions (the counters')."""

    @abc.abstractmethod
    async def ledger(self) -> LedgerSnapshot:
        """The whole ledger: :meth:`ledger_totals`, per (group, version) kept and per group the
        earlier versions, the kept updates and the ones rolled up before them."""

    # mismatch (trainer log-prob uploads, sums in :mod:`router.mismatch`) ---------------
    @abc.abstractmethod
    async def record_lease_order(self, lease_id: str, session_ids: list[str], ttl_s: float) -> None:
        """Remember, for ``ttl_s`` seconds, the session ids a take handed out under ``lease_id``,
        in the order it handed them out, unless the lease's order (or :meth:`release`'s mark) is
        held already: a take's repeat records it again, in case its first answer could not."""

    @abc.abstractmethod
    async def lease_order(self, lease_id: str) -> list[str] | None:
        """The session ids of :meth:`record_lease_order` (None: unknown or forgotten). Raises
        :class:`LeaseReleased` for a lease :meth:`release` forgot."""

    @abc.abstractmethod
    async def add_mismatch(
        self, lease_id: str, sums: Mapping[MismatchKey, MismatchSums], ttl_s: float, digest: str = "-"
    ) -> bool:
        """Add ``sums`` to the accumulated mismatch sums, at most once per ``lease_id``: the
        mark (holding ``digest``, what identifies the upload) and the sums change in one atomic
        step; False (nothing changed) when the lease was booked within the last ``ttl_s``
        seconds. Raises :class:`LeaseReleased` (nothing changed) when :meth:`release` forgot the
        lease before this step."""

    @abc.abstractmethod
    async def mismatch_digest(self, lease_id: str) -> str | None:
        """The ``digest`` of the upload :meth:`add_mismatch` booked for ``lease_id`` (None: none
        booked, or its mark expired)."""

    @abc.abstractmethod
    async def mismatch(self) -> dict[MismatchKey, MismatchSums]:
        """Every accumulated (group, version, position bucket) sum; version None: the group's
        versions rolled up by :meth:`compact`."""

    @abc.abstractmethod
    async def mismatch_totals(self) -> dict[str, MismatchSums]:
        """Per group, the sum of everything :meth:`add_mismatch` added, kept apart from the sums
        of :meth:`mismatch` and never touched by :meth:`compact`: it only grows (it is what the
        ``mixfleet_mismatch_*_total`` counters export; summing :meth:`mismatch`'s floats instead
        changes in the last bits, down too, whenever versions are rolled up)."""

    # bounds ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def compact(self, now: float | None = None) -> Compacted:
        """Apply the bounds of :mod:`router.state.retention` at wall time ``now`` (default: the
        clock): roll each group's versions beyond ``keep_versions`` (ledger and mismatch) into its
        earlier totals, the update records beyond ``keep_updates`` into the earlier summary,
        forget replicas silent for ``replica_forget_s`` and drop what expired. Totals and what
        any read reports of them do not change."""

    @abc.abstractmethod
    async def footprint(self) -> dict[str, int]:
        """The size of what is stored, by kind (entries; the Redis adapter adds ``keys``, its
        database's key count, and ``used_memory`` in bytes): what the bounds keep flat."""

    @abc.abstractmethod
    async def ping(self) -> bool: ...

    def polling(self) -> contextlib.AbstractContextManager[None]:
        """The calls made inside (in this task and the tasks it starts) are a background poll's:
        repeated at the next poll when they fail, so while the adapter knows the store is down (its
        last call could not reach it) it may give up on them sooner than on a request's calls,
        whose deadline stays the same (a turn's append waits a store restart out). The memory
        store is never down: a no-op."""
        return contextlib.nullcontext()

    async def data_lost(self) -> str | None:
        """A message naming the store when it finds that it lost its data since this process's
        previous call (a Redis restarted without persistence, flushed, or failed over to an empty
        replica): every open session, finished trajectory not yet acknowledged and lease it held
        is gone, and a turn, finish or ack of one is then a 404. None otherwise, and on the first
        call. The router asks at every poll and logs the message as an error. The memory store
        loses nothing while its process runs (a restart loses everything: no later call sees it)."""
        return None

    async def durability(self) -> str | None:
        """A warning when the store is set to keep nothing across its own restart (Redis with
        neither an append-only file nor snapshots), None otherwise or when it cannot tell (a
        managed Redis that refuses ``CONFIG``). The router logs it once at start."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class TurnConflict(StateError):
    def __init__(self, next_turn: int) -> None:
        super().__init__(f"next turn is {next_turn}")
        self.next_turn = next_turn


class RequestRecorded(StateError):
    """:meth:`StateStore.append_turn` stored nothing: its request id already holds turn ``index``
    (:meth:`StateStore.turn_for_request` reads it)."""

    def __init__(self, request_id: str, index: int) -> None:
        super().__init__(f"request {request_id!r} already recorded turn {index}")
        self.request_id = request_id
        self.index = index

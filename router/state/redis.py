"""Redis state (production: several routers share one Redis).

Layout under the key prefix ``mf:`` (all values written by this module only):

* ``mf:s:<id>``   hash: group, replica (the route, set by each appended turn), status, created,
  metadata, n_turns, tokens, vmin, vmax, reward, finish_meta, finish_req, ``routes`` (``1``, only
  for a session with ``record_routes``), ``q:<request_id>`` -> turn index (idempotent appends)
  and ``h:<request_id>`` -> the request's digest (when the append gave one),
  while open ``chat_turn`` and ``chat``: the chat note and the turn it is about, and once handed
  to a trainer ``delivered``: how many takes handed it out (more than one: redelivered)
* ``mf:s:<id>:t`` list of turn blocks (:mod:`router.records`), one element per turn
* ``mf:s:<id>:c`` string: the open session's context (uint32 little-endian token ids), extended
  with ``APPEND`` by each turn, replaced by a fork, deleted when the session finishes or goes
* ``mf:ready``    stream of finished sessions (field ``sid``), consumer group ``trainers``;
  each take is a consumer (named by its lease id), so what it picked and, once it answered, its
  lease's entries are the group's pending entries and survive a router restart. A take claims
  (``XCLAIM``, script :data:`_CLAIM`) entries idle for the lease timeout whose consumer is not a
  take in progress (``mf:taking``), then reads new ones (``XREADGROUP``); its answer resets its
  entries' idle time (its lease's time starts then, script :data:`_LEASE`); a take that does not
  answer re-adds what it holds to the stream (script :data:`_GIVE_BACK`); an acknowledgement
  ``XACK`` + ``XDEL``s what is still pending under its consumer (script :data:`_ACK`)
* ``mf:taking`` sorted set: the takes in progress (lease id, scored by when its mark lapses in
  Redis's clock, ms): renewed at each claim, removed by the answer; one left by a router that
  died mid-take lapses ``outage_s`` + 1 s after its last renewal (removed by the next claim), and
  its entries are then claimed like any lease's
* ``mf:lease:<id>`` hash: entry id -> session id, for acknowledgement, and ``!again`` once a
  repeat of its take id was answered it (:data:`_REPEAT_OR_CLAIM`; a release then leaves it);
  once acknowledged only ``!acked`` -> ``acked,expired,update`` (what a repeated
  acknowledgement answers) and ``!again`` if it was there; expires
  :meth:`~router.state.retention.Retention.lease_record_s` after the take
* ``mf:held``     sorted set: held-back session ids scored by their oldest token version
* ``mf:stats``    hash: ``active:<g>``, ``sessions:<g>``, ``turns:<g>``, ``tokens:<g>``
* ``mf:replicas`` hash: replica id -> JSON heartbeat; ``mf:latest``; ``mf:rk:<key>`` route keys
* ``mf:window`` list of the routing window's assignments (JSON ``[seq, group, {group: tokens}]``,
  oldest first, trimmed to the window size; ``seq`` numbers every assignment ever recorded); an
  assignment ``WATCH``es it, reads it with one ``LRANGE``, decides on what it read and appends in
  ``MULTI`` (redis-py's ``transaction`` reruns the decision when another router appended first;
  one process's assignments go one at a time, so only other processes' can conflict)
* ``mf:joblock`` the weight-job lock (value: the job id, ``PX`` its lapse); ``mf:jobs`` hash
  job id -> JSON view and ``mf:jobs:order`` list of job ids in first-put order
* ``mf:epoch`` a random id, set by the first router that finds it missing (script :data:`_EPOCH`),
  never expiring: a router that finds another id than it saw before knows Redis lost its data
  (:meth:`RedisStore.data_lost`)
* ``mf:activity`` sorted set: open session ids scored by their last activity (wall clock)
* the cost ledger (:mod:`router.ledger`): ``mf:ledger`` hash ``rs:<g>``, ``gs:<g>``, ``usd:<g>``
  (replica-, GPU-seconds and dollars per group); ``mf:ledger:v`` hash ``rs|gs|usd|tok:<g>:<v>``
  per group and version (``-``: none reported); ``mf:ledger:e`` hash ``rs|gs|usd|tok:<g>``, the
  group's earlier versions rolled up; ``mf:mark:<replica>`` the replica's booked-until
  time (expires :func:`~router.state.retention.mark_ttl_s` after its last booking);
  ``mf:updates`` list of JSON update records in acknowledgement order (the latest
  ``keep_updates``); ``mf:updates:e`` hash of the ones rolled up: ``n``, ``seq`` (the last one's),
  ``at``, ``trajectories``, ``tokens``, ``cost`` (JSON: the last one's cumulative cost per group)
* ``mf:mismatch`` hash: ``<stat>|<version>|<bucket>|<group>`` -> summed value
  (:class:`router.mismatch.MismatchSums`; version ``-``: the group's versions rolled up);
  ``mf:mismatch:t`` hash: ``<stat>|<group>`` -> everything added for the group, never rolled
  (what the ``mixfleet_mismatch_*_total`` counters export);
  ``mf:mml:<lease>`` marks a lease booked (TTL);
  ``mf:lorder:<lease>`` JSON list of a lease's session ids in take order (TTL), ``released``
  once a release forgot the lease (:data:`_GIVE_BACK`; the lease record's TTL);
  ``mf:takeid:<take id>`` ``claim:<lease id>`` while the take holding the take id (the latest
  to start with it, script :data:`_REPEAT_OR_CLAIM`) has made no lease, then JSON of the lease it
  made (its id, its entries and sessions in order, ``held_back``, ``redelivered``,
  ``trainer_version``; written by :data:`_LEASE` with the lease, only while the take holds the
  take id; TTL: the lease record's)

Every call goes through one redis-py asyncio client (replies parsed by hiredis when it is
installed). Each operation is one round trip where its reads and writes allow: a mutation is one
Lua script (atomic, and idempotent where the contract says so, so redis-py's automatic retry
after a dropped connection, e.g. a Redis restart, cannot apply a turn or a finish twice); a
session read is one ``HMGET``; reads of several keys go out as one pipeline. Connection drops are
retried with backoff for ``outage_s`` seconds; after that a call raises
:class:`~router.state.base.StateUnavailable`. Once a call found Redis unreachable (until a call
reaches it), a background poll's calls (:meth:`RedisStore.polling`) give up after ``poll_s``
instead, so the router's poll goes on (its replica health checks included) every
``poll_interval_s`` rather than every ``outage_s`` per call; a request's calls keep ``outage_s``.
A server at the URL that does not speak Redis (an HTTP server, anything answering other bytes)
raises :class:`~router.state.base.StateNotAStore`, naming the URL, at once (redis-py does not
retry a reply it cannot parse).

Bounds (:mod:`router.state.retention`): what expires by time carries a TTL (acknowledged
sessions, leases, take orders, mismatch marks, route keys, booked-until marks);
:meth:`RedisStore.compact` rolls versions and update records up with scripts (atomic, so routers
compacting at once, or writing meanwhile, neither lose nor double a sum), forgets silent replicas
and lease consumers that own nothing (``XGROUP DELCONSUMER``); a lapsed mark of a take in
progress (``mf:taking``) is removed by the next take's claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core import jsonio
from core.tasks import raise_if_cancelled
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
    StateNotAStore,
    StateStore,
    StateUnavailable,
    StoredTurn,
    TakenTrajectory,
    TakeTakenOver,
    TurnConflict,
    TurnRecord,
    WindowEntry,
)
from router.state.retention import Retention, mark_ttl_s, versions_to_roll

P = "mf:"
STREAM = P + "ready"
GROUP = "trainers"
HELD = P + "held"
STATS = P + "stats"
REPLICAS = P + "replicas"
LATEST = P + "latest"
ACTIVITY = P + "activity"
EPOCH = P + "epoch"
RELEASED = b"released"
"""A released lease's order (``mf:lorder:<lease>``, set by :data:`_GIVE_BACK`)."""
LEDGER = P + "ledger"
LEDGER_V = P + "ledger:v"
LEDGER_E = P + "ledger:e"
UPDATES = P + "updates"
UPDATES_E = P + "updates:e"
MISMATCH = P + "mismatch"
MISMATCH_TOTALS = P + "mismatch:t"
WINDOW = P + "window"
JOB_LOCK = P + "joblock"
JOBS = P + "jobs"
JOB_ORDER = P + "jobs:order"
TAKING = P + "taking"
_TAKING_MARK_S = 1.0  # a take picking renews its mark this often at least; a mark lasts this + outage_s
_PUT_BACK_S = 5.0  # how long a take that does not answer tries to put back what it picked
_MISMATCH_STATS = tuple(f.name for f in dataclasses.fields(MismatchSums))
_MISMATCH_FLOATS = ("k3", "abs_logprob_diff")

_ADD = """
-- add x to a hash field: kind 'f' as a double written back with 17 significant digits (exact
-- round trip; HINCRBYFLOAT keeps 17 decimal places, so it turns 3e-19 into 0 and 1.2345678e-13
-- into 1.2346e-13), else as an integer (HINCRBY)
local function add(key, field, x, kind)
  if kind == 'f' then
    local v = tonumber(redis.call('HGET', key, field) or '0') + tonumber(x)
    redis.call('HSET', key, field, string.format('%.17g', v))
  else
    redis.call('HINCRBY', key, field, x)
  end
end
"""

_ADD_MISMATCH = (
    _ADD
    + """
-- KEYS: the sums, the lease's mark, the group totals, the lease's order; ARGV: the mark's TTL
-- (ms), the upload's digest (the mark's value), then per sum its field (stat|version|bucket|group),
-- value and kind (f: float). Returns 1 (added), 0 (booked before), -1 (the lease was released)
if redis.call('GET', KEYS[4]) == 'released' then return -1 end
if not redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[1]) then return 0 end
for i = 3, #ARGV, 3 do
  local stat, group = string.match(ARGV[i], '^([^|]*)|[^|]*|[^|]*|(.*)$')
  add(KEYS[1], ARGV[i], ARGV[i + 1], ARGV[i + 2])
  add(KEYS[3], stat .. '|' .. group, ARGV[i + 1], ARGV[i + 2])
end
return 1
"""
)

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local h = redis.call('HMGET', KEYS[1], 'created', 'metadata', 'routes')
  if h[1] == ARGV[2] and h[2] == ARGV[3] and (h[3] or '0') == ARGV[5] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], 'group', ARGV[1], 'status', 'open', 'created', ARGV[2],
           'metadata', ARGV[3], 'n_turns', 0, 'tokens', 0)
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'routes', 1) end
redis.call('HINCRBY', KEYS[2], 'active:' .. ARGV[1], 1)
redis.call('HINCRBY', KEYS[2], 'sessions:' .. ARGV[1], 1)
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[4])
return 1
"""

_TURN_FOR_REQUEST = """
local idx = redis.call('HGET', KEYS[1], 'q:' .. ARGV[1])
if not idx then return false end
return {tonumber(idx), redis.call('LINDEX', KEYS[2], idx), redis.call('HGET', KEYS[1], 'h:' .. ARGV[1]) or ''}
"""

_APPEND = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {-1, 0} end
local prev = redis.call('HGET', h, 'q:' .. ARGV[1])
if prev then return {1, tonumber(prev)} end
if redis.call('HGET', h, 'status') ~= 'open' then return {-2, 0} end
local idx = redis.call('LLEN', KEYS[2])
if ARGV[7] ~= '' and tonumber(ARGV[7]) ~= idx then return {-3, idx} end
local old = redis.call('HGET', h, 'group')
if old ~= ARGV[3] then
  redis.call('HINCRBY', KEYS[3], 'active:' .. old, -1)
  redis.call('HINCRBY', KEYS[3], 'active:' .. ARGV[3], 1)
end
redis.call('RPUSH', KEYS[2], ARGV[2])
if ARGV[13] == '1' then
  redis.call('SET', KEYS[6], ARGV[12])
elseif ARGV[12] ~= '' then
  redis.call('APPEND', KEYS[6], ARGV[12])
end
redis.call('HSET', h, 'q:' .. ARGV[1], idx, 'n_turns', idx + 1, 'group', ARGV[3], 'replica', ARGV[10])
if ARGV[14] ~= '' then redis.call('HSET', h, 'h:' .. ARGV[1], ARGV[14]) end
redis.call('HINCRBY', h, 'tokens', ARGV[4])
if ARGV[5] ~= '' then
  local cur = redis.call('HGET', h, 'vmin')
  if (not cur) or tonumber(ARGV[5]) < tonumber(cur) then redis.call('HSET', h, 'vmin', ARGV[5]) end
end
if ARGV[6] ~= '' then
  local cur = redis.call('HGET', h, 'vmax')
  if (not cur) or tonumber(ARGV[6]) > tonumber(cur) then redis.call('HSET', h, 'vmax', ARGV[6]) end
end
redis.call('HINCRBY', KEYS[3], 'turns:' .. ARGV[3], 1)
redis.call('HINCRBY', KEYS[3], 'tokens:' .. ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[8], ARGV[9])
for v, n in string.gmatch(ARGV[11], '(%d+):(%d+)') do
  redis.call('HINCRBY', KEYS[5], 'tok:' .. ARGV[3] .. ':' .. v, n)
end
return {0, idx}
"""

_FINISH = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return -1 end
local n = tonumber(redis.call('HGET', h, 'n_turns') or '0')
if redis.call('HGET', h, 'finish_req') == ARGV[1] then return n end
if redis.call('HGET', h, 'status') ~= 'open' then return -2 end
redis.call('HSET', h, 'status', 'finished', 'reward', ARGV[2], 'finish_meta', ARGV[3], 'finish_req', ARGV[1])
redis.call('HDEL', h, 'chat_turn', 'chat')
redis.call('DEL', KEYS[5])
redis.call('HINCRBY', KEYS[2], 'active:' .. redis.call('HGET', h, 'group'), -1)
if redis.call('EXISTS', KEYS[3]) == 0 then  -- a Redis that lost its data: the queue with its group
  redis.call('XGROUP', 'CREATE', KEYS[3], ARGV[5], '0', 'MKSTREAM')
end
redis.call('XADD', KEYS[3], '*', 'sid', ARGV[4])
redis.call('ZREM', KEYS[4], ARGV[4])
return n
"""

_CONTEXT = """
local v = redis.call('HMGET', KEYS[1], unpack(ARGV, 4))
if redis.call('HGET', KEYS[1], 'status') == 'open' then
  redis.call('ZADD', KEYS[3], 'XX', ARGV[2], ARGV[3])
end
local n = redis.call('HGET', KEYS[1], 'n_turns') or '0'
if ARGV[1] ~= '' and tonumber(n) == tonumber(ARGV[1]) then return {v, false} end
return {v, redis.call('GET', KEYS[2])}
"""

_CHAT_STATE = """
local v = redis.call('HMGET', KEYS[1], unpack(ARGV, 2))
local n = redis.call('HGET', KEYS[1], 'n_turns') or '0'
if ARGV[1] ~= '' and tonumber(n) == tonumber(ARGV[1]) then return {v, false} end
return {v, redis.call('GET', KEYS[2])}
"""

_PUT_CHAT = """
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then return 0 end
local cur = redis.call('HGET', KEYS[1], 'chat_turn')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'chat_turn', ARGV[1], 'chat', ARGV[2])
return 1
"""

_DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then return -2 end
redis.call('HINCRBY', KEYS[3], 'active:' .. redis.call('HGET', KEYS[1], 'group'), -1)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[5])
redis.call('ZREM', KEYS[4], ARGV[1])
return 0
"""

_EXPIRE = """
local score = redis.call('ZSCORE', KEYS[4], ARGV[1])
if (not score) or tonumber(score) > tonumber(ARGV[2]) then return false end
redis.call('ZREM', KEYS[4], ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then return false end
local g = redis.call('HGET', KEYS[1], 'group')
redis.call('HINCRBY', KEYS[3], 'active:' .. g, -1)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[5])
return g
"""

_RELEASE_HELD = """
local sids = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')
for _, sid in ipairs(sids) do
  redis.call('ZREM', KEYS[1], sid)
  redis.call('XADD', KEYS[2], '*', 'sid', sid)
end
return #sids
"""

_HOLD = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('XACK', KEYS[2], ARGV[4], ARGV[1])
redis.call('XDEL', KEYS[2], ARGV[1])
return 1
"""

_CLAIM = """
-- KEYS: the stream, the set of takes in progress, the take id's record (the stream when the take
-- has no take id); ARGV: the group, this take's consumer (its lease id), the lease timeout (ms),
-- how many, how long (ms) this take's mark lasts unrenewed, whether the take has a take id ('1'
-- or ''). Returns false, claiming nothing, when a later take holds the take id (as in _LEASE)
local holder = ARGV[6] ~= '' and redis.call('GET', KEYS[3])
if holder and holder ~= 'claim:' .. ARGV[2] then return false end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[2])
local want, ids, start = tonumber(ARGV[4]), {}, '-'
while #ids < want do
  local page = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], start, '+', 100)
  for _, p in ipairs(page) do
    if #ids < want and not redis.call('ZSCORE', KEYS[2], p[2]) then ids[#ids + 1] = p[1] end
  end
  if #page < 100 then break end
  start = '(' .. page[#page][1]
end
if #ids == 0 then return {} end
return redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], unpack(ids))
"""

_LEASE = """
-- KEYS: the stream, the set of takes in progress, the lease, the held set, the take id's record
-- (the lease when the take has no take id), then per picked entry its session; ARGV: the group,
-- the lease id (the take's consumer), the lease record's TTL (ms), whether the take has a take id
-- ('1' or ''), the trainer version, then per picked entry its id and session id. Returns {-1}
-- and makes nothing when a later take holds the take id (its claim, or its lease's record, is
-- there; none: a Redis that lost it, and no later take claimed it); else {held back, deliveries per entry
-- (0: no longer the take's)}, and a take id's record becomes the lease's (cjson: the Redis Lua
-- API's JSON library, https://redis.io/docs/latest/develop/interact/programmability/lua-api/)
-- (run again with the same arguments, as redis-py's retry does, it counts no delivery twice)
if ARGV[4] ~= '' then
  local rec = redis.call('GET', KEYS[5])
  if rec and rec ~= 'claim:' .. ARGV[2]
    and not (string.sub(rec, 1, 1) == '{' and cjson.decode(rec).lease == ARGV[2]) then
    return {-1}
  end
end
redis.call('ZREM', KEYS[2], ARGV[2])
local kept, seen, entries, again = {}, {}, {}, 0
for i = 6, #ARGV, 2 do
  local n = 0
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    local s = KEYS[6 + (i - 6) / 2]
    kept[#kept + 1] = ARGV[i]
    entries[#entries + 1] = {ARGV[i], ARGV[i + 1]}
    if redis.call('HSETNX', KEYS[3], ARGV[i], ARGV[i + 1]) == 1 and redis.call('EXISTS', s) == 1 then
      redis.call('HINCRBY', s, 'delivered', 1)
    end
    n = tonumber(redis.call('HGET', s, 'delivered') or '1')
    if n > 1 then again = again + 1 end
  end
  seen[#seen + 1] = n
end
local held = redis.call('ZCARD', KEYS[4])
if #kept > 0 then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  kept[#kept + 1] = 'JUSTID'
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(kept))
elseif #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
if ARGV[4] ~= '' and #entries > 0 then
  local rec = {lease = ARGV[2], entries = entries, held_back = held, redelivered = again,
    trainer_version = ARGV[5]}
  redis.call('SET', KEYS[5], cjson.encode(rec), 'PX', ARGV[3])
elseif ARGV[4] ~= '' then
  redis.call('DEL', KEYS[5])
end
return {held, seen}
"""

_REPEAT_OR_CLAIM = """
-- KEYS: the take id's record, its lease (the record when it names none), the stream, then per
-- entry of its lease that entry's session and turns; ARGV: the group, the record as the caller
-- read it ('' for none), this take's claim ('claim:<its lease id>'), the lease timeout (ms), the
-- record's TTL (ms), the record's lease id ('' for none), how many session fields, the fields,
-- then the lease's entry ids. Returns false when the record changed since the caller read it;
-- {1, {session fields, turns} per entry} when the record's lease is open (its lease hash holds
-- it unacknowledged, each entry pending under it, none idle for the lease timeout, each session
-- kept), marking the lease answered again ('!again' in its hash: _GIVE_BACK then leaves it);
-- else {0}, and this take holds the take id from now on
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[2] then return false end
local nf = tonumber(ARGV[7])
local fields = {}
for i = 8, 7 + nf do fields[#fields + 1] = ARGV[i] end
local first = 8 + nf
local open = ARGV[6] ~= '' and redis.call('EXISTS', KEYS[2]) == 1
  and redis.call('HEXISTS', KEYS[2], '!acked') == 0
local out = {}
if open then
  for i = first, #ARGV do
    local k = 4 + 2 * (i - first)
    local p = redis.call('XPENDING', KEYS[3], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[6])
    if #p ~= 1 or tonumber(p[1][3]) >= tonumber(ARGV[4]) or redis.call('EXISTS', KEYS[k]) == 0 then
      open = false
      break
    end
    out[#out + 1] = {redis.call('HMGET', KEYS[k], unpack(fields)), redis.call('LRANGE', KEYS[k + 1], 0, -1)}
  end
end
if open then
  redis.call('HSET', KEYS[2], '!again', '1')
  return {1, out}
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[5])
return {0}
"""

_GIVE_BACK = """
-- KEYS: the stream, the set of takes in progress, the lease, the lease's order, then per picked
-- entry its session; ARGV: the group, the take's consumer (its lease id), '1' when the lease's
-- holder releases it (else ''), then the picked entry ids. A delivery is taken back only of an entry
-- the lease still holds (pending under its consumer: not one a later take claimed once the lease
-- timed out, whose delivery stands). Returns how many went back: 0, changing
-- nothing else, for an acknowledged lease ('!acked', _ACK) and, unless its holder releases it,
-- for a lease a repeat of its take id was answered ('!again', _REPEAT_OR_CLAIM): its retry's
-- client holds it. A lease it forgets has its order marked 'released' for the lease record's TTL
-- (_ADD_MISMATCH then books nothing against it)
redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('HEXISTS', KEYS[3], '!acked') == 1 then return 0 end
if ARGV[3] ~= '1' and redis.call('HEXISTS', KEYS[3], '!again') == 1 then return 0 end
local leased = redis.call('HGETALL', KEYS[3])
if #leased > 0 then
  local mine = {}
  for i = 1, #leased, 2 do mine[leased[i]] = true end
  for i = 4, #ARGV do
    if mine[ARGV[i]] and redis.call('EXISTS', KEYS[i + 1]) == 1
      and #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
      redis.call('HINCRBY', KEYS[i + 1], 'delivered', -1)
    end
  end
  local ttl = redis.call('PTTL', KEYS[3])
  redis.call('DEL', KEYS[3])
  if ttl > 0 then redis.call('SET', KEYS[4], 'released', 'PX', ttl) end
end
local n, page = 0, nil
repeat
  page = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 100, ARGV[2])
  for _, p in ipairs(page) do
    local e = redis.call('XRANGE', KEYS[1], p[1], p[1])
    redis.call('XACK', KEYS[1], ARGV[1], p[1])
    redis.call('XDEL', KEYS[1], p[1])
    if #e == 1 then
      redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
      n = n + 1
    end
  end
until #page < 100
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return n
"""

_ACK = """
-- KEYS: the lease, the stream, the ledger, the updates, the rolled-up updates, then per lease entry
-- its session and its turns; ARGV: the group, the lease id, the retention (ms), the wall time,
-- then the lease's entry ids. Returns {acked, expired, update, 0}, or for a lease acknowledged
-- before (another acknowledgement, or this one's retry by redis-py) {-1, 'acked,expired,update'};
-- false: no such lease. The lease ends as its result: the entries go, '!acked' stays (and the
-- key's TTL with it: set before the entries go, so the hash is never empty)
local before = redis.call('HGET', KEYS[1], '!acked')
if before then return {-1, before} end
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local acked, expired, tokens = 0, 0, 0
for i = 5, #ARGV do
  local s, t = KEYS[2 * i - 4], KEYS[2 * i - 3]
  if #redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    redis.call('XACK', KEYS[2], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[2], ARGV[i])
    if redis.call('EXISTS', s) == 1 then
      redis.call('HSET', s, 'status', 'consumed')
      redis.call('PEXPIRE', s, ARGV[3])
      redis.call('PEXPIRE', t, ARGV[3])
      tokens = tokens + tonumber(redis.call('HGET', s, 'tokens') or '0')
    end
    acked = acked + 1
  else
    expired = expired + 1
  end
end
-- a consumer is deleted only when it holds nothing: DELCONSUMER drops its pending entries for
-- good, and one the lease does not name (a read whose reply was lost) is claimed after the timeout
if #redis.call('XPENDING', KEYS[2], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[2], ARGV[1], ARGV[2])
end
local seq = 0
if acked > 0 then
  local raw = redis.call('HGETALL', KEYS[3])
  local cost = {}
  for i = 1, #raw, 2 do
    local g = string.match(raw[i], '^usd:(.+)$')
    if g then cost[g] = raw[i + 1] end
  end
  seq = tonumber(redis.call('HGET', KEYS[5], 'seq') or '0') + redis.call('LLEN', KEYS[4]) + 1
  redis.call('RPUSH', KEYS[4], cjson.encode({seq = seq, at = ARGV[4], trajectories = acked,
                                              tokens = tokens, cost = cost}))
end
redis.call('HSET', KEYS[1], '!acked', acked .. ',' .. expired .. ',' .. seq)
for i = 5, #ARGV do redis.call('HDEL', KEYS[1], ARGV[i]) end
return {acked, expired, seq, 0}
"""

_ROLL_UPDATES = """
local n = 0
while redis.call('LLEN', KEYS[1]) > tonumber(ARGV[1]) do
  local u = cjson.decode(redis.call('LPOP', KEYS[1]))
  redis.call('HINCRBY', KEYS[2], 'n', 1)
  redis.call('HINCRBY', KEYS[2], 'trajectories', u.trajectories)
  redis.call('HINCRBY', KEYS[2], 'tokens', u.tokens)
  redis.call('HSET', KEYS[2], 'seq', u.seq, 'at', u.at, 'cost', cjson.encode(u.cost))
  n = n + 1
end
return n
"""

_MOVE_FIELDS = (
    _ADD
    + """
local n = 0
for i = 1, #ARGV, 3 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    add(KEYS[2], ARGV[i + 1], v, ARGV[i + 2])
    redis.call('HDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
"""
)

_FORGET_REPLICAS = """
local n = 0
for i = 1, #ARGV - 1 do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if raw then
    local d = cjson.decode(raw)
    if (not d.static) and tonumber(d.wall_seen or 0) < tonumber(ARGV[#ARGV]) then
      redis.call('HDEL', KEYS[1], ARGV[i])
      n = n + 1
    end
  end
end
return n
"""

_ACQUIRE_JOB_LOCK = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

_RELEASE_JOB_LOCK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

_PUT_JOB = """
local new = redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if new then redis.call('RPUSH', KEYS[2], ARGV[1]) end
while redis.call('LLEN', KEYS[2]) > tonumber(ARGV[3]) do
  redis.call('HDEL', KEYS[1], redis.call('LPOP', KEYS[2]))
end
return 1
"""

_EPOCH = """
local v = redis.call('GET', KEYS[1])
if v then return v end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""

_SET_LATEST = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or tonumber(ARGV[1]) > tonumber(cur) then
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return tonumber(cur)
"""

_FIELDS = (
    "group",
    "replica",
    "status",
    "created",
    "metadata",
    "n_turns",
    "tokens",
    "vmin",
    "vmax",
    "reward",
    "finish_meta",
    "routes",
)
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)

_REDIS_PY = os.path.dirname(redis.__file__) + os.sep  # redis-py's own files
_HANDSHAKE = frozenset({"on_connect", "on_connect_check_health"})
"""redis-py 8.2's connection handshake (``redis/asyncio/connection.py``
``AbstractConnection.on_connect_check_health``, 1281-1340): it sends ``HELLO 3`` and reads the
reply as a map (``self.handshake_metadata.get(b"proto")``, 1334-1337), so a server that answers it
with another well-formed reply (``+OK``, a bulk string, an array) raises AttributeError there."""


def not_redis(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py failing to read a server that does not speak Redis: its
    parsers' protocol error (``redis.exceptions.InvalidResponse``, 8.2: ``redis/_parsers/hiredis.py``
    144 and 324 map hiredis' ``protocolError`` to it, ``resp2.py`` 71 and 135 and ``resp3.py`` 173
    and 306 raise it for an unknown reply type byte, ``_parsers/base.py`` 70-81 for a malformed
    number), or a reply of the wrong type to the connection's handshake (:data:`_HANDSHAKE`);
    nothing this module's own code raises."""
    if isinstance(exc, InvalidResponse):
        return True
    if not isinstance(exc, (AttributeError, TypeError, ValueError, IndexError, KeyError)):
        return False
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in _HANDSHAKE and code.co_filename.startswith(_REDIS_PY):
            return True
        tb = tb.tb_next
    return False


def display_url(url: str) -> str:
    """``url`` without its password (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _skey(sid: str) -> str:
    return f"{P}s:{sid}"


def _ckey(sid: str) -> str:
    return f"{P}s:{sid}:c"


def _tkey(sid: str) -> str:
    return f"{P}s:{sid}:t"


def _lease_key(lease_id: str) -> str:
    return f"{P}lease:{lease_id}"


def _order_key(lease_id: str) -> str:
    """The lease's take order (:meth:`RedisStore.record_lease_order`), or :data:`RELEASED`."""
    return f"{P}lorder:{lease_id}"


def _take_id_key(take_id: str) -> str:
    return f"{P}takeid:{take_id}"


_CLAIMED = "claim:"  # a take id's record while the take holding it has made no lease: claim:<its lease id>


ACKED = "!acked"  # the field of an acknowledged lease's record (not a stream entry id)
AGAIN = "!again"  # the field of a lease answered again to a repeat of its take id (not an entry id)


def _acked_before(value: str) -> AckResult:
    """The result of an acknowledged lease, as its record keeps it (``acked,expired,update``)."""
    acked, expired, seq = (int(x) for x in value.split(","))
    return AckResult(acked=acked, expired=expired, update=seq or None, already_acked=True)


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields as a script returns them (``[field, value, ...]``)."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _opt(v: int | None) -> str:
    return "" if v is None else str(int(v))


def _retries(outage_s: float, backoff: ExponentialBackoff) -> int:
    """The number of retries whose backoff sleeps add up to ``outage_s`` (at least one)."""
    n, total = 0, 0.0
    while total < outage_s:
        n += 1
        total += backoff.compute(n)
    return max(1, n)


_POLLING: contextvars.ContextVar[bool] = contextvars.ContextVar("mixfleet_state_polling", default=False)
"""True inside :meth:`RedisStore.polling` (a background poll's task and the tasks it starts)."""


class RedisStore(StateStore):
    """Redis adapter. A call that cannot complete within ``outage_s`` seconds (Redis refusing
    connections, restarting or not answering, while redis-py reconnects with backoff) raises
    :class:`StateUnavailable`; a take's ``wait_s`` comes on top. A background poll's call
    (:meth:`polling`) while the store is known down (the latest call that ended could not reach
    Redis) gives up after ``poll_s`` (at most ``outage_s``). At most ``max_connections`` commands
    are in flight at once; further callers wait for a connection."""

    def __init__(
        self,
        url: str,
        *,
        retention: Retention | None = None,
        outage_s: float = 20.0,
        poll_s: float = 2.0,
        max_connections: int = 512,
    ) -> None:
        self.retention = retention or Retention()
        self.retention_s = self.retention.retention_s
        self._outage_s = outage_s
        self._poll_s = min(poll_s, outage_s)
        self._down = False  # the latest call that ended could not reach Redis
        self._where = display_url(url)
        backoff = ExponentialBackoff(cap=0.5, base=0.02)
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=10.0,
            retry=Retry(backoff, _retries(outage_s, backoff)),
            retry_on_error=[RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionError],
            socket_timeout=10.0,
            socket_connect_timeout=2.0,
        )
        self._r = aioredis.Redis.from_pool(pool)
        self._create = self._r.register_script(_CREATE)
        self._append = self._r.register_script(_APPEND)
        self._turn_for_request = self._r.register_script(_TURN_FOR_REQUEST)
        self._finish = self._r.register_script(_FINISH)
        self._delete = self._r.register_script(_DELETE)
        self._put_chat = self._r.register_script(_PUT_CHAT)
        self._context = self._r.register_script(_CONTEXT)
        self._chat_state = self._r.register_script(_CHAT_STATE)
        self._expire = self._r.register_script(_EXPIRE)
        self._release = self._r.register_script(_RELEASE_HELD)
        self._hold = self._r.register_script(_HOLD)
        self._set_latest = self._r.register_script(_SET_LATEST)
        self._epoch = self._r.register_script(_EPOCH)
        self._epoch_seen: str | None = None
        self._acquire_job_lock = self._r.register_script(_ACQUIRE_JOB_LOCK)
        self._release_job_lock = self._r.register_script(_RELEASE_JOB_LOCK)
        self._put_job = self._r.register_script(_PUT_JOB)
        self._claim = self._r.register_script(_CLAIM)
        self._lease_picked = self._r.register_script(_LEASE)
        self._repeat_take = self._r.register_script(_REPEAT_OR_CLAIM)
        self._give_back = self._r.register_script(_GIVE_BACK)
        self._ack_lease = self._r.register_script(_ACK)
        self._add_mismatch = self._r.register_script(_ADD_MISMATCH)
        self._roll_updates = self._r.register_script(_ROLL_UPDATES)
        self._move_fields = self._r.register_script(_MOVE_FIELDS)
        self._forget_replicas = self._r.register_script(_FORGET_REPLICAS)
        self._assigning = asyncio.Lock()

    @contextlib.contextmanager
    def polling(self):
        """Calls inside are a background poll's: ``poll_s`` while Redis is known down (class
        docstring)."""
        token = _POLLING.set(True)
        try:
            yield
        finally:
            _POLLING.reset(token)

    def _deadline_s(self, extra_s: float) -> float:
        """How long a call may take: ``poll_s`` for a poll's call while Redis is known down, else
        ``outage_s + extra_s``."""
        return self._poll_s if self._down and _POLLING.get() else self._outage_s + extra_s

    async def _call(self, coro_fn, *args, extra_s: float = 0.0, **kwargs):
        """``await coro_fn(*args, **kwargs)``; Redis unreachable (after redis-py's retries), no
        answer within the deadline (:meth:`_deadline_s`), or a command Redis refuses (out of
        memory, a read-only replica, a failed snapshot: ``OOM`` / ``READONLY`` / ``MISCONF`` and
        any other error reply) -> :class:`StateUnavailable` naming it; a server there that does
        not speak Redis (:func:`not_redis`) -> :class:`StateNotAStore` naming the URL. Whether it
        reached Redis sets the known-down mark."""
        deadline_s = self._deadline_s(extra_s)
        try:
            async with asyncio.timeout(deadline_s):
                out = await coro_fn(*args, **kwargs)
        except TimeoutError:  # the deadline (a subclass of OSError: caught first)
            self._down = True
            raise StateUnavailable(f"redis: unreachable or not answering for {deadline_s:g} s") from None
        except _UNAVAILABLE as exc:
            self._down = True
            raise StateUnavailable(f"redis: {exc}") from None
        except ResponseError as exc:
            self._down = False
            raise StateUnavailable(f"redis refused a command: {exc}") from None
        except Exception as exc:
            if not_redis(exc):
                raise StateNotAStore(self.not_redis_message(exc)) from None
            raise
        self._down = False
        return out

    def not_redis_message(self, exc: BaseException) -> str:
        """What :class:`StateNotAStore` says: the URL and what redis-py could not read."""
        what = str(exc) if isinstance(exc, InvalidResponse) else "its reply to HELLO is not a Redis handshake"
        return f"{self._where} does not answer as Redis (another server on that port?): {what}"

    async def _ensure_group(self) -> None:
        """The trainer queue's consumer group, created with the stream where missing: asked before
        every read of the queue, not remembered, as a Redis that lost its data (restarted without
        persistence) has neither; a finish creates them too (:data:`_FINISH`)."""
        try:
            await self._r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # sessions -------------------------------------------------------------------------
    async def create_session(
        self,
        session_id: str,
        group: str,
        metadata: dict[str, Any],
        now: float,
        *,
        record_routes: bool = False,
    ) -> None:
        created = await self._call(
            self._create,
            keys=[_skey(session_id), STATS, ACTIVITY],
            args=[group, repr(now), json.dumps(metadata), session_id, "1" if record_routes else "0"],
        )
        if not created:
            raise ValueError(f"session {session_id} exists")

    async def get_session(self, session_id: str) -> SessionInfo | None:
        return _info(session_id, await self._call(self._r.hmget, _skey(session_id), _FIELDS))

    async def get_session_context(
        self, session_id: str, known_turns: int | None = None
    ) -> tuple[SessionInfo, bytes | None] | None:
        """One script (atomic): ``HMGET``, the session's activity (``ZADD XX``: never re-adds
        one expired or finished), then ``GET`` of the context unless ``n_turns`` is ``known_turns``."""
        known = "" if known_turns is None else str(known_turns)
        values, context = await self._call(
            self._context,
            keys=[_skey(session_id), _ckey(session_id), ACTIVITY],
            args=[known, repr(time.time()), session_id, *_FIELDS],
        )
        info = _info(session_id, values)
        if info is None:
            return None
        return info, None if known_turns == info.n_turns else context or b""

    async def get_chat_state(self, session_id: str, known_turns: int | None = None) -> ChatState | None:
        """One script (atomic): ``HMGET`` (the session and its note), then ``GET`` of the context
        unless ``n_turns`` is ``known_turns``."""
        known = "" if known_turns is None else str(known_turns)
        values, context = await self._call(
            self._chat_state,
            keys=[_skey(session_id), _ckey(session_id)],
            args=[known, *_FIELDS, "chat_turn", "chat"],
        )
        info = _info(session_id, values[: len(_FIELDS)])
        if info is None:
            return None
        turn, note = values[len(_FIELDS) :]
        context = None if known_turns == info.n_turns else context or b""
        return ChatState(info, context, None if turn is None else int(turn), note or b"")

    async def put_chat_note(self, session_id: str, turn: int, note: bytes) -> bool:
        return bool(await self._call(self._put_chat, keys=[_skey(session_id)], args=[turn, note]))

    async def append_turn(self, session_id: str, record: TurnRecord) -> int:
        rc, idx = await self._call(
            self._append,
            keys=[_skey(session_id), _tkey(session_id), STATS, ACTIVITY, LEDGER_V, _ckey(session_id)],
            args=[
                record.request_id,
                record.blob,
                record.group,
                record.tokens,
                _opt(record.min_version),
                _opt(record.max_version),
                _opt(record.expected_turn),
                repr(time.time()),
                session_id,
                record.replica or "",
                ",".join(f"{int(v)}:{int(n)}" for v, n in record.version_tokens.items() if n > 0),
                record.context,
                "1" if record.fork else "0",
                record.request_digest,
            ],
        )
        if rc == -1:
            raise SessionNotFound(session_id)
        if rc == -2:
            raise SessionFinished(session_id)
        if rc == -3:
            raise TurnConflict(int(idx))
        if rc == 1:
            raise RequestRecorded(record.request_id, int(idx))
        return int(idx)

    async def get_turns(self, session_id: str) -> list[bytes]:
        return list(await self._call(self._r.lrange, _tkey(session_id), 0, -1))

    async def turn_for_request(self, session_id: str, request_id: str) -> StoredTurn | None:
        found = await self._call(
            self._turn_for_request, keys=[_skey(session_id), _tkey(session_id)], args=[request_id]
        )
        if not found or len(found) < 3 or found[1] is None:
            return None
        return StoredTurn(int(found[0]), bytes(found[1]), _s(found[2]))

    async def finish_session(
        self, session_id: str, request_id: str, reward: float, metadata: dict[str, Any]
    ) -> int:
        rc = await self._call(
            self._finish,
            keys=[_skey(session_id), STATS, STREAM, ACTIVITY, _ckey(session_id)],
            args=[request_id, repr(float(reward)), json.dumps(metadata), session_id, GROUP],
        )
        if rc == -1:
            raise SessionNotFound(session_id)
        if rc == -2:
            raise SessionFinished(session_id)
        return int(rc)

    async def delete_session(self, session_id: str) -> None:
        rc = await self._call(
            self._delete,
            keys=[_skey(session_id), _tkey(session_id), STATS, ACTIVITY, _ckey(session_id)],
            args=[session_id],
        )
        if rc == -1:
            raise SessionNotFound(session_id)
        if rc == -2:
            raise SessionFinished(session_id)

    async def touch_sessions(self, session_ids: Sequence[str]) -> None:
        """``ZADD XX`` of the activity set: only sessions in it (open) move."""
        if session_ids:
            now = time.time()
            await self._call(self._r.zadd, ACTIVITY, dict.fromkeys(session_ids, now), xx=True)

    async def expire_idle(self, idle_s: float) -> list[tuple[str, str]]:
        before = time.time() - idle_s
        sids = await self._call(self._r.zrangebyscore, ACTIVITY, "-inf", before, start=0, num=1000)
        out = []
        for raw in sids:
            sid = _s(raw)
            group = await self._call(
                self._expire,
                keys=[_skey(sid), _tkey(sid), STATS, ACTIVITY, _ckey(sid)],
                args=[sid, repr(before)],
            )
            if group is not None:
                out.append((sid, _s(group)))
        return out

    # trainer queue --------------------------------------------------------------------
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
        lease_id = uuid.uuid4().hex
        if take_id is not None and (
            again := await self._call(self._repeat_or_claim, take_id, lease_id, lease_timeout_s)
        ):
            return again
        return await self._call(
            self._take,
            lease_id,
            take_id,
            size,
            trainer_version,
            max_version_age,
            lease_timeout_s,
            wait_s,
            extra_s=max(0.0, wait_s),
        )

    async def _repeat_or_claim(self, take_id: str, lease_id: str, lease_timeout_s: float) -> Lease | None:
        """The lease ``take_id``'s take made, answered again, while it is open: not acknowledged
        or released, its consumer still owning every entry it handed out, none idle for the lease
        timeout, every session kept (None: no such take, or its lease is not open; the take
        ``lease_id`` then holds the take id). The record is read for its keys, then checked, and
        the take id claimed, in one script (:data:`_REPEAT_OR_CLAIM`; read again if it changed
        in between)."""
        key = _take_id_key(take_id)
        while True:
            raw = await self._r.get(key) or b""
            record = json.loads(raw) if raw.startswith(b"{") else {}
            owner, entries = record.get("lease", ""), record.get("entries", [])
            if entries:
                await self._ensure_group()
            reply = await self._repeat_take(
                keys=[
                    key,
                    _lease_key(owner) if owner else key,
                    STREAM,
                    *(k for _entry_id, sid in entries for k in (_skey(sid), _tkey(sid))),
                ],
                args=[
                    GROUP,
                    raw,
                    _CLAIMED + lease_id,
                    _ms(lease_timeout_s),
                    _ms(self.retention.lease_record_s()),
                    owner,
                    len(_FIELDS),
                    *_FIELDS,
                    *(entry_id for entry_id, _sid in entries),
                ],
            )
            if reply is not None:
                break
        if int(reply[0]) == 0:
            return None
        taken = [
            TakenTrajectory(_info(sid, values), list(turns))  # type: ignore[arg-type]  # kept: checked
            for (_entry_id, sid), (values, turns) in zip(entries, reply[1], strict=True)
        ]
        return Lease(
            owner,
            taken,
            held_back=int(record["held_back"]),
            redelivered=int(record["redelivered"]),
            trainer_version=int(record["trainer_version"]),
            repeated=True,
        )

    async def _take(
        self,
        lease_id: str,
        take_id: str | None,
        size: int,
        trainer_version: int,
        max_age: int | None,
        lease_timeout_s: float,
        wait_s: float,
    ) -> Lease:
        """Pick until ``size`` are picked or, once ``wait_s`` has passed, a pick comes back short
        (what is ready is all picked: a pick whose entries were held back or dropped is followed by
        another, whatever the time), then make the lease of them (:data:`_LEASE`); a take that
        does not get that far (cancelled, or ``take_id`` taken over by a later take:
        :class:`TakeTakenOver`) puts back what it picked (:meth:`_put_back`)."""
        await self._ensure_group()
        floor = "-inf" if max_age is None else str(trainer_version - max_age)
        await self._release(keys=[HELD, STREAM], args=[floor])
        deadline = time.monotonic() + max(0.0, wait_s)
        picked: dict[str, TakenTrajectory] = {}
        try:
            while len(picked) < size:
                need = size - len(picked)
                batch = await self._pick(lease_id, take_id, need, lease_timeout_s, deadline)
                await self._admit(batch, trainer_version, max_age, picked)
                raise_if_cancelled()
                if len(batch) < need and time.monotonic() >= deadline:
                    break
            lease = await self._make_lease(lease_id, take_id, trainer_version, picked)
            raise_if_cancelled()
            return lease
        except BaseException:
            await self._put_back(lease_id, [(e, t.session.session_id) for e, t in picked.items()])
            raise

    async def _pick(
        self, lease_id: str, take_id: str | None, need: int, lease_timeout_s: float, deadline: float
    ) -> list[tuple[str, str]]:
        """Up to ``need`` (entry id, session id) for the take ``lease_id``: entries whose lease
        timed out (not those of a take in progress), claimed by :data:`_CLAIM`, which also
        renews the take's mark in ``mf:taking``; then new entries, waiting for them up to a
        second while the deadline allows. :class:`TakeTakenOver` when a later take holds
        ``take_id``."""
        claimed = await self._claim(
            keys=[STREAM, TAKING, STREAM if take_id is None else _take_id_key(take_id)],
            args=[
                GROUP,
                lease_id,
                _ms(lease_timeout_s),
                need,
                _ms(_TAKING_MARK_S + self._outage_s),
                "" if take_id is None else "1",
            ],
        )
        if claimed is None:
            raise TakeTakenOver(f"a later take with take id {take_id!r} took it over")
        batch = [(_s(entry_id), _s(_pairs(fields)[b"sid"])) for entry_id, fields in claimed]
        if len(batch) < need:
            remaining = deadline - time.monotonic()
            block = int(min(remaining, _TAKING_MARK_S) * 1000) if remaining > 0.001 else None
            resp = await self._r.xreadgroup(
                GROUP, lease_id, {STREAM: ">"}, count=need - len(batch), block=block
            )
            for _stream, items in resp or []:
                batch += [(_s(entry_id), _s(fields[b"sid"])) for entry_id, fields in items]
        return batch

    async def _admit(
        self,
        batch: list[tuple[str, str]],
        trainer_version: int,
        max_age: int | None,
        picked: dict[str, TakenTrajectory],
    ) -> None:
        """Add the entries of ``batch`` to ``picked`` with their sessions and turns (read in one
        round trip); an entry too old for ``max_age`` is held back, one whose session is gone
        (expired, evicted) is dropped from the stream."""
        if not batch:
            return
        pipe = self._r.pipeline(transaction=False)
        for _entry, sid in batch:
            pipe.hmget(_skey(sid), _FIELDS)
            pipe.lrange(_tkey(sid), 0, -1)
        replies = await pipe.execute()
        gone = []
        for k, (entry_id, sid) in enumerate(batch):
            info = _info(sid, replies[2 * k])
            if info is None:
                gone.append(entry_id)
            elif (
                max_age is not None
                and info.min_version is not None
                and trainer_version - info.min_version > max_age
            ):
                await self._hold(keys=[HELD, STREAM], args=[entry_id, info.min_version, sid, GROUP])
            else:
                picked[entry_id] = TakenTrajectory(info, list(replies[2 * k + 1]))
        if gone:
            pipe = self._r.pipeline(transaction=True)
            pipe.xack(STREAM, GROUP, *gone)
            pipe.xdel(STREAM, *gone)
            await pipe.execute()

    async def _make_lease(
        self, lease_id: str, take_id: str | None, trainer_version: int, picked: dict[str, TakenTrajectory]
    ) -> Lease:
        """The lease of what the take picked and still holds (:data:`_LEASE`, one script): its
        record, its timeout counted from now, each trajectory's deliveries counted (one handed out
        before is redelivered), and with ``take_id`` the take id's record, unless a later take
        holds the take id (:class:`TakeTakenOver`, nothing made)."""
        entries = list(picked.items())
        lease_key = _lease_key(lease_id)
        answer = await self._lease_picked(
            keys=[
                STREAM,
                TAKING,
                lease_key,
                HELD,
                lease_key if take_id is None else _take_id_key(take_id),
                *(_skey(t.session.session_id) for _e, t in entries),
            ],
            args=[
                GROUP,
                lease_id,
                _ms(self.retention.lease_record_s()),
                "" if take_id is None else "1",
                trainer_version,
                *(x for entry_id, t in entries for x in (entry_id, t.session.session_id)),
            ],
        )
        if int(answer[0]) < 0:
            raise TakeTakenOver(f"a later take with take id {take_id!r} took it over")
        held, seen = answer
        kept = [(e, t) for (e, t), n in zip(entries, seen, strict=True) if int(n) > 0]
        redelivered = sum(1 for n in seen if int(n) > 1)
        return Lease(
            lease_id,
            [t for _e, t in kept],
            held_back=int(held),
            redelivered=redelivered,
            trainer_version=trainer_version,
        )

    async def _put_back(self, lease_id: str, entries: list[tuple[str, str]]) -> int:
        """Whatever the take ``lease_id`` holds goes back on the ready queue (:data:`_GIVE_BACK`:
        also entries whose delivery it never read, and a lease it made but did not answer with);
        ``entries`` (entry id, session id) are what it picked. At most ``_PUT_BACK_S`` seconds,
        best effort: what it cannot put back (Redis down) is redelivered once the take's mark has
        lapsed and the lease timeout has passed. Returns how many went back."""
        with contextlib.suppress(*_UNAVAILABLE, InvalidResponse):  # TimeoutError (the bound): an OSError
            async with asyncio.timeout(_PUT_BACK_S):
                return await self._give_back_lease(lease_id, entries, by_holder=False)
        return 0

    async def _give_back_lease(
        self, lease_id: str, entries: list[tuple[str, str]], *, by_holder: bool
    ) -> int:
        """:data:`_GIVE_BACK` for the lease ``lease_id`` that picked ``entries``."""
        return int(
            await self._give_back(
                keys=[
                    STREAM,
                    TAKING,
                    _lease_key(lease_id),
                    _order_key(lease_id),
                    *(_skey(sid) for _e, sid in entries),
                ],
                args=[GROUP, lease_id, "1" if by_holder else "", *(entry_id for entry_id, _sid in entries)],
            )
        )

    async def release(self, lease_id: str, *, by_holder: bool = False) -> int:
        """The lease's record names what it holds (an acknowledged one's holds nothing; one
        answered again to a repeat of its take id is left unless ``by_holder``); then
        :data:`_GIVE_BACK`, as a take that did not answer (the script leaves a lease acknowledged
        or, unless ``by_holder``, answered again meanwhile). Its holder's release raises
        :class:`StateUnavailable` when Redis is down (its client retries); else
        :meth:`_put_back`'s best effort."""
        record = {_s(k): _s(v) for k, v in (await self._call(self._r.hgetall, _lease_key(lease_id))).items()}
        if not record or ACKED in record or (AGAIN in record and not by_holder):
            return 0
        entries = [(entry_id, sid) for entry_id, sid in record.items() if entry_id != AGAIN]
        if by_holder:
            return await self._call(self._give_back_lease, lease_id, entries, by_holder=True)
        return await self._put_back(lease_id, entries)

    async def _reap_consumers(self) -> int:
        """Forget lease consumers that own nothing any more and are idle for twice the lease
        timeout; return how many."""
        await self._ensure_group()
        idle_ms = self.retention.lease_timeout_s * 2000
        gone = [
            _s(c["name"])
            for c in await self._r.xinfo_consumers(STREAM, GROUP)
            if int(c["pending"]) == 0 and int(c["idle"]) > idle_ms
        ]
        for name in gone:
            await self._r.xgroup_delconsumer(STREAM, GROUP, name)
        return len(gone)

    async def ack(self, lease_id: str) -> AckResult:
        return await self._call(self._ack, lease_id)

    async def _ack(self, lease_id: str) -> AckResult:
        """Read the lease's entries (for the keys of their sessions), then :data:`_ACK`: one
        script that ends the lease (gone: LeaseNotFound; ended already: its result again),
        acknowledges each entry still pending under it, counts the others expired and appends
        the update, all at once."""
        key = _lease_key(lease_id)
        record = {_s(k): _s(v) for k, v in (await self._r.hgetall(key)).items()}
        if ACKED in record:
            return _acked_before(record[ACKED])
        entries = [(entry_id, sid) for entry_id, sid in record.items() if entry_id != AGAIN]
        if not entries:
            raise LeaseNotFound(lease_id)
        answer = await self._ack_lease(
            keys=[
                key,
                STREAM,
                LEDGER,
                UPDATES,
                UPDATES_E,
                *(k for _e, sid in entries for k in (_skey(sid), _tkey(sid))),
            ],
            args=[GROUP, lease_id, _ms(self.retention_s), repr(time.time()), *(e for e, _sid in entries)],
        )
        if answer is None:  # forgotten since the read
            raise LeaseNotFound(lease_id)
        if int(answer[0]) < 0:  # another acknowledgement ended it since the read
            return _acked_before(_s(answer[1]))
        acked, expired, seq, _ = (int(x) for x in answer)
        return AckResult(acked=acked, expired=expired, update=seq if acked else None)

    async def queue_stats(self) -> dict[str, int]:
        return await self._call(self._queue_stats)

    async def _queue_stats(self) -> dict[str, int]:
        await self._ensure_group()
        pipe = self._r.pipeline(transaction=True)
        pipe.xlen(STREAM)
        pipe.xinfo_consumers(STREAM, GROUP)
        pipe.zcard(HELD)
        length, consumers, held = await pipe.execute()
        pending = sum(int(c["pending"]) for c in consumers)
        return {
            "ready": int(length) - pending,
            "pending": pending,
            "held_back": int(held),
            "leases": sum(1 for c in consumers if int(c["pending"]) > 0),
        }

    # counters, replicas, versions --------------------------------------------------------
    async def counters(self) -> dict[str, GroupCounters]:
        raw = await self._call(self._r.hgetall, STATS)
        out: dict[str, dict[str, int]] = {}
        names = {"active": "active_sessions", "sessions": "sessions", "turns": "turns", "tokens": "tokens"}
        for k, v in raw.items():
            kind, _, group = _s(k).partition(":")
            if kind in names:
                out.setdefault(group, {})[names[kind]] = int(v)
        return {g: GroupCounters(**c) for g, c in out.items()}

    async def put_replica(self, replica_id: str, data: dict[str, Any]) -> None:
        await self._call(self._r.hset, REPLICAS, replica_id, json.dumps(data))

    async def list_replicas(self) -> dict[str, dict[str, Any]]:
        raw = await self._call(self._r.hgetall, REPLICAS)
        return {_s(k): json.loads(v) for k, v in raw.items()}

    async def delete_replica(self, replica_id: str) -> bool:
        return bool(await self._call(self._r.hdel, REPLICAS, replica_id))

    # routing window ----------------------------------------------------------------------
    async def assign(
        self, decide: Callable[[Sequence[WindowEntry], int], WindowEntry | None], size: int
    ) -> WindowEntry | None:
        async def attempt(pipe) -> WindowEntry | None:  # WATCHed: redis-py reruns it on a conflict
            raw = _window_items(await pipe.lrange(WINDOW, -size, -1))
            seq = int(raw[-1][0]) + 1 if raw else 0
            entry = decide([WindowEntry(g, tokens) for _seq, g, tokens in raw], seq)
            pipe.multi()
            if entry is not None:
                pipe.rpush(WINDOW, json.dumps([seq, entry.group, dict(entry.tokens_total)]))
                pipe.ltrim(WINDOW, -size, -1)
            return entry

        async with self._assigning:  # conflicts only between processes, never among this one's calls
            return await self._call(self._r.transaction, attempt, WINDOW, value_from_callable=True)

    async def window(self, size: int) -> list[WindowEntry]:
        raw = _window_items(await self._call(self._r.lrange, WINDOW, -size, -1))
        return [WindowEntry(g, tokens) for _seq, g, tokens in raw]

    # weight jobs ---------------------------------------------------------------------------
    async def acquire_job_lock(self, job_id: str, ttl_s: float) -> bool:
        px = max(1, int(ttl_s * 1000))
        return bool(await self._call(self._acquire_job_lock, keys=[JOB_LOCK], args=[job_id, px]))

    async def job_lock_holder(self) -> str | None:
        v = await self._call(self._r.get, JOB_LOCK)
        return None if v is None else _s(v)

    async def release_job_lock(self, job_id: str) -> bool:
        return bool(await self._call(self._release_job_lock, keys=[JOB_LOCK], args=[job_id]))

    async def put_job(self, job_id: str, view: dict[str, Any], keep: int) -> None:
        await self._call(self._put_job, keys=[JOBS, JOB_ORDER], args=[job_id, json.dumps(view), int(keep)])

    async def get_job(self, job_id: str) -> dict[str, Any] | None:
        v = await self._call(self._r.hget, JOBS, job_id)
        return None if v is None else json.loads(v)

    async def list_jobs(self, n: int) -> list[dict[str, Any]]:
        if n <= 0:
            return []
        ids = await self._call(self._r.lrange, JOB_ORDER, -n, -1)
        views = await self._call(self._r.hmget, JOBS, ids) if ids else []
        return [json.loads(v) for v in views if v is not None]

    async def get_latest_version(self) -> int | None:
        v = await self._call(self._r.get, LATEST)
        return None if v is None else int(v)

    async def set_latest_version(self, version: int) -> int:
        return int(await self._call(self._set_latest, keys=[LATEST], args=[int(version)]))

    async def get_route_key(self, key: str) -> dict[str, Any] | None:
        v = await self._call(self._r.get, f"{P}rk:{key}")
        return None if v is None else json.loads(v)

    async def set_route_key(self, key: str, value: dict[str, Any], ttl_s: float) -> None:
        px = max(1, int(ttl_s * 1000))
        await self._call(self._r.set, f"{P}rk:{key}", json.dumps(value), px=px)

    # mismatch ---------------------------------------------------------------------------
    async def record_lease_order(self, lease_id: str, session_ids: list[str], ttl_s: float) -> None:
        px = max(1, int(ttl_s * 1000))
        await self._call(self._r.set, _order_key(lease_id), json.dumps(session_ids), px=px, nx=True)

    async def lease_order(self, lease_id: str) -> list[str] | None:
        v = await self._call(self._r.get, _order_key(lease_id))
        if v == RELEASED:
            raise LeaseReleased(lease_id)
        return None if v is None else list(json.loads(v))

    async def add_mismatch(
        self, lease_id: str, sums: Mapping[MismatchKey, MismatchSums], ttl_s: float, digest: str = "-"
    ) -> bool:
        args: list[str | int] = [max(1, int(ttl_s * 1000)), digest]
        for (group, version, bucket), part in sums.items():
            for stat in _MISMATCH_STATS:
                value = getattr(part, stat)
                args += [
                    f"{stat}|{version}|{bucket}|{group}",
                    repr(value),
                    "f" if isinstance(value, float) else "i",
                ]
        keys = [MISMATCH, f"{P}mml:{lease_id}", MISMATCH_TOTALS, _order_key(lease_id)]
        added = int(await self._call(self._add_mismatch, keys=keys, args=args))
        if added < 0:
            raise LeaseReleased(lease_id)
        return bool(added)

    async def mismatch_digest(self, lease_id: str) -> str | None:
        v = await self._call(self._r.get, f"{P}mml:{lease_id}")
        return None if v is None else _s(v)

    async def mismatch_totals(self) -> dict[str, MismatchSums]:
        raw = await self._call(self._r.hgetall, MISMATCH_TOTALS)
        fields: dict[str, dict[str, float | int]] = {}
        for k, v in raw.items():
            stat, group = _s(k).split("|", 1)
            fields.setdefault(group, {})[stat] = float(_s(v)) if stat in _MISMATCH_FLOATS else int(_s(v))
        return {group: MismatchSums(**f) for group, f in fields.items()}

    async def mismatch(self) -> dict[MismatchKey, MismatchSums]:
        raw = await self._call(self._r.hgetall, MISMATCH)
        fields: dict[MismatchKey, dict[str, float | int]] = {}
        for k, v in raw.items():
            stat, version, bucket, group = _s(k).split("|", 3)
            value = _s(v)
            fields.setdefault((group, None if version == "-" else int(version), bucket), {})[stat] = (
                float(value) if stat in _MISMATCH_FLOATS else int(value)
            )
        return {key: MismatchSums(**f) for key, f in fields.items()}

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
        mark = f"{P}mark:{replica_id}"
        v = "-" if version is None else str(int(version))

        async def book(pipe) -> float:  # WATCHed mark: a concurrent booking makes redis-py rerun this
            raw = await pipe.get(mark)
            c = charge(None if raw is None else float(raw), at, span_s, gpus_per_replica, price_per_gpu_hour)
            pipe.multi()
            pipe.set(mark, repr(c.booked_until), px=_ms(mark_ttl_s(span_s)))
            if c.replica_seconds > 0:
                for name, amount in (
                    ("rs", c.replica_seconds),
                    ("gs", c.gpu_seconds),
                    ("usd", c.cost_dollars),
                ):
                    pipe.hincrbyfloat(LEDGER, f"{name}:{group}", amount)
                    pipe.hincrbyfloat(LEDGER_V, f"{name}:{group}:{v}", amount)
            return c.replica_seconds

        return await self._call(self._r.transaction, book, mark, value_from_callable=True)

    async def ledger_totals(self) -> dict[str, LedgerTotals]:
        pipe = self._r.pipeline(transaction=True)
        pipe.hgetall(LEDGER)
        pipe.hgetall(STATS)
        money, stats = await self._call(pipe.execute)
        return _totals(money, stats)

    async def ledger(self) -> LedgerSnapshot:
        pipe = self._r.pipeline(transaction=True)
        pipe.hgetall(LEDGER)
        pipe.hgetall(STATS)
        pipe.hgetall(LEDGER_V)
        pipe.lrange(UPDATES, 0, -1)
        pipe.hgetall(LEDGER_E)
        pipe.hgetall(UPDATES_E)
        money, stats, per_version, updates, earlier, rolled = await self._call(pipe.execute)
        versions: dict[tuple[str, int | None], dict[str, float]] = {}
        for k, val in per_version.items():
            name, group, v = _s(k).split(":")
            versions.setdefault((group, None if v == "-" else int(v)), {})[name] = float(val)
        groups: dict[str, dict[str, float]] = {}
        for k, val in earlier.items():
            name, group = _s(k).split(":", 1)
            groups.setdefault(group, {})[name] = float(val)
        return LedgerSnapshot(
            _totals(money, stats),
            {key: _ledger_totals(d) for key, d in versions.items()},
            [_update_record(json.loads(raw)) for raw in updates],
            {g: _ledger_totals(d) for g, d in groups.items()},
            _earlier_updates({_s(k): _s(v) for k, v in rolled.items()}),
        )

    # bounds ---------------------------------------------------------------------------
    async def compact(self, now: float | None = None) -> Compacted:
        wall = time.time() if now is None else now
        return await self._call(self._compact, wall)

    async def _compact(self, wall: float) -> Compacted:
        await self._reap_consumers()
        replicas = await self._r.hgetall(REPLICAS)
        cutoff = wall - self.retention.replica_forget_s
        stale = [
            _s(k)
            for k, v in replicas.items()
            if not (d := json.loads(v)).get("static") and float(d.get("wall_seen", 0)) < cutoff
        ]
        forgotten = (
            int(await self._forget_replicas(keys=[REPLICAS], args=[*stale, repr(cutoff)])) if stale else 0
        )
        ledger = [
            (group, int(v), f"{name}:{group}:{v}", f"{name}:{group}", "i" if name == "tok" else "f")
            for name, group, v in (_s(k).split(":") for k in await self._r.hkeys(LEDGER_V))
            if v != "-"
        ]
        mismatch = [
            (group, int(v), f"{stat}|{v}|{b}|{group}", f"{stat}|-|{b}|{group}", _kind(stat))
            for stat, v, b, group in (_s(k).split("|", 3) for k in await self._r.hkeys(MISMATCH))
            if v != "-"
        ]
        versions = await self._roll(LEDGER_V, LEDGER_E, ledger) + await self._roll(
            MISMATCH, MISMATCH, mismatch
        )
        updates = int(await self._roll_updates(keys=[UPDATES, UPDATES_E], args=[self.retention.keep_updates]))
        return Compacted(versions=versions, updates=updates, replicas=forgotten)

    async def _roll(self, src: str, dst: str, fields: list[tuple[str, int, str, str, str]]) -> int:
        """Move each (group, version, source field, target field, kind) of ``src`` whose version
        is beyond ``keep_versions`` for its group into ``dst`` (added, in one script); return the
        (group, version) entries moved."""
        by_group: dict[str, set[int]] = {}
        for group, v, *_ in fields:
            by_group.setdefault(group, set()).add(v)
        keep = self.retention.keep_versions
        old = {(g, v) for g, vs in by_group.items() for v in versions_to_roll(vs, keep)}
        chosen = [f for f in fields if (f[0], f[1]) in old]
        if chosen:
            await self._move_fields(keys=[src, dst], args=[x for f in chosen for x in f[2:]])
        return len({(f[0], f[1]) for f in chosen})

    async def footprint(self) -> dict[str, int]:
        return await self._call(self._footprint)

    async def _footprint(self) -> dict[str, int]:
        pipe = self._r.pipeline(transaction=False)
        pipe.dbsize()
        pipe.info("memory")
        for cmd, key in (
            (pipe.xlen, STREAM),
            (pipe.zcard, HELD),
            (pipe.zcard, ACTIVITY),
            (pipe.hlen, REPLICAS),
            (pipe.llen, WINDOW),
            (pipe.hlen, JOBS),
            (pipe.hlen, MISMATCH),
            (pipe.hlen, LEDGER_V),
            (pipe.llen, UPDATES),
        ):
            cmd(key)
        keys, memory, *sizes = await pipe.execute()
        names = ("ready", "held_back", "open_sessions", "replicas", "window", "jobs", "mismatch_fields")
        out = dict(zip((*names, "ledger_version_fields", "updates"), (int(x) for x in sizes), strict=True))
        return {"keys": int(keys), "used_memory": int(memory["used_memory"]), **out}

    async def ping(self) -> bool:
        """Whether Redis answers ``PING`` within 2 s (False too for an error reply or a server
        that does not speak Redis)."""
        try:
            async with asyncio.timeout(2.0):
                return bool(await self._r.ping())
        except (*_UNAVAILABLE, TimeoutError, ResponseError):
            return False
        except Exception as exc:
            if not_redis(exc):
                return False
            raise

    async def data_lost(self) -> str | None:
        """One script (:data:`_EPOCH`): ``mf:epoch``, set to a fresh id where missing; another id
        than this process saw at its previous call means Redis lost its data meanwhile."""
        seen = _s(await self._call(self._epoch, keys=[EPOCH], args=[uuid.uuid4().hex]))
        before, self._epoch_seen = self._epoch_seen, seen
        if before is None or before == seen:
            return None
        return (
            f"state store {self._where} lost its data (Redis restarted without persistence, flushed, "
            "or failed over to an empty replica): every open session, finished trajectory not yet "
            "acknowledged and lease it held is gone; run Redis with appendonly yes to keep them"
        )

    async def durability(self) -> str | None:
        """``CONFIG GET appendonly`` and ``save``: both off -> the warning; ``CONFIG`` refused (a
        managed Redis) -> None."""
        try:
            config = {
                _s(k): _s(v)
                for name in ("appendonly", "save")
                for k, v in (await self._call(self._r.config_get, name)).items()
            }
        except StateUnavailable:
            return None
        if config.get("appendonly") == "no" and not config.get("save", "x").strip():
            return (
                f'state store {self._where} persists nothing (appendonly no, save ""): a restart of '
                "Redis loses every open session, finished trajectory not yet acknowledged and lease; "
                "run it with appendonly yes"
            )
        return None

    async def close(self) -> None:
        await self._r.aclose()


def _ms(seconds: float) -> int:
    """``seconds`` as a TTL in whole milliseconds (at least 1)."""
    return max(1, int(seconds * 1000))


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _window_items(raw: list[bytes]) -> list[list[Any]]:
    """The window list's ``[seq, group, {group: tokens}]`` items, decoded in one call."""
    return jsonio.loads(b"[" + b",".join(raw) + b"]") if raw else []


def _kind(stat: str) -> str:
    """How a mismatch stat adds in Redis (script :data:`_ADD`): ``f`` (a double) or ``i`` (HINCRBY)."""
    return "f" if stat in _MISMATCH_FLOATS else "i"


def _ledger_totals(d: Mapping[str, float]) -> LedgerTotals:
    """The totals of ``rs``, ``gs``, ``usd`` and ``tok`` fields (0 when absent)."""
    return LedgerTotals(d.get("rs", 0.0), d.get("gs", 0.0), d.get("usd", 0.0), int(d.get("tok", 0)))


def _cost(raw: Any) -> dict[str, float]:
    """A stored cumulative cost per group (cjson writes ``{}``, or ``[]``, for an empty table)."""
    return {g: float(x) for g, x in raw.items()} if isinstance(raw, dict) else {}


def _update_record(u: dict[str, Any]) -> UpdateRecord:
    return UpdateRecord(
        int(u["seq"]), float(u["at"]), int(u["trajectories"]), int(u["tokens"]), _cost(u["cost"])
    )


def _earlier_updates(h: dict[str, str]) -> EarlierUpdates:
    """The ``mf:updates:e`` hash as :class:`EarlierUpdates` (empty: none rolled up)."""
    if not h:
        return EarlierUpdates()
    return EarlierUpdates(
        int(h["n"]),
        int(h["seq"]),
        float(h["at"]),
        int(h["trajectories"]),
        int(h["tokens"]),
        _cost(json.loads(h["cost"])),
    )


def _totals(money: dict, stats: dict) -> dict[str, LedgerTotals]:
    """Per group: the ledger hash's money beside the counters' tokens and sessions."""
    d: dict[str, dict[str, float]] = {}
    for k, v in money.items():
        name, _, group = _s(k).partition(":")
        d.setdefault(group, {})[name] = float(v)
    for k, v in stats.items():
        name, _, group = _s(k).partition(":")
        if name in ("tokens", "sessions"):
            d.setdefault(group, {})[name] = float(v)
    return {
        g: LedgerTotals(
            x.get("rs", 0.0),
            x.get("gs", 0.0),
            x.get("usd", 0.0),
            int(x.get("tokens", 0)),
            int(x.get("sessions", 0)),
        )
        for g, x in sorted(d.items())
    }


def _info(session_id: str, values: list[Any]) -> SessionInfo | None:
    d = dict(zip(_FIELDS, values, strict=True))
    if d["group"] is None:
        return None

    def num(k: str) -> int | None:
        return None if d[k] is None else int(d[k])

    return SessionInfo(
        session_id=session_id,
        group=_s(d["group"]),
        replica=_s(d["replica"]) or None if d["replica"] is not None else None,
        status=_s(d["status"]),  # type: ignore[arg-type]
        created_at=float(d["created"]),
        metadata=json.loads(d["metadata"]) if d["metadata"] else {},
        n_turns=int(d["n_turns"] or 0),
        reward=None if d["reward"] is None else float(d["reward"]),
        finish_metadata=json.loads(d["finish_meta"]) if d["finish_meta"] else {},
        min_version=num("vmin"),
        max_version=num("vmax"),
        tokens=int(d["tokens"] or 0),
        record_routes=d["routes"] is not None,
    )

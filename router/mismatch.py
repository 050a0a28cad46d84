"""Sampler-trainer mismatch: pure computation over one uploaded batch (no I/O).

For every output token of a batch the trainer took, ``p`` is the trainer's probability of the
sampled token (uploaded, :mod:`router.trainer_logprobs`) and ``q`` is the sampler's behavior
probability μ recorded with the token (the record's ``logprob``: the distribution the token was
actually drawn from, after temperature, top-k and top-p, renormalized over the support). With
``r = p / q`` and ``d = log p - log q``:

* ``k3 = r - 1 - log r`` per token (Schulman's k3 estimator, as veRL and slime report the
  rollout-training mismatch; computed as ``expm1(d) - d``, never negative: :func:`k3_terms`);
  its mean over tokens sampled from ``q`` estimates KL(q || p);
* ``|d|`` per token (its mean is the mean absolute log-prob difference);
* ``extreme``: ``r`` outside :data:`EXTREME_BAND` = [0.2, 5] (closed: a ratio of exactly 0.2
  or 5 is inside); ``out_of_band``: ``r`` outside the configured band, same rule.

Routing: where the batch recorded routed experts and the trainer uploaded its route
flags (:mod:`router.trainer_logprobs`), ``route_tokens`` counts the tokens compared and
``route_differ`` those whose trainer experts (the trainer's own top-k at the position that
predicted the token, as a set per MoE layer) differ from the recorded ones in some layer; their
ratio is the route-mismatch share. A token without recorded routes is in neither.

Sums are kept per key (group, weight version, token-position bucket) in :class:`MismatchSums`,
which add; every reported figure is a ratio of sums (means and shares over tokens), so sums from
many uploads and many routers combine exactly. A token's group is the group of the turn that
sampled it, its version the version of the span covering it, its position the index it had in
the sequence its engine call saw (prompt length + output index). Tokens whose ``q`` is unknown
(NaN in the record) or whose span names no version are not counted (``skipped``).

The state keeps, per group, the sums of its ``keep_versions`` highest versions
(:mod:`router.state.retention`); older versions are rolled into the group's earlier sums, stored
under version ``None`` (:data:`MismatchKey`), which count in the group's totals and its position
buckets but in no version of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

EXTREME_BAND: tuple[float, float] = (0.2, 5.0)
"""The fixed band of p/q ratios; a token outside it is ``extreme``."""

POSITION_BUCKETS: tuple[int, ...] = (0, 64, 256, 1024)
"""Lower bounds of the token-position buckets: 0-63, 64-255, 256-1023, 1024+."""


def bucket_label(index: int) -> str:
    """The label of bucket ``index`` of :data:`POSITION_BUCKETS` (e.g. ``"64-255"``, ``"1024+"``)."""
    lo = POSITION_BUCKETS[index]
    if index + 1 < len(POSITION_BUCKETS):
        return f"{lo}-{POSITION_BUCKETS[index + 1] - 1}"
    return f"{lo}+"


BUCKET_LABELS: tuple[str, ...] = tuple(bucket_label(i) for i in range(len(POSITION_BUCKETS)))


def position_bucket(position: int) -> str:
    """The label of the bucket holding token position ``position`` (>= 0)."""
    i = int(np.searchsorted(POSITION_BUCKETS, position, side="right")) - 1
    return BUCKET_LABELS[max(0, i)]


def check_band(band: tuple[float, float]) -> tuple[float, float]:
    """``band`` as floats; ValueError unless ``0 < low < 1 < high`` and both are finite."""
    lo, hi = float(band[0]), float(band[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo < 1.0 < hi):
        raise ValueError(f"mismatch band must satisfy 0 < low < 1 < high: {band!r}")
    return lo, hi


@dataclass(frozen=True)
class MismatchSums:
    """Additive sums over tokens: count, Σ k3, Σ |log p - log q|, tokens outside the fixed band,
    tokens outside the configured band, tokens whose routes were compared, those whose routes
    differ."""

    tokens: int = 0
    k3: float = 0.0
    abs_logprob_diff: float = 0.0
    extreme: int = 0
    out_of_band: int = 0
    route_tokens: int = 0
    route_differ: int = 0

    def __add__(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums(
            self.tokens + other.tokens,
            self.k3 + other.k3,
            self.abs_logprob_diff + other.abs_logprob_diff,
            self.extreme + other.extreme,
            self.out_of_band + other.out_of_band,
            self.route_tokens + other.route_tokens,
            self.route_differ + other.route_differ,
        )

    def view(self) -> dict[str, float | int]:
        """The reported figures: ``tokens``, ``k3_kl`` (mean k3), ``abs_logprob_diff_mean``,
        ``extreme_share`` and ``out_of_band_share`` (shares of tokens); 0.0 over no tokens; and
        ``route_tokens`` with ``route_mismatch_share`` (of those)."""
        n = self.tokens
        r = self.route_tokens
        return {
            "route_tokens": r,
            "route_mismatch_share": self.route_differ / r if r else 0.0,
            "tokens": n,
            "k3_kl": self.k3 / n if n else 0.0,
            "abs_logprob_diff_mean": self.abs_logprob_diff / n if n else 0.0,
            "extreme_share": self.extreme / n if n else 0.0,
            "out_of_band_share": self.out_of_band / n if n else 0.0,
        }


MismatchKey = tuple[str, int | None, str]
"""(group, weight version, position-bucket label); version None: the versions rolled up, every
version below the group's lowest kept one."""


@dataclass(frozen=True)
class TurnTokens:
    """What the computation needs of one recorded turn: its group, prompt length, the sampler's
    log μ per output token (NaN = unknown), the weight version per output token (None = no
    span) and whether the turn recorded routed experts (``routes``; without them its tokens are
    in no route figure, whatever flags the trainer uploads)."""

    group: str
    prompt_len: int
    logprobs: Sequence[float]
    versions: Sequence[int | None]
    routes: bool = False


@dataclass(frozen=True)
class BatchMismatch:
    """One batch's sums per key, and how many tokens were not counted."""

    sums: dict[MismatchKey, MismatchSums]
    tokens: int
    skipped: int


LOGPROB_SLACK = 1e-2
"""The largest trainer log-prob taken: a log-probability is at most 0, and a trainer's
log-softmax rounds by far less than this above it."""

LOGPROB_FLOOR = -1e4
"""The smallest trainer log-prob taken (nats; p = e^-10000). A sampled token's real log-prob is
the log-softmax of the trainer's logits at it: at least minus the spread of those logits, tens to
a few hundred nats for a language model (and float32 holds no probability below e^-104 outside
log space), so a real one is far above this floor, however much trainer and sampler disagree.
Masking constants that a trainer may leave in its logits are far below it: -1e9, float32's and
bfloat16's minimum (about -3.4e38), float16's (-65504); a token masked by one comes out at about
that constant, and one such token adds about its magnitude to its group's k3 sum, which is
cumulative (never reset), so every later figure of the group would stay wrong. Such a value is a
wrong log-prob, not a mismatch: the upload is refused."""

CHUNK_TOKENS = 1 << 20
"""Tokens computed at once: the per-token temporaries (about 100 bytes a token) stay bounded
whatever the batch's size."""


def batch_mismatch(
    turns: Sequence[TurnTokens],
    trainer_logprobs: np.ndarray,
    band: tuple[float, float],
    route_flags: np.ndarray | None = None,
) -> BatchMismatch:
    """The sums of one batch. ``trainer_logprobs`` holds log p for every output token of
    ``turns`` in order (turn after turn, output token after output token); ``route_flags`` (same
    order; None: not uploaded) 0 / 1 / 2 per token (routes agree / differ / none recorded), taken
    only for the tokens of turns with ``routes`` (the others are in neither route figure, as the
    module docstring states: the trainer cannot have compared routes that were never recorded).
    ValueError naming the first offending token when a length differs from the turns'
    output-token count, or a log-prob is not finite, above :data:`LOGPROB_SLACK` or below
    :data:`LOGPROB_FLOOR`, or a ratio p/q overflows.

    Computed :data:`CHUNK_TOKENS` tokens at a time, vectorized over each chunk (no Python work
    per token): memory beyond the inputs stays bounded."""
    lo, hi = check_band(band)
    p = np.asarray(trainer_logprobs).reshape(-1)
    total = sum(len(t.logprobs) for t in turns)
    if p.size != total:
        raise ValueError(f"{p.size} trainer log-probs for {total} output tokens")
    flags = np.full(total, 2, dtype=np.uint8) if route_flags is None else np.asarray(route_flags).reshape(-1)
    if flags.size != total:
        raise ValueError(f"{flags.size} route flags for {total} output tokens")
    _check_logprobs(p)
    out: dict[MismatchKey, MismatchSums] = {}
    counted = start = 0
    for chunk in _chunks(turns):
        n = sum(len(t.logprobs) for t in chunk)
        counted += _add_chunk(chunk, p[start : start + n], flags[start : start + n], start, (lo, hi), out)
        start += n
    return BatchMismatch(out, counted, total - counted)


def _check_logprobs(p: np.ndarray) -> None:
    """ValueError naming the first trainer log-prob that is not finite, above
    :data:`LOGPROB_SLACK` or below :data:`LOGPROB_FLOOR`."""
    bad = np.flatnonzero(~np.isfinite(p))
    if bad.size:
        raise ValueError(f"trainer log-prob {int(bad[0])} is not finite ({p[bad[0]]})")
    above = np.flatnonzero(p > LOGPROB_SLACK)
    if above.size:
        at = int(above[0])
        raise ValueError(f"trainer log-prob {at} is {p[at]:.6g}, above 0: not the log of a probability")
    below = np.flatnonzero(p < LOGPROB_FLOOR)
    if below.size:
        at = int(below[0])
        raise ValueError(
            f"trainer log-prob {at} is {p[at]:.6g}, below {LOGPROB_FLOOR:g}: a masking constant, not the "
            "log-prob of a sampled token"
        )


def _chunks(turns: Sequence[TurnTokens]) -> Iterable[Sequence[TurnTokens]]:
    """``turns`` in runs of about :data:`CHUNK_TOKENS` tokens (a turn is never split)."""
    first = tokens = 0
    for i, t in enumerate(turns):
        tokens += len(t.logprobs)
        if tokens >= CHUNK_TOKENS:
            yield turns[first : i + 1]
            first, tokens = i + 1, 0
    if first < len(turns):
        yield turns[first:]


def _add_chunk(
    turns: Sequence[TurnTokens],
    p: np.ndarray,
    flags: np.ndarray,
    offset: int,
    band: tuple[float, float],
    out: dict[MismatchKey, MismatchSums],
) -> int:
    """Add the sums of ``turns`` (whose log p and flags are ``p`` and ``flags``, batch token
    ``offset`` on) to ``out``; return the tokens counted."""
    lens = np.array([len(t.logprobs) for t in turns], dtype=np.int64)
    if not lens.sum():
        return 0
    q = np.concatenate([np.asarray(t.logprobs, dtype=np.float64) for t in turns])
    versions = np.concatenate([_version_array(t.versions) for t in turns])
    firsts = np.repeat(np.cumsum(lens) - lens, lens)
    prompts = np.repeat(np.array([t.prompt_len for t in turns], dtype=np.int64), lens)
    positions = prompts + np.arange(q.size) - firsts
    names = sorted({t.group for t in turns})
    group = np.repeat(np.array([names.index(t.group) for t in turns], dtype=np.int64), lens)
    routes = np.repeat(np.array([t.routes for t in turns], dtype=bool), lens)
    d = p.astype(np.float64) - q
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.exp(d)
        k3 = k3_terms(d)
    known = np.isfinite(q)
    overflow = np.flatnonzero(known & ~np.isfinite(k3))
    if overflow.size:
        at = int(overflow[0])
        raise ValueError(f"token {offset + at}: ratio p/q overflows (log p - log q = {d[at]:.6g})")
    sel = np.flatnonzero(known & (versions >= 0))
    if not sel.size:
        return 0
    buckets = np.searchsorted(POSITION_BUCKETS, positions[sel], side="right") - 1
    kept, version_index = np.unique(versions[sel], return_inverse=True)
    nb = len(POSITION_BUCKETS)
    key = (group[sel] * kept.size + version_index.reshape(-1)) * nb + buckets  # one int per key
    width = len(names) * kept.size * nb
    r, d = r[sel], d[sel]
    extreme = (r < EXTREME_BAND[0]) | (r > EXTREME_BAND[1])
    outside = (r < band[0]) | (r > band[1])
    compared = routes[sel] & (flags[sel] < 2)
    differ = routes[sel] & (flags[sel] == 1)
    columns = [
        np.bincount(key, minlength=width),
        np.bincount(key, k3[sel], width),
        np.bincount(key, np.abs(d), width),
        *(np.bincount(key, x, width) for x in (extreme, outside, compared, differ)),
    ]
    for j in np.flatnonzero(columns[0]).tolist():
        n, k3_sum, absd, ext, oob, cmp, dif = (c[j] for c in columns)
        part = MismatchSums(int(n), float(k3_sum), float(absd), int(ext), int(oob), int(cmp), int(dif))
        g, rest = divmod(j, kept.size * nb)
        v, b = divmod(rest, nb)
        name = (names[g], int(kept[v]), BUCKET_LABELS[b])
        out[name] = out[name] + part if name in out else part
    return int(sel.size)


def k3_terms(d: np.ndarray) -> np.ndarray:
    """Per token ``k3 = r - 1 - log r`` with ``r = e^d``, computed as ``expm1(d) - d``: never
    negative, as k3 is mathematically (``e^d >= 1 + d``). ``exp(d) - 1 - d`` cancels near ``d = 0``
    (p ~= q): ``exp`` rounds ``r`` to a multiple of 2^-52, so for ``|d|`` about 1e-12 it comes out
    below zero (``d = log(1 - 1e-12)`` gives about -1e-16 instead of 5e-25), and such a token
    lowers its group's k3 sum. ``expm1`` has no such cancellation (glibc's is within about one ulp
    of ``e^d - 1``), and since ``e^d - 1 >= d`` with ``d`` itself a double, a faithfully rounded
    ``expm1(d)`` is ``>= d`` and the difference ``>= 0``; the clamp at 0 guards a libm whose last
    bit rounds the other way."""
    return np.maximum(np.expm1(d) - d, 0.0)


def _version_array(versions: Sequence[int | None]) -> np.ndarray:
    """``versions`` as int64, -1 for None."""
    arr = np.asarray(versions)
    if arr.dtype.kind not in "iu":  # a None among them (object), or none at all (float64)
        arr = np.fromiter((-1 if v is None else v for v in versions), dtype=np.int64, count=len(versions))
    return arr.astype(np.int64, copy=False)


def rollup(
    sums: Mapping[MismatchKey, MismatchSums],
) -> dict[str, dict[str, dict]]:
    """Per group: ``total`` (all versions and positions), ``versions`` (kept version -> sums over
    positions), ``earlier`` (the rolled-up versions' sums) and ``positions`` (bucket label -> sums
    over versions, rolled-up ones included), as :class:`MismatchSums`."""
    out: dict[str, dict[str, dict]] = {}
    for (group, version, bucket), s in sums.items():
        g = out.setdefault(
            group, {"total": MismatchSums(), "versions": {}, "earlier": MismatchSums(), "positions": {}}
        )
        g["total"] = g["total"] + s
        if version is None:
            g["earlier"] = g["earlier"] + s
        else:
            g["versions"][version] = g["versions"].get(version, MismatchSums()) + s
        g["positions"][bucket] = g["positions"].get(bucket, MismatchSums()) + s
    return out


def group_view(sums: Mapping[MismatchKey, MismatchSums], group: str, band: tuple[float, float]) -> dict:
    """The JSON view of one group (``/v1/groups``): the band, the totals, per kept version
    (ascending), the rolled-up ``earlier`` versions and per position bucket (in bucket order),
    each as :meth:`MismatchSums.view`."""
    g = rollup({k: v for k, v in sums.items() if k[0] == group}).get(group)
    total = g["total"] if g else MismatchSums()
    earlier = g["earlier"] if g else MismatchSums()
    versions = g["versions"] if g else {}
    positions = g["positions"] if g else {}
    return {
        "band": [float(band[0]), float(band[1])],
        "extreme_band": list(EXTREME_BAND),
        **total.view(),
        "versions": [{"version": v, **versions[v].view()} for v in sorted(versions)],
        "earlier": earlier.view(),
        "positions": [{"bucket": b, **positions[b].view()} for b in BUCKET_LABELS if b in positions],
    }

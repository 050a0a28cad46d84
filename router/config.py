"""Router configuration: one frozen record built by the CLI (or ``mixfleet up``) and handed to
:func:`router.app.create_app`. Holds no live objects.

The environment is read here, by the functions the command (``mixfleet router``, the router on
Modal) calls while it builds the record -- :func:`proxy_auth_headers` and
:meth:`WeightsConfig.from_env` -- and nowhere below: the app, its routes and the publish service
get what they need as values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.errors import UserError
from fleet.specs import FleetSpec
from router.mismatch import check_band
from router.state.retention import Retention

Policy = Literal["capacity", "round_robin", "cost"]
CHAT_FAMILIES: tuple[str, ...] = ("local", "qwen3")
"""The chat renderer families (:data:`router.chat.renderers.FAMILIES`' names)."""
POLICIES: tuple[str, ...] = ("capacity", "round_robin", "cost")
SCOPES: tuple[str, ...] = ("rollout", "trainer", "admin", "replica")
PROXY_KEY_ENV = "MIXFLEET_PROXY_KEY"
PROXY_SECRET_ENV = "MIXFLEET_PROXY_SECRET"
STORE_ENV = "MIXFLEET_STORE"
RUN_ENV = "MIXFLEET_RUN"
STORE_VOLUME_ENV = "MIXFLEET_STORE_VOLUME"
PUBLISH_WORKERS_ENV = "MIXFLEET_PUBLISH_WORKERS"


def proxy_auth_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The headers of a Modal proxy auth token, from ``MIXFLEET_PROXY_KEY`` (token id) and
    ``MIXFLEET_PROXY_SECRET`` (token secret): ``Modal-Key`` and ``Modal-Secret``, the names Modal's
    proxy reads on a server deployed with ``unauthenticated=False``, the default (modal 1.6.4,
    ``app.py`` 1418, 1470: "requires proxy authentication; required by default"; the header
    names: ``cli/server.py`` 383-386).
    Empty when neither is set; :class:`UserError` naming the missing one when only one is."""
    key, secret = environ.get(PROXY_KEY_ENV) or "", environ.get(PROXY_SECRET_ENV) or ""
    if not key and not secret:
        return {}
    if not key or not secret:
        missing = PROXY_KEY_ENV if not key else PROXY_SECRET_ENV
        raise UserError(f"{missing} is not set: a Modal proxy auth token needs both its key and its secret")
    return {"Modal-Key": key, "Modal-Secret": secret}


@dataclass(frozen=True)
class WeightsConfig:
    """What the weight routes and their publish service (:mod:`router.routes_weights`,
    :class:`router.publishing.PublishService`) need.

    ``store_root``: the version store's root (None: publishing is not configured and the weight
    routes answer 503); with ``volume`` the store is that Modal Volume, mounted at ``store_root``
    (None: a directory). ``run_id``: the run published when a request names none. ``workers``:
    conversion processes of the router's own converter (None: one per core and at least one per
    format the fleet serves; 0: conversions run in the router process, one format at a time).
    ``convert_function``: the deployed Modal function (``APP/FUNCTION``) that runs publications
    instead of this router (None: the router converts). ``pointer_poll_s``: how often the store's
    pointers are re-read while the router runs. ``keep_store_versions``: prune the store to the
    run's newest N versions at the start of every weight job (:mod:`weight_sync.retention` says
    what else stays; None: never prune). ValueError for a negative ``workers``, a non-positive
    ``pointer_poll_s``, a ``keep_store_versions`` below 1 or an empty ``run_id``.
    """

    store_root: Path | None = None
    run_id: str = "default"
    volume: str | None = None
    workers: int | None = None
    convert_function: str | None = None
    pointer_poll_s: float = 2.0
    keep_store_versions: int | None = None

    def __post_init__(self) -> None:
        if self.keep_store_versions is not None and self.keep_store_versions < 1:
            raise ValueError(f"keep_store_versions must be >= 1, got {self.keep_store_versions}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if not self.pointer_poll_s > 0:
            raise ValueError(f"pointer_poll_s must be > 0, got {self.pointer_poll_s!r}")
        if not self.run_id:
            raise ValueError("run_id must not be empty")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WeightsConfig:
        """The configuration of a router process from its environment: ``MIXFLEET_STORE``,
        ``MIXFLEET_RUN`` (default ``default``), ``MIXFLEET_STORE_VOLUME``,
        ``MIXFLEET_PUBLISH_WORKERS`` (an integer; negative counts as 0) and
        ``MIXFLEET_CONVERT_FUNCTION`` (``APP/FUNCTION``), each unset when blank.
        :class:`UserError` naming a malformed value."""
        from weight_sync.converters import CONVERT_FUNCTION_ENV
        from weight_sync.converters.modal_function import parse_function_ref

        def value(name: str) -> str | None:
            return (environ.get(name) or "").strip() or None

        workers = value(PUBLISH_WORKERS_ENV)
        try:
            count = None if workers is None else max(0, int(workers))
        except ValueError:
            raise UserError(f"{PUBLISH_WORKERS_ENV} must be an integer, got {workers!r}") from None
        function = value(CONVERT_FUNCTION_ENV)
        if function is not None:
            parse_function_ref(function)
        store = value(STORE_ENV)
        return cls(
            store_root=Path(store) if store else None,
            run_id=value(RUN_ENV) or "default",
            volume=value(STORE_VOLUME_ENV),
            workers=count,
            convert_function=function,
        )


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs to start.

    ``api_keys`` maps a bearer token to its scopes; ``auth_disabled`` must be set explicitly to
    run without keys (the app logs a warning). Open sessions without a turn for ``session_idle_s``
    seconds, and none running, are abandoned (their capacity slot freed; None: never).
    ``vocab_size`` is the served checkpoint's (``config.json``'s ``vocab_size``): an input id at
    or above it (a turn's, ``/generate``'s, ``/v1/score``'s) is refused (422) before anything is
    forwarded, because SGLang 0.5.23 checks a prompt's ids against the vocabulary nowhere before
    its embedding's gather (:mod:`router.dispatch` ``check_vocab``); None: not checked.
    ``mismatch_band`` (low, high; ``0 < low < 1 < high``, else ValueError) is the configured band of
    trainer/sampler probability ratios (:mod:`router.mismatch`). ``engine_headers`` go with every
    call the router makes to a replica (e.g. :func:`proxy_auth_headers` for servers behind Modal's
    proxy auth). ``modal_app`` names the deployed Modal app whose servers (one per group, named by
    the group) serve the fleet: every engine request to a heartbeat replica is then pinned to its
    container, listed every ``container_list_interval_s`` (:mod:`router.pinning`). ``weights``
    configures the weight routes and their publish service (:class:`WeightsConfig`).
    ``chat_model``: the checkpoint directory whose tokenizer and chat template the chat APIs
    render with (:mod:`router.chat`; None: they answer 503); ``chat_family`` picks its renderer
    (one of :data:`CHAT_FAMILIES`; None: detected from the tokenizer). ``context_cache_bytes``
    bounds the JSON text of the sessions' last engine inputs a router process keeps
    (:mod:`router.context_text`; 0: none kept, every turn encodes its whole input). Every
    ``heap_trim_s`` seconds the process returns its C heap's free pages to the system
    (:mod:`core.heap`; None: never).

    A session's turns stay on its replica (its prefix cache) unless that replica's queue has stayed
    above ``affinity_queue_bound`` waiting requests for ``affinity_hold_s`` (:mod:`router.registry`,
    load-aware affinity).

    Engine requests (:mod:`router.dispatch`): a replica that accepts no connection within
    ``connect_timeout_s``, or sends no byte of an answer for ``engine_timeout_s`` seconds, has
    timed out (retried once on the same replica while it stays in rotation, then elsewhere); a
    replica that reported ready within ``heartbeat_timeout_s`` is in rotation, and one that
    failed a request stays out of it for ``failure_cooldown_s``; a request gives up after
    ``2 * max_attempts`` + the number of groups attempts. A replica that has gone
    ``heartbeat_timeout_s`` without a sign of health is lost: the requests running on it are
    abandoned and fail over (:meth:`router.registry.Registry.lost`). Each of the four durations
    must be > 0 (ValueError).

    The state's bounds (:mod:`router.state.retention`): acknowledged trajectories stay readable
    ``retention_s``; per group the ledger and the mismatch sums keep the ``keep_versions`` highest
    versions (older ones rolled into totals) and the ledger the latest ``keep_updates`` update
    records; a heartbeat replica silent for ``replica_forget_s`` is forgotten; ``/generate`` route
    keys live ``route_key_ttl_s`` after they last moved; the store is compacted every
    ``compact_interval_s``.
    """

    fleet: FleetSpec
    state_url: str = "memory"
    api_keys: dict[str, frozenset[str]] = field(default_factory=dict)
    auth_disabled: bool = False
    policy: Policy = "capacity"
    heartbeat_timeout_s: float = 10.0
    poll_interval_s: float = 1.0
    lease_timeout_s: float = 300.0
    retention_s: float = 3600.0
    max_version_lag: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_new_tokens_limit: int = 32768
    vocab_size: int | None = None
    connect_timeout_s: float = 5.0
    engine_timeout_s: float = 600.0
    failure_cooldown_s: float = 2.0
    max_attempts: int = 4
    route_key_ttl_s: float = 3600.0
    session_idle_s: float | None = 3600.0
    f16_support_logprobs: bool = False
    mismatch_band: tuple[float, float] = (0.2, 5.0)
    engine_headers: dict[str, str] = field(default_factory=dict)
    keep_versions: int = 16
    keep_updates: int = 1000
    replica_forget_s: float = 3600.0
    compact_interval_s: float = 60.0
    modal_app: str | None = None
    container_list_interval_s: float = 2.0
    affinity_queue_bound: int = 8
    affinity_hold_s: float = 5.0
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    chat_model: Path | None = None
    chat_family: str | None = None
    context_cache_bytes: int = 256 * 2**20
    heap_trim_s: float | None = 5.0

    def __post_init__(self) -> None:
        check_band(self.mismatch_band)
        if self.chat_family is not None and self.chat_family not in CHAT_FAMILIES:
            raise ValueError(f"chat_family must be one of {', '.join(CHAT_FAMILIES)}: {self.chat_family!r}")
        self.retention()  # ValueError naming a bound out of range
        for name in (
            "compact_interval_s",
            "route_key_ttl_s",
            "heartbeat_timeout_s",
            "connect_timeout_s",
            "engine_timeout_s",
            "failure_cooldown_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 or None, got {self.vocab_size!r}")
        if self.context_cache_bytes < 0:
            raise ValueError(f"context_cache_bytes must be >= 0, got {self.context_cache_bytes}")
        if self.heap_trim_s is not None and not self.heap_trim_s > 0:
            raise ValueError(f"heap_trim_s must be > 0 or None, got {self.heap_trim_s!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}: {self.policy!r}")
        for token, scopes in self.api_keys.items():
            bad = set(scopes) - set(SCOPES)
            if bad:
                raise ValueError(f"API key ...{token[-4:]}: unknown scopes {sorted(bad)}")
        if not self.api_keys and not self.auth_disabled:
            raise ValueError("no API keys configured and auth not explicitly disabled")

    def retention(self) -> Retention:
        """The state store's bounds."""
        return Retention(
            retention_s=self.retention_s,
            lease_timeout_s=self.lease_timeout_s,
            keep_versions=self.keep_versions,
            keep_updates=self.keep_updates,
            replica_forget_s=self.replica_forget_s,
        )

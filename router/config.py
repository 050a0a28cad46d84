"""Router configuration: one frozen record built by the CLI (or ``mixfleet up``) and handed to
:func:`router.app.create_app`. Holds no live objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fleet.specs import FleetSpec
from router.mismatch import check_band

Policy = Literal["capacity", "round_robin", "cost"]
POLICIES: tuple[str, ...] = ("capacity", "round_robin", "cost")
SCOPES: tuple[str, ...] = ("rollout", "trainer", "admin", "replica")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs to start.

    ``api_keys`` maps a bearer token to its scopes; ``auth_disabled`` must be set explicitly to
    run without keys (the app logs a warning). ``vocab_size``, when known, lets the router refuse
    out-of-vocabulary token ids itself (otherwise it learns it from replicas' ``/model_info``
    when they report it, and passes the engine's 400 through). Open sessions without a turn for
    ``session_idle_s`` seconds are abandoned (their capacity slot freed; None: never).
    ``mismatch_band`` (low, high; ``0 < low < 1 < high``, else ValueError) is the configured band of
    trainer/sampler probability ratios (:mod:`router.mismatch`).
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

    def __post_init__(self) -> None:
        check_band(self.mismatch_band)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}: {self.policy!r}")
        for token, scopes in self.api_keys.items():
            bad = set(scopes) - set(SCOPES)
            if bad:
                raise ValueError(f"API key ...{token[-4:]}: unknown scopes {sorted(bad)}")
        if not self.api_keys and not self.auth_disabled:
            raise ValueError("no API keys configured and auth not explicitly disabled")

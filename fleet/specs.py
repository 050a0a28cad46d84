"""Sampler-group specs and presets (docs/architecture.md, "3. Capacity and cost").

A preset is a TOML file with a ``[[groups]]`` array; every group validates into a frozen
:class:`GroupSpec`. Built-in presets (``local``, ``mixed``, ``homogeneous``) ship in
``fleet/presets/``; any other value is read as a path.
"""

from __future__ import annotations

import tomllib
from datetime import date
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.errors import UserError
from core.formats import WeightFormat

KvCacheDtype = Literal["auto", "bf16", "fp8_e4m3"]
PRESETS_DIR = Path(__file__).parent / "presets"


class GroupSpec(BaseModel):
    """One sampler group: replicas of one accelerator kind serving one weight format."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    accelerator: str = Field(min_length=1, description="Modal GPU string (B200, H100!, A100-80GB) or cpu")
    gpus_per_replica: int = Field(default=1, ge=1, le=8)
    weight_format: WeightFormat = "bf16"
    kv_cache_dtype: KvCacheDtype = "auto"
    sessions_per_replica: int = Field(default=8, ge=1)
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    buffer_replicas: int = Field(default=0, ge=0, description="idle replicas kept beyond demand")
    scaledown_window_s: int = Field(
        default=300, ge=2, le=3600, description="seconds an idle replica waits before it is stopped"
    )
    price_per_gpu_hour: float = Field(default=0.0, ge=0.0, description="USD per GPU-hour")
    price_date: date | None = Field(default=None, description="date of the price table the price is from")
    price_source: str | None = Field(default=None, description="where the price was read")
    price_verified: bool = Field(default=False, description="the price agrees across independent sources")
    engine_args: tuple[str, ...] = ()
    replicas: tuple[str, ...] = Field(default=(), description="static replica URLs (engines run elsewhere)")
    record_routes: bool = Field(
        default=False,
        description="record every turn's routed experts (engines get --enable-return-routed-experts)",
    )

    @field_validator("replicas")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://: {url!r}")
        return tuple(u.rstrip("/") for u in urls)

    @model_validator(mode="after")
    def _bounds(self) -> GroupSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.buffer_replicas > self.max_replicas:
            raise ValueError(f"buffer_replicas {self.buffer_replicas} > max_replicas {self.max_replicas}")
        if self.price_verified and not (self.price_source and self.price_date):
            raise ValueError("price_verified needs price_source and price_date")
        return self

    @property
    def is_local(self) -> bool:
        return self.accelerator == "cpu"

    @property
    def route_flags(self) -> tuple[str, ...]:
        """The engine flags ``record_routes`` needs (SGLang's and the local engine's), unless
        ``engine_args`` already has them."""
        from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG as flag

        return (flag,) if self.record_routes and flag not in self.engine_args else ()

    @property
    def returns_routes(self) -> bool:
        """Whether the group's engines start with ``--enable-return-routed-experts``: what a session
        with ``record_routes`` needs. A local group's own replicas (``mixfleet up``, ``mixfleet
        replica``) always do (the capability costs nothing until a request asks); any other
        group's when ``record_routes`` adds the flag (:attr:`route_flags`) or ``engine_args``
        carries it, which is also how a preset declares it for ``replicas`` started elsewhere."""
        from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG as flag

        return self.record_routes or flag in self.engine_args or (self.is_local and not self.replicas)

    @property
    def price_per_replica_hour(self) -> float:
        return self.price_per_gpu_hour * self.gpus_per_replica


class FleetSpec(BaseModel):
    """A whole preset: the groups, in the order the file lists them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    architecture: str = Field(
        default="Qwen3MoeForCausalLM", min_length=1, description="the served model's HF architecture"
    )
    groups: tuple[GroupSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> FleetSpec:
        names = [g.name for g in self.groups]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate group names: {', '.join(dupes)}")
        return self

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    @property
    def formats(self) -> tuple[str, ...]:
        """The distinct weight formats the fleet serves, in first-seen order."""
        return tuple(dict.fromkeys(g.weight_format for g in self.groups))


def load_preset(name_or_path: str | Path) -> FleetSpec:
    """Load a built-in preset by name or a TOML file by path.

    Raises :class:`UserError` naming the file and the problem when it is missing or invalid: one
    line per invalid field, each naming the file, the field and its group.
    """
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PRESETS_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.toml")))
        raise UserError(f"preset {str(name_or_path)!r} not found (built-in presets: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: invalid TOML: {exc}") from None
    data.setdefault("name", path.stem)
    try:
        return FleetSpec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        if any(len(e["loc"]) > 1 and e["loc"][0] == "groups" for e in errors):
            # a tuple whose items failed also fails its length check: not a problem of its own
            errors = [e for e in errors if not (e["loc"] == ("groups",) and e["type"] == "too_short")]
        raise UserError("\n".join(_error_line(path, data, e) for e in errors)) from None


def _error_line(path: Path, data: dict, error: dict) -> str:
    """One line naming the file, the field (and the group by name, when it has one) and the problem."""
    loc = error["loc"]
    where = ".".join(str(p) for p in loc)
    if len(loc) >= 2 and loc[0] == "groups" and isinstance(loc[1], int):
        groups = data.get("groups")
        group = groups[loc[1]] if isinstance(groups, list) and loc[1] < len(groups) else None
        if isinstance(group, dict) and isinstance(group.get("name"), str):
            where += f" (group {group['name']!r})"
    return f"{path}: {where}: {error['msg']}"

"""Weight-version domain types and their rules. Pure: no I/O, no clock, no network.

- ``parse_version``: the one parser of a weight version from the wire (JSON, headers, SGLang's
  string); a version is a non-negative integer or absent.
- ``FormatRef``: one format of one run, the unit a pointer (``CURRENT``) belongs to.
- ``VersionRef``: one immutable version of one format of one run.
- ``VersionConstraint``: what a request needs of the version a replica serves.
- ``VersionUnavailable``: a replica cannot meet a constraint now (the sidecar's 409).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from core.errors import UserError

__all__ = [
    "FormatRef",
    "InvalidName",
    "InvalidVersion",
    "VersionConstraint",
    "VersionRef",
    "VersionUnavailable",
    "parse_version",
    "version_name",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidVersion(UserError, ValueError):
    """``value`` does not name a weight version (a non-negative integer); ``field`` says which one."""

    def __init__(self, value: object, field: str = "weight version") -> None:
        self.value = value
        self.field = field
        super().__init__(f"{field} must be a non-negative integer, got {value!r}")


class InvalidName(UserError, ValueError):
    """``value`` is not a valid run id or format name (``kind`` says which)."""

    def __init__(self, kind: str, value: object) -> None:
        self.kind = kind
        self.value = value
        super().__init__(
            f"invalid {kind} {value!r}: use letters, digits, '.', '_' or '-' (one path component)"
        )


def parse_version(value: object, field: str = "weight version") -> int | None:
    """The version ``value`` names: None for None; an int (not a bool) >= 0; a string of ASCII
    decimal digits (surrounding whitespace ignored). Anything else, floats and negative numbers
    included, raises ``InvalidVersion`` naming ``field``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidVersion(value, field)
    if isinstance(value, int):
        if value < 0:
            raise InvalidVersion(value, field)
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isascii() and text.isdigit():
            return int(text)
    raise InvalidVersion(value, field)


def reported_version(info: dict[str, Any]) -> int | None:
    """The version an engine's info or answer names in ``weight_version``; None when it names
    none or a non-integer (SGLang's ``"default"`` before any update)."""
    try:
        return parse_version(info.get("weight_version"))
    except InvalidVersion:
        return None


def version_name(version: int) -> str:
    """The directory name of version ``version``: ``v{N:06d}`` (``InvalidVersion`` unless an int >= 0)."""
    _check_version(version)
    return f"v{version:06d}"


def _check_name(kind: str, value: object) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidName(kind, value)


def _check_version(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidVersion(value, "version")


@dataclass(frozen=True, slots=True)
class FormatRef:
    """One format of one run. Invariant: ``run_id`` and ``format`` each name one path component
    (letters, digits, ``._-``; not starting with ``.``); raises ``InvalidName`` otherwise."""

    run_id: str
    format: str

    def __post_init__(self) -> None:
        _check_name("run id", self.run_id)
        _check_name("format", self.format)

    def at(self, version: int) -> VersionRef:
        """Version ``version`` of this format."""
        return VersionRef(self.run_id, self.format, version)

    def __str__(self) -> str:
        return f"{self.run_id}/{self.format}"


@dataclass(frozen=True, slots=True, order=True)
class VersionRef:
    """Version ``version`` of ``format`` of ``run_id``. Invariant: names as in ``FormatRef``
    (``InvalidName``), ``version`` an int >= 0 (``InvalidVersion``). Ordered by run, format,
    then version."""

    run_id: str
    format: str
    version: int

    def __post_init__(self) -> None:
        _check_name("run id", self.run_id)
        _check_name("format", self.format)
        _check_version(self.version)

    @property
    def stream(self) -> FormatRef:
        """The format (and run) this version belongs to."""
        return FormatRef(self.run_id, self.format)

    @property
    def name(self) -> str:
        """The version's directory name, ``v{N:06d}``."""
        return version_name(self.version)

    def with_version(self, version: int) -> VersionRef:
        """Another version of the same format."""
        return VersionRef(self.run_id, self.format, version)

    def __str__(self) -> str:
        return f"{self.run_id}/{self.format} {self.name}"


@dataclass(frozen=True, slots=True)
class VersionConstraint:
    """What a request needs of the serving version: at least ``min_version`` and/or exactly
    ``exact_version`` (None: no such bound). Invariant: each bound is None or an int >= 0
    (``InvalidVersion`` naming the field)."""

    min_version: int | None = None
    exact_version: int | None = None

    def __post_init__(self) -> None:
        for field in ("min_version", "exact_version"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise InvalidVersion(value, field)

    @classmethod
    def parse(cls, min_version: object = None, exact_version: object = None) -> VersionConstraint:
        """The constraint from wire values (``parse_version`` rules); ``InvalidVersion`` names the
        bad field (``exact_version`` is checked first)."""
        exact = parse_version(exact_version, "exact_version")
        return cls(min_version=parse_version(min_version, "min_version"), exact_version=exact)

    @property
    def unconstrained(self) -> bool:
        return self.min_version is None and self.exact_version is None

    def unmet(self, active: int | None) -> tuple[str, int] | None:
        """The first bound ``active`` fails, as ``(field name, target)`` (``exact_version`` before
        ``min_version``), or None when ``active`` satisfies the constraint. No version (None)
        meets any bound."""
        if self.exact_version is not None and active != self.exact_version:
            return "exact_version", self.exact_version
        if self.min_version is not None and (active is None or active < self.min_version):
            return "min_version", self.min_version
        return None

    def satisfied_by(self, active: int | None) -> bool:
        """Whether a replica serving ``active`` (None: no version yet) meets every bound."""
        return self.unmet(active) is None


class VersionUnavailable(Exception):
    """A replica serving ``applied_version`` cannot meet ``constraint`` now (retryable: it may be
    staging ``pending_version``). Before: ``constraint`` is not satisfied by ``applied_version``
    (``ValueError`` otherwise). ``kind`` and ``target_version`` name the first unmet bound."""

    def __init__(
        self,
        constraint: VersionConstraint,
        *,
        applied_version: int | None,
        pending_version: int | None,
        replica: str,
        group: str,
    ) -> None:
        unmet = constraint.unmet(applied_version)
        if unmet is None:
            raise ValueError(f"{constraint} is satisfied by version {applied_version}")
        self.constraint = constraint
        self.kind, self.target_version = unmet
        self.applied_version = applied_version
        self.pending_version = pending_version
        self.replica = replica
        self.group = group
        super().__init__(
            f"replica {replica} serves weight version {applied_version}, "
            f"the request needs {self.kind} {self.target_version}"
        )

    def body(self) -> dict[str, Any]:
        """The sidecar's 409 JSON body (``code``, ``object``, ``type``, ``retryable``, ``message``,
        ``constraint``, ``target_version``, ``applied_version``, ``pending_version``, ``replica``,
        ``group``)."""
        return {
            "code": 409,
            "object": "error",
            "type": "version_unavailable",
            "retryable": True,
            "message": str(self),
            "constraint": self.kind,
            "target_version": self.target_version,
            "applied_version": self.applied_version,
            "pending_version": self.pending_version,
            "replica": self.replica,
            "group": self.group,
        }

"""weight_sync.types: the version parser, references, constraints and the unavailable error."""

from __future__ import annotations

import dataclasses

import pytest

from core.errors import UserError
from weight_sync.types import (
    FormatRef,
    InvalidName,
    InvalidVersion,
    VersionConstraint,
    VersionRef,
    VersionUnavailable,
    parse_version,
    version_name,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, None), (0, 0), (7, 7), (2**40, 2**40), ("0", 0), ("12", 12), (" 3 \n", 3), ("007", 7)],
)
def test_parse_version_accepts(raw, expected) -> None:
    assert parse_version(raw) == expected


@pytest.mark.parametrize(
    "raw", [True, False, -1, "-1", "+1", "", " ", "default", "1.0", "1e3", 1.0, 3.5, "٣", b"1", [1], {}]
)
def test_parse_version_refuses(raw) -> None:
    with pytest.raises(InvalidVersion) as exc:
        parse_version(raw)
    assert exc.value.value is raw
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, UserError)
    assert repr(raw) in str(exc.value) and "non-negative integer" in str(exc.value)


def test_parse_version_names_the_field() -> None:
    with pytest.raises(InvalidVersion, match=r"^min_version must be a non-negative integer, got 'x'$") as exc:
        parse_version("x", "min_version")
    assert exc.value.field == "min_version" and exc.value.value == "x"


def test_version_ref_is_frozen_validated_and_ordered() -> None:
    ref = VersionRef("run-1", "fp8", 3)
    assert (ref.run_id, ref.format, ref.version, ref.name) == ("run-1", "fp8", 3, "v000003")
    assert str(ref) == "run-1/fp8 v000003"
    assert ref.stream == FormatRef("run-1", "fp8") and ref.stream.at(3) == ref
    assert ref.with_version(4) == VersionRef("run-1", "fp8", 4) and ref < ref.with_version(4)
    assert hash(ref) == hash(VersionRef("run-1", "fp8", 3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.version = 4  # type: ignore[misc]
    for bad in ("../x", "a/b", "", ".", "..", ".hidden", "x" * 129, 3, None):
        with pytest.raises(InvalidName, match="invalid run id"):
            VersionRef(bad, "fp8", 1)  # type: ignore[arg-type]
        with pytest.raises(InvalidName, match="invalid format"):
            FormatRef("run", bad)  # type: ignore[arg-type]
    for bad in (-1, True, 1.0, "1", None):
        with pytest.raises(InvalidVersion, match="version must be a non-negative integer"):
            VersionRef("run", "fp8", bad)  # type: ignore[arg-type]
    assert str(FormatRef("r", "bf16")) == "r/bf16"


def test_constraint_satisfied_by() -> None:
    free = VersionConstraint()
    assert free.unconstrained and free.satisfied_by(None) and free.satisfied_by(0)
    at_least = VersionConstraint(min_version=3)
    assert [at_least.satisfied_by(v) for v in (None, 0, 2, 3, 4)] == [False, False, False, True, True]
    exactly = VersionConstraint(exact_version=3)
    assert [exactly.satisfied_by(v) for v in (None, 2, 3, 4)] == [False, False, True, False]
    both = VersionConstraint(min_version=2, exact_version=3)
    assert [both.satisfied_by(v) for v in (1, 2, 3, 4)] == [False, False, True, False]
    assert both.unmet(4) == ("exact_version", 3) and at_least.unmet(None) == ("min_version", 3)
    assert VersionConstraint(min_version=5, exact_version=3).unmet(3) == ("min_version", 5)
    with pytest.raises(InvalidVersion, match="min_version"):
        VersionConstraint(min_version=-1)
    with pytest.raises(InvalidVersion, match="exact_version"):
        VersionConstraint(exact_version="3")  # type: ignore[arg-type]


def test_constraint_parse() -> None:
    assert VersionConstraint.parse(" 4", None) == VersionConstraint(min_version=4)
    assert VersionConstraint.parse(None, 2) == VersionConstraint(exact_version=2)
    with pytest.raises(InvalidVersion, match=r"^min_version must be a non-negative integer, got 'abc'$"):
        VersionConstraint.parse("abc", None)
    with pytest.raises(InvalidVersion, match=r"^exact_version .* got -2$"):
        VersionConstraint.parse("abc", -2)


def test_version_unavailable_body() -> None:
    err = VersionUnavailable(
        VersionConstraint(min_version=5), applied_version=4, pending_version=5, replica="r0", group="g"
    )
    assert (err.kind, err.target_version, err.applied_version) == ("min_version", 5, 4)
    assert err.body() == {
        "code": 409,
        "object": "error",
        "type": "version_unavailable",
        "retryable": True,
        "message": "replica r0 serves weight version 4, the request needs min_version 5",
        "constraint": "min_version",
        "target_version": 5,
        "applied_version": 4,
        "pending_version": 5,
        "replica": "r0",
        "group": "g",
    }
    none_yet = VersionUnavailable(
        VersionConstraint(exact_version=0), applied_version=None, pending_version=None, replica="r", group="b"
    )
    assert none_yet.body()["constraint"] == "exact_version" and none_yet.body()["applied_version"] is None
    with pytest.raises(ValueError, match="satisfied"):
        VersionUnavailable(
            VersionConstraint(min_version=1), applied_version=1, pending_version=None, replica="r", group="g"
        )


def test_version_name() -> None:
    assert [version_name(v) for v in (0, 7, 123456, 1234567)] == ["v000000", "v000007", "v123456", "v1234567"]
    with pytest.raises(InvalidVersion):
        version_name(-1)

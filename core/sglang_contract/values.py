"""The value types SGLang 0.5.23's dataclass parse and contract gate give ``/generate``'s fields:
integers, floats, booleans, strings, token ids, lists of them, nullable ones, and whether
pydantic's lax parse would take a value the gate refuses (steps 1 and 2 of the package docstring)."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError

from core.sglang_contract.refusal import ContractError


def _spelled(v: Any) -> str:
    """The value as SGLang's contract names it (serde's ``Unexpected``, api_types.py 30-46)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def refuse(where: str, v: Any, expected: str) -> ContractError:
    """The gate's refusal of ``v`` at ``where`` (a step-2 :class:`ContractError`), in its words:
    ``invalid type: <v as serde spells it>, expected <expected>``."""
    return ContractError(f"{where}: invalid type: {_spelled(v)}, expected {expected}", value=v)


def i64(where: str, v: Any) -> int:
    """``v``, an integer (a JSON number without a fraction; not a bool), or the gate's refusal."""
    if type(v) is int:
        return v
    raise refuse(where, v, "i64")


def f64(where: str, v: Any) -> float:
    """``v`` as a float (an integer or a float; not a bool), or the gate's refusal."""
    if type(v) is int or type(v) is float:
        return float(v)
    raise refuse(where, v, "f64")


def boolean(where: str, v: Any) -> bool:
    """``v``, a bool, or the gate's refusal."""
    if type(v) is bool:
        return v
    raise refuse(where, v, "a boolean")


def string(where: str, v: Any) -> str:
    """``v``, a string, or the gate's refusal."""
    if type(v) is str:
        return v
    raise refuse(where, v, "a string")


def _seq(where: str, v: Any) -> list[Any]:
    if type(v) is list:
        return v
    raise refuse(where, v, "a sequence")


def mapping(where: str, v: Any) -> dict[str, Any]:
    """``v``, a JSON object, or the gate's refusal (``expected a map``)."""
    if type(v) is dict:
        return v
    raise refuse(where, v, "a map")


def each(where: str, v: Any, one: Callable[[str, Any], Any]) -> None:
    """``one`` on every entry of the list ``v`` (``where[i]``); a value that is no list refused."""
    for i, e in enumerate(_seq(where, v)):
        one(f"{where}[{i}]", e)


def or_list(one: Callable[[str, Any], Any]) -> Callable[[str, Any], None]:
    """A value or a list of values (SGLang's ``...OrList``)."""

    def check(where: str, v: Any) -> None:
        if type(v) is list:
            each(where, v, one)
        else:
            one(where, v)

    return check


def int_list(where: str, v: Any, int64: bool = True) -> list[int]:
    """``v``, a list of JSON integers (``decode_Int64List`` / ``decode_TokenIds``, api_types.py
    1021-1022, 938-939), each within int64 when ``int64`` (``input_ids``: ``array("q")``,
    field_validators.py 51-54). Checked in bulk: one pass over the types."""
    ids = _seq(where, v)
    try:
        if int64:
            array("q", ids)  # refuses a string, a float or an int beyond int64; takes a bool
        ok = bool not in map(type, ids) if int64 else set(map(type, ids)) <= {int}
    except (TypeError, OverflowError):
        ok = False
    if ok:
        return ids
    i = next(i for i, x in enumerate(ids) if type(x) is not int or (int64 and not -(2**63) <= x < 2**63))
    if type(ids[i]) is int:
        raise ContractError(f"{where}[{i}]: integer `{ids[i]}` is outside int64", value=ids[i])
    raise refuse(f"{where}[{i}]", ids[i], "i64")


def token_ids(where: str, v: Any) -> None:
    """One list of token ids or a list of such lists (``decode_TokenIdsOrList``, api_types.py
    1029-1045: a list whose first entry is not a number is a batch)."""
    ids = _seq(where, v)
    if not ids or (type(ids[0]) in (int, float)):
        int_list(where, ids)
        return
    for r, row in enumerate(ids):
        int_list(f"{where}[{r}]", row)


def strict_token_ids(where: str, v: Any) -> None:
    """:func:`token_ids`, refused by the dataclass parse (step 1: ``validate_optional_list_i64_1d_2d``,
    field_validators.py 41-81, takes only a list of ints or of lists, each within int64) unless the
    value refused is a bool (Python's int there: the gate refuses it, as ``[true]``)."""
    try:
        token_ids(where, v)
    except ContractError as exc:
        raise exc if type(exc.value) is bool else exc.at("parse") from None


def not_null(one: Callable[[str, Any], Any], expected: str) -> Callable[[str, Any], None]:
    """``one``, and ``null`` refused by the dataclass parse (step 1: a plain bool or int field)."""

    def check(where: str, v: Any) -> None:
        if v is None:
            raise refuse(where, v, expected).at("parse")
        one(where, v)

    return check


def nullable(one: Callable[[str, Any], Any]) -> Callable[[str, Any], None]:
    """``one``, with ``null`` taken (an ``Optional`` field)."""

    def check(where: str, v: Any) -> None:
        if v is not None:
            one(where, v)

    return check


string_or_list = or_list(string)


_LAX_INT = TypeAdapter(int)


_LAX_BOOL = TypeAdapter(bool)


def _lax(adapter: TypeAdapter, v: Any) -> bool:
    """Whether pydantic's lax parse (what SGLang's dataclass parse runs) takes ``v`` as the
    adapter's type."""
    try:
        adapter.validate_python(v)
    except ValidationError:
        return False
    return True


def lax_int(v: Any) -> bool:
    """Whether the dataclass parse (pydantic's lax ``int``) takes ``v`` (a bool, an integral
    float, a decimal string)."""
    return _lax(_LAX_INT, v)


def lax_bool(v: Any) -> bool:
    """Whether the dataclass parse (pydantic's lax ``bool``) takes ``v`` (a bool, 0 or 1, one of
    its words)."""
    return _lax(_LAX_BOOL, v)


def parsed(one: Callable[[str, Any], Any], takes: Callable[[Any], bool]) -> Callable[[str, Any], None]:
    """``one`` (the gate's check), its refusal made by the dataclass parse instead where the
    value refused is not one the parse ``takes`` (step 1 runs first). ``takes`` never: a field
    whose every gate refusal is the parse's too (a string field: pydantic takes only a string)."""

    def check(where: str, v: Any) -> None:
        try:
            one(where, v)
        except ContractError as exc:
            raise exc if takes(exc.value) else exc.at("parse") from None

    return check


def never(v: Any) -> bool:
    """The ``takes`` of :func:`parsed` for a field the dataclass parse takes no refused value of."""
    return False


def one_or_list(one: Callable[[str, Any], Any], union: str) -> Callable[[str, Any], None]:
    """A value or a list of values whose entries may be null (SGLang's ``Optional...OrList``);
    a scalar refused is named as the gate names it (``a value or an array of values for ...``)."""

    def check(where: str, v: Any) -> None:
        if type(v) is list:
            each(where, v, nullable(one))
            return
        try:
            one(where, v)
        except ContractError:
            raise refuse(where, v, f"a value or an array of values for {union}") from None

    return check

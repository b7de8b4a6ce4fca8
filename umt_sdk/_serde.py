"""Payloads to and from JSON text through one private cattrs converter. No pickle anywhere."""

from __future__ import annotations

import hashlib
import json
from datetime import date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any
from uuid import UUID

import cattrs
from cattrs.preconf.json import make_converter as _make_json_converter
from cattrs.strategies import configure_union_passthrough

from umt_sdk.exceptions import PayloadError

__all__ = [
    "decode",
    "dumps",
    "encode",
    "from_raw",
    "input_hash",
    "make_converter",
    "to_raw",
    "validate",
]


def _strict(expected: type, *, also: tuple[type, ...] = ()) -> Any:
    allowed = (expected, *also)

    def structure(value: Any, _: type) -> Any:
        if isinstance(value, bool) and expected is not bool:
            raise TypeError(f"expected {expected.__name__}, got bool")
        if not isinstance(value, allowed):
            raise TypeError(f"expected {expected.__name__}, got {type(value).__name__}")
        return expected(value)

    return structure


def make_converter() -> cattrs.Converter:
    """The converter used for every payload: strict primitives, ISO datetimes, UUIDs."""
    converter = _make_json_converter(detailed_validation=True, forbid_extra_keys=True)
    converter.register_structure_hook(str, _strict(str))
    converter.register_structure_hook(int, _strict(int))
    converter.register_structure_hook(float, _strict(float, also=(int,)))
    converter.register_structure_hook(bool, _strict(bool))
    # The JSON preset passes unions of primitives through when the value's class (or a subclass)
    # is a member; bool is a subclass of int, so `int | str` took True. Configure it without bool
    # (a union that names bool still accepts it, through the strict bool hook).
    configure_union_passthrough(str | int | float | None, converter)

    def structure_none(value: Any, _: type) -> None:
        if value is not None:
            raise TypeError(f"expected null, got {type(value).__name__}")

    converter.register_structure_hook(type(None), structure_none)

    def structure_datetime(value: Any, _: type) -> datetime:
        if isinstance(value, datetime):
            return value
        if not isinstance(value, str):
            raise TypeError(f"expected an ISO 8601 datetime string, got {type(value).__name__}")
        return datetime.fromisoformat(value)

    def structure_date(value: Any, _: type) -> date:
        if isinstance(value, date):
            return value
        if not isinstance(value, str):
            raise TypeError(f"expected an ISO 8601 date string, got {type(value).__name__}")
        return date.fromisoformat(value)

    def structure_uuid(value: Any, _: type) -> UUID:
        if isinstance(value, UUID):
            return value
        if not isinstance(value, str):
            raise TypeError(f"expected a UUID string, got {type(value).__name__}")
        return UUID(value)

    def structure_timedelta(value: Any, _: type) -> timedelta:
        if isinstance(value, timedelta):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"expected seconds as a number, got {type(value).__name__}")
        return timedelta(seconds=value)

    def structure_decimal(value: Any, _: type) -> Decimal:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise TypeError(f"expected a decimal string, got {type(value).__name__}")
        try:
            return Decimal(str(value))
        except InvalidOperation:
            raise ValueError(f"expected a decimal string, got {value!r}") from None

    converter.register_structure_hook(datetime, structure_datetime)
    converter.register_unstructure_hook(datetime, datetime.isoformat)
    converter.register_structure_hook(date, structure_date)
    converter.register_unstructure_hook(date, date.isoformat)
    converter.register_structure_hook(UUID, structure_uuid)
    converter.register_unstructure_hook(UUID, str)
    converter.register_structure_hook(timedelta, structure_timedelta)
    converter.register_unstructure_hook(timedelta, timedelta.total_seconds)
    converter.register_structure_hook(Decimal, structure_decimal)
    converter.register_unstructure_hook(Decimal, str)
    return converter


_converter = make_converter()


def _describe(exc: Exception, what: str) -> PayloadError:
    if isinstance(exc, cattrs.BaseValidationError):
        messages = cattrs.transform_error(exc, path=what)
        first = messages[0] if messages else str(exc)
        field = first.rsplit(" @ ", 1)[-1] if " @ " in first else what
        detail = "; ".join(messages)
        return PayloadError(f"invalid {what}: {detail}", field=field)
    return PayloadError(f"invalid {what}: {exc}", field=what)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode(value: Any, type_: Any = Any, *, what: str = "payload") -> str:
    """Encode `value` (of `type_`) to compact JSON text; raise PayloadError naming the field."""
    try:
        raw = _converter.unstructure(value, unstructure_as=type_ if type_ is not Any else None)
        return _dumps(raw)
    except (TypeError, ValueError) as exc:
        raise PayloadError(
            f"{what} cannot be stored as JSON: {exc}; use attrs classes, dataclasses, "
            "primitives, datetimes, UUIDs, lists and dicts",
            field=what,
        ) from exc


def decode(text: str, type_: Any = Any, *, what: str = "payload") -> Any:
    """Decode JSON text to `type_`; raise PayloadError naming the field that does not fit."""
    raw = json.loads(text)
    if type_ is Any or type_ is None or type_ is type(None):
        return raw
    try:
        return _converter.structure(raw, type_)
    except Exception as exc:
        raise _describe(exc, what) from exc


def validate(value: Any, type_: Any, *, what: str = "input") -> str:
    """Check `value` against `type_` by a full round trip and return its JSON text.

    Accepts either an instance of the type or its unstructured form (a dict from a web form or
    the CLI); rejects anything that would not decode back, naming the field.
    """
    if type_ is Any:
        return encode(value, what=what)
    try:
        raw = _converter.unstructure(value)
        text = _dumps(_converter.unstructure(_converter.structure(raw, type_), type_))
        _converter.structure(json.loads(text), type_)  # what a worker will decode
    except PayloadError:
        raise
    except Exception as exc:
        raise _describe(exc, what) from exc
    return text


def input_hash(text: str) -> str:
    """SHA-256 of canonical JSON (sorted keys, no whitespace): compared for idempotent enqueue."""
    canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def to_raw(value: Any, type_: Any = Any) -> Any:
    """Unstructure `value` to JSON-ready primitives."""
    try:
        return _converter.unstructure(value, unstructure_as=type_ if type_ is not Any else None)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"value cannot be stored as JSON: {exc}") from exc


def from_raw(raw: Any, type_: Any = Any, *, what: str = "payload") -> Any:
    """Structure JSON-ready primitives into `type_`."""
    if type_ is Any or type_ is None or type_ is type(None):
        return raw
    try:
        return _converter.structure(raw, type_)
    except Exception as exc:
        raise _describe(exc, what) from exc


def dumps(raw: Any) -> str:
    """Compact JSON text of JSON-ready primitives."""
    return _dumps(raw)

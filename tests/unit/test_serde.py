"""Payload serde: JSON round trips, strict primitives, field paths, hashing, and no pickle."""

from __future__ import annotations

import ast
import dataclasses
import json
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import attrs
import pytest

from umt_sdk import _serde
from umt_sdk.exceptions import PayloadError

ROOT = Path(__file__).resolve().parents[2]
IDENT = UUID("0190f4d4-1b2c-7a00-8b00-000000000001")
IST = timezone(timedelta(hours=5, minutes=30))


@attrs.frozen
class Item:
    size: int
    label: str = ""


@attrs.frozen
class Order:
    plan_id: str
    items: list[Item] = attrs.field(factory=list)
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class Shipment:
    when: datetime
    ident: UUID
    amount: Decimal
    window: timedelta
    day: date
    tags: dict[str, list[int]]
    order: Order | None = None


SHIPMENT = Shipment(
    when=datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=IST),
    ident=IDENT,
    amount=Decimal("10.50"),
    window=timedelta(days=2, seconds=3, microseconds=7),
    day=date(2030, 2, 28),
    tags={"a": [1, 2], "b": []},
    order=Order(plan_id="p1", items=[Item(size=1, label="x"), Item(size=2)]),
)


def _payload_error(value: Any, type_: Any) -> PayloadError:
    with pytest.raises(PayloadError) as caught:
        _serde.validate(value, type_, what="input")
    return caught.value


# -- round trips ------------------------------------------------------------------------------


def test_attrs_class_round_trips() -> None:
    order = Order(plan_id="p1", items=[Item(size=3, label="iso"), Item(size=4)], note="n")
    text = _serde.encode(order, Order)
    assert json.loads(text) == {
        "plan_id": "p1",
        "items": [{"size": 3, "label": "iso"}, {"size": 4, "label": ""}],
        "note": "n",
    }
    assert _serde.decode(text, Order) == order


def test_dataclass_with_every_supported_scalar_round_trips() -> None:
    text = _serde.encode(SHIPMENT, Shipment)
    back = _serde.decode(text, Shipment)
    assert back == SHIPMENT
    assert back.when.utcoffset() == timedelta(hours=5, minutes=30), "the offset is kept"
    assert str(back.amount) == "10.50", "the decimal's exponent is kept"


@pytest.mark.parametrize(
    ("value", "type_", "raw"),
    [
        (datetime(2030, 1, 1, 12, 0, tzinfo=UTC), datetime, "2030-01-01T12:00:00+00:00"),
        (
            datetime(2030, 1, 1, 12, 0, 0, 5, tzinfo=IST),
            datetime,
            "2030-01-01T12:00:00.000005+05:30",
        ),
        (IDENT, UUID, str(IDENT)),
        (Decimal("0.1"), Decimal, "0.1"),
        (Decimal("-1E+3"), Decimal, "-1E+3"),
        (timedelta(minutes=5, microseconds=1), timedelta, 300.000001),
        (date(2030, 12, 31), date, "2030-12-31"),
        ([[1, 2], [], [3]], list[list[int]], [[1, 2], [], [3]]),
        ({"x": {"y": [1.5, 2.0]}}, dict[str, dict[str, list[float]]], {"x": {"y": [1.5, 2.0]}}),
        ({"k": [IDENT]}, dict[str, list[UUID]], {"k": [str(IDENT)]}),
        ((1, "a"), tuple[int, str], [1, "a"]),
        (None, type(None), None),
    ],
)
def test_values_round_trip_through_json(value: Any, type_: Any, raw: Any) -> None:
    text = _serde.encode(value, type_)
    assert json.loads(text) == raw
    back = _serde.decode(text, type_)
    assert back == value
    assert type(back) is type(value)
    if isinstance(value, datetime):
        assert back.utcoffset() == value.utcoffset()


def test_validate_accepts_the_instance_or_its_json_form_alike() -> None:
    from_instance = _serde.validate(Order(plan_id="p", items=[Item(size=1)]), Order)
    from_dict = _serde.validate({"plan_id": "p", "items": [{"size": 1}]}, Order)
    assert from_instance == from_dict
    assert _serde.decode(from_dict, Order) == Order(plan_id="p", items=[Item(size=1)])


def test_validate_with_any_only_requires_json() -> None:
    assert _serde.validate({"a": [1, None]}, Any) == '{"a":[1,null]}'
    assert _payload_error({"a": object()}, Any).field == "input.a", "the path of the bad value"


# -- strictness -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "type_"),
    [
        (5, str),
        (True, int),
        ("1", int),
        (1.0, int),
        (True, float),
        ("1.5", float),
        (1, bool),
        ("true", bool),
        (True, int | None),
        (True, int | str),
        (True, float | str),
        (5, UUID),
        ("not-a-uuid", UUID),
        (1_700_000_000, datetime),
        ("yesterday", datetime),
        (True, Decimal),
        ("lots", Decimal),
        (True, timedelta),
        ("5m", timedelta),
        (0, type(None)),
        ({"a": "1"}, dict[str, int]),
        ([1, "2"], list[int]),
    ],
)
def test_primitives_are_strict(value: Any, type_: Any) -> None:
    _payload_error(value, type_)


def test_ints_are_accepted_where_floats_are_expected() -> None:
    assert _serde.validate(3, float) == "3.0"
    assert _serde.validate(True, bool | int) == "true", "a union naming bool still takes it"
    assert _serde.validate(2, bool | int) == "2"


def test_none_is_a_payload_type_of_its_own() -> None:
    # `TaskContext[None]` declares a task without input: None must validate, anything else not.
    assert _serde.validate(None, type(None)) == "null"
    assert _serde.validate(None, None) == "null"
    assert "expected null, got int" in str(_payload_error(0, type(None)))


def test_values_json_cannot_hold_are_rejected() -> None:
    assert _payload_error(float("nan"), float).field == "input"
    assert _payload_error(float("inf"), float).field == "input"
    with pytest.raises(PayloadError) as caught:
        _serde.encode(object(), what="task output")
    assert caught.value.field == "task output"
    assert "cannot be stored as JSON" in str(caught.value)


def test_a_bad_decimal_says_what_it_got() -> None:
    error = _payload_error("lots", Decimal)
    assert "expected a decimal string, got 'lots'" in str(error)


def test_what_validate_accepts_decodes_back() -> None:
    # JSON object keys are strings: a dict with int keys would be stored, then not decode.
    error = _payload_error({1: "a"}, dict[int, str])
    assert error.field == "input['1']"
    assert _serde.decode(_serde.validate({"1": 2}, dict[str, int]), dict[str, int]) == {"1": 2}


# -- error paths ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"plan_id": 5}, "input.plan_id"),
        ({}, "input.plan_id"),
        ({"plan_id": "p", "items": [{"size": 1}, {"size": "big"}]}, "input.items[1].size"),
        ({"plan_id": "p", "items": [{"size": True}]}, "input.items[0].size"),
        ({"plan_id": "p", "items": [{"size": 1, "label": 2}]}, "input.items[0].label"),
        ({"plan_id": "p", "note": 1}, "input.note"),
    ],
)
def test_the_error_names_the_field(value: Any, field: str) -> None:
    error = _payload_error(value, Order)
    assert error.field == field
    assert field in str(error)
    assert isinstance(error, ValueError)


def test_the_error_names_a_nested_dataclass_field() -> None:
    raw = json.loads(_serde.encode(SHIPMENT, Shipment))
    raw["tags"]["a"][1] = "2"
    assert _payload_error(raw, Shipment).field == "input.tags['a'][1]"
    raw = json.loads(_serde.encode(SHIPMENT, Shipment))
    raw["order"]["items"][1]["size"] = "2"
    assert _payload_error(raw, Shipment).field == "input.order.items[1].size"


def test_decode_names_the_field_under_its_own_label() -> None:
    with pytest.raises(PayloadError) as caught:
        _serde.decode('{"plan_id": "p", "items": [{"size": "1"}]}', Order, what="run output")
    assert caught.value.field == "run output.items[0].size"


@pytest.mark.parametrize(
    ("value", "type_", "extra"),
    [
        ({"plan_id": "p", "zzz": 1}, Order, "zzz"),
        ({"plan_id": "p", "items": [{"size": 1, "colour": "red"}]}, Order, "colour"),
        ({**json.loads(_serde.encode(SHIPMENT, Shipment)), "extra": 1}, Shipment, "extra"),
    ],
)
def test_extra_keys_are_rejected(value: Any, type_: Any, extra: str) -> None:
    error = _payload_error(value, type_)
    assert "extra fields" in str(error)
    assert extra in str(error)


# -- hashing ----------------------------------------------------------------------------------


def test_input_hash_ignores_key_order_and_whitespace() -> None:
    one = _serde.input_hash('{"a":1,"b":{"y":[1,2],"x":null}}')
    two = _serde.input_hash('{ "b": {"x": null, "y": [1, 2]},\n "a": 1 }')
    assert one == two
    assert len(one) == 64
    assert int(one, 16) >= 0


@pytest.mark.parametrize(
    "other",
    ['{"a":2,"b":{"y":[1,2],"x":null}}', '{"a":1,"b":{"y":[2,1],"x":null}}', '{"a":1}'],
)
def test_input_hash_tells_different_inputs_apart(other: str) -> None:
    assert _serde.input_hash('{"a":1,"b":{"y":[1,2],"x":null}}') != _serde.input_hash(other)


def test_validated_instance_and_dict_hash_alike() -> None:
    order = Order(plan_id="p", items=[Item(size=1)])
    as_dict = {"items": [{"label": "", "size": 1}], "note": None, "plan_id": "p"}
    assert _serde.input_hash(_serde.validate(order, Order)) == _serde.input_hash(
        _serde.validate(as_dict, Order)
    )


# -- no pickle --------------------------------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}


def _docstrings(tree: ast.AST) -> set[int]:
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            found.add(id(body[0].value))
    return found


def pickle_uses(source: str) -> list[str]:
    """Imports of pickle-like modules and any code (not docs or comments) naming pickle."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        ):
            names = [node.value]
        for name in names:
            if name.split(".")[0] in PICKLE_MODULES or "pickle" in name.lower():
                found.append(f"line {getattr(node, 'lineno', '?')}: {name}")
    return found


def _package_files() -> list[Path]:
    return sorted(
        path
        for package in ("umt_sdk", "umt_backend_memory", "umt_backend_pg")
        if (ROOT / package).is_dir()
        for path in (ROOT / package).rglob("*.py")
    )


def test_no_package_uses_pickle() -> None:
    files = _package_files()
    assert ROOT / "umt_sdk" / "_serde.py" in files
    uses = {p.relative_to(ROOT).as_posix(): pickle_uses(p.read_text()) for p in files}
    assert {name: found for name, found in uses.items() if found} == {}


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import dill as d",
        "from pickle import loads",
        "from cloudpickle import dumps",
        "import importlib\nimportlib.import_module('pickle')",
        "x = obj.__reduce__() if pickler else pickle.dumps(obj)",
    ],
)
def test_the_pickle_scan_finds_uses(source: str) -> None:
    assert pickle_uses(source) != []


def test_the_pickle_scan_ignores_docs() -> None:
    assert pickle_uses('"""No pickle anywhere."""\ndef f():\n    """Not pickle."""\n') == []

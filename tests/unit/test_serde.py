"""Payload serde: JSON round trips, strict primitives, field paths, hashing, and no pickle."""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import attrs
import pytest

from umt_sdk import _serde
from umt_sdk.backend import unstorable_json_reason, unstorable_reason
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


# -- what a backend cannot store --------------------------------------------------------------

NUL = "\x00"
SURROGATE = "\ud800"


def _deep_list(levels: int) -> Any:
    """`levels` nested lists: `[[...]]`, built without recursion."""
    value: list[Any] = []
    inner = value
    for _ in range(levels - 1):
        inner.append([])
        inner = inner[0]
    return value


@pytest.mark.parametrize("bad", [NUL, SURROGATE, "\udfff", "a\ud83d"])
def test_nul_and_lone_surrogates_are_refused_with_the_path(bad: str) -> None:
    order = {"plan_id": "p", "items": [{"size": 1}, {"size": 2, "label": f"x{bad}y"}]}
    assert _payload_error(order, Order).field == "input.items[1].label"
    with pytest.raises(PayloadError) as caught:
        _serde.encode({"a": {"b": ["ok", bad]}}, what="payload of fact 'f'")
    assert caught.value.field == "payload of fact 'f'.a.b[1]"
    assert "payload of fact 'f'.a.b[1]" in str(caught.value)
    with pytest.raises(PayloadError) as caught:
        _serde.encode({f"k{bad}": 1}, what="task output")
    assert caught.value.field.startswith("task output['k")
    assert "key" in str(caught.value)
    # Look-alikes are stored: a surrogate pair is one real character, and a backslash
    # followed by "u0000" or "x00" is text.
    for text in ("😀", "\\u0000", "\\\\u0000", "tab\tand\nnewline", "\\ud800"):
        assert _serde.decode(_serde.encode({text: text})) == {text: text}
        assert _serde.decode(_serde.validate({"plan_id": text}, Order), Order).plan_id == text


@pytest.mark.parametrize(
    "encode",
    [
        lambda v: _serde.encode(v, what="input"),
        lambda v: _serde.validate(v, Any, what="input"),
        lambda v: _serde.validate(v, list[Any], what="input"),
        lambda v: _serde.encode_output(v, Any, what="input"),
        lambda v: _serde.encode_output(v, list[Any], what="input"),
    ],
)
def test_the_depth_limit_is_exact_and_never_a_recursion_error(encode: Any) -> None:
    assert _serde.MAX_DEPTH == 64
    encode(_deep_list(64))  # at the limit: accepted
    for levels in (65, 1_000, 10_000, 100_000):
        with pytest.raises(PayloadError) as caught:
            encode(_deep_list(levels))
        assert "nested deeper than 64 levels" in str(caught.value)
        assert caught.value.field == "input" + "[0]" * 64


def test_depth_counts_objects_and_attrs_values_too() -> None:
    value: Any = {"leaf": 1}
    for _ in range(63):
        value = {"a": value}
    _serde.encode(value)
    with pytest.raises(PayloadError) as caught:
        _serde.encode({"a": value}, what="input")
    assert caught.value.field == "input" + ".a" * 64
    # A thousand levels of attrs instances: cattrs alone would recurse past Python's limit.
    node = Node()
    for _ in range(1_000):
        node = Node(child=node)
    with pytest.raises(PayloadError) as caught:
        _serde.encode(node, Node, what="task output")
    assert caught.value.field == "task output" + ".child" * 64
    shallow = Node(child=Node(child=Node()))
    assert _serde.decode(_serde.encode(shallow, Node), Node) == shallow


@attrs.frozen
class Node:
    child: Node | None = None


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    text = "[" * 1000 + "{" * 1000
    assert _serde.decode(_serde.encode({"s": text})) == {"s": text}
    assert _serde.parse_json(json.dumps({"s": text})) == {"s": text}
    many = [[i] for i in range(500)]  # many containers, two levels
    assert _serde.decode(_serde.encode(many)) == many


def test_the_size_limit_is_in_utf8_bytes() -> None:
    assert _serde.MAX_BYTES == 16 * 1024 * 1024
    _serde.encode("a" * (_serde.MAX_BYTES - 2))  # with its quotes: exactly the limit
    with pytest.raises(PayloadError) as caught:
        _serde.encode("a" * (_serde.MAX_BYTES - 1), what="output of step 'big'")
    assert caught.value.field == "output of step 'big'"
    assert "16 MiB" in str(caught.value)
    with pytest.raises(PayloadError):  # 8 Mi characters, 16 MiB + 2 bytes
        _serde.encode("é" * (_serde.MAX_BYTES // 2))
    with pytest.raises(PayloadError):
        _serde.parse_json('"' + "a" * _serde.MAX_BYTES + '"')


def test_parse_json_refuses_deep_text_before_parsing_it() -> None:
    for text in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(PayloadError) as caught:
            _serde.parse_json(text, what="--input")
        assert "nested deeper than 64 levels" in str(caught.value)
        assert "line 1 column" in str(caught.value)
        assert caught.value.field == "--input"
    truncated = "[" * 100_000  # not even valid JSON: still refused for its depth, not a crash
    with pytest.raises(PayloadError):
        _serde.parse_json(truncated)
    assert _serde.parse_json("[" * 64 + "]" * 64) == _deep_list(64)


@pytest.mark.parametrize(
    ("text", "message", "field"),
    [
        ('{"a": "x\\u0000"}', "NUL", "--input.a"),
        ('["\\ud800"]', "surrogate", "--input[0]"),
        ('{"k\\u0000": 1}', "key", "--input['k\\x00']"),
        ('{"a": NaN}', "nan, which JSON cannot hold", "--input.a"),
        ("[1, 2", "not valid JSON", "--input"),
        ("1" * 5000, "not valid JSON", "--input"),
        (b'{"a": "\xff"}', "not valid UTF-8", "--input"),
    ],
)
def test_parse_json_names_what_is_wrong(text: str | bytes, message: str, field: str) -> None:
    with pytest.raises(PayloadError) as caught:
        _serde.parse_json(text, what="--input")
    assert message in str(caught.value)
    assert caught.value.field == field


def test_parse_json_returns_plain_json() -> None:
    assert _serde.parse_json(b'{"a": [1, 2.5, "\\u00e9", null, true]}') == {
        "a": [1, 2.5, "é", None, True]
    }
    with pytest.raises(PayloadError) as caught:
        _serde.parse_json("[1, 2\n, }", what="--input")
    assert "line 2 column 3" in str(caught.value)


# -- the value a step returns is the value its replays decode ---------------------------------


@pytest.mark.parametrize(
    ("value", "type_", "seen"),
    [
        (3, float, 3.0),
        ((1, 2), list[int], [1, 2]),
        ([1, "a"], tuple[int, str], (1, "a")),
        (
            {"when": datetime(2030, 1, 1, tzinfo=UTC)},
            dict[str, Any],
            {"when": "2030-01-01T00:00:00+00:00"},
        ),
        (Order(plan_id="p", items=[Item(size=1)]), Order, Order(plan_id="p", items=[Item(size=1)])),
        (SHIPMENT, Shipment, SHIPMENT),
        (None, Any, None),
        ({"a": [1, 2.5, None, True, "s"]}, Any, {"a": [1, 2.5, None, True, "s"]}),
    ],
)
def test_encode_output_returns_what_a_replay_decodes(value: Any, type_: Any, seen: Any) -> None:
    text, returned = _serde.encode_output(value, type_, what="output of step 's'")
    replayed = _serde.decode(text, type_, what="output of step 's'")
    assert returned == replayed == seen
    assert type(returned) is type(replayed) is type(seen)


def test_encode_output_hands_back_a_copy_of_a_container() -> None:
    value = {"a": [1]}
    _, returned = _serde.encode_output(value, Any, what="s")
    assert returned == value
    assert returned is not value, "as on a replay, mutating it changes no one else's value"


class Colour(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    ("value", "path", "back"),
    [
        (datetime(2030, 1, 1, tzinfo=UTC), "out", "a str"),
        (date(2030, 1, 1), "out", "a str"),
        (IDENT, "out", "a str"),
        (Decimal("1.5"), "out", "a str"),
        (timedelta(seconds=1), "out", "a float"),
        ((1, 2), "out", "a list"),
        (Item(size=1), "out", "a dict"),
        (SHIPMENT, "out", "a dict"),
        (Colour.RED, "out", "a str"),
        ({"a": [1, (2,)]}, "out.a[1]", "a list"),
        ({1: "a"}, "out", "a str"),
    ],
)
def test_an_untyped_output_must_be_json_and_the_error_says_how_to_fix_it(
    value: Any, path: str, back: str
) -> None:
    with pytest.raises(PayloadError) as caught:
        _serde.encode_output(value, Any, what="out")
    assert caught.value.field == path
    assert f"get back as {back}" in str(caught.value)
    if not isinstance(value, dict) or path != "out":
        assert "output_type=" in str(caught.value)
        assert "annotate" in str(caught.value)


def test_an_untyped_output_that_json_cannot_hold_at_all_says_so() -> None:
    with pytest.raises(PayloadError) as caught:
        _serde.encode_output({"a": object()}, Any, what="out")
    assert caught.value.field == "out.a"
    assert "cannot be stored as JSON" in str(caught.value)
    with pytest.raises(PayloadError) as caught:
        _serde.encode_output([float("nan")], Any, what="out")
    assert caught.value.field == "out[0]"
    with pytest.raises(PayloadError) as caught:
        _serde.encode({"n": 10**5000}, what="out")
    assert caught.value.field == "out.n"
    assert "4300 digits" in str(caught.value)


def test_a_typed_output_that_does_not_fit_its_type_is_refused_at_once() -> None:
    with pytest.raises(PayloadError) as caught:
        _serde.encode_output("five", int, what="output of step 's'")
    assert caught.value.field == "output of step 's'"


# -- text umt stores itself -------------------------------------------------------------------


def test_clean_text_escapes_what_cannot_be_stored_and_keeps_the_rest() -> None:
    assert _serde.clean_text("a\x00b\ud800c\udfff") == "a\\x00b\\ud800c\\udfff"
    for text in ("plain", "é😀", "\\x00 already text", ""):
        assert _serde.clean_text(text) is text


def test_check_text_names_the_field() -> None:
    assert _serde.check_text("fine", what="reason") == "fine"
    for bad in ("a\x00", "\ud800"):
        with pytest.raises(PayloadError) as caught:
            _serde.check_text(bad, what="idempotency_key")
        assert caught.value.field == "idempotency_key"


# -- the one rule of what a backend cannot store ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("plain", None),
        ("é😀", None),
        ("\\x00 is four characters", None),
        ("a\x00b", "NUL"),
        ("a\ud800b", "lone surrogate"),
    ],
)
def test_unstorable_reason_is_the_rule_the_backends_share(text: str, reason: str | None) -> None:
    found = unstorable_reason(text)
    assert (found is None) if reason is None else (found is not None and reason in found)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"a":["ok","😀"]}', None),
        ('"\\ud83d\\ude00"', None),  # an escaped surrogate pair is one character
        ('"a \\\\u0000 b"', None),  # a backslash, then the text u0000: storable
        ('{"a":"x\\u0000y"}', "NUL"),
        ('{"k\\u0000":1}', "NUL"),
        ('["\\ud800"]', "lone surrogate"),
        ('"x\ud800"', "lone surrogate"),
    ],
)
def test_unstorable_json_reason_looks_into_escapes(text: str, reason: str | None) -> None:
    found = unstorable_json_reason(text)
    assert (found is None) if reason is None else (found is not None and reason in found)

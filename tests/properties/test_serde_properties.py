"""Properties of payload serde: what is stored decodes back to what every execution sees, and a
string no backend can store is always refused, naming where it is."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import json_values, planted_bad_strings, storable_text, unstorable_text
from umt_sdk import _serde
from umt_sdk.exceptions import PayloadError


@attrs.frozen
class Record:
    name: str
    when: datetime
    ident: UUID
    amount: Decimal
    window: timedelta
    pair: tuple[int, str]
    tags: dict[str, list[float]]
    extra: Record | None = None


records = st.recursive(
    st.builds(
        Record,
        name=storable_text,
        when=st.datetimes(timezones=st.just(UTC)),
        ident=st.uuids(),
        amount=st.decimals(allow_nan=False, allow_infinity=False),
        window=st.timedeltas(min_value=timedelta(days=-1000), max_value=timedelta(days=1000)).map(
            lambda d: timedelta(seconds=round(d.total_seconds(), 3))
        ),
        pair=st.tuples(st.integers(), storable_text),
        tags=st.dictionaries(
            storable_text, st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=3)
        ),
    ),
    lambda inner: st.builds(lambda base, extra: attrs.evolve(base, extra=extra), inner, inner),
    max_leaves=3,
)


@given(json_values)
def test_json_values_round_trip_untyped(value: Any) -> None:
    text, seen = _serde.encode_output(value, Any, what="out")
    assert seen == value
    assert _serde.decode(text) == value
    assert _serde.decode(_serde.encode(value)) == value
    assert _serde.parse_json(text) == value
    assert _serde.decode(_serde.validate(value, Any)) == value


@given(records)
def test_typed_values_round_trip_and_the_first_execution_sees_the_replay(value: Record) -> None:
    text, seen = _serde.encode_output(value, Record, what="out")
    replayed = _serde.decode(text, Record, what="out")
    assert seen == replayed == value
    assert _serde.decode(_serde.validate(value, Record), Record) == value


@given(planted_bad_strings())
def test_an_unstorable_string_is_always_refused_naming_its_path(
    planted: tuple[Any, str, bool],
) -> None:
    value, path, as_key = planted
    for refuse in (
        lambda: _serde.encode(value, what="input"),
        lambda: _serde.validate(value, Any, what="input"),
        lambda: _serde.encode_output(value, Any, what="input"),
        lambda: _serde.parse_json(json.dumps(value), what="input"),
    ):
        with pytest.raises(PayloadError) as caught:
            refuse()
        if as_key:
            assert caught.value.field.startswith(f"input{path}["), (caught.value.field, path)
            assert "key" in str(caught.value)
        else:
            assert caught.value.field == f"input{path}"


@given(unstorable_text)
def test_error_text_is_cleaned_never_refused(text: str) -> None:
    cleaned = _serde.clean_text(text)
    assert _serde.check_text(cleaned, what="error") == cleaned
    assert _serde.decode(_serde.encode(cleaned)) == cleaned


@given(st.integers(min_value=1, max_value=200), st.booleans())
def test_the_depth_limit_holds_for_any_nesting(levels: int, objects: bool) -> None:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value} if objects else [value]
    text = json.dumps(value)
    if levels <= _serde.MAX_DEPTH:
        assert _serde.decode(_serde.encode(value)) == value
        assert _serde.parse_json(text) == value
    else:
        for refuse in (lambda: _serde.encode(value), lambda: _serde.parse_json(text)):
            with pytest.raises(PayloadError, match=f"{_serde.MAX_DEPTH} levels"):
                refuse()


@given(records, st.dictionaries(st.integers(), storable_text, max_size=4))
def test_one_encode_gives_the_text_and_the_hash_of_that_text(
    value: Record, int_keys: dict[int, str]
) -> None:
    """Enqueue encodes once: the hash comes from the same text, and is the one `input_hash`
    gives that text (the hash of stored runs must not change: keys sort as JSON strings)."""
    for payload, type_ in ((value, Record), (int_keys, Any)):
        text, digest = _serde.encode_input(payload, type_)
        assert text == _serde.validate(payload, type_)
        assert digest == _serde.input_hash(text)

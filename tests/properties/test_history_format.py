"""The exported history format (`umt.history`, version 1): any history round-trips through
`to_json`/`from_json`, and any garbage line is refused with a `PayloadError` naming the line,
never another exception."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import json_values, storable_text
from umt_sdk import ErrorInfo, HistoryStep, RunHistory
from umt_sdk.exceptions import PayloadError

_INDIA = timezone(timedelta(hours=5, minutes=30))
times = st.datetimes(
    min_value=datetime(2000, 1, 1),
    max_value=datetime(2100, 1, 1),
    timezones=st.sampled_from([UTC, _INDIA]),
)
names = storable_text.filter(lambda s: s != "")
errors = st.none() | st.builds(ErrorInfo, type=names, message=storable_text)

steps = st.builds(
    HistoryStep,
    name=names,
    kind=st.sampled_from(["step", "sleep", "fact"]),
    status=st.sampled_from(["completed", "failed", "retrying", "waiting"]),
    attempt=st.integers(1, 10),
    output=json_values,
    error=errors,
    started_at=st.none() | times,
    finished_at=st.none() | times,
    wake_at=st.none() | times,
)

histories = st.builds(
    RunHistory,
    run_id=st.uuids(),
    task=names,
    version=st.integers(1, 1000),
    status=st.sampled_from(
        ["pending", "running", "waiting", "completed", "failed", "canceled", "compensated"]
    ),
    input=json_values,
    created_at=times,
    finished_at=st.none() | times,
    output=json_values,
    error=errors,
    steps=st.lists(steps, max_size=6).map(tuple),
)


@given(histories)
def test_any_history_round_trips(history: RunHistory) -> None:
    text = history.to_json()
    assert "\n" not in text
    assert RunHistory.from_json(text) == history
    assert RunHistory.from_jsonl(f"{text}\n\n{text}\n") == [history, history]


def _line(history: RunHistory) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(history.to_json())
    return raw


@given(histories, st.data())
def test_a_broken_field_is_named(history: RunHistory, data: st.DataObject) -> None:
    raw = _line(history)
    field = data.draw(
        st.sampled_from(["run_id", "task", "version", "status", "created_at", "steps"]),
        label="field",
    )
    raw[field] = data.draw(
        st.sampled_from([None, True, -1, 0, "", "x", [], {}, 1.5]).filter(
            lambda v: not (field == "task" and v == "x") and not (field == "steps" and v == [])
        ),
        label="value",
    )
    text = json.dumps(raw)
    with pytest.raises(PayloadError) as caught:
        RunHistory.from_jsonl(f"\n{text}\n", source="h.jsonl")
    message = str(caught.value)
    assert message.startswith("h.jsonl line 2: "), message
    assert field in message, message


@given(st.text(max_size=200) | st.binary(max_size=200) | json_values.map(json.dumps))
def test_garbage_is_a_payload_error_naming_the_line(garbage: Any) -> None:
    refused: PayloadError | None = None
    result: list[RunHistory] = []
    try:
        result = RunHistory.from_jsonl(garbage, source="in.jsonl")
    except PayloadError as exc:
        refused = exc
    if refused is None:
        assert result == []  # only blank lines
    else:
        assert str(refused).startswith("in.jsonl"), str(refused)


def test_an_unknown_format_version_is_refused() -> None:
    raw = _line(
        RunHistory(
            run_id=uuid.uuid4(),
            task="t",
            version=1,
            status="completed",
            input=None,
            created_at=datetime(2030, 1, 1, tzinfo=UTC),
        )
    )
    for version in (2, 0, "1", None, True):
        raw["format_version"] = version
        with pytest.raises(PayloadError, match=r"format_version .* is not one this umt reads"):
            RunHistory.from_json(json.dumps(raw), where="line 1")
    raw["format_version"] = 1
    raw["format"] = "temporal.history"
    with pytest.raises(PayloadError, match=r"line 1: format: expected 'umt\.history'"):
        RunHistory.from_json(json.dumps(raw), where="line 1")

"""`umt events publish` and `umt events list`: an event starts each known subscriber once, a
repeat starts nothing, the list shows each event with its runs; bad input is one line naming
the argument, and nothing is stored."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.cli.test_cli import Umt, one_error_line

EVENTS = "tests.integration.cli.event_tasks:registry"
PLACED = "shop.order.placed"


def _publish(umt: Umt, *args: str) -> dict[str, Any]:
    out = umt.ok("events", "publish", *args, "--registry", EVENTS, "--json").stdout
    data: dict[str, Any] = json.loads(out)  # the command's JSON, read as the user reads it
    return data


def test_publish_starts_each_subscriber_once_and_list_shows_the_runs(umt: Umt) -> None:
    first = _publish(umt, PLACED, "--payload", '{"order_id": "o1", "amount": 2}', "--key", "o1")
    assert first["created"] is True
    assert sorted(r["task"] for r in first["runs"]) == ["shop.mail", "shop.stock"]
    again = umt.ok(
        "events",
        "publish",
        PLACED,
        "--payload",
        '{"order_id": "o1", "amount": 2}',
        "--key",
        "o1",
        "--registry",
        EVENTS,
    )
    assert again.stdout.strip() == first["event_id"]
    assert "already published: nothing started" in again.stderr
    alone = umt.ok("events", "publish", "shop.nobody.listens")
    assert "stored alone" in alone.stderr

    listed = json.loads(umt.ok("events", "list", "--json").stdout)
    assert [e["name"] for e in listed] == ["shop.nobody.listens", PLACED]
    placed = listed[1]
    assert (placed["event_id"], placed["key"], placed["payload"]) == (
        first["event_id"],
        "o1",
        {"order_id": "o1", "amount": 2},
    )
    assert sorted((r["task"], r["status"]) for r in placed["runs"]) == [
        ("shop.mail", "pending"),
        ("shop.stock", "pending"),
    ]
    assert listed[0]["runs"] == []
    text = umt.ok("events", "list", "--name", PLACED).stdout
    for shown in ("shop.mail@1", "shop.stock@1", "pending"):
        assert shown in text
    assert "shop.nobody.listens" not in text
    page = umt.ok("events", "list", "--limit", "1")
    assert f"--limit 1 --before {listed[0]['event_id']})" in page.stderr
    older = json.loads(
        umt.ok("events", "list", "--json", "--before", str(listed[0]["event_id"])).stdout
    )
    assert [e["event_id"] for e in older] == [first["event_id"]]


def test_bad_input_is_refused_naming_the_argument_and_nothing_is_stored(umt: Umt) -> None:
    cases = [
        (["events", "publish", "order placed"], 2, "NAME must be an event name"),
        (["events", "publish", "é"], 2, "NAME must be an event name"),
        (["events", "publish", PLACED, "--payload", "{nope"], 2, "'--payload'"),
        (["events", "publish", PLACED, "--key", ""], 2, "--key must be 1 to 512"),
        (
            ["events", "publish", PLACED, "--payload", '{"amount": 1}', "--registry", EVENTS],
            2,
            "shop.mail",
        ),
        (["events", "list", "--name", "a b"], 2, "--name must be an event name"),
        (["events", "list", "--before", "nope"], 2, "--before must be an event id"),
    ]
    for args, code, says in cases:
        result = umt(*args)
        assert result.exit_code == code, (args, result.output)
        assert says in one_error_line(result), (args, result.stderr)
    umt.ok("events", "publish", PLACED, "--payload", '{"order_id": "o9"}', "--key", "k")
    conflict = umt("events", "publish", PLACED, "--payload", '{"order_id": "o8"}', "--key", "k")
    assert conflict.exit_code == 1
    assert "k" in one_error_line(conflict)
    listed = json.loads(umt.ok("events", "list", "--json").stdout)
    assert [e["payload"] for e in listed] == [{"order_id": "o9"}]

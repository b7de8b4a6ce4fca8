"""`umt limits list|show|set|pause|resume` against the test Postgres, and the errors of a bad
command line."""

from __future__ import annotations

import json

from tests.integration.cli.test_cli import Umt, one_error_line


def test_limits_are_set_listed_shown_paused_and_resumed(umt: Umt) -> None:
    assert umt.ok("limits", "list").stdout.strip() == "no rate limits stored"
    stored = umt.ok("limits", "set", "openai", "--limit", "600", "--per", "1m").stdout.strip()
    assert stored == "openai: 600 per 1m (one token every 100ms)"
    umt.ok("limits", "set", "email", "--limit", "5", "--per", "1h")
    listed = json.loads(umt.ok("limits", "list", "--json").stdout)
    assert [(i["name"], i["limit"], i["per_seconds"], i["paused"]) for i in listed] == [
        ("email", 5, 3600.0, False),
        ("openai", 600, 60.0, False),
    ]
    table = umt.ok("limits", "list").stdout
    assert "600 per 1m" in table
    assert "12m" in table, "one token every 12 minutes"

    changed = umt.ok("limits", "set", "openai", "--limit", "1200", "--per", "1m").stdout
    assert changed.strip() == "openai: 1200 per 1m (one token every 50ms)"
    assert umt.ok("limits", "pause", "openai").stdout.strip() == "paused openai"
    assert "paused already" in umt.ok("limits", "pause", "openai").stdout
    shown = json.loads(umt.ok("limits", "show", "openai", "--json").stdout)
    assert (shown["limit"], shown["paused"]) == (1200, True)
    assert "paused" in umt.ok("limits", "show", "openai").stdout
    assert umt.ok("limits", "resume", "openai").stdout.strip() == "resumed openai"
    assert "not paused" in umt.ok("limits", "resume", "openai").stdout


def test_bad_limits_on_the_command_line_say_what_to_fix(umt: Umt) -> None:
    bad_name = umt("limits", "set", "open ai", "--limit", "5", "--per", "1m")
    assert bad_name.exit_code == 2
    assert "letters, digits" in one_error_line(bad_name)
    zero = umt("limits", "set", "openai", "--limit", "0", "--per", "1m")
    assert zero.exit_code == 2
    assert "limit must be an integer from 1" in one_error_line(zero)
    no_window = umt("limits", "set", "openai", "--limit", "5", "--per", "0s")
    assert no_window.exit_code == 2
    assert "per must be a timedelta > 0" in one_error_line(no_window)
    unknown = umt("limits", "pause", "nobody")
    assert unknown.exit_code == 2
    assert "no rate limit of that name" in one_error_line(unknown)
    missing = umt("limits", "show", "nobody")
    assert missing.exit_code == 2
    assert "umt limits list" in one_error_line(missing)

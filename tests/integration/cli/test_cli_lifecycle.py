"""`umt tasks pause|resume|paused` and `umt runs rerun|fork` against the test Postgres: one run
or every finished run a filter matches, with --dry-run and the confirmation, and the errors of
a bad command line."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.cli import app_tasks
from tests.integration.cli.test_cli import Umt, one_error_line, work_until


@pytest.fixture(autouse=True)
def broken_checkouts() -> Iterator[None]:
    """Every test starts with the card service broken and nothing prepared."""
    app_tasks.FIXED_ORDERS.clear()
    app_tasks.PREPARED.clear()
    yield
    app_tasks.FIXED_ORDERS.clear()
    app_tasks.PREPARED.clear()


def test_a_paused_task_waits_until_it_is_resumed(umt: Umt) -> None:
    assert umt.ok("tasks", "pause", "greet@1").stdout.startswith("paused greet@1")
    assert "was paused already" in umt.ok("tasks", "pause", "greet@1").stdout
    listed = json.loads(umt.ok("tasks", "paused", "--json").stdout)
    assert [(p["task"], p["version"]) for p in listed] == [("greet", 1)]
    assert "greet" in umt.ok("tasks", "paused").stdout

    paused = umt.enqueue("greet@1", {"name": "Ada"})
    newer = umt.enqueue("greet@2", {"name": "Bo"})
    assert work_until(umt, newer, {"completed"}) == "completed"
    held = umt.show(paused)
    assert (held["status"], held["attempts"]) == ("pending", 0), "never claimed while paused"

    umt.ok("tasks", "pause", "greet")
    refused = umt("tasks", "resume", "greet@1")
    assert refused.exit_code == 2
    assert "paused as a whole" in one_error_line(refused)
    assert umt.ok("tasks", "resume", "greet").stdout.strip() == "resumed greet"
    assert "not paused" in umt.ok("tasks", "resume", "greet").stdout
    assert umt.ok("tasks", "paused").stdout.strip() == "no paused tasks"
    assert work_until(umt, paused, {"completed"}) == "completed"

    bad = umt("tasks", "pause", "greet now")
    assert bad.exit_code == 2
    assert "letters, digits" in one_error_line(bad)


def test_runs_rerun_one_run_or_every_run_a_filter_matches(umt: Umt) -> None:
    first = umt.enqueue("greet@1", {"name": "Ada"})
    second = umt.enqueue("greet@1", {"name": "Bo"})
    for run_id in (first, second):
        assert work_until(umt, run_id, {"completed"}) == "completed"

    again = umt.ok("runs", "rerun", first).stdout.strip()
    shown = umt.show(again)
    assert (shown["rerun_of"], shown["status"]) == (first, "pending")
    assert "rerun of" in umt.ok("runs", "show", again).stdout
    unfinished = umt("runs", "rerun", again)
    assert unfinished.exit_code == 2
    assert "still pending" in one_error_line(unfinished)

    everything = umt("runs", "rerun")
    assert everything.exit_code == 2
    assert "needs a RUN, or a filter" in one_error_line(everything)

    dry = umt.ok("runs", "rerun", "--task", "greet@1", "--status", "completed", "--dry-run")
    assert sorted(line.split()[0] for line in dry.stdout.splitlines()) == sorted([first, second])
    assert "would rerun 2 run(s)" in dry.stderr
    declined = umt("runs", "rerun", "--task", "greet", "--since", "1h", input="n\n")
    assert declined.exit_code == 1
    assert "rerun 2 run(s)?" in declined.stderr
    assert len(json.loads(umt.ok("runs", "list", "--json").stdout)) == 3, "nothing started"

    done = umt.ok("runs", "rerun", "--task", "greet", "--status", "completed", "--yes")
    pairs = [line.split() for line in done.stdout.splitlines()]
    assert sorted(old for old, _ in pairs) == sorted([first, second])
    for old, new in pairs:
        assert umt.show(new)["rerun_of"] == old
    assert "reran 2 run(s)" in done.stderr


def test_runs_fork_resumes_the_failed_runs_from_the_broken_step(umt: Umt) -> None:
    orders = [umt.enqueue("checkout", {"order_id": f"o{i}"}) for i in (1, 2)]
    other = umt.enqueue("boom", {"order_id": "x"})  # failed, but never reached `charge`
    for run_id in (*orders, other):
        assert work_until(umt, run_id, {"failed"}) == "failed"
    assert sorted(app_tasks.PREPARED) == ["o1", "o2"]
    app_tasks.FIXED_ORDERS.update({"o1", "o2"})  # the bug is fixed

    dry = umt.ok("runs", "fork", "--from-step", "charge", "--status", "failed", "--dry-run")
    assert sorted(line.split()[0] for line in dry.stdout.splitlines()) == sorted(orders)
    assert "would fork from 'charge', keeping prepare" in dry.stdout
    assert (
        "would fork 2 run(s) from step 'charge'; skipped 1: never recorded the step" in dry.stderr
    )

    done = umt.ok("runs", "fork", "--from-step", "charge", "--status", "failed", "--yes")
    pairs = [line.split() for line in done.stdout.splitlines()]
    assert sorted(old for old, _ in pairs) == sorted(orders)
    for old, new in pairs:
        assert work_until(umt, new, {"completed"}) == "completed"
        shown = umt.show(new)
        assert (shown["forked_from"], shown["forked_at_step"]) == (old, "charge")
        assert [s["name"] for s in shown["timeline"]] == ["prepare", "charge"]
        assert shown["output"].startswith("prepared o")
    assert sorted(app_tasks.PREPARED) == ["o1", "o2"], "kept steps are replayed, never re-run"
    assert "forked from" in umt.ok("runs", "show", pairs[0][1]).stdout

    missing = umt("runs", "fork", orders[0], "--from-step", "nope")
    assert missing.exit_code == 2
    assert "never recorded a step 'nope' (its steps: 'prepare', 'charge')" in one_error_line(
        missing
    )
    single = umt.ok("runs", "fork", orders[0], "--from-step", "prepare", "--dry-run")
    assert "keeping none" in single.stdout
    everything = umt("runs", "fork", "--from-step", "charge")
    assert everything.exit_code == 2
    older = umt("runs", "fork", orders[0], "--from-step", "charge", "--version", "0")
    assert older.exit_code == 2

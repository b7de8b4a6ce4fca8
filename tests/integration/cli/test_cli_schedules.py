"""`umt schedules ...` against the test Postgres: create (idempotent), list, show, pause,
resume, trigger, backfill and delete, and the errors of a bad command line."""

from __future__ import annotations

import json

from tests.integration.cli.test_cli import REGISTRY, Umt, one_error_line


def test_a_schedule_from_create_to_delete(umt: Umt) -> None:
    create = (
        "schedules", "create", "nightly", "greet", "--cron", "0 3 * * *",
        "--timezone", "Europe/Paris", "--input", '{"name": "Ada"}', "--registry", REGISTRY,
        "--json",
    )  # fmt: skip
    first = json.loads(umt.ok(*create).stdout)
    assert (first["task"], first["cron"], first["timezone"], first["paused"]) == (
        "greet",
        "0 3 * * *",
        "Europe/Paris",
        False,
    )
    assert json.loads(umt.ok(*create).stdout) == first, "creating again changes nothing"
    listed = umt.ok("schedules", "list").stdout
    assert "nightly" in listed
    assert "Europe/Paris" in listed
    assert json.loads(umt.ok("schedules", "pause", "nightly", "--json").stdout)["paused"] is True
    assert "paused" in umt.ok("schedules", "list").stdout
    assert json.loads(umt.ok("schedules", "resume", "nightly", "--json").stdout)["paused"] is False

    run_id = umt.ok("schedules", "trigger", "nightly", "--registry", REGISTRY).stdout.strip()
    info = umt.show(run_id)
    assert info["task"] == "greet"
    assert info["idempotency_key"].startswith("umt.schedule:nightly:")

    backfill = (
        "schedules", "backfill", "nightly", "--start", "2030-01-01T00:00:00Z",
        "--end", "2030-01-04T00:00:00+00:00", "--registry", REGISTRY,
    )  # fmt: skip
    made = umt.ok(*backfill)
    assert len(made.stdout.split()) == 3
    assert "3 new run(s)" in made.stderr
    again = umt.ok(*backfill)
    assert again.stdout == made.stdout, "a backfilled tick keeps its run"
    assert "0 new run(s)" in again.stderr

    shown = json.loads(umt.ok("schedules", "show", "nightly", "--json").stdout)
    assert shown["last_run_id"] == run_id
    assert umt.ok("schedules", "delete", "nightly").stdout.strip() == "deleted schedule 'nightly'"
    missing = umt("schedules", "show", "nightly")
    assert missing.exit_code == 1
    assert "no schedule named 'nightly'" in one_error_line(missing)


def test_bad_schedules_are_refused_with_one_line(umt: Umt) -> None:
    base = ("schedules", "create", "s", "greet", "--input", '{"name": "Ada"}')
    for args, code, words in [
        (("--cron", "0 3 * *", "--registry", REGISTRY), 2, "minute hour"),
        (("--cron", "0 3 * * *", "--timezone", "Mars/Olympus", "--registry", REGISTRY), 2,
         "unknown time zone 'Mars/Olympus'"),
        (("--cron", "0 3 * * *"), 2, "UMT_REGISTRY"),
    ]:  # fmt: skip
        result = umt(*base, *args)
        assert result.exit_code == code, result.output
        assert words in one_error_line(result)
    unknown = umt("schedules", "create", "s", "gret", "--cron", "0 3 * * *", "--registry", REGISTRY)
    assert unknown.exit_code == 1
    assert "no task named 'gret'" in one_error_line(unknown)
    naive = umt(
        "schedules", "backfill", "s", "--start", "2030-01-01T00:00", "--end", "2030-01-02T00:00Z",
        "--registry", REGISTRY,
    )  # fmt: skip
    assert naive.exit_code == 2
    assert "no UTC offset" in naive.output
    assert umt.ok("schedules", "list").stdout.strip() == "no schedules"

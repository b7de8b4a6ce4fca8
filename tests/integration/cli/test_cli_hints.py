"""Every hint the `umt` command line prints is a command that works: each is followed here, as
printed, and must do what it says (the paging hint of `runs list` keeps every filter; the
migrate hint creates the missing schema). The embedded Postgres's `umt db` hints are followed
in test_cli.py (`test_db_start_keeps_a_server_that_outlives_the_cli`)."""

from __future__ import annotations

import json
import re
import shlex
import uuid

import psycopg
from click.testing import CliRunner, Result
from psycopg import sql

from tests.integration.cli.test_cli import Umt
from umt_sdk.cli import cli


def typed(command: str, url: str) -> Result:
    """Run `command` as an operator would type it (`umt ...`), the database URL coming from
    the environment as in their shell."""
    words = shlex.split(command)
    assert words[0] == "umt", command
    return CliRunner().invoke(
        cli, words[1:], env={"UMT_DATABASE_URL": url, "UMT_SCHEMA": None}, catch_exceptions=False
    )


def paging_hint(result: Result) -> str | None:
    match = re.search(r"^\(more: (?P<command>.+)\)$", result.stderr, re.MULTILINE)
    if match is None:
        return None
    return match["command"].removesuffix(", with your --database-url")


def ids_of(table: str) -> list[str]:
    return [line.split()[0] for line in table.strip().splitlines()[1:]]


def test_the_paging_hint_of_runs_list_repeats_every_filter(umt: Umt) -> None:
    greets = [umt.enqueue("greet@1", {"name": n}) for n in ("a", "b", "c")]
    umt.enqueue("greet@2", {"name": "other version"})
    umt.enqueue("approval", {"order_id": "o1"})
    umt.ok("cancel", greets[1], "--reason", "not this one")
    wanted = [
        r["run_id"]
        for r in json.loads(
            umt.ok("runs", "list", "--json", "--task", "greet@1", "--status", "pending").stdout
        )
    ]
    assert wanted == [greets[2], greets[0]]

    first = umt.ok("runs", "list", "--task", "greet@1", "--status", "pending", "--limit", "1")
    seen = ids_of(first.stdout)
    hint = paging_hint(first)
    followed = 0
    while hint is not None:
        for option in ("--task greet@1", "--status pending", "--limit 1", f"--schema {umt.schema}"):
            assert option in hint, hint
        page = typed(hint, umt.url)
        assert page.exit_code == 0, page.output
        seen += [] if page.stdout.strip() == "no runs" else ids_of(page.stdout)
        hint = paging_hint(page)
        followed += 1
    assert followed >= 1
    assert seen == wanted, "following the hints lists the filtered runs, and only them"


def test_the_hint_of_a_missing_schema_creates_it(pg_url: str) -> None:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    umt = Umt(pg_url, schema)
    try:
        missing = umt("runs", "list")
        assert missing.exit_code == 1
        match = re.search(r"`(?P<command>umt [^`]+)`", missing.stderr)
        assert match is not None, missing.stderr
        assert typed(match["command"], pg_url).exit_code == 0
        assert umt.ok("runs", "list").stdout.strip() == "no runs"
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))

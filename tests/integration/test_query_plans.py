"""Statements that touch one run by id read `runs` through its primary key, whatever the
statistics say.

Psycopg prepares a statement after a few executions, and Postgres then may switch to a generic
plan. A `status = 'running'` next to `id = $1` lets that plan scan a partial index whose
predicate the status implies (`runs_claim_timers`) and filter on the id: cheaper by the
statistics when few runs are running, and under a snapshot held open elsewhere that index holds
the dead running version of every run claimed since, so each ending read tens of thousands of
entries (found with auto_explain in the idle-in-tx scenario). The statements read `runs` by id
alone and test the status afterwards (see the note at the top of queries.sql); this test shows
the generic plan of each, with statistics that make the partial indexes look tiny.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from umt_backend_pg._sql import queries, render

BY_ID = {
    "end_execution": {"runs_pkey"},
    "heartbeat": {"runs_pkey"},
    "record_steps": {"runs_pkey"},
    "ledger_check_run": {"runs_pkey"},
    "cancel_run": {"runs_pkey"},
    "lock_for_cancel": {"runs_pkey"},
    "get_run": {"runs_pkey"},
    # A broadcast fact reads the runs waiting for its name; a run's own fact reads it by id.
    "insert_fact": {"runs_pkey", "runs_waiting_for"},
    # A stream's write is fenced by the run's token, read by id.
    "append_stream": {"runs_pkey"},
    # A canceled member of a child group counts itself out of its group.
    "group_member_canceled": {"runs_pkey"},
    # Rate limits: a step's token is fenced by its run, read by id; a change or a resume of a
    # limit wakes the runs waiting for it through its own partial index, never a scan.
    "take_rate_token": {"runs_pkey"},
    "unpark_rate_limited": {"runs_waits_for_limit"},
}


def generic(query: str) -> str:
    """psycopg's %(name)s placeholders as $n, for EXPLAIN (GENERIC_PLAN)."""
    names: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        return f"${names.setdefault(m.group(1), len(names) + 1)}"

    return re.sub(r"%\((\w+)\)s", number, query)


def indexes_on_runs(plan: Any, found: set[str]) -> set[str]:
    if isinstance(plan, dict):
        if plan.get("Relation Name") == "runs" and plan["Node Type"] != "ModifyTable":
            found.add(plan.get("Index Name") or plan["Node Type"])
        for value in plan.values():
            indexes_on_runs(value, found)
    elif isinstance(plan, list):
        for value in plan:
            indexes_on_runs(value, found)
    return found


@pytest.fixture
def filled(pg_url: str, pg_schema: str) -> str:
    """20,000 finished runs and a handful of running, waiting and pending ones, analyzed."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.runs (id, task_name, task_version, status, available_at, "
                "input_hash, input, fencing_token, wait_for, lease_expires_at) "
                "SELECT gen_random_uuid(), 't', 1, "
                "CASE WHEN g <= 20000 THEN 'completed' "
                "     ELSE (ARRAY['running', 'waiting', 'pending'])[g % 3 + 1] END, "
                "now(), 'h', '{{}}'::jsonb, g, "
                "CASE WHEN g > 20000 AND g % 3 = 1 THEN 'f' || g END, now() "
                "FROM generate_series(1, 20020) AS g"
            ).format(s=sql.Identifier(pg_schema))
        )
        conn.execute(sql.SQL("ANALYZE {}.runs").format(sql.Identifier(pg_schema)))
    return pg_schema


def generic_plan(pg_url: str, name: str, schema: str) -> Any:
    text = generic(render(queries()[name], schema))
    with psycopg.connect(pg_url) as conn:
        try:
            (plan,) = conn.execute(
                "EXPLAIN (GENERIC_PLAN, FORMAT JSON) " + text  # our own statements
            ).fetchone() or (None,)
        finally:
            conn.rollback()
    return json.loads(plan) if isinstance(plan, str) else plan


@pytest.mark.parametrize("name", sorted(BY_ID))
def test_a_statement_by_id_reads_runs_by_its_key(name: str, pg_url: str, filled: str) -> None:
    used = indexes_on_runs(generic_plan(pg_url, name, filled), set())
    assert used, f"{name}: no read of runs in the plan"
    assert used <= BY_ID[name], f"{name} reads runs through {sorted(used - BY_ID[name])}"


HISTORY = 200_000


def test_a_retention_batch_reads_runs_only_through_indexes(pg_url: str, filled: str) -> None:
    """A batch reads the oldest finished runs of a task (`runs_finished`) and probes, for each,
    its unfinished children (`runs_children`) and its parent (`runs_pkey`). Written as NOT
    EXISTS, the parent check was planned as an anti join against a sequential scan of every
    run, once per batch: 338,000 buffers a batch over ten million finished runs. The plan is
    the one a batch of 500 gets (its limit known: a generic plan guesses the batch's size)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.runs (id, task_name, task_version, status, input_hash, input, "
                "finished_at) SELECT gen_random_uuid(), 'old.' || g %% 20, 1, 'completed', 'h', "
                "'{{}}'::jsonb, now() - interval '60 days' - g * interval '1 ms' "
                "FROM generate_series(1, %s) AS g"
            ).format(s=sql.Identifier(filled)),
            (HISTORY,),
        )
        conn.execute(sql.SQL("ANALYZE {}.runs").format(sql.Identifier(filled)))
    params = {
        "older_than": timedelta(days=1),
        "task_names": None,
        "exclude_task_names": [],
        "limit": 500,
        "lock_name": f"{filled}.prune",
    }
    with psycopg.connect(pg_url) as conn:
        try:
            row = conn.execute(
                "EXPLAIN (FORMAT JSON) " + render(queries()["prune_runs"], filled), params
            ).fetchone()
        finally:
            conn.rollback()
    assert row is not None
    plan = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    used = indexes_on_runs(plan, set())
    assert "runs_finished" in used, used
    allowed = {"runs_finished", "runs_children", "runs_pkey"}
    assert used <= allowed, f"prune_runs reads runs through {sorted(used - allowed)}"

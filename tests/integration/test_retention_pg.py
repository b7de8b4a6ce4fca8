"""Retention on Postgres: several pruners at once delete each run once, in batches, with
everything stored for it; one pruner at a time (a batch that finds another at work does
nothing); unfinished runs and their families are never touched."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from umt_backend_pg._sql import queries, render
from umt_sdk import connect
from umt_sdk.backend import PruneBatch, PruneQuery, RetentionStore

OLD_RUNS = 1500
BATCH = 100


def _fill(pg_url: str, schema: str) -> None:
    """1500 runs finished two days ago, each with a step, an execution, a fact and a tag (a
    third of them keyed), and old pending, running and waiting runs that must stay."""
    s = sql.Identifier(schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.runs (id, task_name, task_version, status, input_hash, input, "
                "idempotency_key, created_at, finished_at, tags) "
                "SELECT gen_random_uuid(), 'old', 1, "
                "(ARRAY['completed', 'failed', 'canceled'])[g %% 3 + 1], 'h' || g, '{{}}', "
                "CASE WHEN g %% 3 = 0 THEN 'key-' || g END, now() - interval '3 days', "
                "now() - interval '2 days' - g * interval '1 second', "
                "jsonb_build_object('tenant', 't' || g %% 5) "
                "FROM generate_series(1, %s) AS g"
            ).format(s=s),
            (OLD_RUNS,),
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.runs (id, task_name, task_version, status, input_hash, input, "
                "created_at, available_at, lease_expires_at, wait_for) "
                "SELECT gen_random_uuid(), 'old', 1, st, 'h', '{{}}', now() - interval '3 days', "
                "now() + interval '1 day', now() - interval '2 days', "
                "CASE WHEN st = 'waiting' THEN 'never' END "
                "FROM unnest(ARRAY['pending', 'running', 'waiting']) AS st"
            ).format(s=s)
        )
        for table, columns, values in (
            (
                "steps",
                "run_id, name, attempt, kind, status, fencing_token",
                "id, 'work', 1, 'step', 'completed', 1",
            ),
            (
                "executions",
                "run_id, fencing_token, worker_id, claimed_at, outcome",
                "id, 1, 'w', created_at, 'completed'",
            ),
            ("facts", "scope, name, run_id, payload", "id::text, 'done', id, 'null'"),
            ("run_tags", "run_id, key, value", "id, 'tenant', tags ->> 'tenant'"),
        ):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {s}.{t} ({c}) "
                    "SELECT {v} FROM {s}.runs WHERE finished_at IS NOT NULL"
                ).format(s=s, t=sql.Identifier(table), c=sql.SQL(columns), v=sql.SQL(values))
            )


def _count(pg_url: str, schema: str, table: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.{}").format(
                sql.Identifier(schema), sql.Identifier(table)
            )
        ).fetchone()
        assert row is not None
        return int(row[0])


async def test_concurrent_pruners_delete_each_run_once_in_batches(
    pg_url: str, pg_schema: str
) -> None:
    _fill(pg_url, pg_schema)
    engines = [
        await connect(pg_url, schema=pg_schema, run_migrations=False, max_size=2) for _ in range(6)
    ]
    batches: list[PruneBatch] = []
    query = PruneQuery(older_than=timedelta(days=1), limit=BATCH)

    async def prune(store: RetentionStore) -> None:
        idle = 0
        while idle < 3:  # until three batches in a row find nothing (and no one else at work)
            batch = await store.prune_runs(query)
            batches.append(batch)
            idle = idle + 1 if (batch.pruned == 0 and not batch.busy) else 0
            await asyncio.sleep(0)

    try:
        stores = [e.backend for e in engines]
        assert all(isinstance(s, RetentionStore) for s in stores)
        await asyncio.gather(*(prune(s) for s in stores if isinstance(s, RetentionStore)))
    finally:
        for engine in engines:
            await engine.close()
    deleted = [b.pruned for b in batches if b.pruned]
    assert sum(deleted) == OLD_RUNS, "each run deleted exactly once, whoever deleted it"
    assert max(deleted) <= BATCH
    assert len(deleted) >= OLD_RUNS // BATCH
    assert all(b.pruned == 0 for b in batches if b.busy), "a busy batch does nothing"
    assert _count(pg_url, pg_schema, "pruned_runs") == OLD_RUNS
    for table in ("steps", "executions", "facts", "run_tags"):
        assert _count(pg_url, pg_schema, table) == 0, f"{table} of pruned runs are gone"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        statuses = Counter(
            row[0]
            for row in conn.execute(
                sql.SQL("SELECT status FROM {}.runs").format(sql.Identifier(pg_schema))
            )
        )
    assert statuses == {"pending": 1, "running": 1, "waiting": 1}


async def test_a_batch_that_finds_another_pruner_at_work_does_nothing(
    pg_url: str, pg_schema: str
) -> None:
    _fill(pg_url, pg_schema)
    engine = await connect(pg_url, schema=pg_schema, run_migrations=False)
    try:
        store = engine.backend
        assert isinstance(store, RetentionStore)
        query = PruneQuery(older_than=timedelta(days=1), limit=BATCH)
        with psycopg.connect(pg_url, autocommit=True) as other:
            # Another pruner's lock, held in its transaction (prune_runs takes it per batch).
            with other.transaction():
                other.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                    (f"{pg_schema}.prune",),
                )
                assert await store.prune_runs(query) == PruneBatch(pruned=0, busy=True)
                forgot = await store.forget_pruned(older_than=timedelta(0), limit=10)
                assert forgot == PruneBatch(pruned=0, busy=True)
                report = await engine.prune(older_than=timedelta(days=1))
                assert (report.pruned, report.busy) == (0, True)
            assert _count(pg_url, pg_schema, "pruned_runs") == 0
            assert await store.prune_runs(query) == PruneBatch(pruned=BATCH)
        assert await store.count_prunable(query) == OLD_RUNS - BATCH
        oldest = await store.forget_pruned(older_than=timedelta(0), limit=10)
        assert oldest == PruneBatch(pruned=10)
    finally:
        await engine.close()


def test_a_batch_never_reads_the_runs_it_keeps(pg_url: str, pg_schema: str) -> None:
    """100,000 old runs of a task kept longer (excluded, as a task's own retention makes them),
    and 1,000 of others to prune: a batch reads about its own runs, never the kept ones."""
    s = sql.Identifier(pg_schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.runs (id, task_name, task_version, status, input_hash, input, "
                "finished_at) "
                "SELECT gen_random_uuid(), "
                "CASE WHEN g <= 100000 THEN 'audit' ELSE 'mail.' || g % 3 END, 1, 'completed', "
                "'h', '{{}}', now() - interval '90 days' + g * interval '1 s' "
                "FROM generate_series(1, 101000) AS g"
            ).format(s=s)
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}.runs").format(s))
        text = render(queries()["prune_runs"], pg_schema)
        params = {
            "older_than": timedelta(days=30),
            "task_names": None,
            "exclude_task_names": ["audit"],
            "limit": 100,
            "lock_name": f"{pg_schema}.prune",
        }
        cur = psycopg.ClientCursor(conn)
        with conn.transaction(force_rollback=True):
            cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, params)
            row = cur.fetchone()
    assert row is not None
    (plan,) = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    read = sum(
        node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
        for node in _nodes(plan["Plan"])
        if node.get("Relation Name") == "runs" and node["Node Type"].startswith("Index")
    )
    assert read < 2_000, f"the batch read {read} index entries of runs"
    assert plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"] < 20_000


def _nodes(plan: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    stack = [plan]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "Node Type" in item:
                found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found

"""What deadlines cost the claim, in work: shared buffers of one `claim_runs` (EXPLAIN ANALYZE,
BUFFERS), per run it claims, with and without deadlines on the queued runs.

    python -m bench.deadline_claim [--runs 20000] [--limit 16] [--repeat 5]

It starts an embedded Postgres unless `UMT_DATABASE_URL` is set, migrates a fresh schema per
case, enqueues `--runs` pending runs of one task (half of them delayed, so both claim sources
have rows), and explains `--repeat` claims of `--limit` runs each in transactions it rolls back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import tempfile
import uuid
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from bench._claim_cost import claim_params
from umt_backend_pg import PostgresBackend, migrate, start_embedded
from umt_backend_pg._sql import queries, render
from umt_sdk.backend import NewRun, TaskPair


def load_queries(schema: str) -> dict[str, Any]:
    """The backend's own named queries for `schema` (this bench measures its SQL)."""
    return {name: render(text, schema) for name, text in queries().items()}


async def _fill(url: str, schema: str, runs: int, deadline: bool) -> None:
    # Through the backend's own enqueue: its insert's parameters follow the schema's columns.
    backend = await PostgresBackend.open(url, schema=schema, run_migrations=False, listen=False)
    try:
        batch = [
            NewRun(
                run_id=uuid.uuid4(),
                task_name="bench.deadline",
                task_version=1,
                input_json="{}",
                input_hash="h",
                delay=timedelta(seconds=-1 if i % 2 else 3600),
                timeout=timedelta(hours=2) if deadline else None,
                start_within=timedelta(hours=3) if deadline else None,
            )
            for i in range(runs)
        ]
        for start in range(0, runs, 1000):
            await backend.enqueue_many(batch[start : start + 1000])
    finally:
        await backend.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}.runs").format(sql.Identifier(schema)))


def _claim_buffers(url: str, schema: str, limit: int) -> float:
    query = load_queries(schema)["claim_runs"]
    params = claim_params(
        [TaskPair(name="bench.deadline", version=1)],
        limit=limit,
        worker_id="bench",
        lease=timedelta(seconds=10),
        timers=True,
    )
    with psycopg.connect(url, cursor_factory=psycopg.ClientCursor) as conn:
        try:
            cur = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT TEXT) " + query, params)
            plan = "\n".join(str(r[0]) for r in cur.fetchall())
        finally:
            conn.rollback()
    # The top node's line of buffers counts the whole statement.
    found = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
    assert found is not None, plan
    return (int(found[1]) + int(found[2] or 0)) / limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    url = os.environ.get("UMT_DATABASE_URL") or start_embedded(tempfile.mkdtemp() + "/pg")
    for deadline in (False, True):
        schema = f"bench_deadline_{int(deadline)}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        asyncio.run(migrate(url, schema=schema))
        asyncio.run(_fill(url, schema, args.runs, deadline))
        figures = [_claim_buffers(url, schema, args.limit) for _ in range(args.repeat)]
        label = "with deadlines   " if deadline else "without deadlines"
        print(
            f"{label}: {statistics.median(figures):.1f} shared buffers per claimed run "
            f"[{min(figures):.1f}-{max(figures):.1f}], claims of {args.limit} among "
            f"{args.runs} pending runs"
        )


if __name__ == "__main__":
    main()

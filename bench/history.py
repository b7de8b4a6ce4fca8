"""What a claim and an enqueue cost as history piles up: 0 finished runs, then a million.

Retention deletes old runs, but until it does (or with no retention at all) the tables hold
every run ever finished. The claim and the enqueue must not read more as they grow: the claim
reads only the ready queue and the partial indexes of runs that can still run, the enqueue
writes one run (and probes the tombstones of pruned keys, by index, only for keyed runs). This
measures both in shared buffers per call (pg_stat_statements: work, not time, so the machine's
load cannot move it) with no history, with a tenth of `--history` and with all of it: finished
runs (a third keyed, a tenth tagged and with a fact, each with a step and an execution) and as
many tombstones of pruned runs; then the cost of one retention batch over that history.
Everything lives in its own database, dropped at the end.

    python -m bench.history [--database-url URL] [--history 1000000] [--ops 2000] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg

from bench._infra import Server, with_dbname
from umt_backend_pg import PostgresBackend, migrate
from umt_sdk.backend import NewRun, PruneQuery, TaskPair, new_run_id

DB = "bench_history"
TASK = "bench.history"
# What identifies each statement in pg_stat_statements (a text only it has).
STATEMENTS = {
    "enqueue": "run_tags (run_id, key, value)",
    "claim": "open_keys AS",
    "prune batch": "tombstones AS",
}


def _fill_history(url: str, first: int, count: int) -> float:
    """Runs `first`..`first + count - 1`, finished 60 days ago, with their steps, executions,
    tags and facts, and as many tombstones; returns the seconds taken."""
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE added (id uuid PRIMARY KEY)")
        for offset in range(first, first + count, 200_000):  # bounded memory and WAL each
            size = min(200_000, first + count - offset)
            conn.execute(
                "WITH new AS (INSERT INTO umt.runs (id, task_name, task_version, status, "
                "input_hash, input, idempotency_key, created_at, finished_at, tags) "
                "SELECT uuidv7(-(interval '60 days' + g * interval '1 ms')), "
                "'history.' || g %% 20, 1, "
                "(ARRAY['completed', 'completed', 'failed', 'canceled'])[g %% 4 + 1], "
                "'h', '{\"n\": 1}', CASE WHEN g %% 3 = 0 THEN 'key-' || g END, "
                "now() - interval '61 days', now() - interval '60 days' - g * interval '1 ms', "
                "CASE WHEN g %% 10 = 0 THEN jsonb_build_object('tenant', 't' || g %% 100) "
                "ELSE '{}' END "
                "FROM generate_series(%s::integer, %s::integer) AS g "
                "RETURNING id) INSERT INTO added SELECT id FROM new",
                (offset, offset + size - 1),
            )
        conn.execute(
            "INSERT INTO umt.run_tags (run_id, key, value) "
            "SELECT r.id, t.key, t.value FROM added a JOIN umt.runs r ON r.id = a.id, "
            "jsonb_each_text(r.tags) AS t WHERE r.tags <> '{}'"
        )
        conn.execute(
            "INSERT INTO umt.steps (run_id, name, attempt, kind, status, fencing_token, output) "
            "SELECT id, 'work', 1, 'step', 'completed', 1, '1' FROM added"
        )
        conn.execute(
            "INSERT INTO umt.executions (run_id, fencing_token, worker_id, claimed_at, outcome) "
            "SELECT id, 1, 'bench', now() - interval '61 days', 'completed' FROM added"
        )
        conn.execute(
            "INSERT INTO umt.facts (scope, name, run_id, payload) "
            "SELECT r.id::text, 'approved', r.id, 'true' FROM added a "
            "JOIN umt.runs r ON r.id = a.id WHERE r.tags <> '{}'"
        )
        conn.execute(
            "INSERT INTO umt.pruned_runs (run_id, task_name, task_version, status, "
            "idempotency_key, input_hash, created_at, finished_at) "
            "SELECT gen_random_uuid(), 'history.' || g %% 20, 1, 'completed', 'old-' || g, 'h', "
            "now() - interval '400 days', now() - interval '399 days' "
            "FROM generate_series(%s::integer, %s::integer) AS g",
            (first, first + count - 1),
        )
        conn.execute("VACUUM ANALYZE")
    return time.monotonic() - started


def _statements(url: str) -> dict[str, dict[str, float]]:
    """Calls and shared buffers (hit + read) per call of each statement since the reset."""
    found: dict[str, dict[str, float]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, shared_blks_hit + shared_blks_read FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    for name, marker in STATEMENTS.items():
        calls = sum(int(r[1]) for r in rows if marker in r[0])
        blocks = sum(int(r[2]) for r in rows if marker in r[0])
        if calls:
            found[name] = {"calls": calls, "buffers_per_call": blocks / calls}
    return found


def _reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


async def _work(backend: PostgresBackend, ops: int) -> None:
    """`ops` enqueues (a third keyed, a third tagged), then `ops` claims of one run each; the
    claimed runs are deleted afterwards, so both phases start from the same live state."""
    for i in range(ops):
        await backend.enqueue(
            NewRun(
                run_id=new_run_id(),
                task_name=TASK,
                task_version=1,
                input_json='{"n": 1}',
                input_hash="h",
                idempotency_key=f"bench-{uuid.uuid4().hex}" if i % 3 == 1 else None,
                tags={"tenant": f"t{i % 100}"} if i % 3 == 2 else {},
            )
        )
    pairs = [TaskPair(name=TASK, version=1)]
    claimed = 0
    while claimed < ops:
        got = await backend.claim(
            worker_id="bench", pairs=pairs, limit=1, lease=timedelta(minutes=5)
        )
        if not got:
            await asyncio.sleep(0.05)  # a run queued in a slot being rotated: next claim
            continue
        claimed += len(got)


def _forget_live(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM umt.runs WHERE task_name = %s", (TASK,))
        conn.execute("TRUNCATE umt.ready")
        conn.execute("VACUUM ANALYZE umt.runs")


async def _phase(url: str, ops: int) -> dict[str, dict[str, float]]:
    backend = await PostgresBackend.open(url, schema="umt", run_migrations=False, listen=False)
    try:
        await _work(backend, min(ops, 100))  # warm up: plans, caches
        _forget_live(url)
        _reset(url)
        await _work(backend, ops)
        figures = _statements(url)
    finally:
        await backend.close()
    _forget_live(url)
    return figures


async def _prune_batches(url: str, batches: int) -> dict[str, dict[str, float]]:
    backend = await PostgresBackend.open(url, schema="umt", run_migrations=False, listen=False)
    try:
        _reset(url)
        query = PruneQuery(older_than=timedelta(days=30), limit=500)
        pruned = [(await backend.prune_runs(query)).pruned for _ in range(batches)]
        figures = _statements(url)
        figures["prune batch"]["runs_per_batch"] = statistics.mean(pruned)
    finally:
        await backend.close()
    return figures


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    if not server.statements:
        raise SystemExit("this bench reads pg_stat_statements: preload it on --database-url")
    with server.connect() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    url = with_dbname(server.admin_url, DB)
    out: dict[str, Any] = {"history": args.history, "ops": args.ops}
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await migrate(url, schema="umt")
        tenth = args.history // 10
        out["phases"] = {0: await _phase(url, args.ops)}
        out["fill_seconds"] = await asyncio.to_thread(_fill_history, url, 1, tenth)
        out["phases"][tenth] = await _phase(url, args.ops)
        out["fill_seconds"] += await asyncio.to_thread(
            _fill_history, url, tenth + 1, args.history - tenth
        )
        out["phases"][args.history] = await _phase(url, args.ops)
        out["retention"] = await _prune_batches(url, args.batches)
    finally:
        server.drop_db(DB)
    print(f"shared buffers per call, {args.ops} calls each (pg_stat_statements):")
    sizes = list(out["phases"])
    print(f"{'finished runs':<14}" + "".join(f"{size:>14,}" for size in sizes))
    for name in ("enqueue", "claim"):
        cells = [
            out["phases"][size].get(name, {}).get("buffers_per_call", float("nan"))
            for size in sizes
        ]
        print(f"{name:<14}" + "".join(f"{cell:>14.1f}" for cell in cells))
    batch = out["retention"].get("prune batch", {})
    print(
        f"retention: {batch.get('buffers_per_call', float('nan')):.0f} buffers per batch of "
        f"{batch.get('runs_per_batch', 0):.0f} runs over that history"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--history", type=int, default=1_000_000, help="finished runs to add")
    p.add_argument("--ops", type=int, default=2000, help="enqueues and claims measured")
    p.add_argument("--batches", type=int, default=20, help="retention batches measured")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

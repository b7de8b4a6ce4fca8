"""What `result()` waiters cost the database: the full read of a run against its head.

`Engine.result()` used to poll `get_run` (the run, all its steps, all its executions: three
statements) every 50 ms on Postgres until the run ended; then `get_run_head` (the run alone:
one statement) every 50 ms; now it reads the head and waits for the run's ending notification
(`notified`: LISTEN on, a read a second in case a notification was lost). This runs N waiters
at once on runs of S steps each that do not end, for a few seconds each way, in turn, and
reports per read: statements (transactions), rows the server returned, and shared buffers
touched, and reads and statements per second.

    python -m bench.result_poll [--database-url URL] [--waiters 1000] [--steps 100] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import psycopg

from bench._infra import Server, with_dbname
from umt_backend_pg import PostgresBackend, migrate

DB = "bench_result_poll"
WAYS = ("get_run", "get_run_head", "notified")


def _fill(url: str, runs: int, steps: int) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(runs)]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO umt.runs (id, task_name, task_version, status, available_at, "
            "input_hash, input, fencing_token, lease_expires_at) "
            "SELECT i, 'bench.long', 1, 'running', now() + interval '1 hour', 'h', "
            "'{}'::jsonb, 1, now() + interval '1 hour' FROM unnest(%s::uuid[]) AS i",
            (ids,),
        )
        conn.execute(
            "INSERT INTO umt.steps (run_id, name, attempt, kind, status, fencing_token, "
            "output, started_at, finished_at) "
            "SELECT i, 's' || n, 1, 'step', 'completed', 1, to_jsonb(n), now(), now() "
            "FROM unnest(%s::uuid[]) AS i, generate_series(1, %s) AS n",
            (ids, steps),
        )
        conn.execute(
            "INSERT INTO umt.executions (run_id, fencing_token, worker_id, claimed_at, outcome) "
            "SELECT i, 1, 'bench', now(), 'running' FROM unnest(%s::uuid[]) AS i",
            (ids,),
        )
        conn.execute("VACUUM ANALYZE umt.runs, umt.steps, umt.executions")
    return ids


def _counters(url: str) -> tuple[int, int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback, tup_returned + tup_fetched, "
            "blks_hit + blks_read FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def _one_pass(
    backend: PostgresBackend, url: str, way: str, ids: list[uuid.UUID], seconds: float
) -> dict[str, Any]:
    read = backend.get_run_head if way == "notified" else getattr(backend, way)
    polls = 0
    stop = 0.0  # set when the pass starts, after the settling below

    async def waiter(run_id: uuid.UUID) -> None:
        nonlocal polls
        while time.monotonic() < stop:
            record = await read(run_id)
            assert record is not None
            polls += 1
            if way == "notified":  # what result() does now
                await backend.wait_for_run(run_id, timeout=max(0.0, stop - time.monotonic()))
            else:
                await asyncio.sleep(0.05)  # result()'s poll interval before

    # Statistics reach pg_stat_database when a backend flushes them: at most every second while
    # it works, after 10 s once idle. Let the pass before land before counting this one.
    await asyncio.sleep(11)
    before = await asyncio.to_thread(_counters, url)
    started = time.monotonic()
    stop = started + seconds
    await asyncio.gather(*(waiter(i) for i in ids))
    elapsed = time.monotonic() - started
    await asyncio.sleep(11)
    after = await asyncio.to_thread(_counters, url)
    xacts, rows, buffers = (b - a for a, b in zip(before, after, strict=True))
    return {
        "polls_per_s": polls / elapsed,
        "statements_per_poll": xacts / max(polls, 1),
        "rows_per_poll": rows / max(polls, 1),
        "buffers_per_poll": buffers / max(polls, 1),
        "statements_per_s": xacts / elapsed,
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    with server.connect() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    url = with_dbname(server.admin_url, DB)
    try:
        await migrate(url, schema="umt")
        ids = await asyncio.to_thread(_fill, url, args.waiters, args.steps)
        backend = await PostgresBackend.open(
            url, schema="umt", run_migrations=False, listen=True, max_size=args.pool
        )
        for _ in range(200):  # the LISTEN connection comes up in the background
            if backend._wakeups._listening:
                break
            await asyncio.sleep(0.05)
        passes: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
        try:
            for _ in range(args.reps):
                for way in WAYS:
                    passes[way].append(await _one_pass(backend, url, way, ids, args.seconds))
        finally:
            await backend.close()
    finally:
        server.drop_db(DB)
    out: dict[str, Any] = {"waiters": args.waiters, "steps": args.steps, "pool": args.pool}
    for way, runs in passes.items():
        out[way] = {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"passes": runs}
        m = out[way]
        print(
            f"{way:<13} reads/s {m['polls_per_s']:8.0f}  statements/read "
            f"{m['statements_per_poll']:5.2f}  rows/read {m['rows_per_poll']:7.1f}  "
            f"buffers/read {m['buffers_per_poll']:6.1f}  statements/s {m['statements_per_s']:7.0f}",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--waiters", type=int, default=1000, help="result() waiters at once")
    p.add_argument("--steps", type=int, default=100, help="steps of each waited-for run")
    p.add_argument("--seconds", type=float, default=5.0, help="length of one pass")
    p.add_argument("--reps", type=int, default=3, help="passes each way, in turn")
    p.add_argument("--pool", type=int, default=10, help="the engine's pool (its default: 10)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""What a finished run leaves on disk, and the WAL its steps write (issue 27, part 2).

Enqueues `--runs` runs of a task of `--steps` steps (each step returns a string of
`--payload` random characters, which compression cannot shrink; the input is one of the same
size), drains them with one in-process
worker, then reports, per finished run, the bytes every engine relation grew by (table, its
indexes, its TOAST: `pg_table_size` and `pg_indexes_size`, against the freshly migrated
schema), once right after the drain and once after a `VACUUM` (which makes the dead versions
left by the run's lifecycle reusable, without giving the space back to the OS), and the WAL
bytes written per step by the drain (`pg_current_wal_lsn()` around it: enqueues not counted)
and per run including its enqueue. Sizes and WAL are work, not time: the machine's load
cannot move them. Everything lives in its own database, dropped at the end.

    python -m bench.storage [--database-url URL] [--runs 2000] [--steps 10] [--payload 100]
                            [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench._infra import Server, machine_info
from umt_backend_pg import migrate
from umt_sdk import Registry, TaskContext, connect, task

DB = "bench_storage"
SCHEMA = "umt"
_STEPS = {"n": 10, "payload": 100}


@task("bench.storage", version=1)
async def stored(ctx: TaskContext[str]) -> int:
    for i in range(_STEPS["n"]):
        await ctx.step.run(
            f"s{i}", lambda: secrets.token_urlsafe(_STEPS["payload"])[: _STEPS["payload"]]
        )
    return _STEPS["n"]


def _sizes(url: str) -> dict[str, dict[str, int]]:
    """Per engine table: heap (with its free-space and visibility maps), TOAST and indexes."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_relation_size(c.oid, 'main') + pg_relation_size(c.oid, 'fsm')"
            " + pg_relation_size(c.oid, 'vm'),"
            " coalesce(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),"
            " pg_indexes_size(c.oid)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind IN ('r', 'p')",
            (SCHEMA,),
        ).fetchall()
    return {r[0]: {"heap": int(r[1]), "toast": int(r[2]), "indexes": int(r[3])} for r in rows}


def _grown(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], runs: int
) -> dict[str, Any]:
    per: dict[str, dict[str, float]] = {}
    for name, now in after.items():
        was = before.get(name, {"heap": 0, "toast": 0, "indexes": 0})
        grew = {part: (now[part] - was[part]) / runs for part in ("heap", "toast", "indexes")}
        if any(grew.values()):
            per[name] = grew
    total = sum(sum(parts.values()) for parts in per.values())
    return {"bytes_per_run": total, "by_table": dict(sorted(per.items()))}


def _lsn(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def _wal_between(url: str, start: str, end: str) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (end, start))
        found = row.fetchone()
    assert found is not None
    return float(found[0])


async def _fill_and_drain(url: str, runs: int, payload: int) -> dict[str, Any]:
    engine = await connect(
        url, registry=Registry([stored]), schema=SCHEMA, run_migrations=False, listen=False
    )
    try:
        lsn0 = _lsn(url)
        done = 0
        while done < runs:
            size = min(1000, runs - done)
            inputs = [secrets.token_urlsafe(payload)[:payload] for _ in range(size)]
            await engine.enqueue_many(stored, inputs)
            done += size
        lsn1 = _lsn(url)
        t0 = time.perf_counter()
        async with engine.worker(concurrency=32, poll_interval=timedelta(milliseconds=100)):
            while True:
                with psycopg.connect(url, autocommit=True) as conn:
                    row = conn.execute(
                        "SELECT count(*) FROM umt.runs WHERE status = 'completed'"
                    ).fetchone()
                if row is not None and row[0] >= runs:
                    break
                await asyncio.sleep(0.2)
        seconds = time.perf_counter() - t0
        lsn2 = _lsn(url)
    finally:
        await engine.close()
    return {"lsn": (lsn0, lsn1, lsn2), "drain_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--payload", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.runs < 1 or args.steps < 1 or args.payload < 0:
        parser.error("--runs and --steps must be at least 1, --payload at least 0")
    _STEPS.update(n=args.steps, payload=args.payload)
    server = Server.start(args.database_url)
    url = server.fresh_db(DB)
    try:
        asyncio.run(migrate(url, schema=SCHEMA))
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")  # the empty schema's maps, so they are not counted
        empty = _sizes(url)
        drained = asyncio.run(_fill_and_drain(url, args.runs, args.payload))
        after_drain = _sizes(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM")
        after_vacuum = _sizes(url)
        lsn0, lsn1, lsn2 = drained["lsn"]
        enqueue_wal = _wal_between(url, lsn0, lsn1)
        drain_wal = _wal_between(url, lsn1, lsn2)
    finally:
        server.drop_db(DB)
    steps = args.runs * args.steps
    result = {
        "runs": args.runs,
        "steps_per_run": args.steps,
        "payload_chars": args.payload,
        "drain_s": drained["drain_s"],
        "after_drain": _grown(empty, after_drain, args.runs),
        "after_vacuum": _grown(empty, after_vacuum, args.runs),
        "wal_bytes_per_step": drain_wal / steps,
        "wal_bytes_per_run": (enqueue_wal + drain_wal) / args.runs,
        "machine": machine_info(),
    }
    print(
        f"{args.runs} runs of {args.steps} steps ({args.payload}-character outputs):"
        f" {result['after_drain']['bytes_per_run']:,.0f} bytes per finished run after the"
        f" drain, {result['after_vacuum']['bytes_per_run']:,.0f} after VACUUM;"
        f" WAL {result['wal_bytes_per_step']:,.0f} bytes per step,"
        f" {result['wal_bytes_per_run']:,.0f} per run with its enqueue"
    )
    for name, parts in result["after_vacuum"]["by_table"].items():
        print(
            f"  {name:<24} heap {parts['heap']:8,.0f}  toast {parts['toast']:6,.0f}"
            f"  indexes {parts['indexes']:8,.0f}  bytes per run (after VACUUM)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

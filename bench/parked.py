"""What an idle worker costs while a million runs are parked in sleeps and fact waits.

Most runs of a long-lived application are neither running nor finished: they sleep until a
date or wait for a fact (an approval, a payment). A worker must not pay for them while it
waits for work: its claim reads the timers of its own tasks by index from a window near now,
and a run waiting for a fact has no timer at all. This measures one real worker process (the
long-horizon scenarios' worker, `bench/_scenario_child.py`, 32 slots, LISTEN on, 1 s poll)
serving one task for `--seconds`, first with nothing parked, then with `--parked` runs of
that task parked (half asleep until 1 to 60 days from now, half waiting for a fact; made with
set-based SQL, not through the engine). In both phases `--due` sleeping runs come due spread
over the phase: each must be picked up (the wake-up latency, from its due time to its
handler's start, is reported) and none may be missed.

Work, not time, is the measure: the worker's CPU seconds (user + system, from /proc) and
resident memory, and the database's transactions and shared buffers per minute
(`pg_stat_database`), with the claim's calls and shared buffers per call (`pg_stat_statements`
where it is loaded). Everything lives in its own database, dropped at the end.

    python -m bench.parked [--database-url URL] [--parked 1000000] [--due 300] [--seconds 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench._hist import Histogram
from bench._infra import Child, Server, machine_info
from bench._scenario_child import TASK

DB = "bench_parked"
CLAIM_MARKER = "open_keys AS"  # a text only the claim's statement has (as in bench.history)
TICK = os.sysconf("SC_CLK_TCK")


def _log(message: str) -> None:
    print(f"[parked] {message}", file=sys.stderr, flush=True)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/<pid>/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _park(url: str, count: int) -> float:
    """`count` runs of the worker's task: half asleep until 1 to 60 days from now, half waiting
    for a fact (no timer). Returns the seconds taken."""
    began = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        for offset in range(0, count, 200_000):  # bounded memory and WAL each
            size = min(200_000, count - offset)
            conn.execute(
                "INSERT INTO umt.runs (id, task_name, task_version, status, available_at, "
                "wait_for, input_hash, input) "
                "SELECT gen_random_uuid(), %s, 1, 'waiting', "
                "CASE WHEN g %% 2 = 0 THEN now() + interval '1 day' "
                "+ (g %% 5000) * interval '17 minutes' END, "
                "CASE WHEN g %% 2 = 1 THEN 'approved:' || g END, 'h', '0' "
                "FROM generate_series(%s::integer, %s::integer) AS g",
                (TASK, offset, offset + size - 1),
            )
        conn.execute("VACUUM ANALYZE umt.runs")
    return time.monotonic() - began


def _due(url: str, count: int, within_s: float) -> None:
    """`count` sleeping runs due evenly over the next `within_s` seconds; the input of each is
    its due time (epoch seconds), so the handler's pickup latency is its wake-up latency."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO umt.runs (id, task_name, task_version, status, available_at, "
            "input_hash, input) "
            "SELECT gen_random_uuid(), %s, 1, 'waiting', d, 'h', "
            "to_jsonb(extract(epoch FROM d)::float8) "
            "FROM (SELECT now() + interval '2 seconds' + g * %s * interval '1 second' AS d "
            "FROM generate_series(0, %s - 1) AS g) AS due",
            (TASK, within_s / max(count, 1), count),
        )


def _database(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT xact_commit + xact_rollback, blks_hit + blks_read FROM pg_stat_database "
        "WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _claims(conn: psycopg.Connection[Any]) -> tuple[int, int] | None:
    """Calls and shared buffers of the claim since the last reset, or None without
    pg_stat_statements."""
    try:
        row = conn.execute(
            "SELECT coalesce(sum(calls), 0), coalesce(sum(shared_blks_hit + shared_blks_read), 0) "
            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) AND query LIKE %s",
            (f"%{CLAIM_MARKER}%",),
        ).fetchone()
    except psycopg.Error:
        return None
    return (int(row[0]), int(row[1])) if row else None


def _phase(url: str, parked: int, due: int, seconds: float) -> dict[str, Any]:
    """One worker process, idle but for `due` runs coming due over `seconds`."""
    worker = Child(
        [sys.executable, "-m", "bench._scenario_child", "work", "--dsn", url],
        name=f"parked-worker-{parked}",
    )
    hist = Histogram()
    started = 0
    try:
        worker.expect("READY", 180)
        worker.send("GO")
        time.sleep(3)  # the pool opens, the first claims settle
        with psycopg.connect(url, autocommit=True) as conn:
            with_statements = _claims(conn) is not None
            if with_statements:
                conn.execute("SELECT pg_stat_statements_reset()")
            _due(url, due, seconds - 4)  # the last one comes due 2 s before the phase ends
            cpu0, xacts0, blocks0 = _cpu_s(worker.proc.pid), *_database(conn)
            began = time.monotonic()
            deadline = began + seconds
            while time.monotonic() < deadline:
                event = worker.expect("EVENT", 10)
                started += int(event["started"])
                hist.merge(Histogram.from_json(event["lat"]))
            elapsed = time.monotonic() - began
            cpu = _cpu_s(worker.proc.pid) - cpu0
            xacts, blocks = _database(conn)
            rss = _rss_mb(worker.proc.pid)
            claims = _claims(conn) if with_statements else None
            grace = time.monotonic() + 30  # a slow machine: late is reported, not missed
            while started < due and time.monotonic() < grace:
                event = worker.expect("EVENT", 10)
                started += int(event["started"])
                hist.merge(Histogram.from_json(event["lat"]))
            missed = conn.execute(
                "SELECT count(*) FROM umt.runs WHERE task_name = %s AND status <> 'completed' "
                "AND available_at < now() - interval '2 seconds'",
                (TASK,),
            ).fetchone()
        per_min = 60.0 / elapsed
        return {
            "parked": parked,
            "seconds": round(elapsed, 1),
            "worker_cpu_s_per_min": round(cpu * per_min, 3),
            "worker_rss_mb": round(rss, 1),
            "db_transactions_per_min": round((xacts - xacts0) * per_min),
            "db_buffers_per_min": round((blocks - blocks0) * per_min),
            "claims_per_min": round(claims[0] * per_min) if claims else None,
            "buffers_per_claim": round(claims[1] / claims[0], 1) if claims and claims[0] else None,
            "due": due,
            "due_started": started,
            "due_missed": int(missed[0]) if missed else None,
            "wake_up_ms": hist.summary(),
        }
    finally:
        worker.send("STOP")
        worker.close(60)


def run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    url = server.fresh_db(DB)
    try:
        import asyncio

        from umt_backend_pg import migrate

        asyncio.run(migrate(url))
        with psycopg.connect(url, autocommit=True) as conn, contextlib.suppress(psycopg.Error):
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")  # where loaded
        phases = []
        _log(f"nothing parked: one worker for {args.seconds:g} s, {args.due} runs coming due")
        phases.append(_phase(url, 0, args.due, args.seconds))
        _log(f"parking {args.parked:,} runs (half asleep, half waiting for a fact)")
        park_s = _park(url, args.parked)
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_total_relation_size('umt.runs') / 1048576.0, "
                "pg_indexes_size('umt.runs') / 1048576.0"
            ).fetchone()
        assert row is not None
        _log(f"  {park_s:.0f} s; runs now {row[0]:.0f} MB ({row[1]:.0f} MB of indexes)")
        phases.append(_phase(url, args.parked, args.due, args.seconds))
        return {
            "phases": phases,
            "park_seconds": round(park_s, 1),
            "runs_mb": round(float(row[0]), 1),
            "runs_index_mb": round(float(row[1]), 1),
            "machine": machine_info(),
            "postgres": server.settings(),
        }
    finally:
        server.drop_db(DB)


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'parked':>10}{'worker CPU s/min':>18}{'RSS MB':>8}{'xacts/min':>11}"
        f"{'buffers/min':>13}{'claims/min':>12}{'buffers/claim':>15}{'due started':>13}"
        f"{'missed':>8}{'wake-up p50/p99 ms':>20}"
    )
    lines = [head]
    for p in result["phases"]:
        w = p["wake_up_ms"]
        lines.append(
            f"{p['parked']:>10,}{p['worker_cpu_s_per_min']:>18.2f}{p['worker_rss_mb']:>8.0f}"
            f"{p['db_transactions_per_min']:>11,}{p['db_buffers_per_min']:>13,}"
            f"{p['claims_per_min'] if p['claims_per_min'] is not None else '-':>12}"
            f"{p['buffers_per_claim'] if p['buffers_per_claim'] is not None else '-':>15}"
            f"{p['due_started']:>9}/{p['due']:<3}{p['due_missed']:>8}"
            f"{(w['p50_ms'] or 0):>12.0f}/{(w['p99_ms'] or 0):<7.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--parked", type=int, default=1_000_000, help="runs parked (1,000,000)")
    p.add_argument("--due", type=int, default=300, help="sleeping runs coming due per phase")
    p.add_argument("--seconds", type=float, default=60.0, help="each phase (60)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()

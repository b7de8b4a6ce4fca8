"""Batched enqueue on Postgres: `engine.enqueue_many` against single enqueues and pgqueuer's
batched `Queries.enqueue`, side by side on one server.

Each repetition runs every system once, in turn (A B C A B C ...), each into a fresh
database: N runs of a no-op task in batches of B (single enqueues: 64 outstanding, as the
drain benchmark's setup enqueues). Per system: runs/s (wall, noisy on a shared machine),
client CPU seconds per 1,000 runs (`time.process_time` of the enqueuing process, around the
enqueues only), and the server's work per run: committed transactions, rows inserted, WAL
bytes (`pg_stat_database` and `pg_current_wal_lsn()` deltas; noise-free).

    python -m bench.enqueue_batch [--database-url URL] [--runs 20000] [--batch 1000]
                                  [--repeats 3] [--systems many,single,pgqueuer]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from bench._infra import BENCH_DIR, Child, Server, machine_info
from bench._peers import default_venv, prepare
from umt_backend_pg import migrate
from umt_sdk import Registry, TaskContext, connect, task

SCHEMA = "umt"


@task("bench.enqueued", version=1)
async def enqueued(ctx: TaskContext[int]) -> int:
    return ctx.input


async def _umt(url: str, n: int, batch: int, many: bool) -> dict[str, Any]:
    await migrate(url, schema=SCHEMA)
    engine = await connect(
        url, registry=Registry([enqueued]), schema=SCHEMA, run_migrations=False, listen=False
    )
    try:
        await engine.enqueue(enqueued, -1)  # warm the pool and the statement
        t0, cpu0 = time.perf_counter(), time.process_time()
        done = 0
        if many:
            while done < n:
                size = min(batch, n - done)
                await engine.enqueue_many(enqueued, range(done, done + size))
                done += size
        else:
            while done < n:
                size = min(64, n - done)
                await asyncio.gather(*(engine.enqueue(enqueued, i) for i in range(size)))
                done += size
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await engine.close()
    return {"enqueue_s": seconds, "enqueue_per_s": n / seconds, "enqueue_cpu_s": cpu}


def _pgqueuer(python: str, url: str, n: int, batch: int, *, installed: bool) -> dict[str, Any]:
    child = Child(
        [
            python,
            str(BENCH_DIR / "peers" / "pgqueuer_worker.py"),
            "enqueue",
            "--dsn",
            url,
            "--n",
            str(n),
            "--enqueue-batch",
            str(batch),
            *(["--installed"] if installed else []),
        ],
        name="pgqueuer-enqueue",
    )
    try:
        result: dict[str, Any] = child.expect("RESULT", timeout=600)
    finally:
        child.close()
    return result


def _once(server: Server, system: str, args: argparse.Namespace, python: str | None) -> Any:
    db = f"bench_enqueue_{system}"
    url = server.fresh_db(db)
    if system == "pgqueuer":
        assert python is not None
        # pgqueuer installs its schema first, outside the counted work: do it with 0 jobs.
        _pgqueuer(python, url, 0, args.batch, installed=False)
    else:
        asyncio.run(migrate(url, schema=SCHEMA))
    server.wait_idle(db)
    before = server.counters(db)
    if system == "pgqueuer":
        assert python is not None
        timing = _pgqueuer(python, url, args.runs, args.batch, installed=True)
    else:
        timing = asyncio.run(_umt(url, args.runs, args.batch, many=system == "many"))
    server.wait_idle(db)
    after = server.counters(db)
    work = server.work_delta(before, after, monitor_xacts=0)
    server.drop_db(db)
    n = args.runs
    return {
        "system": system,
        "runs_per_s": timing["enqueue_per_s"],
        "cpu_ms_per_1000": 1000 * timing["enqueue_cpu_s"] / n * 1000,
        "xact_per_run": work["xact"] / n,
        "rows_inserted_per_run": work["rows_ins"] / n,
        "wal_bytes_per_run": work["wal_bytes"] / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="many,single,pgqueuer")
    parser.add_argument("--no-install-peers", action="store_true")
    args = parser.parse_args()
    systems = args.systems.split(",")
    python = None
    if "pgqueuer" in systems:
        found, status = prepare(default_venv(), install=not args.no_install_peers)
        if found is None or "missing" in status.get("pgqueuer", {}):
            print(f"pgqueuer left out: {status.get('pgqueuer')}", file=sys.stderr)
            systems.remove("pgqueuer")
        else:
            python = str(found)
    server = Server.start(args.database_url)
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for rep in range(args.repeats):
        for system in systems:
            row = _once(server, system, args, python)
            row["repeat"] = rep
            rows[system].append(row)
            print(json.dumps(row), flush=True)
    for system, runs in rows.items():
        folded = {
            key: statistics.median(r[key] for r in runs)
            for key in runs[0]
            if key not in ("system", "repeat")
        }
        spread = [min(r["runs_per_s"] for r in runs), max(r["runs_per_s"] for r in runs)]
        print(json.dumps({"median": system, **folded, "runs_per_s_min_max": spread}), flush=True)
    print(json.dumps({"settings": server.settings(), "machine": machine_info()}), flush=True)


if __name__ == "__main__":
    main()

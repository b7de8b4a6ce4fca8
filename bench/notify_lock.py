"""Does the NOTIFY of each enqueue cap how fast many clients can enqueue?

A transaction that has called NOTIFY takes one lock for the whole server at commit and holds it
through its WAL flush, so notifying transactions commit one at a time: their flushes cannot be
shared (group commit). This runs the engine's own `insert_run` from N connections at once, in
turn three ways: notifying in the insert's statement (as an enqueue in the caller's
transaction does, and every enqueue did before), notifying after the commit through the
engine's coalescing `Notifier`, in the background (as an enqueue does now), and not notifying
at all (the ceiling). It reports enqueues per second, the ratios pass by pass, and the share
of samples in which a connection waited on that lock (`Lock:object`).

    python -m bench.notify_lock [--database-url URL] [--clients 1,4,16] [--seconds 5] [--reps 3]
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
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from bench._infra import Server, with_dbname
from umt_backend_pg import migrate
from umt_backend_pg._notifier import Notifier
from umt_backend_pg._sql import queries, render

DB = "bench_notify_lock"
NOTIFY = "pg_notify(%(channel)s, %(pair)s)"


WAYS = ("in statement", "coalesced", "none")


async def _one_pass(url: str, way: str, clients: int, seconds: float) -> dict[str, Any]:
    query = render(queries()["insert_run"], "umt")
    conns = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(clients)]
    monitor = await psycopg.AsyncConnection.connect(url, autocommit=True)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        url, min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    notifier = Notifier(pool, {k: render(v, "umt") for k, v in queries().items()}, "umt.work")
    done = 0
    stop = time.monotonic() + seconds

    async def client(conn: psycopg.AsyncConnection[Any]) -> None:
        nonlocal done
        while time.monotonic() < stop:
            await conn.execute(
                query,
                {
                    "id": uuid.uuid4(),
                    "task_name": "bench.notify",
                    "task_version": 1,
                    "priority": 0,
                    "delay": "0 s",
                    "idempotency_key": None,
                    "input_hash": "h",
                    "trace_context": Jsonb({}),
                    "input": "{}",
                    "channel": "umt.work",
                    "pair": "bench.notify@1",
                    "notify": way == "in statement",
                },
            )
            if way == "coalesced":
                notifier.notify("bench.notify@1")
            done += 1

    async def sample() -> tuple[int, int]:
        waits = total = 0
        while time.monotonic() < stop:
            cur = await monitor.execute(
                "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock' AND wait_event = 'object'),"
                " count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'active' AND pid <> pg_backend_pid()"
            )
            row = await cur.fetchone()
            if row:
                waits, total = waits + row[0], total + row[1]
            await asyncio.sleep(0.02)
        return waits, total

    started = time.monotonic()
    *_, (waits, active) = await asyncio.gather(*(client(c) for c in conns), sample())
    await notifier.flush()
    elapsed = time.monotonic() - started
    for c in [*conns, monitor]:
        await c.close()
    await notifier.close()
    await pool.close()
    return {"per_s": done / elapsed, "lock_object_share": waits / max(active, 1)}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    with server.connect() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    url = with_dbname(server.admin_url, DB)
    await migrate(url, schema="umt")
    out: dict[str, Any] = {"clients": {}}
    try:
        for clients in [int(c) for c in args.clients.split(",")]:
            passes: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
            for _ in range(args.reps):
                for way in WAYS:
                    passes[way].append(await _one_pass(url, way, clients, args.seconds))
            row: dict[str, Any] = {
                way: {
                    "per_s_median": statistics.median(p["per_s"] for p in runs),
                    "lock_object_share_median": statistics.median(
                        p["lock_object_share"] for p in runs
                    ),
                    "passes": runs,
                }
                for way, runs in passes.items()
            }
            for way in ("in statement", "coalesced"):
                ratios = [
                    a["per_s"] / b["per_s"]
                    for a, b in zip(passes[way], passes["none"], strict=True)
                ]
                row[f"{way} / none"] = {"median": statistics.median(ratios), "ratios": ratios}
            out["clients"][clients] = row
            print(
                f"{clients:>3} clients: "
                + "; ".join(
                    f"{way} {row[way]['per_s_median']:6.0f}/s "
                    f"(Lock:object {row[way]['lock_object_share_median']:.0%})"
                    for way in WAYS
                )
                + "; vs none: "
                + ", ".join(
                    f"{way} {row[f'{way} / none']['median']:.2f} ("
                    + " ".join(f"{r:.2f}" for r in row[f"{way} / none"]["ratios"])
                    + ")"
                    for way in ("in statement", "coalesced")
                ),
                flush=True,
            )
    finally:
        server.drop_db(DB)  # an embedded server is stopped and removed at exit
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--clients", default="1,4,16", help="connections enqueueing at once")
    p.add_argument("--seconds", type=float, default=5.0, help="length of one pass")
    p.add_argument("--reps", type=int, default=3, help="pairs of passes per client count")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""What a fan-out of N children costs the database, per child, three ways.

- `each`: the parent starts each child (`start_child`) and awaits the handles in turn: one
  step record per start, and the parent parks and is woken once per child still running when
  it looks;
- `gather`: the same starts, then one `ctx.step.gather`: woken once;
- `map`: one `ctx.step.map` (all children in one statement), with and without
  `max_concurrency` (held children, let run by the write that ends one): woken once.

For each, the server work of the whole fan-out (parent and children: enqueues, claims,
checkpoints, endings, wake-ups) divided by N: statements and shared buffers touched (hit, read
or dirtied; `pg_stat_statements`, nested statements included in their caller) and committed
transactions (`pg_stat_database`), and how many times the parent was claimed. Work, not
latency: the figures do not depend on the machine's speed.

    python -m bench.fanout [--database-url URL] [--children 100,1000] [--worker-slots 16]
                           [--ways each,gather,map,map10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import attrs
import psycopg

from bench._infra import Server
from umt_backend_pg import migrate
from umt_sdk import Registry, RetryPolicy, TaskContext, connect, task

DB = "bench_fanout"
SCHEMA = "umt"


@attrs.frozen
class Fan:
    way: str
    children: int
    limit: int | None = None


@task("bench.leaf", version=1, retry=RetryPolicy(max_attempts=1))
async def leaf(ctx: TaskContext[int]) -> int:
    return ctx.input + 1


@task("bench.fan", version=1, retry=RetryPolicy(max_attempts=1))
async def fan(ctx: TaskContext[Fan]) -> int:
    spec = ctx.input
    if spec.way == "map":
        outputs = await ctx.step.map(
            "leaves", leaf, list(range(spec.children)), max_concurrency=spec.limit
        )
        return sum(outputs)
    handles = [await ctx.step.start_child(f"leaf{i}", leaf, i) for i in range(spec.children)]
    if spec.way == "gather":
        return sum(await ctx.step.gather("leaves", handles))
    total = 0
    for handle in handles:
        total += await handle.result()
    return total


def _by_statement(conn: psycopg.Connection[Any], dbname: str) -> dict[str, tuple[float, float]]:
    """Calls and buffers of each statement of the database, by the text's first words."""
    rows = conn.execute(
        "SELECT s.query, s.calls, s.shared_blks_hit + s.shared_blks_read + s.shared_blks_dirtied"
        " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
        " WHERE d.datname = %s AND s.query NOT LIKE '%%pg_stat_%%'",
        (dbname,),
    ).fetchall()
    found: dict[str, tuple[float, float]] = {}
    for query, calls, buffers in rows:
        label = " ".join(str(query).split())[:70]
        old = found.get(label, (0.0, 0.0))
        found[label] = (old[0] + float(calls), old[1] + float(buffers))
    return found


def _counters(conn: psycopg.Connection[Any], dbname: str, statements: bool) -> dict[str, float]:
    values: dict[str, float] = {}
    row = conn.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)
    ).fetchone()
    values["transactions"] = float(row[0]) if row else 0.0
    if statements:
        row = conn.execute(
            "SELECT coalesce(sum(calls), 0), coalesce(sum(shared_blks_hit + shared_blks_read"
            " + shared_blks_dirtied), 0) FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s"
            " AND s.query NOT LIKE '%%pg_stat_%%'",
            (dbname,),
        ).fetchone()
        values["statements"], values["buffers"] = (float(row[0]), float(row[1])) if row else (0, 0)
    return values


async def _one(url: str, server: Server, spec: Fan, slots: int) -> dict[str, Any]:
    with server.connect() as monitor:
        await asyncio.sleep(1.2)  # sessions flush their statistics within a second, and at exit
        before = _counters(monitor, DB, server.statements)
        before_each = _by_statement(monitor, DB) if server.statements else {}
        engine = await connect(
            url, registry=Registry([leaf, fan]), schema=SCHEMA, run_migrations=False
        )
        try:
            handle = await engine.enqueue(fan, spec)
            # The parent alone first, until it parks: its children run only then, so each
            # way waits for children that are still running (the case a wake-up is for).
            async with engine.worker(versions=["bench.fan@1"], concurrency=1):
                for _ in range(60_000):
                    head = await engine.backend.get_run_head(handle.run_id)  # one cheap read
                    if head is not None and head.status == "waiting":
                        break
                    await asyncio.sleep(0.01)
            async with engine.worker(concurrency=slots):
                total = await handle.result(timeout=600)
            assert total == sum(i + 1 for i in range(spec.children)), total
            info = await engine.get(handle.run_id)
        finally:
            await engine.close()
        await asyncio.sleep(1.2)
        after = _counters(monitor, DB, server.statements)
        after_each = _by_statement(monitor, DB) if server.statements else {}
    n = spec.children
    result: dict[str, Any] = {
        "way": spec.way if spec.limit is None else f"{spec.way} (max_concurrency={spec.limit})",
        "children": n,
        "parent_claims": info.attempts,
    }
    for key in after:
        result[f"{key}_per_child"] = round((after[key] - before[key]) / n, 2)
    spent = {
        label: (
            calls - before_each.get(label, (0, 0))[0],
            blocks - before_each.get(label, (0, 0))[1],
        )
        for label, (calls, blocks) in after_each.items()
    }
    top = sorted(spent.items(), key=lambda item: -item[1][1])[:5]
    if not server.statements:
        return result
    result["top_statements"] = [
        {
            "statement": label,
            "calls_per_child": round(c / n, 2),
            "buffers_per_child": round(b / n, 1),
        }
        for label, (c, b) in top
    ]
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--children", default="100,1000")
    parser.add_argument("--worker-slots", type=int, default=16)
    parser.add_argument("--ways", default="each,gather,map,map10", help="which ways to run")
    args = parser.parse_args()
    server = Server.start(args.database_url)
    url = server.fresh_db(DB)
    await migrate(url, schema=SCHEMA)
    rows = []
    for n in (int(x) for x in args.children.split(",")):
        specs = {
            "each": Fan(way="each", children=n),
            "gather": Fan(way="gather", children=n),
            "map": Fan(way="map", children=n),
            "map10": Fan(way="map", children=n, limit=10),
        }
        for spec in (specs[way] for way in args.ways.split(",")):
            rows.append(await _one(url, server, spec, args.worker_slots))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"settings": server.settings(), "notes": server.notes}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())

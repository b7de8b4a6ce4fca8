"""What concurrency keys cost the claim: shared buffers per claim, unkeyed and keyed.

Each scenario fills a fresh schema, then repeats: the worker's claim (`claim_runs`, 16 runs,
no timers read) under EXPLAIN (ANALYZE, BUFFERS), committed, and the ending of every run it
claimed (as the worker's would). It reports the median of the claims' shared buffers (hit +
read, the statement's top plan node) and the runs each claim took.

    python -m bench.concurrency_claim [--database-url URL] [--claims 40] [--json FILE]
        [--scenarios unkeyed,keyed_50,full_key_backlog,one_key_backlog]

- `unkeyed`: 2,000 runs without a key (what every claim cost before keys: run this script on
  a tree without them for the "before" figure; the scenarios with keys need them);
- `keyed_50`: 2,000 runs over 50 keys of limit 2;
- `full_key_backlog`: one key of limit 2 holding both slots with 1,000 runs queued behind it,
  and 2,000 runs without a key: what a full key's backlog costs everybody else's claims;
- `one_key_backlog`: one key of limit 16 with 2,000 runs: the claim takes its free slots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import uuid
from datetime import timedelta
from typing import Any

import psycopg

from bench._infra import Server, with_dbname
from umt_backend_pg import PostgresBackend
from umt_backend_pg._sql import queries, render
from umt_sdk.backend import Ending, Lease, NewRun

DB = "bench_concurrency_claim"
TASK = "bench_keys"
LIMIT = 16
LEASE = timedelta(seconds=60)
WORKER = "bench-keys"
DONE = Ending(status="completed", outcome="completed", output_json="null")


def _new_run(key: str | None, limit: int) -> NewRun:
    fields: dict[str, Any] = {}
    if key is not None:  # only with keys: the tree measured "before" has no such fields
        fields = {"concurrency_key": key, "concurrency_limit": limit}
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=TASK,
        task_version=1,
        input_json="null",
        input_hash="h",
        **fields,
    )


async def _fill(backend: PostgresBackend, scenario: str) -> None:
    runs: list[NewRun] = []
    if scenario == "unkeyed":
        runs = [_new_run(None, 0) for _ in range(2000)]
    elif scenario == "keyed_50":
        runs = [_new_run(f"k{i % 50}", 2) for i in range(2000)]
    elif scenario == "full_key_backlog":
        full = [_new_run("full", 2) for _ in range(1002)]
        for new in full:
            await backend.enqueue(new)
        held = await backend.claim(worker_id="holder", pairs=_pairs(), limit=2, lease=LEASE)
        assert len(held) == 2
        runs = [_new_run(None, 0) for _ in range(2000)]
    elif scenario == "one_key_backlog":
        runs = [_new_run("big", LIMIT) for _ in range(2000)]
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    for new in runs:
        await backend.enqueue(new)


def _pairs() -> list[Any]:
    from umt_sdk.backend import TaskPair

    return [TaskPair(name=TASK, version=1)]


def _buffers(plan: dict[str, Any]) -> int:
    top = plan["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


async def _scenario(url: str, scenario: str, claims: int) -> dict[str, Any]:
    schema = f"keys_{scenario}"
    backend = await PostgresBackend.open(url, schema=schema, listen=False)
    query = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render(queries()["claim_runs"], schema)
    params = {
        "names": [TASK],
        "versions": [1],
        "limit": LIMIT,
        "scan": LIMIT + max(LIMIT, 16),
        "worker_id": WORKER,
        "lease": LEASE,
        "timers": False,
        "timers_after": None,
        "timers_margin": timedelta(seconds=5),
    }
    held = render(
        "SELECT id, fencing_token FROM {schema}.runs"
        " WHERE status = 'running' AND lease_owner = %(worker_id)s",
        schema,
    )
    buffers: list[int] = []
    taken: list[int] = []
    try:
        await _fill(backend, scenario)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f"VACUUM ANALYZE {schema}.runs")  # a settled table, as in production
            for _ in range(claims):
                cur = await conn.execute(query, params)
                row = await cur.fetchone()
                assert row is not None
                plan = row[0][0] if isinstance(row[0], list) else json.loads(row[0])[0]
                buffers.append(_buffers(plan))
                cur = await conn.execute(held, {"worker_id": WORKER})
                rows = await cur.fetchall()
                taken.append(len(rows))
                for run_id, token in rows:
                    lease = Lease(
                        run_id=run_id, fencing_token=token, worker_id=WORKER, duration=LEASE
                    )
                    await backend.end_execution(lease, DONE)
    finally:
        await backend.close()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    return {
        "buffers_per_claim_median": statistics.median(buffers),
        "buffers_per_claim_min_max": [min(buffers), max(buffers)],
        "runs_per_claim_median": statistics.median(taken),
        "claims": claims,
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    with server.connect() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    url = with_dbname(server.admin_url, DB)
    out: dict[str, Any] = {}
    try:
        for scenario in args.scenarios.split(","):
            out[scenario] = result = await _scenario(url, scenario, args.claims)
            print(
                f"{scenario:>18}: {result['buffers_per_claim_median']:>7} buffers per claim "
                f"[{result['buffers_per_claim_min_max'][0]}-"
                f"{result['buffers_per_claim_min_max'][1]}], "
                f"{result['runs_per_claim_median']} runs per claim",
                flush=True,
            )
    finally:
        server.drop_db(DB)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--claims", type=int, default=40, help="claims measured per scenario")
    p.add_argument("--scenarios", default="unkeyed,keyed_50,full_key_backlog,one_key_backlog")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

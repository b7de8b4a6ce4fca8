"""The claim benches' shared measure: the worker's claim (`claim_runs`, no timers read) under
EXPLAIN (ANALYZE, BUFFERS), committed, then the ending of every run it claimed (as the worker's
would), repeated; the median of the claims' shared buffers (hit + read, the statement's top plan
node) and of the runs each took. Used by concurrency_claim, rate_limit_claim and
fairness_claim, each with its own data; deadline_claim shares only the claim's parameters."""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import psycopg

from umt_backend_pg import PostgresBackend
from umt_backend_pg._sql import queries, render
from umt_sdk.backend import Ending, Lease, TaskPair

__all__ = [
    "LEASE",
    "claim_params",
    "measure_claims",
    "print_claim_figures",
    "scratch_backend",
]

LEASE = timedelta(seconds=60)
_DONE = Ending(status="completed", outcome="completed", output_json="null")


def claim_params(
    pairs: Sequence[TaskPair],
    *,
    limit: int,
    worker_id: str,
    lease: timedelta = LEASE,
    timers: bool = False,
) -> dict[str, Any]:
    """The parameters of `claim_runs` as the backend's claim passes them, with its
    over-fetch (`scan`); `timers`: whether the claim also reads the timers (none after a
    point)."""
    return {
        "names": [p.name for p in pairs],
        "versions": [p.version for p in pairs],
        "limit": limit,
        "scan": limit + max(limit, 16),
        "worker_id": worker_id,
        "lease": lease,
        "timers": timers,
        "timers_after": None,
        "timers_margin": timedelta(seconds=5),
    }


def _top_buffers(plan: dict[str, Any]) -> int:
    top = plan["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


@contextlib.asynccontextmanager
async def scratch_backend(url: str, schema: str) -> AsyncIterator[PostgresBackend]:
    """A backend on a fresh schema `schema` (migrated, no LISTEN), dropped at the end."""
    backend = await PostgresBackend.open(url, schema=schema, listen=False)
    try:
        yield backend
    finally:
        await backend.close()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def measure_claims(
    backend: PostgresBackend,
    url: str,
    *,
    pairs: Sequence[TaskPair],
    claims: int,
    limit: int,
    worker_id: str,
    claim_sql: str | None = None,
    analyze: Sequence[str] = ("runs",),
) -> dict[str, Any]:
    """Claim `claims` times on the filled schema of `backend`, after VACUUM ANALYZE of its
    tables `analyze` (a settled table, as in production). `claim_sql`: another `claim_runs`
    (an older queries.sql's) instead of this tree's."""
    schema = backend.schema
    query = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render(
        claim_sql or queries()["claim_runs"], schema
    )
    params = claim_params(pairs, limit=limit, worker_id=worker_id)
    held = render(
        "SELECT id, fencing_token FROM {schema}.runs"
        " WHERE status = 'running' AND lease_owner = %(worker_id)s",
        schema,
    )
    buffers: list[int] = []
    taken: list[int] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for table in analyze:
            await conn.execute(f"VACUUM ANALYZE {schema}.{table}")
        for _ in range(claims):
            cur = await conn.execute(query, params)
            row = await cur.fetchone()
            assert row is not None
            plan = row[0][0] if isinstance(row[0], list) else json.loads(row[0])[0]
            buffers.append(_top_buffers(plan))
            cur = await conn.execute(held, {"worker_id": worker_id})
            rows = await cur.fetchall()
            taken.append(len(rows))
            for run_id, token in rows:
                lease = Lease(
                    run_id=run_id, fencing_token=token, worker_id=worker_id, duration=LEASE
                )
                await backend.end_execution(lease, _DONE)
    return {
        "buffers_per_claim_median": statistics.median(buffers),
        "buffers_per_claim_min_max": [min(buffers), max(buffers)],
        "runs_per_claim_median": statistics.median(taken),
        "claims": claims,
    }


def print_claim_figures(scenario: str, result: dict[str, Any], *, width: int) -> None:
    """One line of `measure_claims`' figures, the scenario's name right-aligned in `width`."""
    low, high = result["buffers_per_claim_min_max"]
    print(
        f"{scenario:>{width}}: {result['buffers_per_claim_median']:>7} buffers per claim "
        f"[{low}-{high}], {result['runs_per_claim_median']} runs per claim",
        flush=True,
    )

"""Rate limits across real worker processes on Postgres (issue 16, part 3).

Four worker processes (four slots each) serve `t_limited`: its runs start only with a token of
their tenant's bucket (4 per second), and its step takes a token of one bucket shared by all
(5 per second). Three tenants' runs are enqueued at once; halfway through one worker is
SIGKILLed while it holds a run (its step's token may be taken, its body not recorded). Every
run completes, and from what the database recorded: no bucket ever gave more tokens than GCRA
allows in any window (the runs' first claims per tenant, the steps' grants), across all the
processes; and each step attempt took its token once, the killed one's included.
"""

from __future__ import annotations

import random
import signal
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from tests._procs.support import Spawner, eventually, q
from tests.integration.limited_tasks import RUNS, STEPS, LimitedJob, t_limited
from umt_sdk import Engine, Registry, connect
from umt_sdk.backend import token_interval

pytestmark = pytest.mark.slow

TENANTS = ("acme", "globex", "initech")
WORKERS = 4
RUNS_PER_TENANT = 12


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(
        pg_url, registry=Registry([t_limited]), schema=pg_schema, run_migrations=False
    )
    try:
        yield client
    finally:
        await client.close()


def _over_the_limit(takes: list[datetime], limit: int, per: timedelta) -> list[str]:
    """Every window in which `takes` exceed GCRA's bound: k takes span (k - limit) intervals."""
    interval = token_interval(limit, per)
    ordered = sorted(takes)
    broken = []
    for i in range(len(ordered)):
        for j in range(i + limit, len(ordered)):
            if ordered[j] - ordered[i] < (j - i + 1 - limit) * interval:
                broken.append(f"{j - i + 1} tokens within {ordered[j] - ordered[i]}")
    return broken


async def test_worker_processes_share_each_bucket_and_a_killed_step_takes_one_token(
    engine: Engine, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    rng = random.Random(3)
    await engine.rate_limits.set(STEPS)
    with Spawner.under(
        tmp_path, tasks="tests.integration.limited_tasks", url=pg_url, schema=pg_schema, poll=0.2
    ) as spawner:
        workers = [spawner.start(lease=1.0, concurrency=4) for _ in range(WORKERS)]
        for worker in workers:
            await worker.wait_ready()
        handles = [
            await engine.enqueue(
                t_limited, LimitedJob(key=f"{tenant}:{i}", delay=rng.uniform(0.05, 0.3))
            )
            for i in range(RUNS_PER_TENANT)
            for tenant in TENANTS
        ]
        victim = workers[rng.randrange(WORKERS)]

        async def holds_a_run() -> bool:
            return await _running_of(pg_url, pg_schema, victim.pid) > 0

        await eventually(holds_a_run, timeout=30, what="the victim to hold a run")
        victim.signal(signal.SIGKILL)
        infos = await engine.wait_idle([h.run_id for h in handles], timeout=240)
    assert [i.status for i in infos] == ["completed"] * len(handles)

    starts: dict[str, list[datetime]] = defaultdict(list)
    for info in infos:
        first = min(info.executions, key=lambda e: e.fencing_token)
        assert info.rate_limit == "proc.runs"
        assert info.rate_limit_key is not None
        starts[info.rate_limit_key].append(first.claimed_at)
    assert set(starts) == set(TENANTS)
    for tenant, takes in starts.items():
        broken = _over_the_limit(takes, RUNS.limit, RUNS.per)
        assert not broken, f"tenant {tenant}: {broken[:5]}"

    grants = await _grants(pg_url, pg_schema)
    assert sorted(run_id for run_id, _, _ in grants) == sorted(i.run_id for i in infos), (
        "one token per step attempt: none taken twice, none missing"
    )
    broken = _over_the_limit([at for _, _, at in grants], STEPS.limit, STEPS.per)
    assert not broken, f"the steps' bucket: {broken[:5]}"


async def _running_of(url: str, schema: str, pid: int) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            q(
                "SELECT count(*) FROM {schema}.runs WHERE status = 'running'"
                " AND lease_owner LIKE %s",
                schema,
            ),
            (f"%-{pid}",),
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def _grants(url: str, schema: str) -> list[tuple[object, str, datetime]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            q(
                "SELECT run_id, step_name, granted_at FROM {schema}.rate_grants"
                " WHERE limit_name = 'proc.steps' AND attempt = 1",
                schema,
            )
        )
        return [(r[0], r[1], r[2]) for r in await cur.fetchall()]

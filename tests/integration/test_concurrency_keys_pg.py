"""Concurrency keys across real worker processes on Postgres (issue 16, part 2).

Eight worker processes (four slots each) serve `t_keyed` (limit 2 per tenant) while three
tenants' runs pour in. A sampler reads the database as fast as it can for the whole test: in
every snapshot, no tenant has more than two runs running, and the key's stored counter agrees
with the runs (`concurrency_keys.running` is what the claim trusts). Halfway through, one
worker is SIGKILLed mid-run: its runs keep their slots until their leases lapse and another
worker takes them over. Every run completes.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from tests._procs.support import Spawner, eventually, q
from tests.integration.keyed_tasks import LIMIT, KeyedJob, t_keyed
from umt_sdk import Engine, Registry, connect

pytestmark = pytest.mark.slow

TENANTS = ("acme", "globex", "initech")
WORKERS = 8
RUNS_PER_TENANT = 30

SAMPLE = """
SELECT r.concurrency_key AS key, count(*) FILTER (WHERE r.status = 'running') AS running,
       count(*) FILTER (WHERE r.status IN ('pending', 'waiting')) AS wanting,
       (SELECT k.running FROM {schema}.concurrency_keys k
        WHERE k.task_name = 't_keyed' AND k.concurrency_key = r.concurrency_key) AS counted,
       (SELECT k.queued FROM {schema}.concurrency_keys k
        WHERE k.task_name = 't_keyed' AND k.concurrency_key = r.concurrency_key) AS queued
FROM {schema}.runs r
WHERE r.task_name = 't_keyed' AND r.status NOT IN ('completed', 'failed', 'canceled')
GROUP BY r.concurrency_key
"""


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(
        pg_url, registry=Registry([t_keyed]), schema=pg_schema, run_migrations=False
    )
    try:
        yield client
    finally:
        await client.close()


async def test_eight_worker_processes_never_run_more_than_the_limit_of_a_tenant(
    engine: Engine, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    rng = random.Random(16)
    with Spawner.under(
        tmp_path, tasks="tests.integration.keyed_tasks", url=pg_url, schema=pg_schema, poll=0.2
    ) as spawner:
        workers = [spawner.start(lease=1.0, concurrency=4) for _ in range(WORKERS)]
        for worker in workers:
            await worker.wait_ready()

        samples = 0
        most: Counter[str] = Counter()
        broken: list[str] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            nonlocal samples
            query = q(SAMPLE, pg_schema)
            async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
                cur = conn.cursor(row_factory=dict_row)
                while not stop.is_set():
                    await cur.execute(query)  # one statement: one snapshot of committed state
                    for row in await cur.fetchall():
                        samples += 1
                        most[row["key"]] = max(most[row["key"]], row["running"])
                        if row["running"] > LIMIT:
                            broken.append(f"{row['key']}: {row['running']} running")
                        counters = (row["counted"], row["queued"])
                        if counters != (row["running"], row["wanting"]):
                            broken.append(
                                f"{row['key']}: counters {counters}, "
                                f"{row['running']} running, {row['wanting']} wanting a slot"
                            )

        sampling = asyncio.create_task(sampler())
        handles = []
        for i in range(RUNS_PER_TENANT):
            for tenant in TENANTS:
                job = KeyedJob(key=f"{tenant}:{i}", delay=rng.uniform(0.02, 0.12), nap=i % 3 == 0)
                handles.append(await engine.enqueue(t_keyed, job))
            if i == RUNS_PER_TENANT // 2:

                async def a_holder() -> list[int]:
                    """The indexes of the workers that hold a run now (a worker picked before
                    it held one may win no claim for long on a loaded machine)."""
                    held = [await _running_of(pg_url, pg_schema, w.pid) for w in workers]
                    return [n for n, rows in enumerate(held) if rows > 0]

                holders = await eventually(
                    a_holder, timeout=30, interval=0.1, what="a worker to hold a run"
                )
                workers[rng.choice(holders)].signal(signal.SIGKILL)
            await asyncio.sleep(0.01)
        infos = await engine.wait_idle([h.run_id for h in handles], timeout=240)
        stop.set()
        await sampling

    assert not broken, broken[:10]
    assert samples > 100, f"the sampler read only {samples} rows"
    assert set(most) == set(TENANTS)
    assert max(most.values()) == LIMIT, f"the limit was never reached: {dict(most)}"
    assert [i.status for i in infos] == ["completed"] * len(handles)
    keys = await _key_rows(pg_url, pg_schema)
    assert keys == dict.fromkeys(TENANTS, (0, 0)), "every slot given back, nothing left queued"


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


async def _key_rows(url: str, schema: str) -> dict[str, tuple[int, int]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            q("SELECT concurrency_key, running, queued FROM {schema}.concurrency_keys", schema)
        )
        return {key: (running, queued) for key, running, queued in await cur.fetchall()}


def test_the_claim_reads_a_keys_waiting_runs_never_its_history(pg_url: str, pg_schema: str) -> None:
    """50 keys of 40 waiting runs each, and 20,000 finished runs of another key: the claim
    reads the keys' runs only through runs_claim_keyed, the index of runs wanting a slot, never
    runs_by_concurrency_key (every run of a key, its history included), in its plan with the
    values bound and in its generic plan (psycopg prepares it after a few executions)."""
    from datetime import timedelta

    from psycopg import sql

    from tests.integration.test_query_plans import generic, indexes_on_runs
    from umt_backend_pg._sql import queries, render

    s = sql.Identifier(pg_schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.runs (id, task_name, task_version, status, available_at, "
                "input_hash, input, concurrency_key, finished_at) "
                "SELECT gen_random_uuid(), 't_keyed', 1, "
                "CASE WHEN g <= 2000 THEN 'pending' ELSE 'completed' END, "
                "CASE WHEN g <= 2000 THEN now() END, 'h', '{{}}', "
                "CASE WHEN g <= 2000 THEN 'k' || g % 50 ELSE 'old' END, "
                "CASE WHEN g > 2000 THEN now() END "
                "FROM generate_series(1, 22000) AS g"
            ).format(s=s)
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.concurrency_keys (task_name, concurrency_key, slot_limit, queued)"
                " SELECT 't_keyed', 'k' || g, 2, 40 FROM generate_series(0, 49) AS g"
            ).format(s=s)
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}.runs").format(s))
        query = render(queries()["claim_runs"], pg_schema)
        params = {
            "names": ["t_keyed"],
            "versions": [1],
            "limit": 16,
            "scan": 32,
            "worker_id": "plan",
            "lease": timedelta(seconds=60),
            "timers": False,
            "timers_after": None,
            "timers_margin": timedelta(seconds=5),
        }
        plans = []
        for explain, text, args in (
            ("EXPLAIN (ANALYZE, FORMAT JSON) ", query, params),
            ("EXPLAIN (GENERIC_PLAN, FORMAT JSON) ", generic(query), None),
        ):
            try:
                (plan,) = conn.execute(explain + text, args).fetchone() or (None,)  # ours
                plans.append(plan)
            finally:
                conn.rollback()
    for plan in plans:
        used = indexes_on_runs(plan, set())
        assert "runs_claim_keyed" in used, sorted(used)
        assert "runs_by_concurrency_key" not in used, sorted(used)
        assert "Seq Scan" not in used, sorted(used)

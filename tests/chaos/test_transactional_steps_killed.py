"""Transactional steps whose worker processes are SIGKILLed at random points, from inside (just
before a step, inside its open transaction after its write, after its body before its record,
just after its commit) and from outside (at a random moment): every step's write lands exactly
once, under the attempt that recorded the step."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests._procs.support import Spawner, fetch
from tests.chaos.tx_tasks import ENTRIES, FIRST_KILL, STEPS, TASKS, ddl, ledger
from umt_sdk import Registry, connect

RUNS = 8
WORKERS_KILLED_FROM_OUTSIDE = 4


async def test_transactional_steps_killed_at_random_points_write_each_entry_once(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = int(os.environ.get("UMT_TEST_SEED", str(time.time_ns())))
    rng = random.Random(seed)
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(ddl(pg_schema))
    engine = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    with Spawner.under(tmp_path, tasks="tests.chaos.tx_tasks", **fields) as spawner:
        try:
            handles = [await engine.enqueue(ledger, f"r{i}") for i in range(RUNS)]
            deadline = time.monotonic() + 240
            started = 0
            outside_kills = 0
            while True:
                infos = [await engine.get(h.run_id) for h in handles]
                if all(info.status == "completed" for info in infos):
                    break
                assert time.monotonic() < deadline, f"seed {seed}: runs {infos}"
                # The last workers are left alone (no kills), so the runs finish.
                last = started >= 12
                monkeypatch.setenv("UMT_TEST_TX_KILL", "0" if last else "0.08")
                proc = spawner.start(group=f"w{started}", lease=1.0, concurrency=4)
                started += 1
                if not last and outside_kills < WORKERS_KILLED_FROM_OUTSIDE:
                    await asyncio.sleep(rng.uniform(0.3, 2.0))
                    if proc.alive:
                        proc.kill()  # SIGKILL from outside, wherever it is
                        outside_kills += 1
                        continue
                while proc.alive and time.monotonic() < deadline:
                    infos = [await engine.get(h.run_id) for h in handles]
                    if all(info.status == "completed" for info in infos):
                        break
                    await asyncio.sleep(0.1)
                proc.kill()
            dying = [
                line for p in spawner.started for line in p.lines() if line.startswith("DYING")
            ]
            assert (spawner.workdir / FIRST_KILL).exists(), "the first worker died in a body"
            assert any(line.split()[1] == "first" for line in dying)
            assert await asyncio.gather(*(h.result(timeout=30) for h in handles)) == [STEPS] * RUNS

            entries = await fetch(
                pg_url,
                sql.SQL("SELECT key, step, token FROM {}.{}").format(
                    sql.Identifier(pg_schema), sql.Identifier(ENTRIES)
                ),
            )
            written = sorted((e["key"], e["step"]) for e in entries)
            expected = sorted((f"r{i}", s) for i in range(RUNS) for s in range(STEPS))
            assert written == expected, f"seed {seed}: each step's write exactly once; {dying}"
            tokens = {(e["key"], e["step"]): e["token"] for e in entries}
            interrupted = 0
            for i, handle in enumerate(handles):
                info = await engine.get(handle.run_id)
                completed = [s for s in info.timeline if s.status == "completed"]
                assert [s.name for s in completed] == [f"post-{s}" for s in range(STEPS)]
                for s, record in enumerate(completed):
                    assert tokens[(f"r{i}", s)] == record.fencing_token, (
                        f"seed {seed}: the write of r{i} post-{s} is the recording attempt's"
                    )
                interrupted += info.lease_expirations
            assert interrupted >= 1, f"seed {seed}: some run was taken over after a kill"
        finally:
            await engine.close()

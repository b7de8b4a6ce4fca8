"""The download example's night, killed mid fan-out: a real worker process (the example's own
`app.py worker`) runs `nightly_downloads@1`, whose map has started one `download_plan@2` child
per deferred plan (two at a time, the rest held in the database); it is SIGKILLed while two
plans are done, two children wait for their downloads and two are held. Another worker
finishes the night: one child and one client job per plan, and the night's run is woken once
for all of them."""

from __future__ import annotations

import asyncio
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from umt_sdk import connect

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "download_approval"
PLANS = 6


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _count(url: str, query: str, schema: str, *params: Any) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(sql.SQL(query).format(s=sql.Identifier(schema)), params)
        row = await cur.fetchone()
    return int(row[0]) if row else 0


def _worker(url: str, schema: str, data: Path, name: str, logs: Path) -> subprocess.Popen[str]:
    """The example's worker process (release 2, group io); its stderr in `<logs>/<name>.err`."""
    with (logs / f"{name}.err").open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE / "app.py"), "worker", "--url", url, "--schema", schema,
             "--data", str(data), "--release", "2", "--group", "io", "--name", name],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )  # fmt: skip
    assert proc.stdout is not None
    # Bounded: a worker that never prints its line must fail the test, not block it.
    readable, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if readable else ""
    if not line.startswith("ready"):
        proc.kill()
        proc.wait(timeout=10)
    assert line.startswith("ready"), (
        f"{name} did not start within 60 s (it printed {line!r}, exit {proc.poll()}): "
        f"{(logs / f'{name}.err').read_text()}"
    )
    return proc


async def test_a_night_killed_mid_fan_out_starts_one_child_per_plan(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import app
    import fake_client
    import tasks

    await app.migrate_business(pg_url, pg_schema)
    biz = app.app_schema(pg_schema)
    plans = [
        await app.create_plan(
            pg_url, pg_schema, url_to_fetch=f"https://mirror.example/n{n}.iso", size=300_000,
            deferred=True,
        )
        for n in range(PLANS)
    ]  # fmt: skip
    engine = await connect(
        pg_url, registry=tasks.registry(2), schema=pg_schema, run_migrations=False
    )
    # How many more downloads the client may finish (None: all): a budget, not an on/off
    # switch, so that no download in flight when the test says stop finishes a third plan.
    allowed: list[int | None] = [0]
    stop = asyncio.Event()

    async def client() -> None:
        """The client finishes downloads only as far as the test allows it."""
        while not stop.is_set():
            budget = allowed[0]
            if budget is None or budget > 0:
                done = await fake_client.complete_jobs(
                    pg_url, biz, tmp_path / "incoming", limit=budget
                )
                if budget is not None:
                    allowed[0] = budget - done
                async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
                    cur = await conn.execute(
                        sql.SQL(
                            "UPDATE {s}.downloads d SET status = 'done', path = j.path"
                            " FROM {s}.client_jobs j, {s}.plans p WHERE d.job_id = j.id"
                            " AND j.status = 'done' AND d.status = 'downloading'"
                            " AND p.id = d.plan_id RETURNING p.run_id"
                        ).format(s=sql.Identifier(biz))
                    )
                    finished = await cur.fetchall()
                for (run_id,) in finished:
                    await engine.signal(run_id, "downloaded", {})
            await asyncio.sleep(0.05)

    daemon = asyncio.create_task(client())
    workers: list[subprocess.Popen[str]] = []
    try:
        first = _worker(pg_url, pg_schema, tmp_path, "night-a", tmp_path)
        workers.append(first)
        await engine.schedules.create(tasks.NIGHTLY)
        night = await engine.schedules.trigger("nightly_downloads")

        async def done_count() -> int:
            return await _count(pg_url, "SELECT count(*) FROM {s}.assets", biz)

        async def jobs() -> int:
            return await _count(pg_url, "SELECT count(*) FROM {s}.client_jobs", biz)

        allowed[0] = 2

        async def two_done() -> bool:
            return await done_count() >= 2

        await _until(two_done, "the first two plans to be done")

        async def next_two_submitted() -> bool:
            return await jobs() >= 4

        await _until(next_two_submitted, "the next two children to submit their downloads")
        assert await done_count() < PLANS
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert first.returncode == -signal.SIGKILL

        children = (await engine.list(parent=night.run_id, limit=100)).runs
        assert len(children) == PLANS, "every child was stored by the map's step"
        held = [c for c in children if c.waiting_for == "umt turn"]
        assert len(held) == PLANS - 4, "two done, two downloading, the rest held back"

        workers.append(_worker(pg_url, pg_schema, tmp_path, "night-b", tmp_path))
        allowed[0] = None
        said = await night.result(timeout=120)
        assert sorted(said) == sorted(plans)
        assert all(value == f"asset-{plan}" for plan, value in said.items()), said

        children = (await engine.list(parent=night.run_id, limit=100)).runs
        assert len(children) == PLANS, "one child per plan, none started twice"
        inputs = sorted(child.input["plan_id"] for child in children)
        assert inputs == sorted(plans)
        assert {child.status for child in children} == {"completed"}
        for plan in plans:
            per_plan = await _count(
                pg_url, "SELECT count(*) FROM {s}.client_jobs WHERE tag = %s", biz, f"submit:{plan}"
            )
            assert per_plan == 1, f"{plan}: {per_plan} client jobs"
        info = await engine.get(night.run_id)
        assert info.attempts == 2, "the night's run was woken once, across the kill"
    finally:
        stop.set()
        await asyncio.wait_for(daemon, 30)  # it ends at its next turn (0.05 s)
        for proc in workers:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()  # SIGKILL ends it even when stopped
                    proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        await engine.close()
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(biz))
            )

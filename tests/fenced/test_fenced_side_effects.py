"""Fenced side effects end to end: real worker processes SIGKILLed or SIGSTOPped at every
interesting point of `with_attempt_token`, and a long chunked copy stopped by a cancel.

The business state (the external system's orders, the order file, the bookings) must show
each action exactly once, whatever the point; resumed attempts reconcile by the order's key.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from tests.fenced.worker_proc import CHUNK, POINTS, READY, Action, Copy, copy_file, ddl, registry
from tests.fenced.worker_proc import fenced_action as fenced_task
from umt_sdk import Engine, connect

PROGRAM = Path(__file__).with_name("worker_proc.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


class Worker:
    def __init__(self, url: str, schema: str, workdir: Path, logs: Path, name: str) -> None:
        self.name = name
        self.out_path = logs / f"{name}.out"
        self.err_path = logs / f"{name}.err"
        self._out: IO[bytes] = self.out_path.open("wb")
        self._err: IO[bytes] = self.err_path.open("wb")
        self.popen = subprocess.Popen(
            [
                sys.executable,
                str(PROGRAM),
                *("--url", url, "--schema", schema, "--workdir", str(workdir), "--name", name),
            ],
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1"),
        )

    def lines(self) -> list[str]:
        return self.out_path.read_text(errors="replace").splitlines()

    def describe(self) -> str:
        err = self.err_path.read_text(errors="replace")[-3000:]
        return f"{self.name} (exit {self.popen.poll()}):\n{chr(10).join(self.lines())}\n{err}"

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)
        self._out.close()
        self._err.close()


@pytest.fixture
def workers(pg_url: str, pg_schema: str, tmp_path: Path) -> Any:
    logs, workdir = tmp_path / "logs", tmp_path / "files"
    logs.mkdir()
    workdir.mkdir()
    started: list[Worker] = []

    def start(count: int) -> list[Worker]:
        new = [
            Worker(pg_url, pg_schema, workdir, logs, f"w{len(started) + i}") for i in range(count)
        ]
        started.extend(new)
        return new

    start.workdir = workdir  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for worker in started:
            worker.close()


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> Any:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(ddl(pg_schema))
    client = await connect(pg_url, registry=registry, schema=pg_schema, run_migrations=False)
    try:
        yield client
    finally:
        await client.close()


async def until(check: Any, *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def table(url: str, schema: str, name: str) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(
            sql.SQL("SELECT * FROM {}.{} ORDER BY 1").format(
                sql.Identifier(schema), sql.Identifier(name)
            )
        )
        return await cur.fetchall()


def _paused(workers: list[Worker]) -> dict[str, tuple[Worker, int]]:
    found = {}
    for worker in workers:
        for line in worker.lines():
            if line.startswith("PAUSED "):
                _, point, token = line.split()
                found[point] = (worker, int(token))
    return found


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_each_action_happens_once_whatever_the_point_of_the_crash(
    signum: int, pg_url: str, pg_schema: str, engine: Engine, workers: Any
) -> None:
    # one worker slot each: the four runs pause in four workers, the fifth takes them over
    pool: list[Worker] = workers(len(POINTS) + 1)
    for worker in pool:
        await until(lambda w=worker: READY in w.lines(), timeout=30, what=f"{worker.name} ready")
    runs = {
        point: (await engine.enqueue(fenced_task, Action(key=point, pause=point))).run_id
        for point in POINTS
    }
    paused = await until(
        lambda: p if len(p := _paused(pool)) == len(POINTS) else None,
        timeout=30,
        what="every run paused at its point",
    )
    assert len({w.name for w, _ in paused.values()}) == len(POINTS), paused
    for worker, _ in paused.values():
        worker.popen.send_signal(signum)

    outputs = {}
    for point, run_id in runs.items():
        info = (await engine.wait_idle([run_id], timeout=60))[0]
        assert info.status == "completed", f"{point}: {info.status} {info.error}"
        assert info.lease_expirations == 1, f"{point}: {info.lease_expirations} lease expirations"
        outputs[point] = await engine.result(run_id)

    if signum == signal.SIGSTOP:
        # the frozen attempts wake up after their runs completed elsewhere: each goes on from
        # its point and must be refused (fencing) or stopped (its lease is gone), writing nothing
        (workers.workdir / "release").touch()
        for worker, _ in paused.values():
            worker.popen.send_signal(signal.SIGCONT)
        for point, (worker, token) in paused.items():
            exit_line = await until(
                lambda w=worker, t=token: next(
                    (x for x in w.lines() if x.startswith(f"EXIT {t} ")), None
                ),
                timeout=30,
                what=f"the stale attempt {token} at {point} to end\n{worker.describe()}",
            )
            assert not exit_line.endswith("returned"), f"{point}: stale attempt {exit_line}"

    orders = await table(pg_url, pg_schema, "ext_orders")
    bookings = await table(pg_url, pg_schema, "bookings")
    submits = [e for e in await table(pg_url, pg_schema, "ext_log") if e["event"] == "submit"]
    attempts = await table(pg_url, pg_schema, "attempt_log")
    for point in POINTS:
        op_key = f"submit:{point}"
        mine = [o for o in orders if o["op_key"] == op_key]
        booked = [b for b in bookings if b["op_key"] == op_key]
        assert len(mine) == 1, f"{point}: {len(mine)} external orders: {mine}"
        assert len([s for s in submits if s["op_key"] == op_key]) == 1, f"{point}: submits"
        assert len(booked) == 1, f"{point}: {len(booked)} bookings: {booked}"
        assert booked[0]["ref"] == mine[0]["ref"] == outputs[point], (point, booked, mine)
        order_file = workers.workdir / f"{point}.order"
        assert order_file.read_text().count("token") == 1, order_file.read_text()

        first_token = paused[point][1]
        later = [(a["resumed"], a["decision"]) for a in attempts if a["op_key"] == op_key]
        later_by_new = [
            (a["resumed"], a["decision"])
            for a in attempts
            if a["op_key"] == op_key and a["token"] != first_token
        ]
        if point == "before_begin":  # nothing began: a fresh action by the next attempt
            assert later_by_new == [(False, "fresh")], (point, later)
            assert mine[0]["token"] != first_token
        elif point == "in_action":  # began, nothing written: reconcile finds nothing, redo
            assert later_by_new == [(True, "redo")], (point, later)
            assert mine[0]["token"] != first_token
        elif point == "after_action":  # written, not committed: reconcile finds the order
            assert later_by_new == [(True, "reconciled")], (point, later)
            assert mine[0]["token"] == first_token
        else:  # committed: the recorded result is returned, the action is not called again
            assert later_by_new == [], (point, later)
            assert mine[0]["token"] == first_token


async def test_a_long_copy_stops_within_one_chunk_of_a_cancel(
    pg_url: str, pg_schema: str, engine: Engine, workers: Any, tmp_path: Path
) -> None:
    source, target = tmp_path / "big.iso", tmp_path / "copy.iso"
    chunks = 400
    source.write_bytes(os.urandom(CHUNK) * chunks)
    (worker,) = workers(1)
    await until(lambda: READY in worker.lines(), timeout=30, what="worker ready")
    run = await engine.enqueue(copy_file, Copy(source=str(source), target=str(target)))
    await until(
        lambda: any(x == "CHUNK 20" for x in worker.lines()),
        timeout=30,
        what="20 chunks copied",
    )
    assert (await engine.cancel(run.run_id, reason="operator stop")) == "requested"
    info = (await engine.wait_idle([run.run_id], timeout=30))[0]
    assert info.status == "canceled", f"{info.status} {info.error}"
    line = await until(
        lambda: next((x for x in worker.lines() if x.startswith("ABORTED")), None),
        timeout=10,
        what=f"the copy to report its abort\n{worker.describe()}",
    )
    match = re.fullmatch(r"ABORTED signal_at=(\d+) stopped_at=(\d+)", line)
    assert match, line
    signal_at, stopped_at = int(match[1]), int(match[2])
    assert stopped_at - signal_at <= 1, f"{stopped_at - signal_at} chunks copied after the abort"
    assert stopped_at < chunks, f"the copy ran to the end ({stopped_at} chunks)"
    assert target.stat().st_size == stopped_at * CHUNK, target.stat().st_size
    copy_steps = [s for s in info.timeline if s.name == "copy"]
    assert [s.status for s in copy_steps] != ["completed"], copy_steps

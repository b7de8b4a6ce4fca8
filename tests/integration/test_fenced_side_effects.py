"""Fenced side effects end to end: real worker processes SIGKILLed or SIGSTOPped at every
interesting point of `with_attempt_token`, and a long chunked copy stopped by a cancel.

The business state (the external system's orders, the order file, the bookings) must show
each action exactly once, whatever the point; resumed attempts reconcile by the order's key.

The workers (`tests/_procs/worker.py --tasks tests.integration.test_fenced_side_effects`)
serve the two tasks of this module:

- `fenced_action`: one step that submits an order to a fake "external system" through
  `with_attempt_token`: it writes a file (first write wins) and appends the order to the
  external system's append-only table `ext_orders`, then commits a `bookings` row in the ledger's
  transaction. A resumed attempt (`info.resumed`) reconciles first: it looks the order up by its
  key and finishes with it, or redoes the action when it is not there. The external system
  refuses a write whose fencing token is older than one it has already seen for the key.
  The input names a pause point; on the run's first claim the worker prints
  `PAUSED <point> <token>` there and blocks until the file `<workdir>/release` exists, so a test
  can SIGKILL or SIGSTOP it at exactly that point:
    before_begin  - in the step, before the ledger's begin
    in_action     - inside the action, before it writes anything
    after_action  - after the action wrote (file and external order), before the commit
    after_commit  - after the commit of the business row, before the step is recorded
- `copy_file`: a long step copying a file in chunks, checking the abort signal per chunk;
  it prints `ABORTED signal_at=<chunk> stopped_at=<chunk>` when a cancel stops it.

Every handler exit prints `EXIT <token> <outcome>`.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from tests._procs.support import Process, Spawner, eventually, fetch, q
from tests._procs.worker import config, say, until_file, write_first
from umt_sdk import (
    AttemptInfo,
    Engine,
    FencingError,
    Registry,
    RetryPolicy,
    TaskContext,
    TaskDefinition,
    connect,
    task,
    with_attempt_token,
)

POINTS = ("before_begin", "in_action", "after_action", "after_commit")
CHUNK = 64 * 1024


@attrs.frozen
class Action:
    key: str
    pause: str = ""


@attrs.frozen
class Copy:
    source: str
    target: str
    chunk_delay: float = 0.02


def ddl(schema: str) -> sql.Composed:
    # No unique constraints anywhere: a doubled side effect must show up as a second row.
    return sql.SQL(
        """
        CREATE TABLE {s}.ext_orders (
            seq bigserial PRIMARY KEY, op_key text NOT NULL, ref text NOT NULL,
            token bigint NOT NULL, pid integer NOT NULL);
        CREATE TABLE {s}.ext_log (
            seq bigserial PRIMARY KEY, op_key text NOT NULL, token bigint NOT NULL,
            event text NOT NULL, pid integer NOT NULL);
        CREATE TABLE {s}.attempt_log (
            seq bigserial PRIMARY KEY, op_key text NOT NULL, token bigint NOT NULL,
            resumed boolean NOT NULL, decision text NOT NULL);
        CREATE TABLE {s}.bookings (
            op_key text NOT NULL, ref text NOT NULL, token bigint NOT NULL);
        """
    ).format(s=sql.Identifier(schema))


def _q(text: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(config().schema))


class StaleTokenError(Exception):
    """The external system has seen a newer fencing token for this key."""


async def ext_submit(op_key: str, token: int) -> str:
    """The external system's write: refused for a stale token; otherwise a new order."""
    async with await psycopg.AsyncConnection.connect(config().url) as conn:
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (op_key,))
        cur = await conn.execute(
            _q("SELECT max(token) FROM {s}.ext_log WHERE op_key = %s AND event = 'submit'"),
            (op_key,),
        )
        row = await cur.fetchone()
        newest = row[0] if row else None
        if newest is not None and newest > token:
            await conn.execute(
                _q("INSERT INTO {s}.ext_log (op_key, token, event, pid) VALUES (%s, %s, %s, %s)"),
                (op_key, token, "rejected-stale", os.getpid()),
            )
            await conn.commit()
            raise StaleTokenError(f"{op_key}: token {token} is older than {newest}")
        ref = f"order-{op_key}-{token}"
        await conn.execute(
            _q("INSERT INTO {s}.ext_log (op_key, token, event, pid) VALUES (%s, %s, %s, %s)"),
            (op_key, token, "submit", os.getpid()),
        )
        await conn.execute(
            _q("INSERT INTO {s}.ext_orders (op_key, ref, token, pid) VALUES (%s, %s, %s, %s)"),
            (op_key, ref, token, os.getpid()),
        )
        await conn.commit()
    return ref


async def ext_find(op_key: str) -> str | None:
    async with await psycopg.AsyncConnection.connect(config().url, autocommit=True) as conn:
        cur = await conn.execute(
            _q("SELECT ref FROM {s}.ext_orders WHERE op_key = %s ORDER BY seq LIMIT 1"), (op_key,)
        )
        row = await cur.fetchone()
    return None if row is None else str(row[0])


async def pause(ctx: TaskContext[Action], point: str) -> None:
    if ctx.input.pause != point or ctx.attempt != 1:
        return
    say("PAUSED", point, ctx.attempt_token)
    await until_file("release", limit=None, interval=0.01)
    say("RESUMED", point, ctx.attempt_token)


async def log_attempt(op_key: str, info: AttemptInfo, decision: str) -> None:
    async with await psycopg.AsyncConnection.connect(config().url, autocommit=True) as conn:
        await conn.execute(
            _q(
                "INSERT INTO {s}.attempt_log (op_key, token, resumed, decision)"
                " VALUES (%s, %s, %s, %s)"
            ),
            (op_key, info.attempt_token, info.resumed, decision),
        )


async def submit(ctx: TaskContext[Action]) -> str:
    op_key = f"submit:{ctx.input.key}"
    await pause(ctx, "before_begin")

    async def act(info: AttemptInfo) -> str:
        await pause(ctx, "in_action")
        if info.resumed:  # an earlier attempt began: look the outside state up first
            found = await ext_find(op_key)
            if found is not None:
                await log_attempt(op_key, info, "reconciled")
                return found
            await log_attempt(op_key, info, "redo")
        else:
            await log_attempt(op_key, info, "fresh")
        write_first(config().workdir / f"{ctx.input.key}.order", f"token {info.attempt_token}\n")
        ref = await ext_submit(op_key, info.attempt_token)
        await pause(ctx, "after_action")
        return ref

    async def record(tx: Any, ref: str) -> None:
        await tx.execute(
            _q("INSERT INTO {s}.bookings (op_key, ref, token) VALUES (%s, %s, %s)"),
            (op_key, ref, ctx.attempt_token),
        )

    async with await psycopg.AsyncConnection.connect(config().url, autocommit=True) as conn:
        try:
            ref = await with_attempt_token(conn, op_key, act, commit=record)
        except FencingError:
            say("FENCED", ctx.attempt_token)
            raise
    await pause(ctx, "after_commit")
    return ref


RETRY = RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=100))


@task("fenced_action", version=1, retry=RETRY)
async def fenced_action(ctx: TaskContext[Action]) -> str:
    outcome = "returned"
    try:
        ref: str = await ctx.step.run("submit", submit, ctx)
        return ref
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        say("EXIT", ctx.attempt_token, outcome)


@task("copy_file", version=1, retry=RetryPolicy.file())
async def copy_file(ctx: TaskContext[Copy]) -> int:
    async def copy() -> int:
        done = 0
        signal_at: list[int] = []

        async def watch() -> None:
            await ctx.abort_event.wait()
            signal_at.append(done)

        watcher = asyncio.create_task(watch())
        try:
            with open(ctx.input.source, "rb") as src, open(ctx.input.target, "wb") as dst:  # noqa: ASYNC230  # the blocking chunked copy users write, under test
                while True:
                    ctx.throw_if_canceled()  # once per chunk
                    chunk = src.read(CHUNK)
                    if not chunk:
                        return done
                    dst.write(chunk)
                    dst.flush()
                    done += 1
                    say("CHUNK", done)
                    await asyncio.sleep(ctx.input.chunk_delay)
        except BaseException:
            if signal_at:
                say(f"ABORTED signal_at={signal_at[0]} stopped_at={done}")
            raise
        finally:
            watcher.cancel()

    return await ctx.step.run("copy", copy)


TASKS: list[TaskDefinition[Any, Any]] = [fenced_action, copy_file]


# -- the tests ------------------------------------------------------------------------------------


@pytest.fixture
def workers(pg_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    with Spawner.under(tmp_path, tasks=__name__, **fields) as spawned:
        yield spawned


def start(workers: Spawner, count: int) -> list[Process]:
    """`count` workers with one slot each, on a 1 s lease."""
    return [
        workers.start(group=f"w{len(workers.started)}", concurrency=1, grace=2.0, max_size=4)
        for _ in range(count)
    ]


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(ddl(pg_schema))
    client = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    try:
        yield client
    finally:
        await client.close()


async def table(url: str, schema: str, name: str) -> list[dict[str, Any]]:
    return await fetch(url, q("SELECT * FROM {schema}.{t} ORDER BY 1", schema, t=name))


def _paused(workers: list[Process]) -> dict[str, tuple[Process, int]]:
    found = {}
    for worker in workers:
        for line in worker.lines():
            if line.startswith("PAUSED "):
                _, point, token = line.split()
                found[point] = (worker, int(token))
    return found


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_each_action_happens_once_whatever_the_point_of_the_crash(
    signum: int, pg_url: str, pg_schema: str, engine: Engine, workers: Spawner
) -> None:
    # one worker slot each: the four runs pause in four workers, the fifth takes them over
    pool = start(workers, len(POINTS) + 1)
    for worker in pool:
        await worker.wait_ready(timeout=30)
    runs = {
        point: (await engine.enqueue(fenced_action, Action(key=point, pause=point))).run_id
        for point in POINTS
    }
    paused = await eventually(
        lambda: p if len(p := _paused(pool)) == len(POINTS) else None,
        timeout=30,
        what="every run paused at its point",
    )
    assert len({w.name for w, _ in paused.values()}) == len(POINTS), paused
    for worker, _ in paused.values():
        worker.signal(signum)

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
            worker.signal(signal.SIGCONT)
        for point, (worker, token) in paused.items():
            exit_line = await eventually(
                lambda w=worker, t=token: next(
                    (x for x in w.lines() if x.startswith(f"EXIT {t} ")), None
                ),
                timeout=30,
                what=f"the stale attempt {token} at {point} to end",
                on_timeout=worker.describe,
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
    pg_url: str, pg_schema: str, engine: Engine, workers: Spawner, tmp_path: Path
) -> None:
    source, target = tmp_path / "big.iso", tmp_path / "copy.iso"
    chunks = 400
    source.write_bytes(os.urandom(CHUNK) * chunks)
    (worker,) = start(workers, 1)
    await worker.wait_ready(timeout=30)
    run = await engine.enqueue(copy_file, Copy(source=str(source), target=str(target)))
    await eventually(
        lambda: any(x == "CHUNK 20" for x in worker.lines()),
        timeout=30,
        what="20 chunks copied",
    )
    assert (await engine.cancel(run.run_id, reason="operator stop")) == "requested"
    info = (await engine.wait_idle([run.run_id], timeout=30))[0]
    assert info.status == "canceled", f"{info.status} {info.error}"
    line = await eventually(
        lambda: next((x for x in worker.lines() if x.startswith("ABORTED")), None),
        timeout=10,
        what="the copy to report its abort",
        on_timeout=worker.describe,
    )
    match = re.fullmatch(r"ABORTED signal_at=(\d+) stopped_at=(\d+)", line)
    assert match, line
    signal_at, stopped_at = int(match[1]), int(match[2])
    assert stopped_at - signal_at <= 1, f"{stopped_at - signal_at} chunks copied after the abort"
    assert stopped_at < chunks, f"the copy ran to the end ({stopped_at} chunks)"
    assert target.stat().st_size == stopped_at * CHUNK, target.stat().st_size
    copy_steps = [s for s in info.timeline if s.name == "copy"]
    assert [s.status for s in copy_steps] != ["completed"], copy_steps

"""Forged and garbage notifications (issue 11 part 5): a NOTIFY is only ever a hint to look.

Any role that can log in to the database may NOTIFY on the engine's channels; no privilege on
the engine's schema is needed. Here a real second role (`CREATE ROLE ... LOGIN`, nothing
granted) sends cancel hints for a running run, garbage on both channels and a storm of made-up
pair names, against a real worker on Postgres: the run keeps running and completes, its
`cancel_requested_at` stays NULL, the LISTEN loop survives, and a real `engine.cancel` still
aborts promptly afterwards (the hint path works, it just looks at the table first).
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime, timedelta
from uuid import UUID

import attrs
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from umt_backend_pg import PostgresBackend
from umt_sdk import Engine, Registry, RunCanceledError, TaskContext, connect, task


@attrs.frozen
class Hold:
    key: str


STARTED: dict[str, asyncio.Event] = {}
RELEASE: dict[str, asyncio.Event] = {}
ABORTS: dict[str, int] = {}


def _event(events: dict[str, asyncio.Event], key: str) -> asyncio.Event:
    return events.setdefault(key, asyncio.Event())


@task("hostile.hold", version=1)
async def hold_task(ctx: TaskContext[Hold]) -> str:
    key = ctx.input.key

    async def hold() -> str:
        _event(STARTED, key).set()
        release = asyncio.ensure_future(_event(RELEASE, key).wait())
        abort = asyncio.ensure_future(ctx.abort_event.wait())
        done, pending = await asyncio.wait({release, abort}, return_when="FIRST_COMPLETED")
        for future in pending:
            future.cancel()
        if abort in done:
            ABORTS[key] = ABORTS.get(key, 0) + 1
            ctx.throw_if_canceled()
            return "aborted"
        return "held"

    outcome: str = await ctx.step.run("hold", hold)
    await ctx.step.run("after", lambda: None)  # a canceled run never starts this step
    return outcome


REGISTRY = Registry([hold_task])


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    STARTED.clear()
    RELEASE.clear()
    ABORTS.clear()
    client = await connect(
        pg_url, registry=REGISTRY, schema=pg_schema, run_migrations=False, max_size=6
    )
    try:
        yield client
    finally:
        for event in RELEASE.values():
            event.set()
        await client.close()


@pytest.fixture
def spy_url(pg_url: str) -> Iterator[str]:
    """A login role with no privilege on anything of the engine's (only CONNECT, as PUBLIC)."""
    role = f"spy_{uuid.uuid4().hex[:10]}"
    password = secrets.token_hex(12)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)
            )
        )
    params = conninfo_to_dict(pg_url)
    params.update(user=role, password=password)
    try:
        yield make_conninfo(**params)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _lease_of(backend: PostgresBackend, run_id: UUID) -> datetime | None:
    """The run's lease expiry while it runs; None once it no longer does."""
    record = await backend.get_run(run_id)
    assert record is not None
    return record.lease_expires_at if record.status == "running" else None


async def _after_two_heartbeats(backend: PostgresBackend, run_id: UUID) -> None:
    """Return once two heartbeats of the run were written after now (the first one after a
    hint has then been answered and acted on: the next one starts only after), or once the
    run no longer runs."""
    for _ in range(2):
        before = await _lease_of(backend, run_id)
        if before is None:
            return

        async def moved(before: datetime = before) -> bool:
            return await _lease_of(backend, run_id) != before

        await _until(moved, "a heartbeat")


async def test_forged_cancel_notifications_cancel_nothing(
    engine: Engine, spy_url: str, pg_schema: str
) -> None:
    backend = engine.backend
    assert isinstance(backend, PostgresBackend)
    hints: list[UUID] = []
    remove = backend.add_cancel_listener(lambda run_id, _: hints.append(run_id))
    handle = await engine.enqueue(hold_task, Hold(key="victim"))
    other = await engine.enqueue(hold_task, Hold(key="bystander"), delay=timedelta(hours=1))
    async with engine.worker(lease=timedelta(seconds=2)):
        await asyncio.wait_for(_event(STARTED, "victim").wait(), 30)
        async with await psycopg.AsyncConnection.connect(spy_url, autocommit=True) as spy:
            # The spy really has no access to the engine's tables...
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await spy.execute(
                    sql.SQL("SELECT count(*) FROM {}.runs").format(sql.Identifier(pg_schema))
                )
            # ...and can still NOTIFY on its channels: forge every shape of cancel hint.
            cancel_channel = f"{pg_schema}.cancel"
            work_channel = f"{pg_schema}.work"
            forged = [
                f"{handle.run_id}:x",
                f"{handle.run_id}",
                f"{handle.run_id}:" + "r" * 7000,
                f"{other.run_id}:not running",
                f"{uuid.uuid4()}:no such run",
                f"{handle.run_id.hex}:hex form",
                f"{{{handle.run_id}}}:braces",
                f"urn:uuid:{handle.run_id}",
                "",
                ":",
                "garbage",
                "\u00e9\u4e2d\U0001f600:unicode",
                "x" * 7999,
            ]
            for payload in forged:
                await spy.execute("SELECT pg_notify(%s, %s)", (cancel_channel, payload))
            made_up = ",".join(f"made.up.{i}@{i}" for i in range(400))
            for payload in ["", ",,,", made_up, "hostile.hold@1," * 400, "\x01\x02"]:
                await spy.execute("SELECT pg_notify(%s, %s)", (work_channel, payload))
            # The last word: a forged hint in the shape the engine itself sends.
            await spy.execute(
                "SELECT pg_notify(%s, %s)", (cancel_channel, f"{handle.run_id}:marker")
            )

        async def delivered() -> bool:
            return hints.count(handle.run_id) >= 4  # x, no reason, long reason, marker

        await _until(delivered, "the forged hints to reach the worker's process")
        await _after_two_heartbeats(backend, handle.run_id)

        assert ABORTS == {}, "a forged NOTIFY fired the abort signal"
        record = await backend.get_run(handle.run_id)
        assert record is not None
        assert (record.status, record.cancel_requested_at) == ("running", None)
        wakeups = backend._wakeups
        assert wakeups._listener is not None
        assert not wakeups._listener.done(), "the LISTEN loop died on a hostile payload"
        # Made-up pair names are not remembered (they would grow memory without bound).
        assert set(wakeups._notified) <= {"*", "hostile.hold@1"}, sorted(wakeups._notified)[:5]

        _event(RELEASE, "victim").set()
        assert await handle.result(timeout=30) == "held"

        # A real cancel still aborts a running handler through the same hint, promptly.
        real = await engine.enqueue(hold_task, Hold(key="real"))
        await asyncio.wait_for(_event(STARTED, "real").wait(), 30)
        assert await engine.cancel(real.run_id, reason="for real") == "requested"
        with pytest.raises(RunCanceledError):
            await real.result(timeout=30)
    remove()
    info = await engine.get(handle.run_id)
    assert (info.status, info.cancel_requested, info.cancel_reason) == ("completed", False, None)
    assert [(s.name, s.status) for s in info.timeline] == [
        ("hold", "completed"),
        ("after", "completed"),
    ]
    canceled = await engine.get(real.run_id)
    assert (canceled.status, canceled.cancel_reason) == ("canceled", "for real")
    assert ABORTS == {"real": 1}
    bystander = await engine.get(other.run_id)
    assert (bystander.status, bystander.cancel_requested) == ("pending", False)

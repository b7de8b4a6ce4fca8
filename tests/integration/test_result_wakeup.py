"""`result()` on Postgres waits for the run's ending notification (sent after the ending's
commit, coalesced per process: umt_backend_pg/_notifier.py) instead of reading the run every
50 ms; it reads again once a second in case a notification was lost, and every 50 ms while the
LISTEN connection is down. Notifications are hints: made-up ones cost a read, never a wrong
answer.

Each test makes the once-a-second read 30 s long, so a result that comes back within the
tests' 10 s could only have been woken by a notification (or by the fallback it tests)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import attrs
import psycopg
import pytest
from psycopg import sql

from umt_backend_pg import PostgresBackend
from umt_backend_pg import _wakeups as wakeups
from umt_sdk import Engine, Registry, RunCanceledError, TaskContext, connect, task

GATES: dict[str, asyncio.Event] = {}


@attrs.frozen
class Job:
    key: str


@task("wakeup.gated", version=1)
async def gated(ctx: TaskContext[Job]) -> str:
    async def wait() -> str:
        await asyncio.wait_for(GATES[ctx.input.key].wait(), 20)
        return f"done-{ctx.input.key}"

    return await ctx.step.run("wait", wait)


REGISTRY = Registry([gated])


@pytest.fixture(autouse=True)
def slow_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeups, "RUN_POLL_LISTENING", 30.0)


@pytest.fixture
async def engines(pg_url: str, pg_schema: str) -> AsyncIterator[tuple[Engine, Engine]]:
    """A client that waits for results, and another engine whose worker runs them (as two
    processes would: the ending reaches the client only through the server)."""
    client = await connect(pg_url, registry=REGISTRY, schema=pg_schema)
    runner = await connect(pg_url, registry=REGISTRY, schema=pg_schema)
    try:
        yield client, runner
    finally:
        await client.close()
        await runner.close()


def _wakeups_of(engine: Engine) -> wakeups.Wakeups:
    backend = engine.backend
    assert isinstance(backend, PostgresBackend)
    return backend._wakeups


async def _listening(engine: Engine) -> None:
    for _ in range(200):
        if _wakeups_of(engine)._listening:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the LISTEN connection never came up")


async def _running(engine: Engine, run_id: uuid.UUID) -> None:
    for _ in range(200):
        if (await engine.get(run_id)).status == "running":
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the run never started")


async def _notify(url: str, channel: str, payload: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))


async def test_a_waiter_is_woken_by_the_ending_of_a_run_another_engine_ran(
    engines: tuple[Engine, Engine],
) -> None:
    client, runner = engines
    await _listening(client)
    GATES["a"] = asyncio.Event()
    handle = await client.enqueue(gated, Job("a"))
    async with runner.worker():
        await _running(client, handle.run_id)
        # What result() does between two reads (the SPI's wait, without result()'s own cap of
        # 5 s): only the ending's notification can end it within the 10 s.
        wait = asyncio.create_task(client.backend.wait_for_run(handle.run_id, timeout=30))
        await asyncio.sleep(0.5)
        assert not wait.done()
        GATES["a"].set()
        await asyncio.wait_for(wait, 10)
        assert await handle.result(timeout=10) == "done-a"
    assert not _wakeups_of(client)._run_waiters, "a waiter was left registered"


async def test_an_ending_noted_just_before_the_wait_returns_at_once(
    engines: tuple[Engine, Engine],
) -> None:
    client, runner = engines
    await _listening(client)
    GATES["b"] = asyncio.Event()
    GATES["b"].set()
    handle = await client.enqueue(gated, Job("b"))
    async with runner.worker():
        for _ in range(200):
            if handle.run_id in _wakeups_of(client)._recent_endings:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the ending's notification never came")
    # As if the caller had read the run just before it ended: the wait does not sleep.
    await asyncio.wait_for(_wakeups_of(client).wait_for_run(handle.run_id, timeout=30), 10)
    assert handle.run_id not in _wakeups_of(client)._recent_endings
    assert await handle.result(timeout=10) == "done-b"


async def test_made_up_notifications_cost_a_read_and_never_a_wrong_answer(
    engines: tuple[Engine, Engine], pg_url: str
) -> None:
    client, runner = engines
    await _listening(client)
    channel = _wakeups_of(client).ended_channel
    GATES["c"] = asyncio.Event()
    handle = await client.enqueue(gated, Job("c"))
    async with runner.worker():
        waiter = asyncio.create_task(handle.result(timeout=60))
        await asyncio.sleep(0.3)
        for payload in [
            "",
            ",,,",
            "not-a-uuid",
            "x" * 7_000,
            str(uuid.uuid4()),
            "{" + str(handle.run_id) + "}",  # UUID() would take it; the canonical form only
            f"{handle.run_id},{handle.run_id}",  # the waited run, still running
            "\x01\u00e9\u2603",
        ]:
            await _notify(pg_url, channel, payload)
        await asyncio.sleep(0.5)
        assert not waiter.done(), "a made-up ending must not end the wait with an answer"
        many = ",".join(str(uuid.uuid4()) for _ in range(150))
        for _ in range(40):  # far more made-up ids than are remembered
            await _notify(pg_url, channel, many)
        GATES["c"].set()
        assert await asyncio.wait_for(waiter, 10) == "done-c"
    assert len(_wakeups_of(client)._recent_endings) <= wakeups.RECENT_ENDINGS


async def test_a_cancel_of_a_pending_run_wakes_its_waiter(engines: tuple[Engine, Engine]) -> None:
    client, runner = engines
    await _listening(client)
    handle = await client.enqueue(gated, Job("d"))
    wait = asyncio.create_task(client.backend.wait_for_run(handle.run_id, timeout=30))
    await asyncio.sleep(0.3)
    assert await runner.cancel(handle.run_id, reason="not needed") == "canceled"
    await asyncio.wait_for(wait, 10)
    with pytest.raises(RunCanceledError):
        await handle.result(timeout=10)


async def test_with_the_listen_connection_cut_a_waiter_still_sees_the_ending(
    engines: tuple[Engine, Engine], pg_url: str
) -> None:
    client, runner = engines
    await _listening(client)
    GATES["e"] = asyncio.Event()
    handle = await client.enqueue(gated, Job("e"))
    async with runner.worker():
        waiter = asyncio.create_task(handle.result(timeout=60))
        await asyncio.sleep(0.3)
        # Cut the client's LISTEN connection, and end the run while it is down.
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            channel = _wakeups_of(client).ended_channel
            await admin.execute(
                sql.SQL(
                    "SELECT pg_terminate_backend(l.pid) FROM pg_stat_activity l "
                    "WHERE l.pid <> pg_backend_pid() AND l.query LIKE {} "
                ).format(sql.Literal(f'LISTEN "{channel}"%')),
            )
        GATES["e"].set()
        assert await asyncio.wait_for(waiter, 10) == "done-e"

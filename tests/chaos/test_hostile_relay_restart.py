"""The OutboxRelay survives restarts of Postgres and cut connections (issue 11 part 7).

The failure this pins: a relay whose connection broke between a batch and its idle wait's
`next_due` query ended its task on the OperationalError, and rows written afterwards stayed
`pending` with no relay left. To hit that gap every time instead of by luck, the test parks
the relay inside `next_due`: a route's mapper (called in the batch) tells the test, which then
takes an ACCESS EXCLUSIVE lock on the outbox table; the lock is granted when the batch commits,
and the relay's `next_due` waits behind it. Then the server is restarted (fast, then crashed
with `-m immediate`, then fast again), or the relay's session is terminated with
`pg_terminate_backend`. After each, new rows must be dispatched, once each.

The restarts run on a private embedded Postgres (tests/fixtures/private_pg.py);
the cut-connection variant runs on the session's server, in both layouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests._procs.support import fetch, q
from tests.fixtures.private_pg import PrivatePostgres
from tests.integration.outbox._support import eventually, insert_items, status_counts
from tests.integration.outbox.conftest import engine, layout, make_relay
from tests.integration.outbox.tasks import process_item
from umt_backend_pg import OutboxRelay, install_outbox, migrate
from umt_sdk import Engine, Registry, TaskContext, connect, task

# Fixtures, imported to be used here.
__all__ = ["engine", "layout", "make_relay"]

SCHEMA = "umt_relay_restart"
PARK = -1
"""The payload `n` of the event whose mapping makes the test park the relay in `next_due`."""


class Parker:
    """Parks the relay in its `next_due` query, behind a lock the test holds.

    The route's mapper, called inside the batch's transaction, queues an ACCESS EXCLUSIVE lock
    request on the outbox table behind the batch's own row locks, and returns only once that
    request is seen waiting: the lock is then granted the moment the batch commits, before the
    relay's next statement (`next_due`), which must wait behind it. No race left to luck.
    """

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.mapped = asyncio.Event()
        self.locker: psycopg.Connection[Any] | None = None
        self._locking: threading.Thread | None = None

    def mapper(self, payload: dict[str, Any]) -> dict[str, Any]:
        if payload["n"] == PARK:
            self._queue_lock()
            self.mapped.set()
        return {"n": payload["n"]}

    def _queue_lock(self) -> None:
        locker = self.locker = psycopg.connect(self.url)
        pid = locker.info.backend_pid
        statement = q("LOCK TABLE {schema}.outbox_event IN ACCESS EXCLUSIVE MODE", self.schema)
        self._locking = threading.Thread(target=locker.execute, args=(statement,), daemon=True)
        self._locking.start()
        deadline = time.monotonic() + 20
        with psycopg.connect(self.url, autocommit=True) as probe:
            while time.monotonic() < deadline:
                row = probe.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                if row is not None and row[0] == "Lock":
                    return
                time.sleep(0.01)
        raise AssertionError("the lock request never queued behind the relay's batch")

    async def park(self, relay_business_url: str) -> int:
        """Insert the parking event and return the pid of the relay's session once it waits
        for the test's lock in `next_due`."""
        self.url = relay_business_url
        self.mapped.clear()
        await insert_items(relay_business_url, self.schema, [PARK])
        await asyncio.wait_for(self.mapped.wait(), 30)

        async def parked() -> list[dict[str, Any]]:
            return await fetch(
                relay_business_url,
                sql.SQL(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%min(next_attempt_at)%' AND datname = current_database()"
                ),
            )

        waiting = await eventually(parked, timeout=30, what="the relay to wait in next_due")
        assert len(waiting) == 1, waiting
        pid: int = waiting[0]["pid"]
        return pid

    async def release(self) -> None:
        await asyncio.to_thread(self._release)

    def _release(self) -> None:
        locker, self.locker = self.locker, None
        locking, self._locking = self._locking, None
        if locking is not None:
            locking.join(timeout=30)
        if locker is not None and not locker.closed:
            with contextlib.suppress(psycopg.OperationalError):  # the server went with it
                locker.rollback()
            locker.close()


async def _runs_by_n(engine_url: str, schema: str) -> dict[int, int]:
    found = await fetch(
        engine_url,
        q(
            "SELECT (input->>'n')::int AS n, count(*) AS c FROM {schema}.runs"
            " WHERE task_name = 'process_item' GROUP BY 1",
            schema,
        ),
    )
    return {r["n"]: r["c"] for r in found}


async def _dispatch_and_check(
    business: str, engine_url: str, schema: str, numbers: list[int], what: str
) -> None:
    await insert_items(business, schema, numbers)

    async def done() -> bool:
        counts = await status_counts(business, schema)
        return counts.get("pending", 0) == 0 and "dead" not in counts

    await eventually(done, timeout=60, what=f"the rows written {what} to be dispatched")
    runs = await _runs_by_n(engine_url, schema)
    missing = [n for n in numbers if runs.get(n) != 1]
    assert not missing, f"rows written {what} without exactly one run: {missing[:10]}"


def _relay(
    business: str, engine: Engine, schema: str, parker: Parker, make: Callable[..., OutboxRelay]
) -> OutboxRelay:
    return make(
        business,
        engine,
        {"item": (process_item, parker.mapper)},
        schema=schema,
        poll_interval=timedelta(seconds=1),
        backoff=timedelta(milliseconds=100),
    )


RELEASE = asyncio.Event()


@task("hostile.relay.hold", version=1)
async def hold_task(ctx: TaskContext[None]) -> str:
    """Holds its worker's heartbeats busy across the outages (a step open until released)."""

    async def hold() -> None:
        await RELEASE.wait()

    await ctx.step.run("hold", hold)
    return "held"


def _outage_lines(records: list[logging.LogRecord]) -> Counter[str]:
    """Warnings of the long-lived loops about a failure, by loop."""
    loops = {
        "relay": ("outbox relay on",),
        "relay LISTEN": ("outbox LISTEN",),
        "worker claim": ("claim",),
        "worker heartbeat": ("heartbeat failed",),
        "worker LISTEN": ("LISTEN connection lost",),
    }
    found: Counter[str] = Counter()
    for record in records:
        if record.levelno < logging.WARNING or "works again" in record.getMessage():
            continue
        message = record.getMessage()
        for loop, marks in loops.items():
            if any(message.startswith(m) or m in message.split(";")[0] for m in marks):
                found[loop] += 1
                break
    return found


@pytest.mark.slow
async def test_the_relay_and_a_worker_survive_restarts_of_postgres(
    private_pg: PrivatePostgres,
    make_relay: Callable[..., OutboxRelay],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = private_pg.url
    await migrate(url, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await install_outbox(conn, schema=SCHEMA)
    caplog.set_level(logging.DEBUG, logger="umt")
    RELEASE.clear()
    engine = await connect(
        url, registry=Registry([process_item, hold_task]), schema=SCHEMA, run_migrations=False
    )
    parker = Parker(url, SCHEMA)
    relay = _relay(url, engine, SCHEMA, parker, make_relay)
    held = await engine.enqueue(hold_task, None)
    worker = engine.worker(versions=["hostile.relay.hold@1"], lease=timedelta(seconds=1))
    per_outage: list[Counter[str]] = []
    try:
        async with relay, worker:
            try:
                await _dispatch_and_check(url, url, SCHEMA, list(range(50)), "before any restart")
                for i, how in enumerate(("fast", "immediate", "fast")):
                    await parker.park(url)
                    seen = len(caplog.records)
                    private_pg.pg_ctl("-w", "-m", how, "stop")
                    await parker.release()
                    await asyncio.sleep(2.0)  # an outage long enough for several retries
                    private_pg.start()
                    start = 100 * (i + 1)
                    await _dispatch_and_check(
                        url, url, SCHEMA, list(range(start, start + 50)), f"after restart {i + 1}"
                    )
                    per_outage.append(_outage_lines(caplog.records[seen:]))
                assert relay._task is not None
                assert not relay._task.done(), "the relay's task ended"
                assert all(not t.done() for t in worker._tasks), "a worker loop ended"
                RELEASE.set()
                assert await held.result(timeout=60) == "held"
            finally:
                # Before the worker's exit, which waits for the held run to end.
                RELEASE.set()
    finally:
        RELEASE.set()
        await parker.release()
        await engine.close()
    for i, lines in enumerate(per_outage):
        # Each loop says it once per outage (a stale pooled connection met after the first
        # success may count as a second, short one), not once per retry.
        assert lines["relay"] >= 1, (i, lines)
        assert all(n <= 2 for n in lines.values()), (i, lines)
    # The heartbeat may not recover between two outages close together (its next success
    # waits for the pool's reconnect), so it is only sure to warn in one of them.
    assert sum(lines["worker heartbeat"] for lines in per_outage) >= 1, per_outage


async def test_the_relay_survives_a_cut_connection(
    layout: str,
    pg_url: str,
    pg_schema: str,
    engine: Engine,
    make_relay: Callable[..., OutboxRelay],
) -> None:
    async with await psycopg.AsyncConnection.connect(layout, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    parker = Parker(layout, pg_schema)
    relay = _relay(layout, engine, pg_schema, parker, make_relay)
    try:
        async with relay:
            await _dispatch_and_check(layout, pg_url, pg_schema, list(range(10)), "first")
            for round_ in range(2):
                pid = await parker.park(layout)
                async with await psycopg.AsyncConnection.connect(layout, autocommit=True) as admin:
                    # The relay's batch session, and its LISTEN session on the second round.
                    await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                    if round_ == 1:
                        await admin.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE query = %s",
                            (
                                sql.SQL("LISTEN {}")
                                .format(sql.Identifier(relay.channel))
                                .as_string(None),
                            ),
                        )
                await parker.release()
                start = 100 * (round_ + 1)
                await _dispatch_and_check(
                    layout,
                    pg_url,
                    pg_schema,
                    list(range(start, start + 10)),
                    f"after cut {round_ + 1}",
                )
            assert relay._task is not None
            assert not relay._task.done(), "the relay's task ended"
    finally:
        await parker.release()

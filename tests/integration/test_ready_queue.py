"""The ready queue (migrations/0003_ready_queue.sql): runs claimable at once have a row in
`ready` that their claim deletes; `rotate_ready()` truncates past slots without losing a
claimable row, even while another connection holds a snapshot open."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from umt_backend_pg import PostgresBackend, migrate
from umt_backend_pg._sql import queries, render
from umt_sdk.backend import Ending, Lease, NewRun, TaskPair
from umt_sdk.exceptions import BackendError

PAIR = TaskPair(name="rq", version=1)
LEASE = timedelta(seconds=30)


@pytest.fixture
async def backend(pg_url: str, pg_schema: str) -> AsyncIterator[PostgresBackend]:
    opened = await PostgresBackend.open(
        pg_url, schema=pg_schema, run_migrations=False, listen=False, max_size=4
    )
    try:
        yield opened
    finally:
        await opened.close()


def new_run(*, delay: timedelta | None = None, priority: int = 0) -> NewRun:
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=PAIR.name,
        task_version=PAIR.version,
        input_json="{}",
        input_hash="h",
        priority=priority,
        delay=delay,
    )


async def rows(url: str, schema: str, query: str, *args: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL(query).format(schema=sql.Identifier(schema)),  # test's own constant SQL
            args,
        )
        return await cur.fetchall()


async def execute(url: str, schema: str, query: str, *args: Any) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL(query).format(schema=sql.Identifier(schema)),  # test's own constant SQL
            args or None,
        )


async def ready_ids(url: str, schema: str) -> list[uuid.UUID]:
    return [r[0] for r in await rows(url, schema, "SELECT run_id FROM {schema}.ready")]


async def rotate(url: str, schema: str) -> str:
    (outcome,) = (await rows(url, schema, "SELECT {schema}.rotate_ready(10000)"))[0]
    assert isinstance(outcome, str)
    return outcome


async def claim(backend: PostgresBackend, limit: int = 100) -> list[uuid.UUID]:
    claimed = await backend.claim(worker_id="w", pairs=[PAIR], limit=limit, lease=LEASE)
    return [c.run_id for c in claimed]


async def test_a_run_claimable_at_once_is_queued_and_its_claim_dequeues_it(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    now = new_run()
    later = new_run(delay=timedelta(hours=1))
    await backend.enqueue(now)
    await backend.enqueue(later)
    assert await ready_ids(pg_url, pg_schema) == [now.run_id]
    flags = dict(await rows(pg_url, pg_schema, "SELECT id, queued FROM {schema}.runs"))
    assert flags == {now.run_id: True, later.run_id: False}
    assert (await backend.queue_depths([PAIR]))[PAIR] == 2

    assert await claim(backend) == [now.run_id]
    assert await ready_ids(pg_url, pg_schema) == []
    assert dict(await rows(pg_url, pg_schema, "SELECT id, queued FROM {schema}.runs")) == {
        now.run_id: False,
        later.run_id: False,
    }


async def test_priority_then_fifo_across_the_queue_and_the_pending_runs(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    # A released run (pending, not queued) is ordered with the queued ones by priority, then
    # by the time it became claimable.
    first = new_run()
    await backend.enqueue(first)
    (claimed,) = await backend.claim(worker_id="w", pairs=[PAIR], limit=1, lease=LEASE)
    lease = Lease(
        run_id=claimed.run_id, fencing_token=claimed.fencing_token, worker_id="w", duration=LEASE
    )
    low, high = new_run(priority=0), new_run(priority=5)
    await backend.enqueue(low)
    await backend.end_execution(lease, Ending(status="pending", outcome="released"))
    await backend.enqueue(high)
    assert [await claim(backend, limit=1) for _ in range(4)] == [
        [high.run_id],
        [low.run_id],
        [first.run_id],
        [],
    ]


async def test_cancel_dequeues_a_queued_run(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    run = new_run()
    await backend.enqueue(run)
    assert await backend.cancel(run.run_id, reason="no") == "canceled"
    assert await ready_ids(pg_url, pg_schema) == []
    assert await claim(backend) == []


async def test_a_fact_queues_the_run_it_wakes_so_the_next_claim_takes_it(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    run = new_run()
    await backend.enqueue(run)
    (claimed,) = await backend.claim(worker_id="w", pairs=[PAIR], limit=1, lease=LEASE)
    lease = Lease(
        run_id=claimed.run_id, fencing_token=claimed.fencing_token, worker_id="w", duration=LEASE
    )
    parked = await backend.end_execution(
        lease, Ending(status="waiting", outcome="waiting", wait_for="go", available_at=None)
    )
    assert parked == "ended"
    assert await claim(backend) == []  # this claim read the timers: the next one will not
    assert await backend.signal(run_id=run.run_id, name="go", payload_json="1")
    assert await ready_ids(pg_url, pg_schema) == [run.run_id]
    assert await claim(backend) == [run.run_id]
    assert await ready_ids(pg_url, pg_schema) == []


async def until_truncated(url: str, schema: str, partition: str) -> None:
    """Offer rotations until `partition` was truncated (each slot's turn comes every 3 s)."""
    outcomes = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        outcomes.append(await rotate(url, schema))
        (size,) = (
            await rows(
                url, schema, "SELECT pg_relation_size(%s::regclass)", f"{schema}.{partition}"
            )
        )[0]
        if size == 0:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{partition} was never truncated: {outcomes}")


async def partition_of(url: str, schema: str, run_id: uuid.UUID) -> str:
    (name,) = (
        await rows(
            url,
            schema,
            "SELECT tableoid::regclass::text FROM {schema}.ready WHERE run_id = %s",
            run_id,
        )
    )[0]
    assert isinstance(name, str)
    return name.rsplit(".", 1)[-1]


async def test_rotation_truncates_a_claimed_slot_while_a_snapshot_is_held(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    # The very situation vacuum cannot help with: a transaction holds an old snapshot, so the
    # deleted rows of claimed runs stay visible to it. TRUNCATE does not wait for snapshots.
    runs = [new_run() for _ in range(200)]
    for run in runs:
        await backend.enqueue(run)
    partition = await partition_of(pg_url, pg_schema, runs[-1].run_id)
    async with await psycopg.AsyncConnection.connect(pg_url) as holder:
        await holder.execute("SELECT txid_current()")  # BEGIN ... and stay idle in it
        claimed: list[uuid.UUID] = []
        while len(claimed) < len(runs):
            got = await claim(backend)
            assert got, "runs were left unclaimed"
            claimed += got
        assert sorted(claimed) == sorted(r.run_id for r in runs)
        # The slot's size reaching 0 is the proof: vacuum cannot remove rows the held snapshot
        # may still see, only TRUNCATE empties the file. The rotation that did it may be ours
        # or the one the backend's own claims offer when it is due; either is the one under test.
        await until_truncated(pg_url, pg_schema, partition)
        assert holder.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        (held,) = (
            await rows(
                pg_url,
                pg_schema,
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
                " AND backend_xid IS NOT NULL AND pid = %s",
                holder.info.backend_pid,
            )
        )[0]
        assert held == 1, "the snapshot was not held while the slot was truncated"
        await holder.rollback()


async def test_rotation_moves_claimable_rows_and_loses_none(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    runs = [new_run(priority=i % 3) for i in range(60)]
    for run in runs:
        await backend.enqueue(run)
        await asyncio.sleep(0.05)  # spread over more than one slot
    canceled = runs[7]
    await backend.cancel(canceled.run_id, reason="no")
    first = await partition_of(pg_url, pg_schema, runs[0].run_id)
    await until_truncated(pg_url, pg_schema, first)
    left = await ready_ids(pg_url, pg_schema)
    assert sorted(left) == sorted(r.run_id for r in runs if r is not canceled)  # each once
    # One at a time, in claim order: by priority, then FIFO (a stable sort keeps the order).
    expected = sorted((r for r in runs if r is not canceled), key=lambda r: -r.priority)
    claimed = [await claim(backend, limit=1) for _ in expected]
    assert claimed == [[r.run_id] for r in expected]


async def test_rotation_leaves_a_slot_that_someone_holds(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    run = new_run()
    await backend.enqueue(run)
    partition = await partition_of(pg_url, pg_schema, run.run_id)
    assert await claim(backend) == [run.run_id]
    async with await psycopg.AsyncConnection.connect(pg_url) as reader:
        # A reader of the queue (REPEATABLE READ, as a report would be) keeps the slot.
        await reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        await reader.execute(
            sql.SQL("SELECT count(*) FROM {}.{}").format(
                sql.Identifier(pg_schema), sql.Identifier(partition)
            )
        )
        outcomes = []
        deadline = time.monotonic() + 7  # more than one turn of every slot
        while time.monotonic() < deadline:
            outcomes.append(await rotate(pg_url, pg_schema))
            await asyncio.sleep(0.2)
        assert "busy" in outcomes
        (size,) = (
            await rows(
                pg_url,
                pg_schema,
                "SELECT pg_relation_size(%s::regclass)",
                f"{pg_schema}.{partition}",
            )
        )[0]
        assert size > 0, "the slot was truncated under a reader's lock"
        await reader.rollback()
    await until_truncated(pg_url, pg_schema, partition)


@contextlib.asynccontextmanager
async def limited_role(pg_url: str, pg_schema: str, *, creates: bool = False) -> AsyncIterator[str]:
    """The URL of a new role with every right on the engine's tables but TRUNCATE (and, when
    `creates`, CREATE on the database and the schema, as a DBA might grant an app's role)."""
    role = f"r_{uuid.uuid4().hex[:10]}"
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        await conn.execute(
            sql.SQL(
                "GRANT USAGE ON SCHEMA {s} TO {r}; "
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {r}; "
                "GRANT USAGE, UPDATE ON ALL SEQUENCES IN SCHEMA {s} TO {r}; "
                "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {s} TO {r}"
            ).format(s=sql.Identifier(pg_schema), r=sql.Identifier(role))
        )
        if creates:
            cur = await conn.execute("SELECT current_database()")
            database = (await cur.fetchall())[0][0]
            await conn.execute(
                sql.SQL(
                    "GRANT CREATE ON DATABASE {d} TO {r}; GRANT CREATE ON SCHEMA {s} TO {r}"
                ).format(
                    d=sql.Identifier(database), s=sql.Identifier(pg_schema), r=sql.Identifier(role)
                )
            )
    try:
        yield psycopg.conninfo.make_conninfo(pg_url, user=role)
    finally:
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP OWNED BY {r}; DROP ROLE {r}").format(r=sql.Identifier(role))
            )


async def test_a_worker_without_truncate_rights_still_claims_and_says_why_it_cannot_rotate(
    pg_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with limited_role(pg_url, pg_schema) as url:
        limited = await PostgresBackend.open(
            url, schema=pg_schema, run_migrations=False, listen=False, max_size=2
        )
        try:
            runs = [new_run() for _ in range(5)]
            for run in runs:
                await limited.enqueue(run)
            got = await limited.claim(worker_id="w", pairs=[PAIR], limit=10, lease=LEASE)
            assert sorted(c.run_id for c in got) == sorted(r.run_id for r in runs)
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline and limited._clocks.rotation_enabled:
                await limited.enqueue(new_run())
                await limited.claim(worker_id="w", pairs=[PAIR], limit=10, lease=LEASE)
                await asyncio.sleep(0.3)
            assert not limited._clocks.rotation_enabled
            assert "TRUNCATE" in caplog.text
        finally:
            await limited.close()


async def test_migrating_as_a_role_without_truncate_rights_is_a_clear_error(
    pg_url: str, pg_schema: str
) -> None:
    async with limited_role(pg_url, pg_schema, creates=True) as url:
        with pytest.raises(BackendError) as caught:
            await migrate(url, schema=pg_schema)
        message = str(caught.value)
        role = psycopg.conninfo.conninfo_to_dict(url)["user"]
        assert f"GRANT TRUNCATE ON {pg_schema}.ready_0, {pg_schema}.ready_1, " in message
        assert f"TO {role}" in message
        # connect() migrates by default: the same error, before any worker runs.
        with pytest.raises(BackendError, match="cannot TRUNCATE"):
            await PostgresBackend.open(url, schema=pg_schema, listen=False, max_size=1)
    # A role that cannot even create the schema's tables is told to migrate as the owner.
    async with limited_role(pg_url, pg_schema) as url:
        with pytest.raises(BackendError, match="as the schema's owner") as caught:
            await migrate(url, schema=pg_schema)
        assert "run_migrations=False" in str(caught.value)


async def test_a_queued_run_whose_ready_row_was_lost_is_claimed_after_the_sweep(
    backend: PostgresBackend, pg_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    # What no rotation does, an operator may: empty the queue by hand. The runs stay queued in
    # `runs`, where the claim no longer looks; the sweeper hands them back.
    runs = [new_run(priority=i % 2) for i in range(6)]
    for run in runs:
        await backend.enqueue(run)
    await execute(
        pg_url, pg_schema, "TRUNCATE {schema}.ready_0, {schema}.ready_1, {schema}.ready_2"
    )
    # ... a while ago (the sweeper leaves runs younger than its grace alone)
    await execute(
        pg_url,
        pg_schema,
        "UPDATE {schema}.runs SET available_at = available_at - interval '1 minute'",
    )
    assert await claim(backend) == []
    backend._clocks._sweep_at = float("-inf")  # the sweep's 30 s, now
    got = await claim(backend, limit=1)
    assert got == [runs[1].run_id], "the sweep hands runs back in the claim's order"
    assert "lost their row in the ready queue" in caplog.text
    rest = [await claim(backend, limit=1) for _ in range(6)]
    assert rest == [
        [runs[3].run_id],
        [runs[5].run_id],
        [runs[0].run_id],
        [runs[2].run_id],
        [runs[4].run_id],
        [],
    ]


async def test_the_sweep_pages_through_a_backlog_and_leaves_queued_runs_alone(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    runs = [new_run() for _ in range(7)]
    for run in runs:
        await backend.enqueue(run)
    await execute(
        pg_url,
        pg_schema,
        "UPDATE {schema}.runs SET available_at = available_at - interval '1 minute'",
    )
    lost = runs[4]
    await execute(pg_url, pg_schema, "DELETE FROM {schema}.ready WHERE run_id = %s", lost.run_id)
    query = render(queries()["sweep_ready"], pg_schema)
    after: tuple[Any, Any] = (None, None)
    pages = []
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        while True:
            cur = await conn.execute(
                query,
                {
                    "grace": timedelta(seconds=10),
                    "page": 3,
                    "after_at": after[0],
                    "after_id": after[1],
                },
            )
            scanned, requeued, last_at, last_id = await cur.fetchone() or (0, 0, None, None)
            pages.append((scanned, requeued))
            if scanned < 3:
                break
            after = (last_at, last_id)
    assert pages == [(3, 0), (3, 1), (1, 0)]
    flags = dict(await rows(pg_url, pg_schema, "SELECT id, queued FROM {schema}.runs"))
    assert flags == {r.run_id: r is not lost for r in runs}
    claimed = await claim(backend)
    assert sorted(claimed) == sorted(r.run_id for r in runs), "each run claimed once"


async def park(backend: PostgresBackend, until: datetime) -> uuid.UUID:
    """A run that sleeps until `until` (claimed, then parked waiting with a deadline)."""
    run = new_run()
    await backend.enqueue(run)
    (claimed,) = await backend.claim(worker_id="w", pairs=[PAIR], limit=1, lease=LEASE)
    assert claimed.run_id == run.run_id
    lease = Lease(
        run_id=run.run_id, fencing_token=claimed.fencing_token, worker_id="w", duration=LEASE
    )
    ended = await backend.end_execution(
        lease, Ending(status="waiting", outcome="waiting", available_at=until)
    )
    assert ended == "ended"
    return run.run_id


@pytest.mark.slow
async def test_no_due_timer_is_passed_over_by_the_bounded_timers_read(
    backend: PostgresBackend, pg_url: str, pg_schema: str
) -> None:
    # 24 sleeps end at once; a busy worker takes one run every half second, so the last ones
    # are still due 12 s later, long after the read's margin; the first one is locked by
    # another transaction for 7 s meanwhile. Each must be taken, in order of its time, long
    # before the minute's full read.
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT now()")
        (db_now,) = await cur.fetchone() or (None,)
    # Due a few seconds on: parking 24 runs (a claim each) must end before the first is due,
    # or a park's claim takes a due sleeper instead of its own run (a loaded machine took
    # more than the second this once allowed).
    due = db_now + timedelta(seconds=6)
    sleepers = [await park(backend, due + timedelta(milliseconds=i)) for i in range(24)]
    assert await claim(backend) == []  # not yet due
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT now()")
        (db_now,) = await cur.fetchone() or (None,)
    await asyncio.sleep((due - db_now).total_seconds() + 0.5)
    taken: list[uuid.UUID] = []
    async with await psycopg.AsyncConnection.connect(pg_url) as holder:
        await holder.execute(
            sql.SQL("SELECT 1 FROM {}.runs WHERE id = %s FOR UPDATE").format(
                sql.Identifier(pg_schema)
            ),
            (sleepers[0],),
        )
        locked_until = time.monotonic() + 7
        while time.monotonic() < locked_until:
            taken += await claim(backend, limit=1)
            await asyncio.sleep(0.5)
        await holder.rollback()
    while_locked = len(taken)
    assert 0 < while_locked < len(sleepers) - 1
    for _ in range(40):
        taken += await claim(backend, limit=1)
        if len(taken) == len(sleepers):
            break
        await asyncio.sleep(0.5)
    assert sorted(taken) == sorted(sleepers), f"{len(sleepers) - len(taken)} due timers left"
    # In order of their time; the locked one at the first claim after its lock went.
    assert taken.index(sleepers[0]) == while_locked
    assert [t for t in taken if t != sleepers[0]] == sleepers[1:]

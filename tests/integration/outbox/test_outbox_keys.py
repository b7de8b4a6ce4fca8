"""The outbox's default idempotency key identifies the event globally (issue 11 part 8).

Two business databases routing to one engine, and two outbox tables in one database, all
write event 1 (and 2): every event gets its own run, and `dispatched` always means a run of
that event exists under its key, with its input. An outbox installed before the install id
existed dispatches nothing until `install_outbox` is applied again, and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests._procs.support import fetch, q
from tests.fixtures.pg import scratch_database
from tests.integration.outbox._support import eventually, status_counts
from tests.integration.outbox.tasks import process_item
from umt_backend_pg import OutboxRelay, insert_outbox_event, install_outbox
from umt_sdk import Engine
from umt_sdk.exceptions import BackendError


@pytest.fixture
def third_db(pg_url: str) -> Iterator[str]:
    """Another business database, dropped afterwards."""
    with scratch_database(pg_url) as url:
        yield url


async def _insert(url: str, schema: str, payload: dict[str, Any], table: str) -> int:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        event_id = await insert_outbox_event(conn, "item", payload, schema=schema, table=table)
        await conn.commit()
    return event_id


async def _rows_of(url: str, schema: str, table: str) -> list[dict[str, Any]]:
    return await fetch(
        url,
        sql.SQL("SELECT id, status, payload, last_error FROM {}.{} ORDER BY id").format(
            sql.Identifier(schema), sql.Identifier(table)
        ),
    )


async def test_the_same_event_id_in_two_databases_and_two_tables_makes_two_runs(
    make_relay: Callable[..., OutboxRelay],
    second_db: str,
    third_db: str,
    pg_url: str,
    pg_schema: str,
    engine: Engine,
) -> None:
    # Same schema and table name in two databases, plus two tables in the engine's database.
    outboxes = [
        (second_db, "outbox_event"),
        (third_db, "outbox_event"),
        (pg_url, "outbox_event"),
        (pg_url, "outbox_other"),
    ]
    for url, table in outboxes:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await install_outbox(conn, schema=pg_schema, table=table)
    relays = []
    for i, (url, table) in enumerate(outboxes):
        assert await _insert(url, pg_schema, {"n": 1}, table) == 1  # the same payload
        assert await _insert(url, pg_schema, {"n": 10 + i}, table) == 2  # another payload
        relay = make_relay(url, engine, {"item": process_item}, schema=pg_schema, table=table)
        report = await relay.run_once()
        assert (report.claimed, report.dispatched, report.created, report.dead) == (2, 2, 2, 0), (
            url,
            table,
            report,
        )
        relays.append(relay)
    install_ids = {relay.install_id for relay in relays}
    assert None not in install_ids
    assert len(install_ids) == len(outboxes), "each outbox table has its own install id"
    runs = await fetch(
        pg_url,
        q("SELECT idempotency_key AS key, input FROM {schema}.runs", pg_schema),
    )
    by_key = {r["key"]: r["input"] for r in runs}
    assert len(runs) == len(by_key) == 2 * len(outboxes), runs
    # `dispatched` means: a run of this very event exists under its key, with its input.
    for relay, (url, table) in zip(relays, outboxes, strict=True):
        for row in await _rows_of(url, pg_schema, table):
            assert row["status"] == "dispatched", row
            key = relay.default_key(row["id"])
            assert key == f"outbox:{relay.install_id}:{pg_schema}.{table}:{row['id']}"
            assert by_key.get(key) == row["payload"], (key, row)


async def test_the_install_id_is_stable_and_an_old_install_is_told_to_upgrade(
    make_relay: Callable[..., OutboxRelay],
    second_db: str,
    pg_schema: str,
    engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with await psycopg.AsyncConnection.connect(second_db, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
        cur = await conn.execute(
            q("SELECT install_id FROM {schema}.umt_outbox_installs", pg_schema)
        )
        first = await cur.fetchall()
        await install_outbox(conn, schema=pg_schema)  # again: nothing changes
        cur = await conn.execute(
            q("SELECT install_id FROM {schema}.umt_outbox_installs", pg_schema)
        )
        assert await cur.fetchall() == first
        assert len(first) == 1
        # As installed by an older umt: the outbox table without an install id.
        await conn.execute(q("DROP TABLE {schema}.umt_outbox_installs", pg_schema))
    event_id = await _insert(second_db, pg_schema, {"n": 5}, "outbox_event")
    relay = make_relay(second_db, engine, {"item": process_item}, schema=pg_schema)
    with pytest.raises(BackendError, match=r"has no install id .*apply install_outbox"):
        await relay.run_once()
    assert await status_counts(second_db, pg_schema) == {"pending": 1}
    assert (await engine.list()).runs == ()
    # The running relay says so once, keeps trying, and dispatches once it is upgraded.
    caplog.set_level(logging.WARNING, logger="umt.outbox")
    async with relay:

        async def told() -> bool:
            return any("has no install id" in r.getMessage() for r in caplog.records)

        await eventually(told, timeout=20, what="the relay to log the missing install id")
        async with await psycopg.AsyncConnection.connect(second_db, autocommit=True) as conn:
            await install_outbox(conn, schema=pg_schema)

        async def dispatched() -> bool:
            return await status_counts(second_db, pg_schema) == {"dispatched": 1}

        await eventually(dispatched, timeout=30, what="the row to be dispatched after upgrade")
    told_lines = [r for r in caplog.records if "has no install id" in r.getMessage()]
    assert len(told_lines) == 1, "one line per outage, not one per retry"
    [run] = (await engine.list()).runs
    assert run.idempotency_key == relay.default_key(event_id)
    assert run.idempotency_key == f"outbox:{event_id}", "a row older than the upgrade keeps its key"
    later = await _insert(second_db, pg_schema, {"n": 6}, "outbox_event")
    await relay.run_once()
    assert relay.default_key(later) == f"outbox:{relay.install_id}:{pg_schema}.outbox_event:{later}"
    keys = {r.idempotency_key for r in (await engine.list()).runs}
    assert keys == {f"outbox:{event_id}", relay.default_key(later)}


async def test_a_run_an_old_relay_enqueued_before_the_upgrade_is_not_made_twice(
    make_relay: Callable[..., OutboxRelay],
    second_db: str,
    pg_schema: str,
    engine: Engine,
) -> None:
    """Two databases, an old relay: it enqueued the run of event 1 under `outbox:1`, then died
    before marking the row. After the upgrade the new relay finds that run (same key, same
    input) and marks the row: one run, not two."""
    async with await psycopg.AsyncConnection.connect(second_db, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
        await conn.execute(q("DROP TABLE {schema}.umt_outbox_installs", pg_schema))
    event_id = await _insert(second_db, pg_schema, {"n": 8}, "outbox_event")
    old = await engine.enqueue(process_item, {"n": 8}, idempotency_key=f"outbox:{event_id}")
    async with await psycopg.AsyncConnection.connect(second_db, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)  # the upgrade
    relay = make_relay(second_db, engine, {"item": process_item}, schema=pg_schema)
    report = await relay.run_once()
    assert (report.claimed, report.dispatched, report.created) == (1, 1, 0), report
    [run] = (await engine.list()).runs
    assert run.run_id == old.run_id
    assert await status_counts(second_db, pg_schema) == {"dispatched": 1}

"""OutboxRelay in one process, on real Postgres: routing, keys, both layouts, backoff and
dead-lettering, NOTIFY wake-up, graceful stop, tracing, and the shipped DDL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from psycopg_pool import AsyncConnectionPool

from tests._procs.support import fetch, q
from tests.integration.outbox._support import eventually, runs_per_key, status_counts
from tests.integration.outbox.tasks import Order, process_item, registry, ship_order
from umt_backend_pg import OutboxRelay, insert_outbox_event, install_outbox, outbox_ddl
from umt_sdk import Engine, connect
from umt_sdk.exceptions import TaskDefinitionError


async def _insert(url: str, schema: str, type_: str, payload: dict[str, Any], **kw: Any) -> int:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        event_id = await insert_outbox_event(conn, type_, payload, schema=schema, **kw)
        await conn.commit()
    return event_id


async def _event(url: str, schema: str, event_id: int) -> dict[str, Any]:
    found = await fetch(
        url,
        q(
            "SELECT *, next_attempt_at - now() AS due_in FROM {schema}.outbox_event WHERE id = %s",
            schema,
        ),
        (event_id,),
    )
    assert len(found) == 1, f"expected 1 outbox row {event_id}, found {len(found)}"
    return found[0]


async def _make_due(url: str, schema: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(q("UPDATE {schema}.outbox_event SET next_attempt_at = now()", schema))


async def test_routes_keys_and_inputs_in_both_layouts(
    make_relay: Callable[..., OutboxRelay], layout: str, pg_url: str, pg_schema: str, engine: Engine
) -> None:
    async with await psycopg.AsyncConnection.connect(layout, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    plain = await _insert(layout, pg_schema, "item", {"n": 7})
    mapped = await _insert(
        layout, pg_schema, "order", {"id": "o-1", "qty": "3"}, idempotency_key="order:o-1"
    )
    relay = make_relay(
        layout,
        engine,
        {
            "item": process_item,
            "order": (ship_order, lambda p: Order(order_id=p["id"], quantity=int(p["qty"]))),
        },
        schema=pg_schema,
    )
    report = await relay.run_once()
    assert relay.same_database is (layout == pg_url), f"detected {relay.same_database}"
    assert (report.claimed, report.dispatched, report.created) == (2, 2, 2), report
    for event_id in (plain, mapped):
        row = await _event(layout, pg_schema, event_id)
        assert row["status"] == "dispatched", row
        assert row["published_at"] is not None, row
        assert row["attempts"] == 0, row
    runs = await fetch(
        pg_url,
        q("SELECT idempotency_key AS k, task_name, input FROM {schema}.runs ORDER BY 1", pg_schema),
    )
    assert [(r["k"], r["task_name"], r["input"]) for r in runs] == [
        ("order:o-1", "ship_order", {"order_id": "o-1", "quantity": 3}),
        (relay.default_key(plain), "process_item", {"n": 7}),
    ], f"{len(runs)} runs: {runs}"
    # nothing left: a second pass claims nothing and enqueues nothing
    again = await relay.run_once()
    assert again.claimed == 0, again
    assert len((await engine.list()).runs) == 2


async def test_mode_can_be_forced_and_is_checked(
    make_relay: Callable[..., OutboxRelay],
    second_db: str,
    pg_url: str,
    pg_schema: str,
    engine: Engine,
) -> None:
    async with await psycopg.AsyncConnection.connect(second_db, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    await _insert(second_db, pg_schema, "item", {"n": 1})
    wrong = make_relay(
        second_db, engine, {"item": process_item}, schema=pg_schema, mode="same_database"
    )
    with pytest.raises(ValueError, match="not on the same database"):
        await wrong.run_once()
    assert await status_counts(second_db, pg_schema) == {"pending": 1}
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    await _insert(pg_url, pg_schema, "item", {"n": 2})
    forced = make_relay(pg_url, engine, {"item": process_item}, schema=pg_schema, mode="separate")
    report = await forced.run_once()
    assert forced.same_database is False
    assert report.created == 1, report


async def test_unknown_type_invalid_payload_and_key_conflict_are_dead_at_once(
    make_relay: Callable[..., OutboxRelay], outbox: str, pg_schema: str, engine: Engine
) -> None:
    unknown = await _insert(outbox, pg_schema, "refund", {"n": 1})
    invalid = await _insert(outbox, pg_schema, "item", {"n": "not a number"})
    first = await _insert(outbox, pg_schema, "item", {"n": 1}, idempotency_key="dup")
    relay = make_relay(outbox, engine, {"item": process_item}, schema=pg_schema, max_attempts=5)
    report = await relay.run_once()
    assert (report.dispatched, report.dead, report.retried) == (1, 2, 0), report
    conflict = await _insert(outbox, pg_schema, "item", {"n": 2}, idempotency_key="dup")
    report = await relay.run_once()
    assert (report.dispatched, report.dead) == (0, 1), report

    row = await _event(outbox, pg_schema, unknown)
    assert (row["status"], row["attempts"]) == ("dead", 1), row
    assert "no route for outbox event type 'refund' (routes: item)" in row["last_error"], row
    row = await _event(outbox, pg_schema, invalid)
    assert (row["status"], row["attempts"]) == ("dead", 1), row
    assert row["last_error"].startswith("PayloadError"), row
    assert "n" in row["last_error"], row
    assert (await _event(outbox, pg_schema, first))["status"] == "dispatched"
    row = await _event(outbox, pg_schema, conflict)
    assert (row["status"], row["attempts"]) == ("dead", 1), row
    assert row["last_error"].startswith("IdempotencyConflictError"), row
    assert await runs_per_key(outbox, pg_schema) == {"dup": 1}
    # dead rows are never claimed again
    await _make_due(outbox, pg_schema)
    assert (await relay.run_once()).claimed == 0


async def test_failures_back_off_exponentially_capped_then_go_dead(
    make_relay: Callable[..., OutboxRelay], outbox: str, pg_schema: str, engine: Engine
) -> None:
    calls: list[int] = []

    def flaky(payload: dict[str, Any]) -> dict[str, Any]:
        calls.append(payload["n"])
        raise ConnectionError(f"downstream refused attempt {len(calls)}")

    event_id = await _insert(outbox, pg_schema, "item", {"n": 5})
    relay = make_relay(
        outbox,
        engine,
        {"item": (process_item, flaky)},
        schema=pg_schema,
        max_attempts=5,
        backoff=timedelta(seconds=10),
        max_backoff=timedelta(seconds=35),
    )
    expected = [10, 20, 35, 35]  # 10 * 2^(n-1), capped at 35
    for attempt, delay in enumerate(expected, start=1):
        report = await relay.run_once()
        assert (report.claimed, report.retried, report.dead) == (1, 1, 0), (attempt, report)
        row = await _event(outbox, pg_schema, event_id)
        assert (row["status"], row["attempts"]) == ("pending", attempt), row
        assert f"ConnectionError: downstream refused attempt {attempt}" == row["last_error"]
        due = row["due_in"].total_seconds()
        assert delay - 5 < due <= delay, f"attempt {attempt}: due in {due} s, expected ~{delay}"
        assert (await relay.run_once()).claimed == 0, "a row in backoff must not be claimed"
        await _make_due(outbox, pg_schema)
    report = await relay.run_once()
    assert (report.retried, report.dead) == (0, 1), report
    row = await _event(outbox, pg_schema, event_id)
    assert (row["status"], row["attempts"]) == ("dead", 5), row
    assert row["last_error"] == "ConnectionError: downstream refused attempt 5", row
    assert len(calls) == 5, f"{len(calls)} dispatch attempts"
    assert await runs_per_key(outbox, pg_schema) == {}
    await _make_due(outbox, pg_schema)
    assert (await relay.run_once()).claimed == 0


async def test_a_retry_succeeds_once_the_cause_is_gone(
    make_relay: Callable[..., OutboxRelay], outbox: str, pg_schema: str, engine: Engine
) -> None:
    healthy = asyncio.Event()

    def mapper(payload: dict[str, Any]) -> dict[str, Any]:
        if not healthy.is_set():
            raise RuntimeError("mapping service down")
        return payload

    event_id = await _insert(outbox, pg_schema, "item", {"n": 9})
    relay = make_relay(
        outbox,
        engine,
        {"item": (process_item, mapper)},
        schema=pg_schema,
        backoff=timedelta(milliseconds=200),
        poll_interval=timedelta(seconds=30),
    )
    async with relay:
        await eventually(
            lambda: _attempts_at_least(outbox, pg_schema, event_id, 2),
            timeout=20,
            what="two failed attempts (the relay wakes itself for a due retry)",
        )
        healthy.set()
        await eventually(
            lambda: _is_status(outbox, pg_schema, event_id, "dispatched"),
            timeout=20,
            what="the retried row to be dispatched",
        )
    assert await runs_per_key(outbox, pg_schema) == {relay.default_key(event_id): 1}


async def _attempts_at_least(url: str, schema: str, event_id: int, n: int) -> bool:
    return bool((await _event(url, schema, event_id))["attempts"] >= n)


async def _is_status(url: str, schema: str, event_id: int, status: str) -> bool:
    return bool((await _event(url, schema, event_id))["status"] == status)


@pytest.mark.parametrize("source", ["url", "pool", "connection"])
async def test_notify_wakes_an_idle_relay_long_before_its_poll(
    make_relay: Callable[..., OutboxRelay], source: str, outbox: str, pg_schema: str, engine: Engine
) -> None:
    pool: AsyncConnectionPool[Any] | None = None
    conn: psycopg.AsyncConnection[Any] | None = None
    given: Any = outbox
    if source == "pool":
        pool = AsyncConnectionPool(outbox, min_size=1, max_size=2, open=False)
        await pool.open()
        given = pool
    elif source == "connection":
        conn = await psycopg.AsyncConnection.connect(outbox, autocommit=True)
        given = conn
    relay = make_relay(
        given, engine, {"item": process_item}, schema=pg_schema, poll_interval=timedelta(hours=1)
    )
    try:
        async with relay:
            await asyncio.sleep(0.3)  # let it go idle on an empty table
            for n in range(3):
                event_id = await _insert(outbox, pg_schema, "item", {"n": n})
                # an hour-long poll interval: only the trigger's NOTIFY can bring this in time
                await eventually(
                    lambda event_id=event_id: _is_status(outbox, pg_schema, event_id, "dispatched"),
                    timeout=15,
                    what=f"row {event_id} dispatched after its NOTIFY",
                )
                await asyncio.sleep(0.2)
        assert relay.totals.created == 3, relay.totals
    finally:
        if pool is not None:
            await pool.close()
        if conn is not None:
            await conn.close()


async def test_stop_is_graceful_and_waits_for_the_batch(
    make_relay: Callable[..., OutboxRelay], outbox: str, pg_schema: str, engine: Engine
) -> None:
    entered = asyncio.Event()
    release = asyncio.Event()
    seen: list[int] = []

    async def slow_enqueue_gate() -> None:
        entered.set()
        await release.wait()

    original = engine.enqueue

    async def gated(*args: Any, **kwargs: Any) -> Any:
        await slow_enqueue_gate()
        handle = await original(*args, **kwargs)
        seen.append(1)
        return handle

    engine.enqueue = gated  # type: ignore[method-assign]
    await _insert(outbox, pg_schema, "item", {"n": 1})
    relay = make_relay(outbox, engine, {"item": process_item}, schema=pg_schema)
    task = relay.start()
    await asyncio.wait_for(entered.wait(), 10)
    stopping = asyncio.create_task(relay.stop())
    await asyncio.sleep(0.2)
    assert not stopping.done(), "stop() returned while a batch was in flight"
    release.set()
    await asyncio.wait_for(stopping, 10)
    assert task.done()
    assert task.exception() is None
    assert await status_counts(outbox, pg_schema) == {"dispatched": 1}
    assert len(seen) == 1


async def test_routes_are_checked_against_the_registry(
    make_relay: Callable[..., OutboxRelay], outbox: str, pg_schema: str, engine: Engine
) -> None:
    with pytest.raises(TaskDefinitionError, match="no task named 'nope'"):
        make_relay(outbox, engine, {"x": "nope"}, schema=pg_schema)
    with pytest.raises(ValueError, match="table must be a lowercase identifier"):
        make_relay(outbox, engine, {"item": process_item}, schema=pg_schema, table="Bad-Name")


async def test_a_span_per_row_links_the_writer_and_parents_the_enqueue(
    make_relay: Callable[..., OutboxRelay], outbox: str, pg_url: str, pg_schema: str
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("business")
    engine = await connect(
        pg_url, registry=registry, schema=pg_schema, run_migrations=False, tracer_provider=provider
    )
    try:
        with tracer.start_as_current_span("place order") as writer:
            traced = await _insert(outbox, pg_schema, "item", {"n": 1})
        untraced = await _insert(outbox, pg_schema, "item", {"n": 2})
        unknown = await _insert(outbox, pg_schema, "mystery", {})
        relay = make_relay(
            outbox, engine, {"item": process_item}, schema=pg_schema, tracer_provider=provider
        )
        await relay.run_once()
    finally:
        await engine.close()
    spans = exporter.get_finished_spans()
    dispatch = {
        s.attributes["umt.outbox.event.id"]: s for s in spans if s.name.startswith("umt.outbox")
    }
    assert sorted(dispatch) == sorted([traced, untraced, unknown]), [s.name for s in spans]
    first = dispatch[traced]
    assert first.kind == SpanKind.CONSUMER
    assert [link.context.span_id for link in first.links] == [writer.get_span_context().span_id]
    assert first.context.trace_id != writer.get_span_context().trace_id, "linked, not parented"
    assert dispatch[untraced].links == ()
    attributes = dict(first.attributes or {})
    assert attributes["umt.outbox.event.type"] == "item"
    assert attributes["umt.outbox.attempt"] == 1
    assert attributes["umt.outbox.idempotency_key"] == relay.default_key(traced)
    assert attributes["umt.outbox.same_database"] is True  # the engine's schema is here
    assert attributes["umt.outbox.outcome"] == "dispatched"
    assert attributes["umt.run.created"] is True
    assert dispatch[unknown].status.status_code == StatusCode.ERROR
    assert dispatch[unknown].attributes["umt.outbox.outcome"] == "dead"
    enqueues = [s for s in spans if s.name == "umt.enqueue process_item"]
    assert len(enqueues) == 2, [s.name for s in spans]
    parents = {s.parent.span_id for s in enqueues if s.parent is not None}
    assert parents == {dispatch[traced].context.span_id, dispatch[untraced].context.span_id}


async def test_the_ddl_is_idempotent_and_uses_the_configured_names(
    pg_url: str, pg_schema: str
) -> None:
    text = outbox_ddl(schema=pg_schema, table="events_out")
    assert f'"{pg_schema}"."events_out"' in text
    assert '"events_out_claim"' in text
    assert '"events_out_notify"' in text
    assert "{" not in text.replace("'{}'", ""), "every placeholder is rendered"
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema, table="events_out")
        await install_outbox(conn, schema=pg_schema, table="events_out")
        cur = await conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
            (pg_schema, "events_out_claim"),
        )
        (indexdef,) = await cur.fetchone() or ("",)
        assert "WHERE (status = 'pending'::text)" in indexdef, indexdef
        cur = await conn.execute(
            "SELECT action_orientation FROM information_schema.triggers"
            " WHERE event_object_schema = %s AND event_object_table = 'events_out'",
            (pg_schema,),
        )
        assert await cur.fetchall() == [("STATEMENT",)]


async def test_an_unreachable_engine_charges_no_attempt(
    make_relay: Callable[..., OutboxRelay], second_db: str, pg_url: str, pg_schema: str
) -> None:
    async with await psycopg.AsyncConnection.connect(second_db, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    for n in range(3):
        await _insert(second_db, pg_schema, "item", {"n": n})
    engine = await connect(pg_url, registry=registry, schema=pg_schema, run_migrations=False)
    relay = make_relay(second_db, engine, {"item": process_item}, schema=pg_schema)
    assert (await relay.run_once()).created == 3
    for n in range(3, 6):
        await _insert(second_db, pg_schema, "item", {"n": n})
    await engine.close()  # the engine's pool is gone: as if its database were down
    report = await relay.run_once()
    assert report.engine_unavailable, report
    assert (report.dispatched, report.retried, report.dead) == (0, 0, 0), report
    pending = await fetch(
        second_db,
        q("SELECT attempts FROM {schema}.outbox_event WHERE status = 'pending'", pg_schema),
    )
    assert [r["attempts"] for r in pending] == [0, 0, 0], pending


async def test_stop_right_after_start_and_a_direct_run_both_end(
    make_relay: Callable[..., OutboxRelay], outbox: str, pg_schema: str, engine: Engine
) -> None:
    relay = make_relay(
        outbox, engine, {"item": process_item}, schema=pg_schema, poll_interval=timedelta(hours=1)
    )
    relay.start()
    await asyncio.wait_for(relay.stop(), 10)  # before the task even ran
    running = asyncio.create_task(relay.run())
    await _insert(outbox, pg_schema, "item", {"n": 1})
    await eventually(
        lambda: _status_is(outbox, pg_schema, "dispatched", 1), timeout=15, what="a dispatch"
    )
    await relay.stop()
    await asyncio.wait_for(running, 10)
    assert relay.totals.created == 1, relay.totals


async def _status_is(url: str, schema: str, status: str, count: int) -> bool:
    return await status_counts(url, schema) == {status: count}

"""Encryption at rest on Postgres: with a codec, no payload's plaintext is anywhere in the
engine's schema, neither in what its rows read back as nor in the bytes of its relation files
(heap, TOAST and indexes, after a checkpoint): inputs, outputs, step records, facts, stream
entries, errors' messages and tracebacks, ledger results, schedules' inputs, and the outbox
path (the row `insert_outbox_event(codec=...)` writes, and the run the relay makes of it).

The control: one run enqueued without the codec, whose marker both scans must find, so a scan
that reads nothing would fail the test instead of passing it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from umt_backend_pg import OutboxRelay, insert_outbox_event, install_outbox
from umt_sdk import (
    AesGcmCodec,
    AttemptInfo,
    CodecChain,
    Engine,
    Registry,
    RetryPolicy,
    RunFailedError,
    Schedule,
    TaskContext,
    ZlibCodec,
    connect,
    task,
    with_attempt_token,
)

SECRET = "Marie-Curie-1867"
CONTROL = "Ada-Lovelace-1815"
_where: dict[str, str] = {}


@attrs.frozen
class Patient:
    name: str


async def _receipt(info: AttemptInfo) -> str:
    return f"receipt {SECRET} {info.attempt_token}"


async def _ledgered() -> str:
    async with await psycopg.AsyncConnection.connect(_where["url"]) as conn:
        # The op key is a key, not a payload: it stays clear (no secret in it).
        return await with_attempt_token(conn, "bill", _receipt)


@task("pii.flow", version=1)
async def pii_flow(ctx: TaskContext[Patient]) -> dict[str, Any]:
    record = await ctx.step.run("look_up", lambda: {"diagnosis": f"{ctx.input.name} flu"})
    await ctx.stream.write("progress", {"patient": ctx.input.name})
    billed = await ctx.step.run("bill", _ledgered)
    approval: dict[str, Any] = await ctx.step.wait_for_fact("approved")
    return {"record": record, "billed": billed, "approval": approval}


def _refuse(name: str) -> str:
    raise ValueError(f"no consent from {name}")


@task("pii.refused", version=1, retry=RetryPolicy.none())
async def pii_refused(ctx: TaskContext[Patient]) -> str:
    return await ctx.step.run("consent", _refuse, ctx.input.name)


registry = Registry([pii_flow, pii_refused])


def _codec() -> CodecChain:
    return CodecChain(ZlibCodec(), AesGcmCodec(keys={"k1": bytes(range(32))}, current="k1"))


async def _rows_as_text(url: str, schema: str) -> str:
    """Every row of every table in `schema`, as Postgres prints it."""
    out = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,)
        )
        tables = [r[0] for r in await cur.fetchall()]
        assert {"runs", "steps", "facts", "op_ledger", "outbox_event"} <= set(tables), tables
        for table in tables:
            cur = await conn.execute(
                sql.SQL("SELECT t::text FROM {}.{} t").format(
                    sql.Identifier(schema), sql.Identifier(table)
                )
            )
            out += [f"{table}: {r[0]}" for r in await cur.fetchall()]
    return "\n".join(out)


async def _relation_bytes(url: str, schema: str) -> bytes:
    """The bytes of every relation file of `schema` (tables, their TOAST and every index),
    after a checkpoint wrote the buffers out."""
    chunks = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("CHECKPOINT")
        cur = await conn.execute(
            """
            SELECT pg_relation_filepath(c.oid) FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = %s AND c.relkind IN ('r', 'i', 't', 'p')
            UNION
            SELECT pg_relation_filepath(c.reltoastrelid) FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = %s AND c.reltoastrelid <> 0
            UNION
            SELECT pg_relation_filepath(i.indexrelid) FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace
            JOIN pg_index i ON i.indrelid = c.reltoastrelid
            WHERE n.nspname = %s AND c.reltoastrelid <> 0
            """,
            (schema, schema, schema),
        )
        paths = [r[0] for r in await cur.fetchall() if r[0] is not None]
        for path in paths:
            cur = await conn.execute(
                "SELECT pg_read_binary_file(%s, 0, (pg_stat_file(%s)).size, true)", (path, path)
            )
            row = await cur.fetchone()
            if row is not None and row[0] is not None:
                chunks.append(bytes(row[0]))
    assert chunks, "no relation file was read"
    return b"".join(chunks)


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> Any:
    _where["url"] = pg_url
    engine = await connect(
        pg_url, registry=registry, schema=pg_schema, run_migrations=False, codec=_codec()
    )
    yield engine
    await engine.close()


async def test_no_plaintext_at_rest(engine: Engine, pg_url: str, pg_schema: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
        async with conn.transaction():
            await insert_outbox_event(
                conn, "admit", {"name": SECRET}, schema=pg_schema, codec=engine.codec
            )
    relay = OutboxRelay(pg_url, engine, {"admit": pii_flow}, schema=pg_schema, listen=False)
    try:
        report = await relay.run_once()
    finally:
        await relay.stop()
    assert report.dispatched == 1, report
    (via_outbox,) = (await engine.list(task_name="pii.flow")).runs
    direct = await engine.enqueue(pii_flow, Patient(name=SECRET), idempotency_key="admission-2")
    refused = await engine.enqueue(pii_refused, Patient(name=SECRET))
    await engine.schedules.create(
        Schedule(name="pii.nightly", task=pii_flow, cron="0 3 * * *", input=Patient(name=SECRET))
    )
    async with engine.worker(lease=timedelta(seconds=5), schedules=False):
        for run_id in (via_outbox.run_id, direct.run_id):  # kept until the wait reads it
            await engine.signal(run_id, "approved", {"by": SECRET})
        outputs = [await engine.result(r, timeout=30) for r in (via_outbox.run_id, direct.run_id)]
        with pytest.raises(RunFailedError, match=f"no consent from {SECRET}"):
            await refused.result(timeout=30)
    assert all(SECRET in str(o) for o in outputs), "read back whole through the codec"
    assert [i.value async for i in engine.stream(direct.run_id, "progress", follow=False)] == [
        {"patient": SECRET}
    ]

    # The control: a run written without the codec, in clear.
    plain = await connect(pg_url, registry=registry, schema=pg_schema, run_migrations=False)
    try:
        await plain.enqueue(pii_flow, Patient(name=CONTROL))
    finally:
        await plain.close()

    rows = await _rows_as_text(pg_url, pg_schema)
    assert CONTROL in rows, "the scan reads the payloads"
    assert SECRET not in rows
    assert rows.count("umt-codec/1:zlib+aes-gcm:") >= 12
    files = await _relation_bytes(pg_url, pg_schema)
    assert CONTROL.encode() in files, "the control is in the files (not compressed away)"
    assert SECRET.encode() not in files

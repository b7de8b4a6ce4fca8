"""The outbox table: its DDL (`outbox_ddl`, `install_outbox`) and the business side's insert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from opentelemetry import propagate
from psycopg import sql
from psycopg.types.json import Jsonb

from umt_backend_pg._args import refuse, text
from umt_backend_pg._sql import blocks, render_identifiers, validate_identifier
from umt_sdk import PayloadCodec
from umt_sdk.backend import check_codec, encode_payload, seal_json, unstorable_reason
from umt_sdk.exceptions import PayloadError, UsageError

__all__ = ["channel_name", "insert_outbox_event", "install_outbox", "outbox_ddl", "outbox_sql"]

_MAX_TABLE_NAME = 56  # leaves room for the derived `<table>_claim` / `<table>_notify` names


def _names(schema: str, table: str) -> dict[str, str]:
    validate_identifier(schema, "schema")
    validate_identifier(table, "table")
    if len(table) > _MAX_TABLE_NAME:
        raise UsageError(
            f"table must be at most {_MAX_TABLE_NAME} characters, got {table!r}", argument="table"
        )
    return {
        "schema": schema,
        "table": table,
        "index": f"{table}_claim",
        "function": f"{table}_notify",
        "trigger": f"{table}_notify",
    }


def outbox_sql(block: str, schema: str, table: str) -> str:
    names = _names(schema, table)  # validated identifiers
    text = blocks("outbox.sql")[block]
    if "{table_name}" not in text:
        return render_identifiers(text, **names)
    composed = sql.SQL(text).format(  # our own .sql file, never input
        **{name: sql.Identifier(value) for name, value in names.items()},
        table_name=sql.Literal(table),
    )
    return composed.as_string(None)


def channel_name(schema: str, table: str) -> str:
    """The NOTIFY channel of the insert trigger (as the trigger computes it)."""
    _names(schema, table)
    return f"{schema}.{table}"[:63]


def outbox_ddl(*, schema: str = "public", table: str = "outbox_event") -> str:
    """The SQL that creates the outbox table, its claim index and its insert trigger.

    For projects that run their own migrations; idempotent (IF NOT EXISTS / OR REPLACE).
    """
    return outbox_sql("ddl", schema, table)


async def install_outbox(
    conn: psycopg.AsyncConnection[Any], *, schema: str = "public", table: str = "outbox_event"
) -> None:
    """Apply `outbox_ddl(schema=..., table=...)` on `conn` (your business database), in one
    transaction under an advisory lock, so concurrent installs are safe; applying it again
    changes nothing, except that it adds what an older version of the DDL lacked (the
    table's install id in `<schema>.umt_outbox_installs`)."""
    if not isinstance(conn, psycopg.AsyncConnection):
        raise UsageError(
            f"install_outbox(conn) takes a psycopg.AsyncConnection, got {type(conn).__name__}",
            argument="conn",
        )
    ddl = outbox_ddl(schema=schema, table=table)
    async with conn.transaction():
        await conn.execute(
            outbox_sql("install_lock", schema, table), {"key": f"umt-outbox:{schema}.{table}"}
        )
        await conn.execute(ddl)


async def insert_outbox_event(
    conn: psycopg.AsyncConnection[Any],
    type: str,
    payload: Mapping[str, Any] | None = None,
    *,
    idempotency_key: str | None = None,
    schema: str = "public",
    table: str = "outbox_event",
    codec: PayloadCodec | None = None,
) -> int:
    """Insert an outbox row on `conn` (inside your business transaction) and return its id.

    `payload` becomes the run's input (in its JSON form) when the relay dispatches the row. It
    is checked here as `enqueue` checks an input, before anything reaches Postgres: a value
    that cannot be stored (a NUL, a lone surrogate, something JSON has no form for) raises
    `PayloadError` naming its path (`payload.items[0]`). None is stored as JSON null, not as
    `{}`: the run gets None, and a task whose input type refuses it fails the dispatch.

    The current trace context (W3C headers), if any, is stored with the row: the relay's
    dispatch span links to it.

    With `codec` (the engine's: `engine.codec`), the payload is stored sealed, as the
    engine stores the run's input: the relay's engine opens it with the same codec.
    """
    where = "insert_outbox_event()"
    text(type, "type", where=where, expected="an event type (a non-empty string)")
    _storable(type, "type")
    if payload is not None and not isinstance(payload, Mapping):
        refuse("payload", "a mapping (a dict) or None", payload, where=where)
    if idempotency_key is not None:
        text(idempotency_key, "idempotency_key", where=where, expected="a non-empty string or None")
        _storable(idempotency_key, "idempotency_key")
    payload_json = encode_payload(None if payload is None else dict(payload), what="payload")
    if codec is not None:
        check_codec(codec, where=where)
        payload_json = seal_json(codec, payload_json)
    query = outbox_sql("insert_event", schema, table)  # checks the names
    if not isinstance(conn, psycopg.AsyncConnection):
        refuse("conn", "a psycopg.AsyncConnection (your business transaction's)", conn, where=where)
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    cur = await conn.execute(
        query,
        {
            "type": type,
            "payload": Jsonb(payload_json, dumps=_as_is),  # JSON text already
            "idempotency_key": idempotency_key,
            "trace_context": Jsonb(carrier) if carrier else None,
        },
    )
    row = await cur.fetchone()
    assert row is not None
    event_id: int = row[0]
    return event_id


def _as_is(text: str) -> str:
    return text


def _storable(value: str, argument: str) -> None:
    """Text Postgres can store (as `enqueue` checks a key): else `PayloadError` naming it."""
    problem = unstorable_reason(value)
    if problem is not None:
        raise PayloadError(
            f"insert_outbox_event(): {argument} cannot be stored: it {problem}", field=argument
        )

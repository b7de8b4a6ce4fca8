"""`insert_outbox_event` checks what it is given as `enqueue` checks an input, before anything
reaches Postgres: a `UsageError` or a `PayloadError` naming the path, never a TypeError, a
plain ValueError or a database error; and None is stored as JSON null, never as `{}`."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from umt_backend_pg import insert_outbox_event
from umt_sdk.exceptions import PayloadError, UsageError


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"n": value}
    return value


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"note": "a\x00b"}, "payload.note"),
        ({"items": [{"name": "ok"}, {"name": "\ud800"}]}, "payload.items[1].name"),
        ({"when": object()}, "payload.when"),
        ({"ratio": float("nan")}, "payload.ratio"),
    ],
    ids=["nul", "lone-surrogate", "not-json", "nan"],
)
async def test_a_payload_enqueue_would_refuse_is_refused_naming_its_path(
    outbox: str, pg_schema: str, payload: dict[str, Any], field: str
) -> None:
    async with await psycopg.AsyncConnection.connect(outbox) as conn:
        with pytest.raises(PayloadError) as caught:
            await insert_outbox_event(conn, "item", payload, schema=pg_schema)
        assert caught.value.field == field, str(caught.value)
        # Refused before Postgres: the business transaction is still usable.
        assert await (await conn.execute("SELECT 1")).fetchone() == (1,)


async def test_text_postgres_cannot_store_and_wrong_types_are_refused_before_postgres(
    outbox: str, pg_schema: str
) -> None:
    async with await psycopg.AsyncConnection.connect(outbox) as conn:
        with pytest.raises(PayloadError, match="type cannot be stored") as bad_type:
            await insert_outbox_event(conn, "it\x00em", {}, schema=pg_schema)
        assert bad_type.value.field == "type"
        with pytest.raises(PayloadError, match="idempotency_key cannot be stored") as bad_key:
            await insert_outbox_event(conn, "item", {}, idempotency_key="k\x00", schema=pg_schema)
        assert bad_key.value.field == "idempotency_key"
        with pytest.raises(PayloadError, match="nested deeper"):
            await insert_outbox_event(conn, "item", _nested(70), schema=pg_schema)
        with pytest.raises(UsageError, match="payload must be a mapping") as not_a_dict:
            await insert_outbox_event(conn, "item", ["a"], schema=pg_schema)  # type: ignore[arg-type]  # deliberately wrong
        assert not_a_dict.value.argument == "payload"
        assert await (await conn.execute("SELECT 1")).fetchone() == (1,)


async def test_none_is_stored_as_json_null_and_a_dict_as_itself(
    outbox: str, pg_schema: str
) -> None:
    async with await psycopg.AsyncConnection.connect(outbox) as conn:
        empty = await insert_outbox_event(conn, "item", None, schema=pg_schema)
        given = await insert_outbox_event(conn, "item", {"n": 1, "s": "ü"}, schema=pg_schema)
        await conn.commit()
        cur = await conn.execute(
            sql.SQL(
                "SELECT id, jsonb_typeof(payload), payload FROM {}.outbox_event ORDER BY id"
            ).format(sql.Identifier(pg_schema))
        )
        rows = await cur.fetchall()
    assert rows == [(empty, "null", None), (given, "object", {"n": 1, "s": "ü"})]

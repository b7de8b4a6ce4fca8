"""Encrypted payloads on Postgres: what the database holds is ciphertext, what you read is not.

Run it: `python examples/17_encrypted_payloads.py` (uses `UMT_DATABASE_URL`, else the
embedded Postgres in `.umt/pg`; everything lives in a fresh schema, dropped at the end).
Needs the `crypto` extra: `pip install 'umt-tasks[crypto]'`.

A clinic's task handles patient data. The engine connects with a codec (zlib, then AES-GCM
with keys by id), so every payload is encrypted before it is stored: the input, each step's
output, the fact a nurse sends, the output, an error's message. Then:
1. the rows as Postgres holds them: no patient name anywhere, only `umt-codec/1:...`;
2. the same run through the engine: everything decoded;
3. an idempotency key still finds the run (its hash is the plaintext's);
4. a key rotation: a new key becomes current, runs written with the old one still read;
5. a reader without the codec gets a `CodecError` that says what to do, never garbage.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import attrs
import psycopg
from psycopg import sql

from umt_backend_pg import database_url
from umt_sdk import (
    AesGcmCodec,
    CodecChain,
    CodecError,
    Registry,
    TaskContext,
    ZlibCodec,
    connect,
    task,
)

URL = database_url()  # UMT_DATABASE_URL if set, else the embedded Postgres
SCHEMA = f"ex17_{uuid.uuid4().hex[:8]}"

# In production the keys come from your secret store (a KMS, Vault, an env var), never code.
KEYS = {"2025-01": os.urandom(32)}


def make_codec(keys: dict[str, bytes], current: str) -> CodecChain:
    """Compress, then encrypt (ciphertext does not compress)."""
    return CodecChain(ZlibCodec(), AesGcmCodec(keys=keys, current=current))


@attrs.frozen
class Visit:
    patient: str
    symptoms: str


@task("triage", version=1)
async def triage(ctx: TaskContext[Visit]) -> dict[str, Any]:
    chart = await ctx.step.run(
        "open_chart", lambda: {"patient": ctx.input.patient, "allergies": ["penicillin"]}
    )
    seen_by: dict[str, str] = await ctx.step.wait_for_fact("seen_by")
    return {"chart": chart, "seen_by": seen_by["nurse"], "note": f"{ctx.input.symptoms}: rest"}


registry = Registry([triage])


async def stored_rows(run_id: uuid.UUID) -> list[str]:
    """The run's payloads as Postgres holds them."""
    async with await psycopg.AsyncConnection.connect(URL) as conn:
        cur = await conn.execute(
            sql.SQL(
                "SELECT input::text FROM {s}.runs WHERE id = %(id)s"
                " UNION ALL SELECT output::text FROM {s}.runs WHERE id = %(id)s"
                " UNION ALL SELECT output::text FROM {s}.steps WHERE run_id = %(id)s"
                " UNION ALL SELECT payload::text FROM {s}.facts WHERE run_id = %(id)s"
            ).format(s=sql.Identifier(SCHEMA)),
            {"id": run_id},
        )
        return [row[0] for row in await cur.fetchall() if row[0] is not None]


async def main() -> None:
    engine = await connect(URL, registry=registry, schema=SCHEMA, codec=make_codec(KEYS, "2025-01"))
    try:
        visit = Visit(patient="Jeanne Martin", symptoms="fever")
        handle = await engine.enqueue(triage, visit, idempotency_key="visit-1042")
        await engine.signal(handle.run_id, "seen_by", {"nurse": "Claire Dubois"})
        async with engine.worker():
            output = await handle.result(timeout=30)
        print(f"1. the result, through the engine: {output}")

        rows = await stored_rows(handle.run_id)
        print(f"2. what Postgres holds ({len(rows)} payloads), e.g. {rows[0][:60]}...")
        assert len(rows) >= 4  # input, output, the steps' outputs, the fact
        assert all(r.startswith('"umt-codec/1:zlib+aes-gcm:') for r in rows)
        assert not any("Jeanne" in r or "Claire" in r or "penicillin" in r for r in rows)

        again = await engine.enqueue(triage, visit, idempotency_key="visit-1042")
        print(f"3. same key, same input: the same run ({again.run_id == handle.run_id})")
        assert again.run_id == handle.run_id
        assert not again.created
    finally:
        await engine.close()

    # A rotation: the new key encrypts from now on; the old one stays to read older payloads.
    rotated_keys = {**KEYS, "2025-07": os.urandom(32)}
    rotated = await connect(
        URL, registry=registry, schema=SCHEMA, codec=make_codec(rotated_keys, "2025-07")
    )
    try:
        old = await rotated.get(handle.run_id)
        print(f"4. after the rotation the old run still reads: {old.input['patient']}")
        assert old.input == {"patient": "Jeanne Martin", "symptoms": "fever"}
    finally:
        await rotated.close()

    # A reader without the codec: a clear error, not ciphertext decoded as if it were data.
    plain = await connect(URL, registry=registry, schema=SCHEMA)
    try:
        await plain.result(handle.run_id, timeout=5)
        raise AssertionError("a reader without the codec must not decode the output")
    except CodecError as exc:
        print(f"5. without the codec: CodecError: {str(exc)[:80]}...")
    finally:
        await plain.close()
        async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(SCHEMA)))


if __name__ == "__main__":
    asyncio.run(main())

"""The download-approval application: business tables, business operations, and its processes.

    python app.py worker --url URL --schema S --group io|agent --release 1|2 --name NAME
    python app.py relay  --url URL --schema S --release 1|2

The engine lives in schema S; the business tables (plans, downloads, assets, the outbox and
the fake download client's own tables) in schema `S_app` of the same database, so the relay
enqueues in its own transaction (it detects this; see docs/outbox.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def app_schema(engine_schema: str) -> str:
    return f"{engine_schema}_app"


BUSINESS_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.plans (
    id          text PRIMARY KEY,
    url         text NOT NULL,
    size        bigint NOT NULL,
    status      text NOT NULL DEFAULT 'planned',
    run_id      uuid,
    approved_by text,
    approved_at timestamptz,
    night_run   uuid,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {s}.downloads (
    plan_id     text PRIMARY KEY REFERENCES {s}.plans (id),
    job_id      bigint NOT NULL,
    status      text NOT NULL DEFAULT 'downloading',
    path        text,
    finished_at timestamptz
);
CREATE TABLE IF NOT EXISTS {s}.assets (
    id          text PRIMARY KEY,
    plan_id     text NOT NULL REFERENCES {s}.plans (id),
    path        text NOT NULL,
    size        bigint NOT NULL,
    sha256      text,
    version     integer NOT NULL,
    description text
);
-- The fake download client's own state (an outside system; no unique key on purpose, so a
-- doubled submission would show as a second job).
CREATE TABLE IF NOT EXISTS {s}.client_jobs (
    id     bigserial PRIMARY KEY,
    tag    text NOT NULL,
    url    text NOT NULL,
    size   bigint NOT NULL,
    token  bigint NOT NULL,
    status text NOT NULL DEFAULT 'queued',
    path   text
);
CREATE TABLE IF NOT EXISTS {s}.client_faults (
    mode      text PRIMARY KEY,
    remaining integer NOT NULL
);
"""


async def migrate_business(url: str, engine_schema: str) -> None:
    """The application's own migration: its tables, then the outbox (same schema)."""
    from umt_backend_pg import install_outbox

    schema = app_schema(engine_schema)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(sql.SQL(BUSINESS_DDL).format(s=sql.Identifier(schema)))
        await install_outbox(conn, schema=schema)


def q(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(schema))


async def create_plan(
    url: str, engine_schema: str, *, url_to_fetch: str, size: int, deferred: bool = False
) -> str:
    """Store a plan and its `plan.created` event in one transaction: both or neither. A
    `deferred` plan is approved for the night window instead: no event, the nightly schedule
    takes it (`nightly_downloads`)."""
    from umt_backend_pg import insert_outbox_event

    schema = app_schema(engine_schema)
    plan_id = f"plan-{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(url) as conn, conn.transaction():
        if deferred:
            await conn.execute(
                q(
                    "INSERT INTO {s}.plans (id, url, size, status, approved_by, approved_at)"
                    " VALUES (%s, %s, %s, 'deferred', 'night window', now())",
                    schema,
                ),
                (plan_id, url_to_fetch, size),
            )
            return plan_id
        await conn.execute(
            q("INSERT INTO {s}.plans (id, url, size) VALUES (%s, %s, %s)", schema),
            (plan_id, url_to_fetch, size),
        )
        await insert_outbox_event(
            conn,
            "plan.created",
            {"plan_id": plan_id},
            idempotency_key=f"plan:{plan_id}",
            schema=schema,
        )
    return plan_id


async def approve(engine: Any, url: str, engine_schema: str, plan_id: str, by: str) -> None:
    """The operator's approval: the business table first, then a signal to wake the run (the
    run's `check` reads the table, so an approval before the run waits is not lost)."""
    schema = app_schema(engine_schema)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            q(
                "UPDATE {s}.plans SET approved_by = %s, approved_at = now()"
                " WHERE id = %s AND approved_by IS NULL RETURNING run_id",
                schema,
            ),
            (by, plan_id),
        )
        row = await cur.fetchone()
    if row is not None and row[0] is not None:
        await engine.signal(row[0], "approved", {"by": by})


async def client_daemon(
    url: str, engine_schema: str, incoming: Path, engine: Any, stop: asyncio.Event
) -> None:
    """The fake client finishing downloads, and the app's webhook handler that records them:
    the business table first, then a signal to wake the run."""
    import fake_client

    schema = app_schema(engine_schema)
    while not stop.is_set():
        await fake_client.complete_jobs(url, schema, incoming)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(
                q(
                    "UPDATE {s}.downloads d SET status = 'done', path = j.path,"
                    " finished_at = now() FROM {s}.client_jobs j, {s}.plans p"
                    " WHERE d.job_id = j.id AND j.status = 'done'"
                    " AND d.status = 'downloading' AND p.id = d.plan_id RETURNING p.run_id",
                    schema,
                )
            )
            finished = await cur.fetchall()
        for (run_id,) in finished:
            await engine.signal(run_id, "downloaded", {})
        await asyncio.sleep(0.1)


# -- processes -------------------------------------------------------------------------------


async def run_worker(args: argparse.Namespace) -> None:
    os.environ["DL_RELEASE"] = str(args.release)
    import tasks

    from umt_sdk import connect

    tasks.configure(args.url, app_schema(args.schema), Path(args.data))
    engine = await connect(
        args.url, registry=tasks.registry(args.release), schema=args.schema, run_migrations=False
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with engine.worker(
        versions=tasks.groups(args.release)[args.group],
        concurrency=4,
        lease=timedelta(seconds=2),
        worker_id=args.name,
        poll_interval=timedelta(milliseconds=500),
        shutdown_grace=timedelta(seconds=5),
    ):
        print(f"ready {args.name}", flush=True)
        await stop.wait()
    await engine.close()


async def run_relay(args: argparse.Namespace) -> None:
    import tasks

    from umt_backend_pg import OutboxRelay
    from umt_sdk import connect

    registry = tasks.registry(args.release)
    engine = await connect(args.url, registry=registry, schema=args.schema, run_migrations=False)
    relay = OutboxRelay(
        args.url,
        engine,
        tasks.routes(args.release),
        schema=app_schema(args.schema),
        poll_interval=timedelta(seconds=2),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with relay:
        print("ready relay", flush=True)
        await stop.wait()
    print(f"relay dispatched {relay.totals.dispatched}", flush=True)
    await engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("role", choices=["worker", "relay"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--release", type=int, choices=[1, 2], required=True)
    parser.add_argument("--group", choices=["io", "agent"], default="io")
    parser.add_argument("--name", default="worker")
    parser.add_argument("--data", default=".umt/download_approval")
    arguments = parser.parse_args()
    asyncio.run(run_worker(arguments) if arguments.role == "worker" else run_relay(arguments))

"""The demo's tasks: a download with a fenced submission, and two tasks owned by one group each.

Step bodies log to `step_log` (an append-only "external system" table) so the demo can
prove which bodies ran, where, and how often.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

import attrs
import psycopg

from umt_sdk import AttemptInfo, Registry, RetryPolicy, TaskContext, task, with_attempt_token

WORKER = os.environ.get("DEMO_WORKER", "driver")
URL = os.environ.get("DEMO_URL", "")
BUSINESS_SCHEMA = os.environ.get("DEMO_BIZ", "umt_demo_biz")
TRANSFER_SECONDS = float(os.environ.get("DEMO_TRANSFER_SECONDS", "1.2"))


async def business() -> psycopg.AsyncConnection[Any]:
    """A connection to the demo's business tables (its schema first on the search path)."""
    return await psycopg.AsyncConnection.connect(
        URL, autocommit=True, options=f"-c search_path={BUSINESS_SCHEMA}"
    )


@attrs.frozen
class Download:
    item: str


@attrs.frozen
class Receipt:
    item: str
    approved_by: str
    client_ref: str
    size: int


async def _log(ctx: TaskContext[Any], step: str, *, finished: bool) -> None:
    """Note in the 'external system' that a step body of this attempt started or finished."""
    run_id, token = ctx.run_id, ctx.attempt_token
    async with await business() as conn:
        if finished:
            await conn.execute(
                "UPDATE step_log SET finished_at = clock_timestamp()"
                " WHERE run_id = %s AND step = %s AND token = %s",
                (run_id, step, token),
            )
        else:
            await conn.execute(
                "INSERT INTO step_log (run_id, step, worker, token) VALUES (%s, %s, %s, %s)",
                (run_id, step, WORKER, token),
            )


@task("download", version=1, retry=RetryPolicy.network())
async def download(ctx: TaskContext[Download]) -> Receipt:
    async def plan() -> str:
        await _log(ctx, "plan", finished=False)
        await _log(ctx, "plan", finished=True)
        return f"https://mirror.example/{ctx.input.item}.iso"

    async def transfer(url: str) -> int:
        await _log(ctx, "transfer", finished=False)
        for _ in range(int(TRANSFER_SECONDS / 0.1)):  # a long step that honours cancel
            ctx.throw_if_canceled()
            await asyncio.sleep(0.1)
        await _log(ctx, "transfer", finished=True)
        return 4_700_000 + len(url)

    async def submit(size: int, approved_by: str) -> str:
        async def call_client(info: AttemptInfo) -> str:
            async with await business() as conn:
                await conn.execute(
                    "INSERT INTO client_calls (op_key, token, resumed) VALUES (%s, %s, %s)",
                    (info.op_key, info.attempt_token, info.resumed),
                )
            return f"job-{ctx.input.item}-{info.attempt_token}"

        async def record(conn: psycopg.AsyncConnection[Any], ref: str) -> None:
            await conn.execute(
                "INSERT INTO submissions (item, client_ref, size, approved_by)"
                " VALUES (%s, %s, %s, %s)",
                (ctx.input.item, ref, size, approved_by),
            )

        async with await business() as conn:
            return await with_attempt_token(
                conn, f"submit:{ctx.input.item}", call_client, commit=record
            )

    url = await ctx.step.run("plan", plan)
    size = await ctx.step.run("transfer", transfer, url)
    await ctx.step.sleep("cool-down", timedelta(seconds=1))
    approval: dict[str, str] = await ctx.step.wait_for_fact(
        "approved", timeout=timedelta(minutes=10)
    )
    ref = await ctx.step.run("submit", submit, size, approval["by"])
    ctx.logger.info("submitted %s as %s", ctx.input.item, ref)
    return Receipt(item=ctx.input.item, approved_by=approval["by"], client_ref=ref, size=size)


@task("fetch_metadata", version=1)
async def fetch_metadata(ctx: TaskContext[Download]) -> str:
    async def fetch() -> str:
        await _log(ctx, "fetch", finished=False)
        await _log(ctx, "fetch", finished=True)
        return WORKER

    return await ctx.step.run("fetch", fetch)


@task("summarize", version=1)
async def summarize(ctx: TaskContext[Download]) -> str:
    async def write() -> str:
        await _log(ctx, "write", finished=False)
        await asyncio.sleep(0.2)
        await _log(ctx, "write", finished=True)
        return WORKER

    return await ctx.step.run("write", write)


registry = Registry([download, fetch_metadata, summarize])

GROUPS = {
    "io": ["download@1", "fetch_metadata@1"],
    "agent": ["download@1", "summarize@1"],
}

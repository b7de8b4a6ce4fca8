"""Runs in needs_attention on the dashboard: the run list filters them (`status=
needs_attention`) and shows the status and the step to settle; a run's page says what to do.
On the memory backend and on Postgres."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from uuid import UUID

import psycopg
import pytest
from psycopg import sql

from tests.fixtures.dashboard import Browser, browser_for
from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.dashboard import create_app

RUN_LINK = re.compile(r'href="/runs/([0-9a-f-]{36})"')


async def _lost_reply() -> int:
    raise TimeoutError("no reply from the warehouse")


@task("dash.reserve", version=1)
async def reserve(ctx: TaskContext[str]) -> int:
    value: int = await ctx.step.run("reserve-stock", _lost_reply, uncertain_on=(TimeoutError,))
    return value


@task("dash.wait", version=1)
async def wait(ctx: TaskContext[str]) -> str:
    value: str = await ctx.step.wait_for_fact("go")
    return value


async def _parked(engine: Engine, run_id: UUID) -> None:
    for _ in range(3000):
        if (await engine.get(run_id)).status == "waiting":
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"run {run_id} never parked")


@pytest.fixture(params=["memory", "pg"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    registry = Registry([reserve, wait])
    if request.param == "memory":
        engine = await connect("memory://", registry=registry)
        try:
            yield engine
        finally:
            await engine.close()
        return
    url: str = request.getfixturevalue("pg_url")
    schema = f"d_{uuid.uuid4().hex[:12]}"
    engine = await connect(url, registry=registry, schema=schema)
    try:
        yield engine
    finally:
        await engine.close()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def test_the_run_list_filters_and_shows_runs_needing_attention(engine: Engine) -> None:
    stuck = await engine.enqueue(reserve, "sku-1")
    waiting = await engine.enqueue(wait, "x")
    async with engine.worker():
        for run_id in (stuck.run_id, waiting.run_id):
            await _parked(engine, run_id)
    async with browser_for(create_app(engine)) as client:
        board = Browser(client)
        listed = await board.page("/runs?status=needs_attention")
        assert [UUID(m) for m in RUN_LINK.findall(listed)] == [stuck.run_id]
        assert '<span class="status needs_attention">needs_attention</span>' in listed
        assert "settle step reserve-stock" in listed
        assert '<option value="needs_attention" selected>' in listed
        both = await board.page("/runs?status=waiting")
        assert {UUID(m) for m in RUN_LINK.findall(both)} == {stuck.run_id, waiting.run_id}
        page = await board.page(f"/runs/{stuck.run_id}")
        assert "needs_attention" in page
        assert f"umt runs settle {stuck.run_id} --step reserve-stock" in page

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


async def _parked_again(engine: Engine, run_id: UUID, attempt: int) -> None:
    for _ in range(3000):
        info = await engine.get(run_id)
        if any(s.name == "reserve-stock" and s.attempt == attempt for s in info.timeline) and (
            info.needs_attention == "reserve-stock"
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"run {run_id} never parked on attempt {attempt}")


async def test_a_run_needing_attention_is_settled_done_from_its_page(engine: Engine) -> None:
    stuck = await engine.enqueue(reserve, "sku-2")
    async with engine.worker(), browser_for(create_app(engine)) as client:
        await _parked(engine, stuck.run_id)
        board = Browser(client)
        page = await board.page(f"/runs/{stuck.run_id}")
        assert f'action="/runs/{stuck.run_id}/settle"' in page
        assert '<input type="hidden" name="step" value="reserve-stock">' in page
        assert "settle it (with the form below, or <code>umt runs settle" in page
        refused = await board.submit(
            f"/runs/{stuck.run_id}/settle",
            {"step": "reserve-stock", "as": "done", "output": "7", "by": "dana"},
            csrf=False,
        )
        assert refused.status_code == 403
        settled = await board.submit(
            f"/runs/{stuck.run_id}/settle",
            {"step": "reserve-stock", "as": "done", "output": "7", "by": "dana"},
        )
        assert settled.status_code == 303, settled.text
        assert settled.headers["location"].startswith(f"/runs/{stuck.run_id}?notice=")
        assert await stuck.result(timeout=30) == 7, "the settled output, the step not run again"
        shown = await board.page(settled.headers["location"])
        assert "settled step &#39;reserve-stock&#39; as done: the run goes on (by dana)" in shown
        again = await board.submit(
            f"/runs/{stuck.run_id}/settle",
            {"step": "reserve-stock", "as": "done", "output": "8", "by": "eve"},
        )
        assert again.status_code == 400
        assert "not needs_attention" in again.text
    info = await engine.get(stuck.run_id)
    settlements = [s for s in info.timeline if s.kind == "fact"]
    assert len(settlements) == 1
    assert '"by":"dana"' in (settlements[0].output_json or "").replace(" ", "")


async def test_settled_not_done_from_the_page_the_step_runs_again(engine: Engine) -> None:
    stuck = await engine.enqueue(reserve, "sku-3")
    async with engine.worker(), browser_for(create_app(engine)) as client:
        await _parked(engine, stuck.run_id)
        board = Browser(client)
        settled = await board.submit(
            f"/runs/{stuck.run_id}/settle",
            {"step": "reserve-stock", "as": "not-done", "output": "", "by": "dana"},
        )
        assert settled.status_code == 303, settled.text
        await _parked_again(engine, stuck.run_id, attempt=2)  # ran again, and was lost again
        shown = await board.page(settled.headers["location"])
        assert "as not done: the step runs again (by dana)" in shown


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"output": "7", "by": "dana"}, "as", "choose done"),
        ({"as": "done", "by": "dana"}, "output", "done needs the step&#39;s output"),
        ({"as": "done", "output": "{seven", "by": "dana"}, "output", "output"),
        ({"as": "done", "output": '"seven"', "by": "dana"}, "output", "output type"),
        ({"as": "not-done", "output": "7", "by": "dana"}, "output", "only with done=True"),
        ({"as": "done", "output": "7", "by": " "}, "by", "give your name"),
        (
            {"as": "done", "output": "7", "by": "dana", "step": "other"},
            "form",
            "not &#39;other&#39;",
        ),
    ],
)
async def test_a_settle_form_that_is_wrong_says_why_and_stores_nothing(
    engine: Engine, fields: dict[str, str], field: str, says: str
) -> None:
    stuck = await engine.enqueue(reserve, "sku-4")
    async with engine.worker():
        await _parked(engine, stuck.run_id)
    async with browser_for(create_app(engine)) as client:
        board = Browser(client)
        response = await board.submit(
            f"/runs/{stuck.run_id}/settle", {"step": "reserve-stock", **fields}
        )
        assert response.status_code == 400
        assert says in response.text
        if field == "form":
            assert 'class="field-error" role="alert"' in response.text
        else:
            assert f'name="{field}"' in response.text
            assert 'aria-invalid="true"' in response.text
        assert f'action="/runs/{stuck.run_id}/settle"' in response.text, "the form, kept"
    info = await engine.get(stuck.run_id)
    assert info.needs_attention == "reserve-stock"
    assert [s for s in info.timeline if s.kind == "fact"] == []


async def test_a_read_only_dashboard_offers_no_settle_and_refuses_it(engine: Engine) -> None:
    stuck = await engine.enqueue(reserve, "sku-5")
    async with engine.worker():
        await _parked(engine, stuck.run_id)
    async with browser_for(create_app(engine, read_only=True)) as client:
        board = Browser(client)
        page = await board.page(f"/runs/{stuck.run_id}")
        assert "/settle" not in page
        assert "with the form below" not in page
        response = await board.submit(
            f"/runs/{stuck.run_id}/settle",
            {"step": "reserve-stock", "as": "done", "output": "7", "by": "dana"},
        )
        assert response.status_code == 403
    assert (await engine.get(stuck.run_id)).needs_attention == "reserve-stock"

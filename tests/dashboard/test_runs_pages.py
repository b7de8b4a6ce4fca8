"""The runs list and a run's page over HTTP, on the memory backend and on Postgres."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta
from uuid import UUID

from tests.dashboard.tasks import Approval, Order, Trouble, approve, fail, ship
from tests.fixtures.dashboard import Browser, browser_for
from umt_sdk import Engine
from umt_sdk.backend import NewRun, TaskPair, new_run_id
from umt_sdk.dashboard import create_app

RUN_LINK = re.compile(r'href="/runs/([0-9a-f-]{36})"')


def run_ids(html: str) -> list[UUID]:
    return [UUID(m) for m in RUN_LINK.findall(html)]


async def test_the_home_page_leads_to_the_runs(board: Browser) -> None:
    response = await board.get("/")
    assert response.status_code == 303
    assert response.headers["location"] == "/runs"


async def test_the_runs_page_lists_runs_newest_first(dash_engine: Engine, board: Browser) -> None:
    first = await dash_engine.enqueue(ship, Order(customer="ada", quantity=1))
    second = await dash_engine.enqueue(fail, Trouble(message="boom"))
    html = await board.page("/runs")
    assert run_ids(html) == [second.run_id, first.run_id]
    assert "dash.ship@1" in html
    assert "dash.fail@1" in html
    assert "pending" in html


async def test_the_runs_page_filters_by_status_task_and_version(
    dash_engine: Engine, board: Browser
) -> None:
    shipped = await dash_engine.enqueue(ship, Order(customer="ada", quantity=1))
    failing = await dash_engine.enqueue(fail, Trouble(message="boom"))
    async with dash_engine.worker():
        await dash_engine.wait_idle([shipped.run_id, failing.run_id])
    waiting = await dash_engine.enqueue(approve, Approval(item="x"))

    assert run_ids(await board.page("/runs?status=failed")) == [failing.run_id]
    assert run_ids(await board.page("/runs?status=completed")) == [shipped.run_id]
    assert run_ids(await board.page("/runs?task=dash.ship")) == [shipped.run_id]
    assert run_ids(await board.page("/runs?task=dash.ship@1")) == [shipped.run_id]
    assert run_ids(await board.page("/runs?task=dash.ship@2")) == []
    assert run_ids(await board.page("/runs?status=pending")) == [waiting.run_id]
    html = await board.page("/runs?status=nonsense")
    assert run_ids(html) == []
    assert "one of pending, running" in html


async def test_the_runs_page_finds_a_run_by_id_and_by_idempotency_key(
    dash_engine: Engine, board: Browser
) -> None:
    keyed = await dash_engine.enqueue(ship, Order(customer="k", quantity=2), idempotency_key="k-1")
    other = await dash_engine.enqueue(ship, Order(customer="o", quantity=2))
    assert run_ids(await board.page(f"/runs?run_id={other.run_id}")) == [other.run_id]
    assert run_ids(await board.page(f"/runs?run_id={new_run_id()}")) == []
    assert "not a run id" in await board.page("/runs?run_id=nope")
    found = await board.page("/runs?task=dash.ship&idempotency_key=k-1")
    assert run_ids(found) == [keyed.run_id]
    alone = await board.page("/runs?idempotency_key=k-1")
    assert run_ids(alone) == []
    assert "keys are per task: give the task too" in alone


async def test_the_runs_page_filters_by_creation_time(dash_engine: Engine, board: Browser) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="t", quantity=1))
    info = await dash_engine.get(run.run_id)
    before = (info.created_at - timedelta(minutes=1)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M")
    after = (info.created_at + timedelta(minutes=1)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M")
    assert run_ids(await board.page(f"/runs?created_after={before}")) == [run.run_id]
    assert run_ids(await board.page(f"/runs?created_after={after}")) == []
    assert run_ids(await board.page(f"/runs?created_before={before}")) == []
    assert run_ids(await board.page(f"/runs?created_before={after}")) == [run.run_id]
    assert "expected a time such as" in await board.page("/runs?created_after=yesterday")


async def test_the_runs_page_pages_with_a_cursor(dash_engine: Engine, board: Browser) -> None:
    handles = [
        await dash_engine.enqueue(ship, Order(customer=f"c{i}", quantity=i)) for i in range(120)
    ]
    newest_first = [h.run_id for h in reversed(handles)]
    seen: list[UUID] = []
    path = "/runs?task=dash.ship"
    pages = 0
    while path:
        html = await board.page(path)
        seen += run_ids(html)
        pages += 1
        found = re.search(r'rel="next" href="([^"]+)"', html)
        path = found.group(1).replace("&amp;", "&") if found else ""
    assert pages == 3
    assert seen == newest_first


async def test_the_rows_fragment_serves_live_updates(dash_engine: Engine, board: Browser) -> None:
    html = await board.page("/runs?status=pending")
    assert 'data-live="/runs/rows?status=pending"' in html
    run = await dash_engine.enqueue(ship, Order(customer="live", quantity=1))
    rows = await board.page("/runs/rows?status=pending")
    assert "<html" not in rows
    assert run_ids(rows) == [run.run_id]
    async with dash_engine.worker():
        await run.result(timeout=30)
    assert run_ids(await board.page("/runs/rows?status=pending")) == []
    assert run_ids(await board.page("/runs/rows?status=completed")) == [run.run_id]


async def test_a_run_page_shows_input_output_and_the_step_timeline(
    dash_engine: Engine, board: Browser
) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="ada", quantity=3))
    async with dash_engine.worker(worker_id="worker-one"):
        assert await run.result(timeout=30) == "posted ada x3"
    html = await board.page(f"/runs/{run.run_id}")
    assert "completed" in html
    assert "&#34;customer&#34;: &#34;ada&#34;" in html  # the input, as indented JSON
    assert "posted ada x3" in html
    assert '<svg class="timeline"' in html
    for label in ("step label · try 1", "step post · try 1"):
        assert label in html
    token = (await dash_engine.get(run.run_id)).executions[0].fencing_token
    assert f"execution #{token}" in html
    assert f"worker worker-one · token {token} · completed" in html
    assert "data-live" not in html.split("<main>")[1].split("Actions")[0]  # finished: no polling


async def test_a_failed_run_shows_its_error_and_redacts_secrets(
    dash_engine: Engine, board: Browser
) -> None:
    run = await dash_engine.enqueue(fail, Trouble(message="db password=hunter2 refused"))
    async with dash_engine.worker():
        await dash_engine.wait_idle([run.run_id])
    info = await dash_engine.get(run.run_id)
    assert info.status == "failed"
    html = await board.page(f"/runs/{run.run_id}")
    assert "ValueError" in html
    assert "hunter2" not in html
    assert "password=[REDACTED]" in html
    listing = await board.page("/runs?status=failed")
    assert "hunter2" not in listing


async def test_an_input_field_named_like_a_secret_is_redacted(
    dash_engine: Engine, board: Browser
) -> None:
    new = NewRun(
        run_id=new_run_id(),
        task_name="dash.raw",
        task_version=1,
        input_json='{"api_key": "sk-live-123456", "user": "ada"}',
        input_hash="h",
    )
    await dash_engine.backend.enqueue(new)
    html = await board.page(f"/runs/{new.run_id}")
    assert "sk-live-123456" not in html
    assert "[REDACTED]" in html
    assert "ada" in html
    assert "sk-live-123456" not in await board.page("/runs")


async def test_a_waiting_run_polls_and_shows_the_fact_it_waits_for(
    dash_engine: Engine, board: Browser
) -> None:
    run = await dash_engine.enqueue(approve, Approval(item="laptop"))
    async with dash_engine.worker():
        for _ in range(300):
            if (await dash_engine.get(run.run_id)).status == "waiting":
                break
            await asyncio.sleep(0.05)
        html = await board.page(f"/runs/{run.run_id}")
        assert f'data-live="/runs/{run.run_id}/live"' in html
        assert "for fact <code>approval</code>" in html
        live = await board.page(f"/runs/{run.run_id}/live")
        assert "<html" not in live
        assert "fact wait approval" in live
        await dash_engine.signal(run.run_id, "approval", {"by": "boss"})
        await run.result(timeout=30)
    html = await board.page(f"/runs/{run.run_id}")
    assert "&#34;by&#34;: &#34;boss&#34;" in html or "{&#34;by&#34;: &#34;boss&#34;}" in html


async def test_an_interrupted_execution_is_marked_and_the_takeover_shown(
    dash_engine: Engine, board: Browser
) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="crash", quantity=1))
    # A worker that claims the run and vanishes (its lease lapses), as a SIGKILLed one does.
    claimed = await dash_engine.backend.claim(
        worker_id="doomed-worker",
        pairs=[TaskPair(name="dash.ship", version=1)],
        limit=1,
        lease=timedelta(milliseconds=200),
    )
    assert [c.run_id for c in claimed] == [run.run_id]
    await asyncio.sleep(0.4)
    async with dash_engine.worker(worker_id="rescuer"):
        await run.result(timeout=30)
    html = await board.page(f"/runs/{run.run_id}")
    assert "INTERRUPTED" in html
    first, second = (await dash_engine.get(run.run_id)).executions
    assert f"worker doomed-worker · token {first.fencing_token} · interrupted" in html
    assert f"worker rescuer · token {second.fencing_token} · completed" in html
    assert 'class="bar execution interrupted"' in html


async def test_a_run_page_links_parent_rerun_and_trace(dash_engine: Engine) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = NewRun(
        run_id=new_run_id(), task_name="dash.raw", task_version=1, input_json="{}", input_hash="h"
    )
    child = NewRun(
        run_id=new_run_id(),
        task_name="dash.raw",
        task_version=1,
        input_json="{}",
        input_hash="h",
        parent_run_id=parent.run_id,
        trace_context={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    await dash_engine.backend.enqueue(parent)
    await dash_engine.backend.enqueue(child)
    app = create_app(dash_engine, trace_url_template="https://traces.example/t/{trace_id}")
    async with browser_for(app) as client:
        board = Browser(client)
        html = await board.page(f"/runs/{child.run_id}")
        assert f'href="/runs/{parent.run_id}"' in html
        assert f'href="https://traces.example/t/{trace_id}"' in html
        parent_html = await board.page(f"/runs/{parent.run_id}")
        assert "Child runs" in parent_html
        assert f'href="/runs/{child.run_id}"' in parent_html
    async with browser_for(create_app(dash_engine)) as client:
        plain = await Browser(client).page(f"/runs/{child.run_id}")
        assert trace_id in plain
        assert "traces.example" not in plain


async def test_an_unknown_run_is_a_404(board: Browser) -> None:
    assert (await board.get(f"/runs/{new_run_id()}")).status_code == 404
    assert (await board.get("/runs/not-a-uuid")).status_code == 404


async def test_the_app_mounts_under_a_prefix(dash_engine: Engine) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    run = await dash_engine.enqueue(ship, Order(customer="m", quantity=1))
    outer = Starlette(routes=[Mount("/ops/umt", app=create_app(dash_engine))])
    async with browser_for(outer) as client:
        html = (await client.get("/ops/umt/runs")).text
        assert f'href="/ops/umt/runs/{run.run_id}"' in html
        assert 'href="/ops/umt/static/dashboard.css"' in html
        assert (await client.get("/ops/umt/static/dashboard.js")).status_code == 200
        assert (await client.get(f"/ops/umt/runs/{run.run_id}")).status_code == 200


async def test_pages_carry_a_strict_content_security_policy(board: Browser) -> None:
    response = await board.get("/runs")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy
    assert "unsafe-inline" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert datetime.now(UTC)  # the page renders times in UTC

"""The tasks, workers, schedules, concurrency keys and paused tasks pages, the enqueue form,
pause and resume, the runs list by worker, and /metrics, over HTTP on both backends."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta

from tests.dashboard.tasks import Approval, Order, Report, Trouble, approve, fail, report, ship
from tests.fixtures.dashboard import Browser, browser_for
from umt_sdk import Engine, Schedule
from umt_sdk.backend import InsightStore, TaskPair, WorkerState
from umt_sdk.dashboard import create_app


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(400):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def test_the_tasks_page_counts_each_pair_and_charts_its_last_hour(
    dash_engine: Engine, board: Browser
) -> None:
    done = await dash_engine.enqueue(ship, Order(customer="a", quantity=1))
    broken = await dash_engine.enqueue(fail, Trouble(message="x"))
    async with dash_engine.worker(worker_id="tasks-worker"):
        await dash_engine.wait_idle([done.run_id, broken.run_id])
        assert "tasks-worker" in await board.page("/tasks")
        # Paused while the worker claims: the held runs stay pending under its nose.
        await dash_engine.pause("dash.ship@1")
        held = [
            await dash_engine.enqueue(ship, Order(customer=f"held{i}", quantity=i))
            for i in range(3)
        ]
        html = await board.page("/tasks")
        for handle in held:
            assert (await dash_engine.get(handle.run_id)).status == "pending"
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"<tr>\s*<td><a href=\"/runs\?task=([^\"]+)\".*?</tr>", html, re.S)
    }
    ship_row = rows["dash.ship%401"]
    assert '<span class="badge">paused</span>' in ship_row
    assert 'status=pending">' in ship_row
    fail_row = rows["dash.fail%401"]
    assert "0 / <a" in fail_row
    assert ">1</a>" in fail_row
    assert "100.0%" in fail_row
    assert '<svg class="spark"' in fail_row
    assert "1 finished, 1 failed" in fail_row
    assert "dash.approve%401" in rows  # registered, no run yet
    assert 'action="/tasks/resume"' in ship_row
    assert 'href="/tasks/dash.ship/1/enqueue"' in ship_row


async def test_the_workers_page_shows_live_and_stopped_workers(
    dash_engine: Engine, board: Browser
) -> None:
    async with dash_engine.worker(worker_id="live-one", concurrency=3):
        await _until(lambda: _has(board, "/workers", "live-one"), "the worker reported itself")
        html = await board.page("/workers")
        assert "dash.ship@1" in html
        assert re.search(r"<td>3</td>", html)
        assert ">live<" in html
    html = await board.page("/workers")
    assert ">stopped<" in html
    store = dash_engine.backend
    assert isinstance(store, InsightStore)
    long_ago = (await dash_engine.workers())[0].last_seen_at - timedelta(minutes=5)
    await store.record_worker(
        WorkerState(
            worker_id="ghost",
            host="h",
            pid=1,
            pairs=(TaskPair(name="dash.ship", version=1),),
            concurrency=1,
            runs_held=1,
            started_at=long_ago,
        )
    )
    assert "ghost" in await board.page("/workers")


async def _has(board: Browser, path: str, text: str) -> bool:
    return text in await board.page(path)


async def test_the_runs_list_filters_by_worker(dash_engine: Engine, board: Browser) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="w", quantity=1))
    other = await dash_engine.enqueue(ship, Order(customer="x", quantity=1))
    async with dash_engine.worker(worker_id="filter-worker"):
        await dash_engine.wait_idle([run.run_id, other.run_id])
    lonely = await dash_engine.enqueue(ship, Order(customer="y", quantity=1))
    html = await board.page("/runs?worker=filter-worker")
    listed = re.findall(r'href="/runs/([0-9a-f-]{36})"', html)
    assert set(listed) == {str(run.run_id), str(other.run_id)}
    assert str(lonely.run_id) not in listed
    assert re.findall(r'href="/runs/([0-9a-f-]{36})"', await board.page("/runs?worker=none")) == []


async def test_pause_and_resume_a_task_from_the_paused_page(
    dash_engine: Engine, board: Browser
) -> None:
    assert "No task is paused" in await board.page("/paused")
    response = await board.submit("/tasks/pause", {"task": "dash.ship@1"})
    assert response.status_code == 303
    assert [str(p) for p in await dash_engine.paused()] == ["dash.ship@1"]
    html = await board.page(response.headers["location"])
    assert "paused dash.ship@1" in html
    assert "<code>dash.ship@1</code>" in html
    again = await board.submit("/tasks/pause", {"task": "dash.ship@1"})
    assert "was paused already" in await board.page(again.headers["location"])
    bad = await board.submit("/tasks/pause", {"task": "not a task@x"})
    assert bad.status_code == 400
    resumed = await board.submit("/tasks/resume", {"task": "dash.ship@1"})
    assert "resumed dash.ship@1" in await board.page(resumed.headers["location"])
    assert await dash_engine.paused() == []


async def test_the_schedules_page_lists_schedules(dash_engine: Engine, board: Browser) -> None:
    await dash_engine.schedules.create(
        Schedule(
            name="nightly-ship", task=ship, cron="0 3 * * *", input=Order(customer="n", quantity=1)
        )
    )
    html = await board.page("/schedules")
    assert "nightly-ship" in html
    assert "0 3 * * *" in html
    assert "dash.ship" in html


async def test_the_concurrency_keys_page_lists_keys_in_use(
    dash_engine: Engine, board: Browser
) -> None:
    assert "No concurrency key is in use" in await board.page("/concurrency")
    for _ in range(2):
        await dash_engine.enqueue(report, Report(tenant="acme"))
    html = await board.page("/concurrency")
    assert "<code>acme</code>" in html
    assert "<strong>2</strong>" in html  # both pending, waiting for a slot


async def test_the_enqueue_form_is_generated_from_the_input_type(
    dash_engine: Engine, board: Browser
) -> None:
    html = await board.page("/tasks/dash.ship/1/enqueue")
    assert 'name="field.customer"' in html
    assert 'type="number" name="field.quantity"' in html
    assert 'type="checkbox" name="field.express"' in html
    assert 'step="any" name="field.weight" value="1.0"' in html
    assert '<option value="courier">courier</option>' in html
    assert 'name="field.tags" rows="3"' in html
    assert "[]</textarea>" in html
    bad = await board.submit(
        "/tasks/dash.ship/1/enqueue",
        {"field.customer": "", "field.quantity": "many", "field.tags": "[1, 2"},
    )
    assert bad.status_code == 400
    assert '<span class="field-error" id="error-customer">required</span>' in bad.text
    assert (
        '<span class="field-error" id="error-quantity">expected a whole number</span>' in bad.text
    )
    assert 'id="error-tags"' in bad.text
    assert 'value="many"' in bad.text  # what was typed stays
    assert len(await dash_engine.list(task_name="dash.ship")) == 0  # nothing stored
    typed = await board.submit(
        "/tasks/dash.ship/1/enqueue",
        {"field.customer": "ada", "field.quantity": "2", "field.tags": '[1, "x"]'},
    )
    assert typed.status_code == 400
    assert 'id="error-tags"' in typed.text
    assert len(await dash_engine.list(task_name="dash.ship")) == 0
    good = await board.submit(
        "/tasks/dash.ship/1/enqueue",
        {
            "field.customer": "ada",
            "field.quantity": "2",
            "field.express": "on",
            "field.weight": "2.5",
            "field.carrier": "courier",
            "field.tags": '["fragile"]',
            "priority": "5",
        },
    )
    assert good.status_code == 303, good.text
    (run,) = (await dash_engine.list(task_name="dash.ship")).runs
    assert run.input == {
        "customer": "ada",
        "quantity": 2,
        "express": True,
        "weight": 2.5,
        "carrier": "courier",
        "tags": ["fragile"],
    }
    assert run.priority == 5
    assert good.headers["location"].startswith(f"/runs/{run.run_id}")


async def test_the_enqueue_form_of_an_unregistered_task_says_how_to_register_it(
    board: Browser,
) -> None:
    response = await board.get("/tasks/nope/1/enqueue")
    assert response.status_code == 404
    assert "--registry" in response.text


async def test_read_only_refuses_pause_and_enqueue(dash_engine: Engine) -> None:
    async with browser_for(create_app(dash_engine, read_only=True)) as client:
        board = Browser(client)
        assert "Pause</button>" not in await board.page("/tasks")
        assert (await board.submit("/tasks/pause", {"task": "dash.ship"})).status_code == 403
        posted = await board.submit(
            "/tasks/dash.ship/1/enqueue", {"field.customer": "a", "field.quantity": "1"}
        )
        assert posted.status_code == 403
    assert await dash_engine.paused() == []
    assert len(await dash_engine.list()) == 0


async def test_metrics_are_served_in_the_prometheus_text_format(
    dash_engine: Engine, board: Browser
) -> None:
    await dash_engine.enqueue(ship, Order(customer="m", quantity=1))
    await dash_engine.enqueue(approve, Approval(item="m"))
    response = await board.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert "# TYPE umt_runs_unfinished gauge" in text
    assert 'umt_runs_unfinished{status="pending",task="dash.ship",version="1"} 1.0' in text
    assert 'umt_runs_unfinished{status="pending",task="dash.approve",version="1"} 1.0' in text
    assert "umt_store_insight_up 1.0" in text
    assert 'umt_workers{health="live"} 0.0' in text


async def test_metrics_need_the_token_when_one_is_set(dash_engine: Engine) -> None:
    app = create_app(dash_engine, token="metrics-token-123")
    async with browser_for(app) as client:
        assert (await client.get("/metrics")).status_code == 401
    async with browser_for(app, authorization="Bearer metrics-token-123") as client:
        assert (await client.get("/metrics")).status_code == 200


async def test_the_rate_limits_page_lists_limits_and_pauses_them(
    dash_engine: Engine, board: Browser
) -> None:
    assert "No rate limit is stored" in await board.page("/rate-limits")
    await dash_engine.rate_limits.set("openai", limit=600, per=timedelta(minutes=1))
    html = await board.page("/rate-limits")
    assert "<code>openai</code>" in html
    assert "<td>600</td>" in html
    assert "0.100s" in html  # a token every 100 ms
    paused = await board.submit("/rate-limits/pause", {"name": "openai"})
    assert paused.status_code == 303
    assert "paused rate limit openai" in await board.page(paused.headers["location"])
    (limit,) = await dash_engine.rate_limits.list()
    assert limit.paused
    resumed = await board.submit("/rate-limits/resume", {"name": "openai"})
    assert "resumed rate limit openai" in await board.page(resumed.headers["location"])
    assert not (await dash_engine.rate_limits.list())[0].paused
    unknown = await board.submit("/rate-limits/pause", {"name": "nope"})
    assert unknown.status_code == 400
    async with browser_for(create_app(dash_engine, read_only=True)) as client:
        read_only = Browser(client)
        assert "Pause</button>" not in await read_only.page("/rate-limits")
        refused = await read_only.submit("/rate-limits/pause", {"name": "openai"})
        assert refused.status_code == 403
    assert not (await dash_engine.rate_limits.list())[0].paused


async def test_the_runs_list_filters_by_finish_time_and_parent(
    dash_engine: Engine, board: Browser
) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="f", quantity=1))
    open_run = await dash_engine.enqueue(approve, Approval(item="open"))
    await dash_engine.cancel(run.run_id)
    info = await dash_engine.get(run.run_id)
    assert info.finished_at is not None
    before = (info.finished_at - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M")
    listed = re.findall(
        r'href="/runs/([0-9a-f-]{36})"', await board.page(f"/runs?finished_after={before}")
    )
    assert listed == [str(run.run_id)]
    assert str(open_run.run_id) not in listed
    children = await board.page(f"/runs?parent={run.run_id}")
    assert "children of" in children
    assert re.findall(r'<td><a href="/runs/([0-9a-f-]{36})"', children) == []
    assert "not a run id" in await board.page("/runs?parent=nope")


async def test_the_concurrency_keys_page_shows_a_fairness_key_without_a_limit(
    dash_engine: Engine, board: Browser
) -> None:
    await dash_engine.enqueue(ship, Order(customer="f", quantity=1), fairness_key="tenant-f")
    html = await board.page("/concurrency")
    assert "<code>tenant-f</code>" in html
    assert "none (fairness key)" in html
    assert "2147483647" not in html

"""The dashboard's actions over HTTP (cancel, cancel all matching, send a fact, retry as new),
and what guards them: read-only mode, the CSRF check and the access token."""

from __future__ import annotations

import asyncio
import re
from typing import Any
from uuid import UUID

from tests.dashboard.tasks import Approval, Order, approve, ship
from tests.fixtures.dashboard import Browser, browser_for
from umt_sdk import Engine, RunHandle
from umt_sdk.dashboard import create_app


async def _waiting(engine: Engine, item: str) -> RunHandle[Any]:
    run = await engine.enqueue(approve, Approval(item=item))
    for _ in range(400):
        if (await engine.get(run.run_id)).status == "waiting":
            return run
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run.run_id} never waited")


async def test_cancel_a_run(dash_engine: Engine, board: Browser) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="c", quantity=1))
    page = await board.page(f"/runs/{run.run_id}")
    assert f'action="/runs/{run.run_id}/cancel"' in page
    response = await board.submit(f"/runs/{run.run_id}/cancel", {"reason": "not needed"})
    assert response.status_code == 303
    assert response.headers["location"].startswith(f"/runs/{run.run_id}?notice=")
    info = await dash_engine.get(run.run_id)
    assert info.status == "canceled"
    assert info.cancel_reason == "not needed"
    shown = await board.page(response.headers["location"])
    assert "canceled" in shown
    again = await board.submit(f"/runs/{run.run_id}/cancel")
    assert "already finished" in await board.page(again.headers["location"])


async def test_cancel_all_runs_matching_a_filter_after_a_confirmation(
    dash_engine: Engine, board: Browser
) -> None:
    pending = [
        await dash_engine.enqueue(ship, Order(customer=f"p{i}", quantity=i)) for i in range(5)
    ]
    other = await dash_engine.enqueue(approve, Approval(item="keep me"))
    listing = await board.page("/runs?task=dash.ship")
    assert 'href="/runs/cancel?task=dash.ship"' in listing
    confirm = await board.page("/runs/cancel?task=dash.ship")
    assert '<strong id="match-count">5</strong>' in confirm
    # Nothing is canceled by looking at the confirmation.
    assert {(await dash_engine.get(h.run_id)).status for h in pending} == {"pending"}
    response = await board.submit("/runs/cancel", {"task": "dash.ship", "count": "5"})
    assert response.status_code == 303
    assert {(await dash_engine.get(h.run_id)).status for h in pending} == {"canceled"}
    assert (await dash_engine.get(other.run_id)).status == "pending"
    assert "5 canceled" in await board.page(response.headers["location"])
    assert "No unfinished run matches" in await board.page("/runs/cancel?task=dash.ship")


async def test_cancel_all_matching_stops_at_the_confirmed_count(
    dash_engine: Engine, board: Browser
) -> None:
    for i in range(4):
        await dash_engine.enqueue(ship, Order(customer=f"q{i}", quantity=i))
    await board.submit("/runs/cancel", {"task": "dash.ship", "count": "3"})
    statuses = sorted(r.status for r in await dash_engine.list(task_name="dash.ship"))
    assert statuses == ["canceled", "canceled", "canceled", "pending"]


async def test_send_a_fact_to_a_waiting_run(dash_engine: Engine, board: Browser) -> None:
    async with dash_engine.worker():
        run = await _waiting(dash_engine, "desk")
        page = await board.page(f"/runs/{run.run_id}")
        assert 'name="name" required maxlength="200" value="approval"' in page
        bad = await board.submit(
            f"/runs/{run.run_id}/signal",
            {"name": "approval", "payload": "{not json"},
        )
        assert bad.status_code == 400
        assert 'aria-invalid="true"' in bad.text
        assert "payload" in bad.text
        assert (await dash_engine.get(run.run_id)).status == "waiting"
        sent = await board.submit(
            f"/runs/{run.run_id}/signal",
            {"name": "approval", "payload": '{"ok": true}'},
        )
        assert sent.status_code == 303
        assert await run.result(timeout=30) == {"ok": True}
        twice = await board.submit(
            f"/runs/{run.run_id}/signal",
            {"name": "approval", "payload": "2"},
        )
        assert "the first one stays" in await board.page(twice.headers["location"])


async def test_retry_a_finished_run_as_a_new_linked_run(
    dash_engine: Engine, board: Browser
) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="again", quantity=2))
    await board.submit(f"/runs/{run.run_id}/cancel")
    page = await board.page(f"/runs/{run.run_id}")
    assert f'action="/runs/{run.run_id}/rerun"' in page
    response = await board.submit(f"/runs/{run.run_id}/rerun")
    assert response.status_code == 303
    new_id = re.match(r"/runs/([0-9a-f-]{36})", response.headers["location"])
    assert new_id is not None
    info = await dash_engine.get(UUID(new_id.group(1)))
    assert info.rerun_of == run.run_id
    assert info.input["customer"] == "again"
    assert info.input_json == (await dash_engine.get(run.run_id)).input_json
    assert f'href="/runs/{run.run_id}"' in await board.page(response.headers["location"])


async def test_a_read_only_dashboard_shows_no_action_and_refuses_them(dash_engine: Engine) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="ro", quantity=1))
    async with browser_for(create_app(dash_engine, read_only=True)) as client:
        board = Browser(client)
        page = await board.page(f"/runs/{run.run_id}")
        assert '<form method="post"' not in page
        assert "read-only" in page
        assert "/runs/cancel?" not in await board.page("/runs?task=dash.ship")
        for path in (f"/runs/{run.run_id}/cancel", "/runs/cancel", f"/runs/{run.run_id}/rerun"):
            response = await board.submit(path, {"task": "dash.ship", "count": "1"})
            assert response.status_code == 403, path
    assert (await dash_engine.get(run.run_id)).status == "pending"


async def test_an_action_without_its_csrf_field_is_refused(
    dash_engine: Engine, board: Browser
) -> None:
    run = await dash_engine.enqueue(ship, Order(customer="csrf", quantity=1))
    response = await board.submit(f"/runs/{run.run_id}/cancel", csrf=False)
    assert response.status_code == 403
    forged = await board.client.post(
        f"/runs/{run.run_id}/cancel", data={"csrf": "forged-value-that-is-not-the-cookie"}
    )
    assert forged.status_code == 403
    cross_site = await board.client.post(
        f"/runs/{run.run_id}/cancel",
        data={"csrf": board.client.cookies["umt_csrf"]},
        headers={"origin": "https://evil.example"},
    )
    assert cross_site.status_code == 403
    assert (await dash_engine.get(run.run_id)).status == "pending"


async def test_a_token_guards_every_page_and_action(dash_engine: Engine) -> None:
    token = "s3cret-token-for-tests"
    run = await dash_engine.enqueue(ship, Order(customer="tok", quantity=1))
    app = create_app(dash_engine, token=token)
    async with browser_for(app) as client:
        page = await client.get("/runs")
        assert page.status_code == 303
        assert page.headers["location"] == "/login?next=%2Fruns"
        api = await client.get("/runs", headers={"accept": "application/json"})
        assert api.status_code == 401
        posted = await client.post(f"/runs/{run.run_id}/cancel", data={})
        assert posted.status_code in (303, 401)
        assert (await dash_engine.get(run.run_id)).status == "pending"
        login = await client.get("/login?next=/runs")
        assert login.status_code == 200
        wrong = await client.post(
            "/login?next=/runs", data={"token": "nope", "csrf": client.cookies["umt_csrf"]}
        )
        assert wrong.status_code == 401
        right = await client.post(
            "/login?next=/runs", data={"token": token, "csrf": client.cookies["umt_csrf"]}
        )
        assert right.status_code == 303
        assert right.headers["location"] == "/runs"
        assert (await client.get("/runs")).status_code == 200
        board = Browser(client)
        assert (await board.submit(f"/runs/{run.run_id}/cancel")).status_code == 303
    assert (await dash_engine.get(run.run_id)).status == "canceled"
    async with browser_for(app, authorization=f"Bearer {token}") as client:
        assert (await client.get("/runs")).status_code == 200
    async with browser_for(app, authorization="Bearer wrong-token-value") as client:
        assert (await client.get("/runs")).status_code == 303

"""The events page: the newest events with the runs each started, linked; a name filter and
pages; hostile keys and payloads shown as text; a bad filter said beside it."""

from __future__ import annotations

from tests.dashboard.tasks import Approval
from tests.fixtures.dashboard import Browser
from umt_sdk import Engine


async def test_the_events_page_lists_events_with_their_runs(
    dash_engine: Engine, board: Browser
) -> None:
    empty = await board.page("/events")
    assert "No event is stored" in empty
    assert 'href="/events" aria-current="page"' in empty
    placed = await dash_engine.publish("dash.order.placed", Approval(item="desk"), key="o-1")
    hostile = await dash_engine.publish(
        "dash.nobody", {"note": "<script>alert(1)</script>"}, key="<b>k</b>"
    )
    page = await board.page("/events")
    (run,) = placed.runs
    assert f'<a href="/runs/{run.run_id}">dash.on_placed@1</a>' in page
    assert '<span class="status pending">pending</span>' in page
    assert str(hostile.event_id) in page
    assert "<script>alert(1)" not in page
    assert "&lt;b&gt;k&lt;/b&gt;" in page
    assert "no run" in page
    only = await board.page("/events?name=dash.order.placed")
    assert str(placed.event_id) in only
    assert str(hostile.event_id) not in only
    older = await board.page(f"/events?before={hostile.event_id}")
    assert str(placed.event_id) in older
    assert str(hostile.event_id) not in older


async def test_a_bad_filter_is_said_and_lists_nothing(dash_engine: Engine, board: Browser) -> None:
    await dash_engine.publish("dash.order.placed", Approval(item="chair"))
    bad = await board.page("/events?name=not%20a%20name")
    assert 'aria-invalid="true"' in bad
    assert "must be an event name" in bad
    assert "chair" not in bad
    cursor = await board.page("/events?before=nope")
    assert "not an event id" in cursor

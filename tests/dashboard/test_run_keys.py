"""A run's page shows the keys it was enqueued with (idempotency, concurrency, singleton or
sequence, debounce), each linked to the runs list of its key; the runs list filters by key."""

from __future__ import annotations

from datetime import timedelta

from tests.dashboard.tasks import Order, Report, report, ship
from tests.fixtures.dashboard import Browser
from umt_sdk import Debounce, Engine, Singleton


async def test_a_runs_page_shows_each_of_its_keys(dash_engine: Engine, board: Browser) -> None:
    plain = await dash_engine.enqueue(ship, Order(customer="p", quantity=1))
    single = await dash_engine.enqueue(
        ship, Order(customer="s", quantity=1), singleton=Singleton("mailbox-<7>")
    )
    keyed = await dash_engine.enqueue(
        ship, Order(customer="i", quantity=1), idempotency_key="order-9", sequence="acct-3"
    )
    debounced = await dash_engine.enqueue(
        ship, Order(customer="d", quantity=1), debounce=Debounce("doc-1", timedelta(hours=1))
    )
    limited = await dash_engine.enqueue(report, Report(tenant="t1"))
    fair = await dash_engine.enqueue(
        ship, Order(customer="f", quantity=1), fairness_key="tenant-7", weight=3
    )

    page = await board.page(f"/runs/{plain.run_id}")
    assert "run-key" not in page
    page = await board.page(f"/runs/{single.run_id}")
    assert "<dt>Singleton or sequence key</dt>" in page
    assert (
        'href="/runs?task=dash.ship&amp;key=mailbox-%3C7%3E"><code>mailbox-&lt;7&gt;</code>' in page
    )
    page = await board.page(f"/runs/{keyed.run_id}")
    assert "<dt>Idempotency key</dt>" in page
    assert 'href="/runs?task=dash.ship&amp;idempotency_key=order-9"' in page
    assert 'href="/runs?task=dash.ship&amp;key=acct-3"' in page
    page = await board.page(f"/runs/{debounced.run_id}")
    assert "<dt>Debounce key</dt>" in page
    assert "<code>doc-1</code>" in page
    page = await board.page(f"/runs/{limited.run_id}")
    assert "<dt>Concurrency key</dt>" in page
    assert "at most 1 run(s) of the key at once" in page
    page = await board.page(f"/runs/{fair.run_id}")
    assert "<dt>Fairness key</dt>" in page
    assert "(weight 3)" in page
    assert "Singleton or sequence key" not in page


async def test_the_runs_list_filters_by_key_with_a_task(
    dash_engine: Engine, board: Browser
) -> None:
    first = await dash_engine.enqueue(ship, Order(customer="a", quantity=1), sequence="k-1")
    second = await dash_engine.enqueue(ship, Order(customer="b", quantity=1), sequence="k-1")
    other = await dash_engine.enqueue(ship, Order(customer="c", quantity=1), sequence="k-2")
    page = await board.page("/runs?task=dash.ship&key=k-1")
    assert str(first.run_id) in page
    assert str(second.run_id) in page
    assert str(other.run_id) not in page
    alone = await board.page("/runs?key=k-1")
    assert "keys are per task: give the task too" in alone
    assert str(first.run_id) not in alone

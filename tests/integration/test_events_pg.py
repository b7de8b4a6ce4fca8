"""Events on Postgres, what the contract suite does not say: a publish in the caller's
transaction is traced as a request (its event and runs exist only if the caller commits), and
concurrent publishes of one (name, key) store one event and start each subscriber once."""

from __future__ import annotations

import asyncio

import psycopg

from tests.unit.test_event_tracing import Placed, receipt
from tests.unit.test_telemetry_truth import Otel, attrs_of
from umt_sdk import Registry, connect


async def test_a_publish_in_a_rolled_back_transaction_is_traced_as_a_request(
    pg_url: str, pg_schema: str
) -> None:
    otel = Otel()
    engine = await connect(
        pg_url,
        registry=Registry([receipt]),
        schema=pg_schema,
        run_migrations=False,
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
    )
    try:
        async with await psycopg.AsyncConnection.connect(pg_url) as conn:
            async with conn.transaction(force_rollback=True):
                gone = await engine.publish("traced.placed", Placed("o1"), key="o1", conn=conn)
            async with conn.transaction():
                kept = await engine.publish("traced.placed", Placed("o2"), key="o2", conn=conn)
        page = await engine.list(task_name="traced.receipt")
    finally:
        await engine.close()
    assert [r.run_id for r in page.runs] == [kept.runs[0].run_id], "only the committed one"
    assert gone.created, "as far as the SDK knows: the caller rolled back afterwards"
    assert otel.total("umt.runs.enqueued") == 0, "the SDK never saw a commit"
    spans = otel.spans("umt.publish traced.placed")
    assert len(spans) == 2
    for span in spans:
        attributes = attrs_of(span)
        assert attributes["umt.event.created_if_committed"] is True
        assert "umt.event.created" not in attributes, "created is said only of a known commit"
        assert attributes["umt.event.name"] == "traced.placed"
        assert attributes["umt.event.subscribers"] == 1
    assert [attrs_of(s)["umt.event.id"] for s in spans] == [str(gone.event_id), str(kept.event_id)]


async def test_concurrent_publishes_of_one_key_start_each_subscriber_once(
    pg_url: str, pg_schema: str
) -> None:
    engines = [
        await connect(pg_url, registry=Registry([receipt]), schema=pg_schema, run_migrations=False)
        for _ in range(4)
    ]
    try:
        published = await asyncio.gather(
            *(e.publish("traced.placed", Placed("o3"), key="o3") for e in engines for _ in range(5))
        )
        assert sum(p.created for p in published) == 1
        assert len({p.event_id for p in published}) == 1
        runs = list(await engines[0].list(task_name="traced.receipt"))
        assert len(runs) == 1
        assert runs[0].idempotency_key == f"umt.event:{published[0].event_id}"
    finally:
        for engine in engines:
            await engine.close()
